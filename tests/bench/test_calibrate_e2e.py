"""End to end: `pdgate bench --calibrate` through a PD gateway and a colocated gateway over
reference workers (`tiny`), then `pdgate simulate` reads the file it wrote. Checks the file's
shape and what the engine makes certain (its KV bytes per token), not timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import launch
from tests.gateway.stacks import FAST_HEALTH

KEY = ["--admin-api-key", "calibrate-test"]


@pytest.fixture
def gateways(processes: Processes) -> Any:
    workers = [ReferenceWorker(mode="prefill", model="tiny"), ReferenceWorker(mode="decode", model="tiny"),
               ReferenceWorker(mode="null", model="tiny", extra_args=["--chunked-prefill-size", "64"])]
    try:
        for w in workers:
            w.start(timeout=60)
        p, d, c = workers
        pd = launch(processes, ["--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url,
                                "--admission-slack", "0", *KEY, *FAST_HEALTH])
        col = launch(processes, ["--worker-urls", c.url, *KEY, *FAST_HEALTH])
        pd.wait_ready()
        col.wait_ready()
        yield pd, col
    finally:
        for w in workers:
            w.stop()


def test_calibrate_writes_a_service_model_simulate_reads(gateways: Any, tmp_path: Path) -> None:
    pd, col = gateways
    out = tmp_path / "service_model.json"
    cmd = [sys.executable, "-m", "pdgate.cli", "bench", "--calibrate", "--base-url", pd.url,
           "--colocated-base-url", col.url, "--admin-api-key", "calibrate-test",
           "--calibrate-prompt-lens", "16,64,128", "--calibrate-batch-sizes", "1,2", "--calibrate-repeats", "1",
           "--calibrate-decode-prompt-len", "8", "--calibrate-decode-output-len", "24",
           "--service-model-out", str(out), "--request-timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    cal = data["calibration"]
    # tiny: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes = 512 bytes a token, sent in whole
    # 16-token pages (the prompt plus BOS rounded up), so at least 512 and under 2x that here.
    assert 512 <= data["kv_bytes_per_token"] < 1024
    assert data["prefill_b_ms"] >= 0 and data["prefill_a_ms"] >= 0 and data["decode_step_ms"] > 0
    assert data["send_chunk_tokens"] == 0 and data["prefill_chunk_tokens"] == 64
    assert data["max_batch"] == 256 and data["link_gib_per_s"] > 0
    assert [p[0] for p in cal["fits"]["prefill_ms_vs_tokens"]["points"]] == [17.0, 65.0, 129.0]  # BOS added
    assert {p[0] for p in cal["fits"]["decode_step_ms_vs_batch"]["points"]} == {1.0, 2.0}
    assert cal["fits"]["transfer_ms_vs_bytes"] is not None
    assert len(cal["samples"]["pd_ttft_ms"]) == len(cal["samples"]["colocated_ttft_ms"]) == 3
    # The link from the decode worker's own reports: one transfer per PD request, whole pages
    # of the prompt (the same bytes the prefill worker counted as sent).
    transfers = cal["samples"]["engine_transfer_ms"]
    assert len(transfers) == 3 and cal["handoff"]["unreported_requests"] == 0, cal["handoff"]
    assert sum(b for b, _ in transfers) == cal["kv_bytes_sent"]
    assert all(ms >= 0 for _, ms in transfers)
    assert cal["fits"]["engine_transfer_ms_vs_bytes"] is not None
    assert cal["handoff"]["overhead_ms"] >= 0 and len(cal["handoff"]["overhead_per_pair_ms"]) == 3
    assert data["link_setup_ms"] >= cal["handoff"]["overhead_ms"]
    assert cal["prefill_workers"] and cal["decode_workers"] and cal["colocated_workers"]

    sim = subprocess.run([sys.executable, "-m", "pdgate.cli", "simulate", "--service-model", str(out),
                          "--placement", "disaggregated", "--num-requests", "50", "--request-rate", "2",
                          "--random-input-len", "64", "--random-output-len", "8"],
                         capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr
    result = json.loads(sim.stdout)["results"][0]
    assert result["completed"] == 50
    assert result["config"]["model"]["kv_bytes_per_token"] == data["kv_bytes_per_token"]


def test_calibrate_without_the_admin_key_says_what_is_missing(gateways: Any, tmp_path: Path) -> None:
    pd, _ = gateways
    cmd = [sys.executable, "-m", "pdgate.cli", "bench", "--calibrate", "--base-url", pd.url,
           "--service-model-out", str(tmp_path / "m.json"), "--request-timeout", "30"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PDGATE_ADMIN_API_KEY"})
    assert proc.returncode == 2
    assert "--admin-api-key" in proc.stderr
    assert not (tmp_path / "m.json").exists()
