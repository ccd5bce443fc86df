"""The claim, measured (issue 14 item 4): goodput of colocated (chunked prefill), disaggregated
and conditional placement on the reference engine, the same number of worker processes in each,
through pdgate, with a short/long prompt mix at several load levels. A benchmark, not a test:
results, plots and the command go in docs/placement.md.

Per placement (fleet.py): colocated = N regular workers; disaggregated = 1 prefill + N-1 decode;
conditional = 1 prefill + 1 decode + N-2 regular (the colocated target). Every level replays the
same seeded trace (workload.py) in each placement. With `--service-model` (from
calibrate_and_compare.py or `pdgate bench --calibrate`), the gateways start from the calibrated
cost-model priors, and `pdgate simulate` predicts each cell for comparison.

    python bench/placement/three_placements.py --rates 0.5,1,2 --duration 30 \\
        --service-model placement-results/service_model.json --out-dir placement-results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calibrate_and_compare import auto_slos, bench, shared_cores, simulate  # noqa: E402
from fleet import start_fleet, model_priors  # noqa: E402
from workload import Mix, write_trace  # noqa: E402

PLACEMENTS = ("colocated", "disaggregated", "conditional", "conditional_pinned")
# name -> (the gateway's --pd-placement, extra gateway flags). `conditional_pinned` keeps the
# calibrated cost model (the priors outweigh any observation): the gateway's online prefill fit
# takes each prefill leg's time, queueing at the engine included, and drifts up under load.
VARIANTS = {"colocated": ("colocated", []), "disaggregated": ("disaggregated", []),
            "conditional": ("conditional", []),
            "conditional_pinned": ("conditional", ["--placement-prior-weight", "1000000", "--placement-forgetting", "1.0"])}


def placement_counts(url: str) -> dict[str, float]:
    """pdgate_placement_total{placement,reason} from the gateway's /metrics (0 series dropped)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'^pdgate_placement_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        value = float(m.group(2))
        if value:
            out[f"{labels.get('placement')}:{labels.get('reason')}"] = value
    return out


