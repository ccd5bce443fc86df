"""Gateway CPU per request in front of a gRPC worker vs an HTTP worker, in the same run.

One reference engine of each kind (`tiny`), one `pdgate launch` in front of each in turn, N
sequential /v1/completions (8 tokens, greedy) whole and streamed; the gateway's CPU (utime +
stime from /proc, 10 ms ticks) over the N requests. Not the issue's benchmark: the workers are
the numpy reference engine, not fast mocks, and there is no SMG column. Usage:
N=500 python scripts/bench_grpc_cpu.py"""
import os, subprocess, sys, time, json, tempfile
import httpx
from pdgate.workers import ReferenceWorker, free_port

N = int(os.environ.get("N", "200"))
d = tempfile.mkdtemp()
subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny", "--export-tokenizer", d], check=True, capture_output=True)

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

def measure(worker_url):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "pdgate.cli", "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker_url, "--model-path", d, "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/readiness", timeout=1).status_code == 200: break
            except httpx.HTTPError: pass
            time.sleep(0.1)
        out = {}
        # the gateway binary is the child of the launcher (or the launcher itself)
        pids = [p.pid] + [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}
            with httpx.Client(timeout=60) as c:
                for _ in range(10):
                    c.post(url + "/v1/completions", json=body).read()
                c0 = sum(cpu(x) for x in pids); t0 = time.monotonic()
                for _ in range(N):
                    r = c.post(url + "/v1/completions", json=body); r.read(); assert r.status_code == 200
                c1 = sum(cpu(x) for x in pids); t1 = time.monotonic()
            out["stream" if stream else "whole"] = {"cpu_us_per_req": round((c1 - c0) / N * 1e6), "req_s": round(N / (t1 - t0), 1)}
        return out
    finally:
        p.terminate(); p.wait(20)

h = ReferenceWorker(mode="null"); g = ReferenceWorker(mode="null", grpc_service="sglang")
h.start(90); g.start(90)
try:
    print(json.dumps({"http": measure(h.url), "grpc": measure(g.grpc_url), "N": N}))
finally:
    h.stop(); g.stop()
