"""`pdgate bench`: argument parsing and the run over load levels (vLLM `bench serve` dialect)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime
from typing import Any, Sequence

import numpy as np

from .arrivals import ARRIVALS, arrival_offsets
from .client import RequestSpec
from .dataset import (LENGTH_DISTRIBUTIONS, SampleRequest, random_requests, sharegpt_requests, trace_requests,
                      with_images)
from .metrics import DETAILED_KEYS, PERCENTILE_METRICS, compute_metrics, parse_goodput
from .report import print_report

__all__ = ["build_parser", "main", "parse_rates"]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def parse_rates(text: str) -> list[float]:
    """`"1,2,4"` → [1.0, 2.0, 4.0]; `inf` allowed."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a request rate: {part!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"a request rate must be positive (or inf), got {part!r}")
        rates.append(rate)
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate bench", description=(
        "Load an OpenAI-compatible endpoint (pdgate, SGLang, vLLM, ...) and measure TTFT, TPOT, ITL, "
        "E2E and goodput at the client. Flags and result keys follow vLLM's `bench serve`."))
    a = p.add_argument
    a("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    a("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    a("--model", default=None, help="model name to send (default: the first of /v1/models)")
    a("--dataset-name", default="random", choices=("random", "sharegpt", "custom"))
    a("--dataset-path", default=None, help="ShareGPT JSON, or the JSONL trace of `custom`")
    a("--num-prompts", type=int, default=1000)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0, help="uniform lengths in [L(1-r), L(1+r)]")
    a("--random-prefix-len", type=int, default=0, help="tokens of shared prefix before each prompt")
    a("--random-num-prefixes", type=int, default=1, help="distinct shared prefixes, round robin (pdgate)")
    a("--random-length-dist", default="uniform", choices=LENGTH_DISTRIBUTIONS,
      help="length distribution around the mean lengths (pdgate; vLLM's is uniform)")
    a("--random-lognormal-sigma", type=float, default=0.5, help="shape of the lognormal lengths")
    a("--sharegpt-output-len", type=int, default=None)
    a("--custom-output-len", type=int, default=256, help="output tokens for trace lines without one")
    a("--image-fraction", type=float, default=0.0,
      help="EPD (pdgate): the share of chat requests that carry images (random PNGs, data URLs)")
    a("--images-per-request", type=int, default=1, help="EPD: images in a request that has any")
    a("--image-size", type=int, default=32, help="EPD: the images' side in pixels")
    a("--request-rate", type=parse_rates, default=[math.inf],
      help="requests per second, or a comma list for a sweep (one result per level); inf = all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the intervals (1 = Poisson)")
    a("--arrivals", default="poisson", choices=ARRIVALS,
      help="poisson (gamma with --burstiness), constant, or replay the trace's own times (pdgate)")
    a("--replay-speedup", type=float, default=1.0, help="divide replayed arrival times by this")
    a("--max-concurrency", type=int, default=None)
    a("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    a("--percentile-metrics", default=",".join(PERCENTILE_METRICS))
    a("--metric-percentiles", default="50,90,99", help="comma list (default: %(default)s; vLLM's is 99)")
    a("--no-stream", action="store_true", help="non-streaming requests (TTFT is then E2E)")
    a("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    a("--chunk-timing", default="text", choices=("text", "choices"),
      help="stream chunks that time a token (TTFT, ITL): those with text (default), or every chunk with "
           "`choices`, text or not, as `vllm bench serve` counts")
    a("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    a("--seed", type=int, default=0)
    a("--save-result", action="store_true")
    a("--save-detailed", action="store_true", help="also save per-request ttfts, itls (seconds), lens, errors")
    a("--result-dir", default=".")
    a("--result-filename", default=None, help="with a sweep, -<rate>qps is added before .json")
    a("--plot-dir", default=None, help="write TTFT/ITL CDFs and goodput/p99 vs rate here (needs pdgate[bench])")
    a("--disable-tqdm", action="store_true")
    a("--label", default=None)
    c = p.add_argument_group("calibration (pdgate): measure the engine's service times for `pdgate simulate`")
    c.add_argument("--calibrate", action="store_true",
                   help="measure prefill time vs prompt tokens, decode step vs batch, KV bytes per token and "
                        "the transfer through the PD gateway at --base-url, write --service-model-out, and exit")
    c.add_argument("--colocated-base-url", default=None,
                   help="a gateway over regular workers of the same engine: prefill times from its idle TTFT "
                        "(without it the prefill fit includes the KV hand-off)")
    c.add_argument("--admin-api-key", default=os.environ.get("PDGATE_ADMIN_API_KEY"),
                   help="the gateways' admin key, to list their workers (GET /workers); default: "
                        "$PDGATE_ADMIN_API_KEY")
    c.add_argument("--calibrate-prompt-lens", type=_int_list, default=[16, 256, 512, 1024, 2048])
    c.add_argument("--calibrate-batch-sizes", type=_int_list, default=[1, 2, 4, 8, 16])
    c.add_argument("--calibrate-repeats", type=int, default=3, help="samples per prompt length")
    c.add_argument("--calibrate-decode-prompt-len", type=int, default=64,
                   help="prompt tokens of the decode-step requests (the step grows with the context)")
    c.add_argument("--calibrate-decode-output-len", type=int, default=64,
                   help="output tokens of the decode-step requests (long enough for the batch to form)")
    c.add_argument("--calibrate-contention-prompt-len", type=int, default=1024,
                   help="prompt tokens that keep the prefill worker busy while a decode stream's gaps are "
                        "measured: the cores the workers effectively share (0: skip)")
    c.add_argument("--service-model-out", default="service_model.json",
                   help="where --calibrate writes the service-time file (default: %(default)s)")
    return p


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def _requests(args: argparse.Namespace, rng: np.random.Generator) -> list[SampleRequest]:
    requests = _text_requests(args, rng)
    return with_images(requests, args.image_fraction, args.images_per_request, args.image_size, args.seed)


def _text_requests(args: argparse.Namespace, rng: np.random.Generator) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
                               num_prefixes=args.random_num_prefixes, dist=args.random_length_dist,
                               sigma=args.random_lognormal_sigma, rng=rng)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.sharegpt_output_len, rng)
    return trace_requests(args.dataset_path, args.num_prompts, args.custom_output_len, rng)


