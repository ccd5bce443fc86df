"""The simulator's conditional placement is pdgate-core's decision, through the bindings: its
predictions agree with the simulator's service-time model on a grid of inputs."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pdgate.simulate import ServiceModel
from pdgate.simulate.placement import (COLOCATED, DISAGGREGATED, PlacementView, conditional, core_decide,
                                       predicted_local_ttft_ms, predicted_remote_ttft_ms)

MODELS = [ServiceModel(), replace(ServiceModel(), decode_step_per_seq_ms=0.5, send_chunk_tokens=0, prefill_chunk_tokens=512)]


def _stall_tpot_ms(v: PlacementView, m: ServiceModel) -> float:
    # The model's statement of the stall (docs/placement.md), written out independently.
    stall = (v.local_wait_ms + m.prefill_ms(v.prompt_tokens)) * max(1, v.local_batch)
    return m.decode_step(v.local_batch) + stall / max(v.output_tokens, 1)


@pytest.mark.parametrize("model", MODELS)
def test_python_and_rust_agree_on_a_grid(model: ServiceModel) -> None:
    grid = itertools.product((1, 100, 2000, 6000, 30000), (1, 400), (0.0, 250.0), (0.0, 900.0), (0, 8, 32), (0.0, 120.0), (0, 1, 16))
    seen = set()
    for tokens, out, pwait, dwait, rbatch, lwait, lbatch in grid:
        v = PlacementView(tokens, out, pwait, dwait, rbatch, lwait, lbatch, 1000.0, 50.0)
        placement, reason, remote, local, tpot = core_decide(v, model)
        assert remote == pytest.approx(predicted_remote_ttft_ms(v, model), rel=1e-9, abs=1e-9)
        assert local == pytest.approx(predicted_local_ttft_ms(v, model), rel=1e-9, abs=1e-9)
        if lbatch:
            assert tpot == pytest.approx(_stall_tpot_ms(v, model), rel=1e-9)
        else:
            assert tpot is None
        d = conditional(v, model)
        assert (d.placement, d.reason) == (placement, reason)
        assert placement in (COLOCATED, DISAGGREGATED), "the simulator never rejects"
        seen.add(placement)
    assert seen == {COLOCATED, DISAGGREGATED}, "the grid exercises both placements"


def test_the_worked_example_through_core() -> None:
    m = replace(ServiceModel(), send_chunk_tokens=0)
    v = PlacementView(6000, 200, 0.0, 0.0, 0, 0.0, 8, 600.0, 50.0)
    placement, reason, remote, _, tpot = core_decide(v, m)
    assert remote == pytest.approx(370.2, abs=0.1)
    assert (placement, reason) == (DISAGGREGATED, "local_stall_breaks_tpot") and tpot > 50.0
    # The gateway's early rejection: over 300 ms × 1, nothing fits.
    assert core_decide(replace(v, slo_ttft_ms=300.0), m, slack=1.0)[:2] == ("rejected", "predicted_ttft_over_budget")


def test_the_utilisation_tie_break_through_core() -> None:
    # The core unit test's case (placement/tests.rs): a 2,000-token prompt, 50 output tokens,
    # SLOs 600 / 100 ms, the pair idle. Eight local decodes put their stall TPOT at 59.4 ms (0.594
    # of the SLO) against the remote step's 45 ms (0.45): remote, though local's TTFT is lower.
    m = ServiceModel()
    v = PlacementView(2000, 50, 0.0, 0.0, 0, 0.0, 8, 600.0, 100.0)
    placement, reason, remote, local, tpot = core_decide(v, m)
    assert local < remote and tpot == pytest.approx(59.4)
    assert (placement, reason) == (DISAGGREGATED, "remote_less_utilised")
    # Four: 52.2 ms (0.522), within 0.1 of the remote's: the lower TTFT keeps it local.
    assert core_decide(replace(v, local_batch=4), m)[:2] == (COLOCATED, "local_ttft_lower")
