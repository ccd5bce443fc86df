"""`pdgate simulate`: flags, the run over placements and load levels, and the JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import fields
from typing import Any, Sequence

import numpy as np

from pdgate.bench.arrivals import ARRIVALS
from pdgate.bench.cli import parse_rates
from pdgate.bench.dataset import LENGTH_DISTRIBUTIONS
from pdgate.bench.metrics import parse_goodput

from .analysis import encode_workers, pd_ratio, split_threshold, worked_example
from .engine import FAILURE_POLICIES, PLACEMENTS, SimConfig, Simulator
from .model import ServiceModel
from .placement import Decide, conditional, load_decision
from .results import queue_series, simulation_result
from .traffic import draw_images, random_traffic, trace_traffic

__all__ = ["build_parser", "main"]

_MODEL_HELP = {
    "prefill_a_ms": "prefill fixed cost (ms)", "prefill_b_ms": "prefill cost per prompt token (ms)",
    "prefill_c_ms": "prefill cost per prompt token squared (ms; attention)",
    "decode_step_ms": "decode step (ms)", "decode_step_per_seq_ms": "extra decode step per running sequence (ms)",
    "kv_bytes_per_token": "KV bytes per token", "link_setup_ms": "setup per KV send (ms)",
    "link_gib_per_s": "KV link bandwidth (GiB/s)", "send_chunk_tokens": "tokens per KV send (0: one send)",
    "prefill_chunk_tokens": "chunked-prefill size on colocated workers", "max_batch": "decode slots per worker",
    "encode_image_ms": "EPD: the vision tower's time per image (ms), on an encode worker or the prefilling one",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate simulate", description=(
        "Discrete-event model of colocated (chunked prefill), disaggregated and conditional placement; "
        "prints results as JSON with `pdgate bench`'s key names."))
    a = p.add_argument
    a("--example", choices=("worked",), help="print the design's worked example (one 6,000-token prompt) and exit")
    a("--placement", default="all", choices=(*PLACEMENTS, "all"))
    a("--num-requests", type=int, default=1000)
    a("--prefill-workers", type=int, default=1)
    a("--decode-workers", type=int, default=2, help="colocated runs prefill+decode workers, all colocated")
    a("--request-rate", type=parse_rates, default=[1.0], help="req/s, or a comma list (one result per level)")
    a("--burstiness", type=float, default=1.0)
    a("--arrivals", default="poisson", choices=ARRIVALS)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0)
    a("--random-length-dist", default="uniform", choices=LENGTH_DISTRIBUTIONS)
    a("--random-lognormal-sigma", type=float, default=0.5)
    a("--dataset-path", default=None, help="a JSONL trace, as for `pdgate bench --dataset-name custom`")
    a("--custom-output-len", type=int, default=256)
    a("--service-model", default=None, metavar="JSON", help="service-time model file (flags below override it)")
    for f in fields(ServiceModel):
        a("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
          help=f"{_MODEL_HELP.get(f.name, f.name)} (default: {f.default})")
    a("--goodput", nargs="+", default=["ttft:1000", "tpot:50"], metavar="NAME:MS")
    a("--metric-percentiles", default="50,90,99")
    a("--transfer-failure-rate", type=float, default=0.0)
    a("--failure-policy", default="retry", choices=FAILURE_POLICIES)
    a("--max-retries", type=int, default=2)
    a("--decision", default=None, metavar="MODULE:FUNCTION", help="placement decision for conditional "
      "(default: pdgate.simulate.placement:conditional)")
    a("--shared-cores", type=float, default=0.0, metavar="N", help="workers share N CPU cores (processor sharing: "
      "each busy worker runs at min(1, N / busy workers) of its speed), as reference engines on one CPU host "
      "do; 0 (default): each worker has its own hardware, as with one GPU per worker")
    a("--encode-workers", type=int, default=0, help="EPD: workers that run the vision tower, one image at a "
      "time (0: the worker that prefills runs it first)")
    a("--image-fraction", type=float, default=0.0, help="EPD: the share of requests that carry images")
    a("--images-per-request", type=int, default=1, help="EPD: images in a request that has any")
    a("--image-tokens", type=int, default=16, help="EPD: prompt tokens per image (placeholders; the reference "
      "engine's tiny-mm: 16)")
    a("--sample-interval-ms", type=float, default=1000.0)
    a("--seed", type=int, default=0)
    a("--save-detailed", action="store_true", help="include each stage's queue length over time")
    a("--result-filename", default=None, help="also write the JSON here")
    a("--plot-dir", default=None, help="TTFT/ITL CDFs and goodput/p99 vs rate (needs pdgate[bench])")
    return p


def _model(args: argparse.Namespace) -> ServiceModel:
    overrides = {f.name: getattr(args, f.name) for f in fields(ServiceModel) if getattr(args, f.name) is not None}
    if args.service_model:
        return ServiceModel.from_json(args.service_model, **overrides)
    return ServiceModel(**overrides)


def _traffic(args: argparse.Namespace, rate: float) -> tuple[list[float], list[int], list[int]]:
    rng = np.random.default_rng(args.seed)
    if args.dataset_path:
        return trace_traffic(args.dataset_path, args.num_requests, rate, burstiness=args.burstiness,
                             arrivals=args.arrivals, default_output=args.custom_output_len, rng=rng)
    if math.isinf(rate):
        raise ValueError("the simulator needs a finite --request-rate (or a trace with --arrivals replay)")
    return random_traffic(args.num_requests, rate, burstiness=args.burstiness, arrivals=args.arrivals,
                          input_len=args.random_input_len, output_len=args.random_output_len,
                          range_ratio=args.random_range_ratio, dist=args.random_length_dist,
                          sigma=args.random_lognormal_sigma, prefix_len=args.random_prefix_len, rng=rng)


def _one(args: argparse.Namespace, model: ServiceModel, decide: Decide, placement: str, rate: float,
         goodput: dict[str, float], percentiles: list[float]) -> tuple[dict[str, Any], Simulator]:
    arrivals, prompts, outputs = _traffic(args, rate)
    images = draw_images(len(prompts), args.image_fraction, args.images_per_request, args.seed)
    prompts = [p + k * args.image_tokens for p, k in zip(prompts, images)]
    config = SimConfig(placement, args.prefill_workers, args.decode_workers, goodput.get("ttft", 1000.0),
                       goodput.get("tpot", 50.0), args.transfer_failure_rate, args.failure_policy,
                       args.max_retries, args.sample_interval_ms, args.seed, args.shared_cores, args.encode_workers)
    sim = Simulator(model, config, decide)
    started = time.perf_counter()
    sim.run(arrivals, prompts, outputs, images)
    result = simulation_result(sim, goodput, percentiles, rate if args.arrivals != "replay" else None)
    result["wall_seconds"] = time.perf_counter() - started
    if args.save_detailed:
        result["queue_series"] = queue_series(sim)
    return result, sim


def _recommendation(args: argparse.Namespace, model: ServiceModel, goodput: dict[str, float],
                    decide: Decide) -> dict[str, Any]:
    prompt = args.random_input_len + args.random_prefix_len
    ttft, tpot = goodput.get("ttft", 1000.0), goodput.get("tpot", 50.0)
    rates = [r for r in args.request_rate if math.isfinite(r)]
    images = args.image_fraction * args.images_per_request
    return {
        "pd_ratio": [pd_ratio(model, prompt_tokens=prompt, output_tokens=args.random_output_len,
                              slo_ttft_ms=ttft, slo_tpot_ms=tpot, target_rate=r) for r in rates],
        "encode_workers": [encode_workers(model, images_per_s=r * images) for r in rates] if images else [],
        "split_threshold_tokens": {
            f"local_batch={b}": split_threshold(model, local_batch=b, output_tokens=args.random_output_len,
                                                slo_ttft_ms=ttft, slo_tpot_ms=tpot, decide=decide)
            for b in (0, 1, model.max_batch // 2, model.max_batch)},
    }


def _run(args: argparse.Namespace) -> int:
    model = _model(args)
    decide = load_decision(args.decision) if args.decision else conditional
    if args.example == "worked":
        print(json.dumps(worked_example(model, decide), indent=2))
        return 0
    goodput = parse_goodput(args.goodput)
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    placements = PLACEMENTS if args.placement == "all" else (args.placement,)
    results, levels = [], []
    for placement in placements:
        for rate in args.request_rate:
            result, sim = _one(args, model, decide, placement, rate, goodput, percentiles)
            results.append(result)
            levels.append(_plot_level(placement, rate, result, sim))
    output = {"results": results, "recommendation": _recommendation(args, model, goodput, decide)}
    text = json.dumps(output, indent=2)
    print(text)
    if args.result_filename:
        with open(args.result_filename, "w", encoding="utf-8") as f:
            f.write(text)
    if args.plot_dir:
        _plots(levels, args.plot_dir)
    return 0


def _plot_level(placement: str, rate: float, result: dict[str, Any], sim: Simulator) -> dict[str, Any]:
    ok = [r for r in sim.requests if not r.failed and r.first_token is not None]
    gaps = sorted(sim.itl.counts.items())
    return {"placement": placement, "rate": rate, "label": f"{placement} {rate} req/s", "result": result,
            "queue_series": queue_series(sim),
            "ttfts_ms": [r.first_token - r.arrival for r in ok],  # type: ignore[operator]
            "itls_ms": [g for g, _ in gaps], "itl_weights": [c for _, c in gaps]}


def _plots(levels: list[dict[str, Any]], out_dir: str) -> None:
    from pdgate.bench.plots import PlotsUnavailable, write_plots

    from .plots import queue_plot_name, write_queue_plot

    try:
        for placement in dict.fromkeys(level["placement"] for level in levels):
            mine = [level for level in levels if level["placement"] == placement]
            for path in write_plots(mine, out_dir, prefix=f"simulate_{placement}"):
                print(f"plot written to {path}", file=sys.stderr)
        for level in levels:
            path = write_queue_plot(level["queue_series"], os.path.join(out_dir, queue_plot_name(level)),
                                    f"stage queues: {level['label']}")
            print(f"plot written to {path}", file=sys.stderr)
    except PlotsUnavailable as exc:
        print(f"pdgate simulate: no plots written: {exc}", file=sys.stderr)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as exc:
        print(f"pdgate simulate: {exc}", file=sys.stderr)
        return 2
