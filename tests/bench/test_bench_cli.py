"""`pdgate bench` and `pdgate simulate` on the command line: help, bad input, a small simulation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PDGATE = [sys.executable, "-m", "pdgate.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PDGATE, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_and_describes_both_commands() -> None:
    top = run("--help")
    assert "bench" in top.stdout and "simulate" in top.stdout
    bench = run("bench", "--help")
    assert bench.returncode == 0 and "usage: pdgate bench" in bench.stdout
    for flag in ("--base-url", "--endpoint", "--dataset-name", "--random-input-len", "--random-output-len",
                 "--random-range-ratio", "--random-prefix-len", "--num-prompts", "--request-rate", "--burstiness",
                 "--max-concurrency", "--goodput", "--save-result", "--result-filename", "--seed",
                 "--percentile-metrics", "--metric-percentiles", "--save-detailed"):
        assert flag in bench.stdout, flag
    sim = run("simulate", "--help")
    assert sim.returncode == 0 and "usage: pdgate simulate" in sim.stdout and "--placement" in sim.stdout


def test_bad_input_is_a_usage_error_not_a_crash() -> None:
    for args, needle in ((["bench", "--base-url", "http://x", "--request-rate", "0"], "request rate"),
                         (["bench", "--base-url", "http://x", "--model", "m", "--goodput", "itl:5"], "--goodput"),
                         (["bench", "--base-url", "http://x", "--model", "m", "--dataset-name", "custom"], "dataset-path"),
                         (["bench", "--base-url", "http://x", "--model", "m", "--percentile-metrics", "ttft,foo"],
                          "--percentile-metrics"),
                         (["bench", "--base-url", "http://x", "--model", "m", "--metric-percentiles", "101"],
                          "--metric-percentiles"),
                         (["simulate", "--placement", "sideways"], "invalid choice"),
                         (["simulate", "--request-rate", "inf"], "finite"),
                         (["simulate", "--decision", "nonsense"], "module:function"),
                         (["simulate", "--decode-step-ms", "0"], "decode_step_ms")):
        out = run(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_small_simulation_writes_results_with_bench_keys(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    out = run("simulate", "--num-requests", "300", "--placement", "all", "--request-rate", "1,3",
              "--random-input-len", "2000", "--random-output-len", "50", "--random-range-ratio", "0.9",
              "--transfer-failure-rate", "0.05", "--result-filename", str(path), "--save-detailed",
              "--plot-dir", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    data = json.loads(path.read_text())
    assert [(r["placement"], r["request_rate"]) for r in data["results"]] == [
        (p, rate) for p in ("colocated", "disaggregated", "conditional") for rate in (1.0, 3.0)]
    for r in data["results"]:
        for key in ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                    "std_e2el_ms", "queues", "transferred_bytes", "idle_fraction", "failures", "queue_series"):
            assert key in r, key
        assert r["completed"] + r["failed"] == 300
        assert r["failures"]["reservations_held_at_end"] == 0
        assert r["request_goodput"] <= r["request_throughput"]
    assert data["recommendation"]["pd_ratio"][0]["target_rate"] == 1.0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plots written" in out.stderr
        return
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    for placement in ("colocated", "disaggregated", "conditional"):
        assert {f"simulate_{placement}_ttft_cdf.png", f"simulate_{placement}_goodput_vs_rate.png",
                f"simulate_{placement}_3.0_queues.png"} <= names
