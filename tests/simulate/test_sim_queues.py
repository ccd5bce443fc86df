"""The event loop's queues: Little's law and the M/D/1 wait on a steady case, failure cleanup,
and the conditional placement splitting a mixed load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdgate.simulate import ServiceModel, SimConfig, Simulator
from pdgate.simulate.results import simulation_result
from pdgate.simulate.traffic import random_traffic


def _traffic(n: int, rate: float, input_len: int, output_len: int, seed: int = 0, range_ratio: float = 0.0):
    return random_traffic(n, rate, burstiness=1.0, arrivals="poisson", input_len=input_len, output_len=output_len,
                          range_ratio=range_ratio, dist="uniform", sigma=0.5, prefix_len=0,
                          rng=np.random.default_rng(seed))


def test_prefill_queue_obeys_littles_law_and_md1() -> None:
    # M/D/1: Poisson arrivals, one prefill worker, every prompt 2,000 tokens -> S = 90 ms.
    model = replace(ServiceModel(), max_batch=10_000)
    service_s = model.prefill_ms(2000) / 1000.0
    rate = 0.7 / service_s                                    # utilisation 0.7
    sim = Simulator(model, SimConfig(placement="disaggregated", prefill_workers=1, decode_workers=4))
    sim.run(*_traffic(20000, rate, 2000, 4))
    end = sim.now
    waits = [r.prefill_wait for r in sim.requests]
    queue = sim.stage["prefill_queue"]
    assert queue.value == 0
    # Little's law: time-average number waiting = arrival rate x mean wait (over the same window).
    assert queue.mean(end) == pytest.approx(len(waits) / end * np.mean(waits), rel=1e-9)
    # ... and the wait is the Pollaczek-Khinchine one for M/D/1: rho S / (2 (1 - rho)).
    expected_ms = 0.7 * service_s / (2 * 0.3) * 1000.0
    assert np.mean(waits) == pytest.approx(expected_ms, rel=0.1)


def test_decode_running_obeys_littles_law() -> None:
    sim = Simulator(ServiceModel(), SimConfig(placement="disaggregated", prefill_workers=1, decode_workers=1))
    sim.run(*_traffic(3000, 1.0, 500, 50))
    end = sim.now
    # Each sequence occupies a slot from its admission to its finish: output x 45 ms at this model.
    occupancy = [(r.finish - r.first_token) + 45.0 for r in sim.requests]
    assert sim.stage["decode_running"].mean(end) == pytest.approx(sum(occupancy) / end, rel=1e-6)


@pytest.mark.parametrize("policy", ["retry", "recompute", "fail"])
def test_transfer_failures_release_their_reservations(policy: str) -> None:
    sim = Simulator(ServiceModel(), SimConfig(placement="disaggregated", transfer_failure_rate=0.3,
                                              failure_policy=policy, max_retries=1, seed=4))
    sim.run(*_traffic(500, 2.0, 1000, 20, range_ratio=0.5))
    result = simulation_result(sim, {"ttft": 1000.0}, [99], 2.0)
    failures = result["failures"]
    assert failures["transfer_failures"] > 0
    assert failures["reservations_held_at_end"] == 0
    assert result["completed"] + result["failed"] == 500
    assert all(s.value == 0 for s in sim.stage.values())
    if policy == "fail":
        assert result["failed"] == failures["transfer_failures"] == failures["failed"]
    elif policy == "recompute":
        assert result["failed"] == 0 and failures["recomputed"] == failures["transfer_failures"]
    else:
        assert failures["retries"] > 0 and result["failed"] == failures["failed"]


def test_conditional_sends_short_prompts_local_and_long_ones_remote() -> None:
    prompts = [200] * 100 + [20000] * 100
    order = np.random.default_rng(2).permutation(200)
    arrivals = [i * 400.0 for i in range(200)]
    sim = Simulator(ServiceModel(), SimConfig(placement="conditional"))
    sim.run(arrivals, [prompts[i] for i in order], [200] * 200)
    short = [r for r in sim.requests if r.prompt == 200]
    long = [r for r in sim.requests if r.prompt == 20000]
    assert sum(r.placement == "colocated" for r in short) >= 0.9 * len(short)
    assert sum(r.placement == "disaggregated" for r in long) >= 0.6 * len(long)
    # A long prompt stays local only when the remote path is congested past the TTFT SLO too.
    assert {r.reason for r in long if r.placement == "colocated"} <= {"both_miss_ttft_local_lower"}
