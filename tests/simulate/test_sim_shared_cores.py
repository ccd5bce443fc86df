"""`--shared-cores N`: workers sharing N CPU cores by processor sharing (each busy worker at
min(1, N / busy) of its speed). Hand-computed cases, and no change where no core is shared."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdgate.simulate import ServiceModel, SimConfig, Simulator
from pdgate.simulate.traffic import random_traffic

# A 100 ms prefill whatever the prompt, in one chunk; one output token: the request is done at
# its first token, so a TTFT is exactly the prefill's run time.
FLAT = replace(ServiceModel(), prefill_a_ms=100.0, prefill_b_ms=0.0, prefill_chunk_tokens=0)


def _colocated(shared_cores: float, arrivals: list[float]) -> Simulator:
    sim = Simulator(FLAT, SimConfig(placement="colocated", prefill_workers=1, decode_workers=1,
                                    shared_cores=shared_cores))
    sim.run(arrivals, [10] * len(arrivals), [1] * len(arrivals))
    return sim


def _ttfts(sim: Simulator) -> list[float]:
    return [r.first_token - r.arrival for r in sim.requests]  # type: ignore[operator]


def test_two_workers_on_one_core_each_take_twice_as_long() -> None:
    assert _ttfts(_colocated(0.0, [0.0, 0.0])) == [100.0, 100.0]
    assert _ttfts(_colocated(1.0, [0.0, 0.0])) == pytest.approx([200.0, 200.0])
    assert _ttfts(_colocated(2.0, [0.0, 0.0])) == pytest.approx([100.0, 100.0])


def test_staggered_prefills_share_the_core_only_while_both_run() -> None:
    # A alone for 50 ms (half done), then A and B at half speed for 100 ms: A ends at 150. B has
    # done 50 by then and runs its last 50 alone: it ends at 200, 150 ms after it arrived.
    sim = _colocated(1.0, [0.0, 50.0])
    assert [r.first_token for r in sim.requests] == pytest.approx([150.0, 200.0])
    assert _ttfts(sim) == pytest.approx([150.0, 150.0])
    # 1.5 cores for two workers: each at 0.75 while both run. A: 50 alone, its other 50 take
    # 66.7 ms (ends at 116.7); B: 50 done by then, the rest alone (ends at 166.7).
    assert [r.first_token for r in _colocated(1.5, [0.0, 50.0]).requests] == pytest.approx([350 / 3, 500 / 3])


def test_as_many_cores_as_workers_changes_nothing() -> None:
    # Disaggregated: 1 prefill + 2 decode workers, a Poisson mix; with 3 cores nobody slows down.
    model = replace(ServiceModel(), decode_step_per_seq_ms=0.5)
    traffic = random_traffic(400, 3.0, burstiness=1.0, arrivals="poisson", input_len=3000, output_len=100,
                             range_ratio=0.5, dist="uniform", sigma=0.5, prefix_len=0, rng=np.random.default_rng(3))
    runs = []
    for cores in (0.0, 3.0):
        sim = Simulator(model, SimConfig(placement="disaggregated", prefill_workers=1, decode_workers=2,
                                         shared_cores=cores))
        sim.run(*traffic)
        runs.append(sim)
    for a, b in zip(runs[0].requests, runs[1].requests):
        assert b.first_token == pytest.approx(a.first_token, abs=1e-6)
        assert b.finish == pytest.approx(a.finish, abs=1e-6)


def test_fewer_cores_slow_a_busy_pipeline_and_leave_nothing_behind() -> None:
    model = replace(ServiceModel(), decode_step_per_seq_ms=0.5)
    traffic = random_traffic(300, 2.0, burstiness=1.0, arrivals="poisson", input_len=3000, output_len=100,
                             range_ratio=0.5, dist="uniform", sigma=0.5, prefix_len=0, rng=np.random.default_rng(4))
    mean_e2e = {}
    for cores in (0.0, 1.0):
        sim = Simulator(model, SimConfig(placement="disaggregated", prefill_workers=1, decode_workers=2,
                                         shared_cores=cores))
        sim.run(*traffic)
        assert all(r.finish is not None and r.first_token is not None for r in sim.requests)
        assert all(r.arrival <= r.first_token <= r.finish for r in sim.requests)  # type: ignore[operator]
        assert sim.busy == 0 and sim.reserved_at_end() == 0
        mean_e2e[cores] = float(np.mean([r.finish - r.arrival for r in sim.requests]))  # type: ignore[operator]
    assert mean_e2e[1.0] > 1.2 * mean_e2e[0.0], mean_e2e


def test_negative_cores_are_refused() -> None:
    with pytest.raises(ValueError, match="shared_cores"):
        Simulator(FLAT, SimConfig(placement="colocated", shared_cores=-1.0))
