"""The simulator's encode stage (EPD, issue 31 item 6): exact TTFTs on an idle pipeline, the
encode queue's M/D/1 wait, and what moving the tower off the prefill does to text requests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdgate.simulate import ServiceModel, SimConfig, Simulator
from pdgate.simulate.analysis import encode_workers
from pdgate.simulate.traffic import draw_images

MODEL = replace(ServiceModel(), prefill_a_ms=10.0, prefill_b_ms=0.1, decode_step_ms=5.0, encode_image_ms=40.0,
                link_setup_ms=1.0, kv_bytes_per_token=0.0, send_chunk_tokens=0, max_batch=10_000)


def _run(encoders: int, arrivals: list[float], prompts: list[int], images: list[int], outputs: int = 4) -> Simulator:
    sim = Simulator(MODEL, SimConfig(placement="disaggregated", prefill_workers=1, decode_workers=1,
                                     encode_workers=encoders))
    sim.run(arrivals, prompts, [outputs] * len(arrivals), images)
    return sim


def _ttft(r) -> float:  # type: ignore[no-untyped-def]
    return r.first_token - r.arrival


@pytest.mark.parametrize("encoders", [0, 1, 2])
def test_one_image_request_on_an_idle_pipeline(encoders: int) -> None:
    """Two images, 100 prompt tokens: the tower (2 x 40 ms) runs on the prefill (0 encode
    workers), one after the other on one encode worker, or side by side on two; then the
    prefill (10 + 0.1 x 100 ms), the hand-off (1 ms) and the first decode step (5 ms)."""
    sim = _run(encoders, [0.0], [100], [2])
    tower = {0: 80.0, 1: 80.0, 2: 40.0}[encoders]
    assert _ttft(sim.requests[0]) == pytest.approx(tower + 20.0 + 1.0 + 5.0)
    assert sim.stage["encode_queue"].value == 0
    assert sim.idle_fraction(sim.now).get("encode", 1.0) < 1.0 or encoders == 0


def test_text_requests_stop_waiting_behind_the_tower() -> None:
    """An image request, then a text one 1 ms later: without encode workers the text request
    queues behind the image's tower on the one prefill worker; with one, it does not."""
    local = _run(0, [0.0, 1.0], [100, 100], [4, 0])
    remote = _run(1, [0.0, 1.0], [100, 100], [4, 0])
    text_local, text_remote = _ttft(local.requests[1]), _ttft(remote.requests[1])
    assert text_local == pytest.approx(4 * 40.0 + 20.0 - 1.0 + 20.0 + 1.0 + 5.0)
    assert text_remote == pytest.approx(20.0 + 1.0 + 5.0)
    # the image request pays the same tower either way, and nothing else waits for it
    assert _ttft(local.requests[0]) == pytest.approx(_ttft(remote.requests[0]))


def test_the_encode_queue_obeys_md1_and_the_sizing_rule() -> None:
    """Poisson image requests (one image each) at 70 % of one encode worker: the mean wait for
    the tower is the Pollaczek-Khinchine rho S / (2 (1 - rho)); `encode_workers` sizes the pool
    to stay under 80 %."""
    rng = np.random.default_rng(0)
    service = MODEL.encode_image_ms
    rate_per_ms = 0.7 / service
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_ms, 20000)).tolist()
    sim = Simulator(replace(MODEL, prefill_a_ms=0.0, prefill_b_ms=0.0001),
                    SimConfig(placement="disaggregated", prefill_workers=4, decode_workers=1, encode_workers=1))
    sim.run(arrivals, [1] * len(arrivals), [1] * len(arrivals), [1] * len(arrivals))
    queue = sim.stage["encode_queue"]
    assert queue.value == 0
    # Little's law over the encode stage: images in it = arrival rate x time in it (wait + S)
    in_stage_ms = queue.mean(sim.now) * sim.now / len(arrivals)
    expected = 0.7 * service / (2 * 0.3) + service
    assert in_stage_ms == pytest.approx(expected, rel=0.1)
    sizing = encode_workers(MODEL, images_per_s=50.0)
    assert sizing["images_per_s_per_worker"] == pytest.approx(25.0)
    assert sizing["encode_workers"] == 3  # 50 / (25 x 0.8) = 2.5


def test_images_are_drawn_apart_from_the_lengths() -> None:
    a = draw_images(1000, 0.3, 2, seed=5)
    assert set(a) == {0, 2} and 250 < sum(1 for k in a if k) < 350
    assert draw_images(1000, 0.3, 2, seed=5) == a
    assert draw_images(10, 0.0, 2, seed=5) == [0] * 10
    with pytest.raises(ValueError):
        draw_images(10, 1.5, 1, seed=5)
