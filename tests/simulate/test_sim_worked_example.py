"""The design's worked example, derived from the service-time model (not stored anywhere)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdgate.cli import main
from pdgate.simulate import ServiceModel, worked_example


def test_worked_example_numbers() -> None:
    ex = worked_example()
    assert ex["prefill_ms"] == pytest.approx(230.0)                  # 20 + 0.035 x 6000
    assert ex["transfer_ms"] == pytest.approx(95.23, abs=0.01)       # 12 + 6000 x 320 KiB / 22 GiB/s
    assert ex["ttft_ms"] == pytest.approx(370.23, abs=0.01)          # + one 45 ms decode step
    assert ex["ttft_chunked_ms"] == pytest.approx(314.74, abs=0.01)  # only the last 2,000-token send shows
    # "one prefill feeds about two decodes": 4.35 req/s of prefill against 32 / (400 x 45 ms) of decode.
    ratio = ex["pd_ratio"]
    assert ratio["prefill_requests_per_s"] == pytest.approx(1000 / 230)
    assert ratio["decode_requests_per_s"] == pytest.approx(32 / 18)
    assert 2.0 <= ratio["decodes_per_prefill"] < 2.5


def test_numbers_follow_the_model() -> None:
    m = replace(ServiceModel(), prefill_a_ms=10.0, link_setup_ms=0.0, send_chunk_tokens=0)
    ex = worked_example(m)
    assert ex["prefill_ms"] == pytest.approx(220.0)
    assert ex["transfer_ms"] == pytest.approx(83.23, abs=0.01)
    # With one send after the prefill, nothing is hidden: chunked TTFT equals the plain one.
    assert ex["ttft_chunked_ms"] == pytest.approx(ex["ttft_ms"])


def test_simulate_example_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--example", "worked"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [round(out[k]) for k in ("prefill_ms", "transfer_ms", "ttft_ms", "ttft_chunked_ms")] == [230, 95, 370, 315]
    assert out["split_thresholds"] and "pd_ratio" in out


def test_an_idle_pipeline_simulated_matches_the_example() -> None:
    # One request alone through the discrete-event model gives the closed-form TTFT.
    from pdgate.simulate import SimConfig, Simulator

    sim = Simulator(ServiceModel(), SimConfig(placement="disaggregated"))
    sim.run([0.0], [6000], [400])
    req = sim.requests[0]
    assert req.first_token == pytest.approx(314.74, abs=0.01)
    assert req.finish - req.first_token == pytest.approx(399 * 45.0)
    assert sim.transferred_bytes == 6000 * 320 * 1024
