"""Calibrate -> simulate -> bench: does `pdgate simulate`, fed with `pdgate bench --calibrate`'s
service-time file, predict the goodput and p99 TTFT that `pdgate bench` then measures?
(issue 14 item 3; a benchmark, not a test: results go in docs/placement.md.)

1. Starts a PD fleet (1 prefill + 1 decode reference worker behind `pdgate launch
   --pd-disaggregation`) and, for the prefill table, a colocated gateway over one regular worker.
2. `pdgate bench --calibrate` through them writes the service-time file.
3. At each load level: a seeded short/long trace (workload.py); `pdgate simulate --placement
   disaggregated --prefill-workers 1 --decode-workers 1` replays it with the file, twice: with
   `--shared-cores N` (this machine's cores, which the two workers share: the comparison's
   prediction) and without (each worker its own hardware, as on GPUs; for reference);
   `pdgate bench` replays it against the PD gateway.
4. Prints the table (simulated / measured) and writes it as JSON, with the load average (other
   people's jobs share the machine) before and after each level.

    nice python bench/placement/calibrate_and_compare.py --rates 0.25,0.5,1 --duration 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet import ADMIN_KEY, start_fleet  # noqa: E402
from workload import Mix, write_trace  # noqa: E402

PDGATE = [sys.executable, "-m", "pdgate.cli"]


def run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def calibrate(pd_url: str, col_url: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    run([*PDGATE, "bench", "--calibrate", "--base-url", pd_url, "--colocated-base-url", col_url, "--admin-api-key", ADMIN_KEY,
         "--calibrate-prompt-lens", args.calibrate_prompt_lens, "--calibrate-batch-sizes", args.calibrate_batch_sizes,
         "--calibrate-repeats", str(args.calibrate_repeats), "--calibrate-decode-prompt-len",
         str(args.decode_prompt_len), "--service-model-out", out, "--seed", str(args.seed)], timeout=1800)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def simulate(trace: str, model_file: str, placement: str, prefill: int, decode: int,
             goodput: list[str], shared_cores: float = 0.0) -> dict[str, Any]:
    out = run([*PDGATE, "simulate", "--placement", placement, "--prefill-workers", str(prefill),
               "--decode-workers", str(decode), "--dataset-path", trace, "--arrivals", "replay",
               "--service-model", model_file, "--goodput", *goodput, "--metric-percentiles", "50,99",
               "--shared-cores", str(shared_cores)], timeout=600)
    return json.loads(out)["results"][0]


def bench(url: str, trace: str, result: str, goodput: list[str], label: str) -> dict[str, Any]:
    run([*PDGATE, "bench", "--base-url", url, "--dataset-name", "custom", "--dataset-path", trace,
         "--arrivals", "replay", "--ignore-eos", "--goodput", *goodput, "--metric-percentiles", "50,99",
         "--request-timeout", "120", "--disable-tqdm", "--save-detailed", "--label", label,
         "--result-filename", result, "--result-dir", "."], timeout=900)
    with open(result, encoding="utf-8") as f:
        return json.load(f)


def auto_slos(model: dict[str, Any], mix: Mix) -> list[str]:
    """SLOs scaled to the machine as calibrated: TTFT 2x the idle disaggregated TTFT of the
    mix's longest prompt, TPOT 2x the decode step at a batch of 4. On a shared machine whose
    speed changes threefold with other people's builds, fixed SLOs give a goodput of 0 (or the
    offered rate) everywhere, which validates nothing."""
    tokens = mix.long[1]
    kv = tokens * model["kv_bytes_per_token"] / (model["link_gib_per_s"] * 1024 ** 3) * 1000.0
    prefill = model["prefill_a_ms"] + model["prefill_b_ms"] * tokens + model.get("prefill_c_ms", 0.0) * tokens ** 2
    ttft = prefill + model["link_setup_ms"] + kv + model["decode_step_ms"]
    tpot = model["decode_step_ms"] + 4 * model["decode_step_per_seq_ms"]
    return [f"ttft:{2 * ttft:.0f}", f"tpot:{2 * tpot:.0f}"]


def shared_cores(arg: str, model: dict[str, Any]) -> float:
    """`--shared-cores`: a number, or `measured`: what the calibration measured (0 when it saw no
    contention or did not measure it: each worker its own hardware)."""
    if arg != "measured":
        return float(arg)
    return float(((model.get("calibration") or {}).get("shared_cores") or {}).get("cores") or 0.0)


def ratio(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else sim / real


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per level")
    p.add_argument("--goodput", nargs="+", default=["auto"],
                   help="SLOs as for `pdgate bench`, or `auto`: scaled to the calibrated machine (see auto_slos)")
    p.add_argument("--model", default="small")
    p.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size of the workers")
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--calibrate-prompt-lens", default="16,128,256,512,1024")
    p.add_argument("--calibrate-batch-sizes", default="1,2,4,8")
    p.add_argument("--calibrate-repeats", type=int, default=5, help="samples per prompt length and batch size")
    p.add_argument("--shared-cores", default="measured",
                   help="cores the workers effectively share, for the simulator: a number, or `measured` "
                        "(default): the calibration's estimate (a decode stream beside a busy prefill)")
    p.add_argument("--decode-prompt-len", type=int, default=64, help="prompt tokens of the decode-step requests")
    p.add_argument("--service-model", default=None, help="skip calibration and use this file")
    p.add_argument("--out-dir", default="placement-results")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    mix = Mix(long_fraction=args.long_fraction)
    started = time.time()
    pd = start_fleet("disaggregated", workers=2, prefill=1, model=args.model, chunk=args.chunk,
                     log_dir=os.path.join(args.out_dir, "logs"))
    try:
        model_file = args.service_model or os.path.join(args.out_dir, "service_model.json")
        if not args.service_model:
            col = start_fleet("colocated", workers=1, model=args.model, chunk=args.chunk,
                              log_dir=os.path.join(args.out_dir, "logs"))
            try:
                model = calibrate(pd.url, col.url, model_file, args)
            finally:
                col.stop()
            print("calibrated:", json.dumps({k: v for k, v in model.items() if k != "calibration"}), flush=True)
        else:
            with open(model_file, encoding="utf-8") as f:
                model = json.load(f)
        args.shared_cores = shared_cores(args.shared_cores, model)
        print(f"shared cores: {args.shared_cores}", flush=True)
        if args.goodput == ["auto"]:
            args.goodput = auto_slos(model, mix)
            print("SLOs (auto):", " ".join(args.goodput), flush=True)
        rows = []
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            trace = os.path.join(args.out_dir, f"trace-{rate}.jsonl")
            n = write_trace(trace, rate=rate, duration_s=args.duration, mix=mix, seed=args.seed + i)
            sim = simulate(trace, model_file, "disaggregated", 1, 1, args.goodput, args.shared_cores)
            own = simulate(trace, model_file, "disaggregated", 1, 1, args.goodput)
            load_before = os.getloadavg()[0]
            real = bench(pd.url, trace, os.path.join(args.out_dir, f"bench-disaggregated-{rate}.json"),
                         args.goodput, "disaggregated")
            row = {"rate": rate, "requests": n, "shared_cores": args.shared_cores,
                   "sim_goodput": sim["request_goodput"], "real_goodput": real["request_goodput"],
                   "sim_p99_ttft_ms": sim["p99_ttft_ms"], "real_p99_ttft_ms": real["p99_ttft_ms"],
                   "own_hw_sim_goodput": own["request_goodput"], "own_hw_sim_p99_ttft_ms": own["p99_ttft_ms"],
                   "sim_median_tpot_ms": sim["median_tpot_ms"], "real_median_tpot_ms": real["median_tpot_ms"],
                   "real_failed": real["failed"], "load_avg_before": load_before, "load_avg": os.getloadavg()[0]}
            row["goodput_ratio"] = ratio(row["sim_goodput"], row["real_goodput"])
            row["p99_ttft_ratio"] = ratio(row["sim_p99_ttft_ms"], row["real_p99_ttft_ms"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pd.stop()
    print(f"\nworkload: {mix.describe()}; SLOs {' '.join(args.goodput)}; {args.duration:.0f} s per level; "
          f"wall {time.time() - started:.0f} s")
    print("| rate (req/s) | requests | goodput sim | goodput measured | sim/measured | p99 TTFT sim (ms) "
          "| p99 TTFT measured (ms) | sim/measured | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']} | {r['requests']} | {r['sim_goodput']:.3f} | {r['real_goodput']:.3f} | "
              f"{r['goodput_ratio'] or float('nan'):.2f} | {r['sim_p99_ttft_ms']:.0f} | {r['real_p99_ttft_ms']:.0f} | "
              f"{r['p99_ttft_ratio'] or float('nan'):.2f} | {r['load_avg']:.1f} |")
    with open(os.path.join(args.out_dir, "calibrate_and_compare.json"), "w", encoding="utf-8") as f:
        json.dump({"mix": mix.__dict__, "goodput": args.goodput, "duration_s": args.duration,
                   "shared_cores": args.shared_cores, "service_model": model, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