def _first_model(base_url: str, timeout: float) -> str:
    import httpx

    resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def _filename(args: argparse.Namespace, rate: float, model: str, many: bool) -> str:
    if args.result_filename:
        name = args.result_filename
        if many:
            stem, ext = os.path.splitext(name)
            name = f"{stem}-{rate}qps{ext or '.json'}"
    else:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.label or 'pdgate'}-{rate}qps{conc}-{model.split('/')[-1]}-{stamp}.json"
    return os.path.join(args.result_dir, name)


def _header(args: argparse.Namespace, model: str, rate: float, goodput: dict[str, float]) -> dict[str, Any]:
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if args.endpoint.endswith("chat/completions") else "openai",
            "label": args.label, "model_id": model, "base_url": args.base_url, "endpoint": args.endpoint,
            "num_prompts": args.num_prompts, "request_rate": rate if math.isfinite(rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "arrivals": args.arrivals, "stream": not args.no_stream, "goodput_config": goodput, "seed": args.seed}


def _run(args: argparse.Namespace) -> int:
    from .runner import run_level

    goodput = parse_goodput(args.goodput or [])
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = sorted(set(metrics) - set(PERCENTILE_METRICS))
    if unknown or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--percentile-metrics takes {','.join(PERCENTILE_METRICS)} (got {unknown or metrics}) "
                         f"and --metric-percentiles numbers in [0, 100] (got {percentiles})")
    model = args.model or _first_model(args.base_url, min(args.request_timeout, 30.0))
    if args.calibrate:
        return _calibrate(args, model)
    spec = RequestSpec(url=args.base_url.rstrip("/") + args.endpoint, model=model,
                       chat=args.endpoint.endswith("chat/completions"), stream=not args.no_stream,
                       ignore_eos=args.ignore_eos, chunk_timing=args.chunk_timing)
    levels = []
    for rate in args.request_rate:
        rng = np.random.default_rng(args.seed)
        requests = _requests(args, rng)
        offsets = arrival_offsets(args.arrivals, len(requests), rate, args.burstiness, rng,
                                  [r.arrival_s for r in requests], args.replay_speedup)
        outputs, duration = asyncio.run(run_level(
            spec, requests, offsets, max_concurrency=args.max_concurrency, timeout_s=args.request_timeout,
            progress=not args.disable_tqdm, desc=f"{rate} req/s"))
        result = {**_header(args, model, rate, goodput),
                  **compute_metrics(outputs, duration, goodput, percentiles, metrics)}
        print_report(result, metrics, percentiles)
        levels.append({"rate": rate, "label": f"{rate} req/s", "result": result,
                       "ttfts_ms": [t * 1000 for t, o in zip(result["ttfts"], outputs) if o.success],
                       "itls_ms": [g * 1000 for o in outputs if o.success for g in o.itl]})
        if not args.save_detailed:
            for key in DETAILED_KEYS:
                result.pop(key, None)
        if args.save_result or args.result_filename:
            path = _filename(args, rate, model, len(args.request_rate) > 1)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
            print(f"result written to {path}")
    if args.plot_dir:
        _plots(levels, args.plot_dir)
    return 0


def _calibrate(args: argparse.Namespace, model: str) -> int:
    from .calibrate import CalibrationPlan, calibrate

    if args.calibrate_repeats < 1:
        raise ValueError("--calibrate-repeats must be at least 1")
    plan = CalibrationPlan(
        base_url=args.base_url, model=model, colocated_base_url=args.colocated_base_url,
        prompt_lens=args.calibrate_prompt_lens, batch_sizes=args.calibrate_batch_sizes,
        repeats=args.calibrate_repeats, decode_prompt_len=args.calibrate_decode_prompt_len,
        decode_output_len=args.calibrate_decode_output_len, contention_prompt_len=args.calibrate_contention_prompt_len,
        endpoint=args.endpoint, image_size=args.image_size,
        timeout_s=args.request_timeout, seed=args.seed, admin_api_key=args.admin_api_key, log=lambda msg: print(msg, file=sys.stderr))
    data = calibrate(plan, args.service_model_out)
    print(json.dumps({k: v for k, v in data.items() if k != "calibration"}, indent=2))
    for note in data["calibration"]["notes"]:
        print(f"pdgate bench --calibrate: {note}", file=sys.stderr)
    print(f"service-time file written to {args.service_model_out}", file=sys.stderr)
    return 0


def _plots(levels: list[dict[str, Any]], out_dir: str) -> None:
    from .plots import PlotsUnavailable, write_plots

    try:
        for path in write_plots(levels, out_dir):
            print(f"plot written to {path}")
    except PlotsUnavailable as exc:
        print(f"pdgate bench: no plots written: {exc}", file=sys.stderr)


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as exc:
        print(f"pdgate bench: {exc}", file=sys.stderr)
        return 2