def model_gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^pdgate_placement_model\{param="([^"]*)"\} (\S+)$', text, re.M)}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def run_cell(name: str, url: str, rate: float, trace: str, args: argparse.Namespace) -> dict[str, Any]:
    placement = VARIANTS[name][0]
    before = placement_counts(url) if placement != "colocated" else {}
    result = bench(url, trace, os.path.join(args.out_dir, f"claim-{name}-{rate}.json"), args.goodput, name)
    cell = {"placement": name, "rate": rate, "requests": result["completed"] + result["failed"],
            "goodput": result["request_goodput"], "throughput": result["request_throughput"],
            "failed": result["failed"], "p99_ttft_ms": result["p99_ttft_ms"], "p99_tpot_ms": result["p99_tpot_ms"],
            "median_ttft_ms": result["median_ttft_ms"], "load_avg": os.getloadavg()[0]}
    if placement != "colocated":
        cell["decisions"] = delta(placement_counts(url), before)
        cell["model"] = model_gauges(url)
    if args.service_model:
        # The simulator's conditional runs local prefills on a decode worker (kv_both); the
        # gateway's uses the regular pool: the same worker count, a close model.
        sim = simulate(trace, args.service_model, placement, 1, args.workers - 1, args.goodput, args.shared_cores)
        cell["sim_goodput"] = sim["request_goodput"]
        cell["sim_p99_ttft_ms"] = sim["p99_ttft_ms"]
        cell["sim_decisions"] = sim.get("decisions")
    return cell


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per level")
    p.add_argument("--goodput", nargs="+", default=["auto"],
                   help="SLOs as for `pdgate bench`, or `auto` (needs --service-model): scaled to the calibrated machine")
    p.add_argument("--workers", type=int, default=3, help="worker processes in every placement")
    p.add_argument("--model", default="small")
    p.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size of every worker")
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--service-model", default=None, help="calibrated service-time file: gateway priors, predictions")
    p.add_argument("--shared-cores", default="measured",
                   help="cores the workers effectively share, for the simulator's predictions: a number, or "
                        "`measured` (default): the --service-model calibration's estimate")
    p.add_argument("--out-dir", default="placement-results")
    p.add_argument("--seed", type=int, default=100)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    mix = Mix(long_fraction=args.long_fraction)
    priors: list[str] = []
    if args.service_model:
        with open(args.service_model, encoding="utf-8") as f:
            model = json.load(f)
        priors = model_priors(model)
        args.shared_cores = shared_cores(args.shared_cores, model)
        if args.goodput == ["auto"]:
            args.goodput = auto_slos(model, mix)
    elif args.goodput == ["auto"]:
        p.error("--goodput auto needs --service-model")
    # The gateways judge their own SLO counters by the same objectives.
    ttft_slo = next((g.split(":")[1] for g in args.goodput if g.startswith("ttft:")), None)
    tpot_slo = next((g.split(":")[1] for g in args.goodput if g.startswith("tpot:")), None)
    priors += (["--slo-ttft-ms", ttft_slo] if ttft_slo else []) + (["--slo-tpot-ms", tpot_slo] if tpot_slo else [])
    print("SLOs:", " ".join(args.goodput), flush=True)
    traces = {}
    for i, rate in enumerate(rates):
        traces[rate] = os.path.join(args.out_dir, f"claim-trace-{rate}.jsonl")
        write_trace(traces[rate], rate=rate, duration_s=args.duration, mix=mix, seed=args.seed + i)
    started = time.time()
    cells: list[dict[str, Any]] = []
    fleets = {}
    try:
        # All fleets up at once (idle ones cost no CPU), and each level runs every placement back
        # to back in a rotating order: on a shared machine whose load changes by the minute, the
        # placements of one level then see the same machine.
        for name in args.placements.split(","):
            placement, extra = VARIANTS[name]
            fleets[name] = start_fleet(placement, workers=args.workers, model=args.model, chunk=args.chunk,
                                       gateway_args=[*priors, *extra] if placement != "colocated" else (),
                                       log_dir=os.path.join(args.out_dir, "logs", name))
        names = list(fleets)
        for i, rate in enumerate(rates):
            for name in names[i % len(names):] + names[:i % len(names)]:
                cell = run_cell(name, fleets[name].url, rate, traces[rate], args)
                cells.append(cell)
                print(json.dumps(cell), flush=True)
    finally:
        for fleet in fleets.values():
            fleet.stop()
    # Cells of earlier runs into the same directory (other placements) are kept unless re-run.
    path = os.path.join(args.out_dir, "three_placements.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            done = {(c["placement"], c["rate"]) for c in cells}
            cells = [c for c in json.load(f)["cells"] if (c["placement"], c["rate"]) not in done] + cells
            cells.sort(key=lambda c: (PLACEMENTS.index(c["placement"]), c["rate"]))
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"mix": mix.__dict__, "goodput": args.goodput, "duration_s": args.duration,
                   "workers": args.workers, "chunk": args.chunk, "cells": cells}, f, indent=2)
    print(f"\nworkload: {mix.describe()}; SLOs {' '.join(args.goodput)}; {args.duration:.0f} s per level; "
          f"{args.workers} workers per placement; wall {time.time() - started:.0f} s")
    names = list(dict.fromkeys(c["placement"] for c in cells))
    rates = sorted({c["rate"] for c in cells})
    print("| rate (req/s) | " + " | ".join(f"{n} goodput" for n in names) + " | conditional ≥ max(others) |")
    print("|---|" + "---|" * (len(names) + 1))
    for rate in rates:
        row = {c["placement"]: c for c in cells if c["rate"] == rate}
        good = {n: row[n]["goodput"] for n in names if n in row}
        verdict = "-"
        base = [v for n, v in good.items() if not n.startswith("conditional")]
        cond = [v for n, v in good.items() if n.startswith("conditional")]
        if base and cond:
            verdict = "yes" if max(cond) >= max(base) else "no"
        print(f"| {rate} | " + " | ".join(f"{good.get(n, float('nan')):.3f}" for n in names) + f" | {verdict} |")
    try:
        from pdgate.bench.plots import PlotsUnavailable, write_comparison_plot

        series = {n: ([c["rate"] for c in cells if c["placement"] == n],
                      [c["goodput"] for c in cells if c["placement"] == n]) for n in names}
        path = write_comparison_plot(series, os.path.join(args.out_dir, "three_placements_goodput.png"),
                                     title=f"{args.workers} reference workers ({args.model}), measured")
        print(f"plot written to {path}")
    except PlotsUnavailable as exc:
        print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
