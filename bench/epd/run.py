"""EPD on the reference engine: TTFT of image and text requests under a mixed load, with and
without encode workers (issue 31 item 6; docs/performance.md, "EPD").

Starts `tiny-mm` reference workers (one prefill, one decode, E encode workers; no embedding
cache anywhere, so every image runs the tower), then for each configuration a gateway in this
process and `pdgate bench` against it with the same traffic:

- pd:  `--pd-disaggregation`, the prefill runs the tower itself;
- epd: `--epd-disaggregation --encode ...`, the encode workers run it.

    PYTHONPATH=python python bench/epd/run.py --num-prompts 120 --request-rate 4 \\
        --image-fraction 0.5 --images-per-request 4 --out /tmp/epd-bench

`--order epd,pd` runs them the other way round (on a shared machine, run both orders).
Prints one line per configuration and writes each `pdgate bench` result JSON under --out; exits 1
when a request failed. CI's smoke: `--num-prompts 6 --request-rate inf --images-per-request 1
--image-size 32 --input-len 16 --output-len 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pdgate
from pdgate.bench.cli import main as bench
from pdgate.workers import ReferenceWorker

MODEL = "tiny-mm"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--request-rate", default="4")
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--images-per-request", type=int, default=4)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--encode-workers", type=int, default=1)
    p.add_argument("--order", default="pd,epd", help="which configurations, in which order")
    p.add_argument("--out", default="/tmp/epd-bench")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    nocache = ["--mm-embedding-cache-items", "0"]
    prefill = ReferenceWorker(mode="prefill", model=MODEL, extra_args=nocache)
    decode = ReferenceWorker(mode="decode", model=MODEL, extra_args=nocache)
    encoders = [ReferenceWorker(mode="encode", model=MODEL, extra_args=nocache) for _ in range(args.encode_workers)]
    workers = [prefill, decode, *encoders]
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=120), workers))
    try:
        common = dict(port=0, prefill=[[prefill.url, prefill.bootstrap_port]], decode=[decode.url],
                      request_timeout_secs=120, admin_api_open=True)
        configs = {"pd": dict(pd_disaggregation=True, **common),
                   "epd": dict(epd_disaggregation=True, encode=[[e.url, e.bootstrap_port] for e in encoders], **common)}
        for name in args.order.split(","):
            options = configs[name]
            with pdgate.Gateway(**options) as gw:
                out = os.path.join(args.out, f"{name}.json")
                argv = ["--base-url", gw.url, "--endpoint", "/v1/chat/completions", "--model", MODEL,
                        "--dataset-name", "random", "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len), "--ignore-eos",
                        "--num-prompts", str(args.num_prompts), "--request-rate", args.request_rate,
                        "--image-fraction", str(args.image_fraction), "--images-per-request",
                        str(args.images_per_request), "--image-size", str(args.image_size),
                        "--seed", "0", "--disable-tqdm", "--result-filename", out]
                if bench(argv) != 0:
                    return 1
                with open(out, encoding="utf-8") as f:
                    r = json.load(f)
                e = r["epd"]
                print(f"{name}: completed={r['completed']} failed={r['failed']} "
                      f"image TTFT median/p90/p99 = {e['median_image_ttft_ms']:.0f}/{e['p90_image_ttft_ms']:.0f}/"
                      f"{e['p99_image_ttft_ms']:.0f} ms, text TTFT = {e['median_text_ttft_ms']:.0f}/"
                      f"{e['p90_text_ttft_ms']:.0f}/{e['p99_text_ttft_ms']:.0f} ms, "
                      f"all TTFT p99 {r['p99_ttft_ms']:.0f} ms, TPOT median {r['median_tpot_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
                if r["failed"] or not r["completed"]:
                    print(f"{name}: {r['failed']} of {r['completed'] + r['failed']} requests failed", file=sys.stderr)
                    return 1
    finally:
        for w in workers:
            w.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
