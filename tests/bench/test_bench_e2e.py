"""End to end: `pdgate bench` against reference-engine prefill and decode workers behind
`pdgate launch`; checks the result files, their keys, goodput by its definition, and the plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdgate.bench.dataset import random_requests
from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import launch
from tests.gateway.stacks import FAST_HEALTH

RATES = (4.0, 8.0)
# Tight enough on TPOT that some requests may miss it on a busy machine; the check below recomputes
# goodput from the raw per-request lists either way.
GOODPUT = {"ttft": 3000.0, "tpot": 20.0}
VLLM_KEYS = ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "total_input_tokens", "total_output_tokens")
DETAILED = ("ttfts", "itls", "input_lens", "output_lens", "errors")


@pytest.fixture
def pd_gateway(processes: Processes) -> Any:
    prefill = ReferenceWorker(mode="prefill", model="tiny")
    decode = ReferenceWorker(mode="decode", model="tiny")
    try:
        prefill.start(timeout=60)
        decode.start(timeout=60)
        gateway = launch(processes, ["--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port),
                                     "--decode", decode.url, *FAST_HEALTH])
        gateway.wait_ready()
        yield gateway
    finally:
        prefill.stop()
        decode.stop()


def _goodput_by_definition(result: dict[str, Any]) -> float:
    """Requests meeting TTFT and TPOT (excluding the first token) per second, from the raw lists."""
    good = 0
    rows = zip(result["ttfts"], result["latencies"], result["output_lens"], result["errors"])
    for ttft, e2e, out, err in rows:
        if err:
            continue
        tpot = (e2e - ttft) / (out - 1) if out > 1 else 0.0
        good += ttft * 1000 <= GOODPUT["ttft"] and tpot * 1000 <= GOODPUT["tpot"]
    return good / result["duration"]


def test_bench_against_reference_pd_stack(pd_gateway: Any, tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    cmd = [sys.executable, "-m", "pdgate.cli", "bench", "--base-url", pd_gateway.url, "--endpoint", "/v1/completions",
           "--num-prompts", "10", "--request-rate", ",".join(map(str, RATES)), "--random-input-len", "24",
           "--random-output-len", "6", "--random-range-ratio", "0.5", "--random-prefix-len", "8",
           "--ignore-eos", "--goodput", *(f"{k}:{v}" for k, v in GOODPUT.items()), "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "run.json",
           "--plot-dir", str(plots), "--seed", "3", "--request-timeout", "60", "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout

    for rate in RATES:
        result = json.loads((tmp_path / f"run-{rate}qps.json").read_text())
        assert result["request_rate"] == rate and result["model_id"] == "tiny"
        for key in VLLM_KEYS + DETAILED:
            assert key in result, key
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p50", "p90", "p99"):
                assert f"{stat}_{metric}_ms" in result
        assert (result["completed"], result["failed"]) == (10, 0), result["errors_by_kind"]
        # --ignore-eos: exactly the planned lengths (the same seed draws the same requests).
        planned = random_requests(10, 24, 6, range_ratio=0.5, prefix_len=8, rng=np.random.default_rng(3))
        assert result["output_lens"] == [r.output_len for r in planned]
        # One gap per content chunk after the first; a chunk can carry several byte tokens (or
        # none, while a UTF-8 character is incomplete), so there are at most output - 1 gaps.
        assert all(len(gaps) <= r.output_len - 1 for gaps, r in zip(result["itls"], planned))
        assert sum(len(gaps) for gaps in result["itls"]) > 0 and result["mean_itl_ms"] > 0
        # The server's usage counts the prompt (the reference engine adds a BOS token).
        assert all(r.prompt_len <= n <= r.prompt_len + 1 for r, n in zip(planned, result["input_lens"]))
        assert all(0 < t < 60 for t in result["ttfts"])     # seconds, as vLLM writes them
        assert result["mean_tpot_ms"] > 0 and result["p99_ttft_ms"] >= result["p50_ttft_ms"]
        assert result["request_goodput"] == pytest.approx(_goodput_by_definition(result))
        assert result["request_throughput"] == pytest.approx(10 / result["duration"])

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plots written" in proc.stderr
        pytest.skip("matplotlib is not installed (pip install 'pdgate[bench]'): plots not checked")
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["bench_goodput_vs_rate.png", "bench_itl_cdf.png", "bench_p99_vs_rate.png", "bench_ttft_cdf.png"]
    assert all((plots / n).stat().st_size > 1000 for n in names)


def test_bench_chat_without_streaming(pd_gateway: Any, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdgate.cli", "bench", "--base-url", pd_gateway.url, "--endpoint",
           "/v1/chat/completions", "--no-stream", "--num-prompts", "4", "--request-rate", "inf", "--max-concurrency", "2",
           "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos", "--save-detailed",
           "--result-dir", str(tmp_path), "--result-filename", "chat.json", "--request-timeout", "60", "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "chat.json").read_text())
    assert (result["completed"], result["failed"], result["backend"]) == (4, 0, "openai-chat")
    assert result["output_lens"] == [4] * 4 and result["request_goodput"] is None
    assert result["ttfts"] == result["latencies"]   # no stream: the first token is seen with the last
    assert result["itls"] == [[]] * 4


def test_bench_reports_errors_by_kind_without_crashing(tmp_path: Path) -> None:
    # Nothing listens on this port: every request fails as a connect error, the run still ends
    # with a result file, zero goodput and the errors counted by kind.
    from pdgate.workers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pdgate.cli", "bench", "--base-url", url, "--model", "m", "--num-prompts", "3",
           "--random-input-len", "4", "--random-output-len", "2", "--goodput", "ttft:100",
           "--result-dir", str(tmp_path), "--result-filename", "r.json", "--request-timeout", "5", "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"], result["request_goodput"]) == (0, 3, 0.0)
    assert result["errors_by_kind"] == {"connect": 3}
    assert "ttfts" not in result                          # per-request lists only with --save-detailed
