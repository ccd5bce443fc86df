"""Arrival processes: seeded, right mean rate, right spread. Fixed seeds, so nothing can flake."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdgate.bench.arrivals import arrival_offsets, constant_offsets, gamma_offsets, replay_offsets


def _cv(offsets: list[float]) -> float:
    gaps = np.diff([0.0, *offsets])
    return float(np.std(gaps) / np.mean(gaps))


def test_poisson_mean_rate_and_exponential_gaps() -> None:
    offsets = gamma_offsets(20000, 5.0, 1.0, np.random.default_rng(0))
    assert offsets[-1] == pytest.approx(20000 / 5.0)
    assert np.all(np.diff(offsets) >= 0)
    assert _cv(offsets) == pytest.approx(1.0, abs=0.03)  # exponential gaps: CV 1
    # The rate holds over the run, not only at its end: half the requests in half the time.
    assert np.searchsorted(offsets, 2000.0) == pytest.approx(10000, rel=0.03)


def test_burstiness_is_the_gamma_shape() -> None:
    regular = gamma_offsets(20000, 5.0, 4.0, np.random.default_rng(1))
    bursty = gamma_offsets(20000, 5.0, 0.25, np.random.default_rng(1))
    assert _cv(regular) == pytest.approx(0.5, abs=0.03)   # CV = 1/sqrt(shape)
    assert _cv(bursty) == pytest.approx(2.0, rel=0.08)
    assert regular[-1] == pytest.approx(bursty[-1]) == pytest.approx(4000.0)


def test_seeded_and_reproducible() -> None:
    a = gamma_offsets(100, 2.0, 1.0, np.random.default_rng(7))
    assert a == gamma_offsets(100, 2.0, 1.0, np.random.default_rng(7))
    assert a != gamma_offsets(100, 2.0, 1.0, np.random.default_rng(8))


def test_constant_infinite_and_replay() -> None:
    assert constant_offsets(4, 2.0) == [0.5, 1.0, 1.5, 2.0]
    assert gamma_offsets(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    assert gamma_offsets(3, 2.0, math.inf, np.random.default_rng(0)) == [0.5, 1.0, 1.5]
    assert replay_offsets([100.5, 100.0, 103.0], speedup=2.0) == [0.25, 0.0, 1.5]
    rng = np.random.default_rng(0)
    assert arrival_offsets("replay", 2, 1.0, 1.0, rng, [5.0, 6.0, 7.0]) == [0.0, 1.0]
    with pytest.raises(ValueError):
        replay_offsets([1.0, None])
    with pytest.raises(ValueError):
        gamma_offsets(3, 0.0, 1.0, rng)
    with pytest.raises(ValueError):
        arrival_offsets("uniform", 3, 1.0, 1.0, rng)
