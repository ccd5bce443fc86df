"""When each request is sent: offsets in seconds from the start of a load level.

Pure functions of their arguments (the rng comes in), so tests run them on a fixed seed.
The Poisson/gamma process follows vLLM's `bench serve`: intervals are drawn from a gamma
distribution of shape `burstiness` and mean 1/rate (shape 1 is Poisson; below 1 burstier, above 1
more regular), accumulated, then rescaled so the last request goes out at n/rate exactly.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["ARRIVALS", "arrival_offsets", "constant_offsets", "gamma_offsets", "replay_offsets"]

ARRIVALS = ("poisson", "constant", "replay")


def gamma_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Cumulative send offsets for `n` requests at `rate` req/s (`inf`: all at once)."""
    if n <= 0:
        return []
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(burstiness):
        return constant_offsets(n, rate)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    # Rescale so that n requests take n/rate seconds: the achieved mean rate then does not
    # depend on the seed (vLLM does the same).
    offsets *= (n / rate) / offsets[-1]
    return offsets.tolist()


def constant_offsets(n: int, rate: float) -> list[float]:
    """One request every 1/rate seconds (the first after one interval, as the gamma process)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    return [(i + 1) / rate for i in range(n)]


def replay_offsets(arrivals: Sequence[float | None], speedup: float = 1.0) -> list[float]:
    """A trace's own arrival times, shifted so the first is 0 and divided by `speedup`."""
    if speedup <= 0:
        raise ValueError(f"replay speed-up must be positive, got {speedup}")
    if any(a is None for a in arrivals):
        raise ValueError("replay needs an arrival time on every trace line")
    values = [float(a) for a in arrivals]  # type: ignore[arg-type]
    if not values:
        return []
    first = min(values)
    return [(a - first) / speedup for a in values]


def arrival_offsets(kind: str, n: int, rate: float, burstiness: float, rng: np.random.Generator,
                    trace_arrivals: Sequence[float | None] = (), speedup: float = 1.0) -> list[float]:
    """Dispatch on `--arrivals`."""
    if kind == "poisson":
        return gamma_offsets(n, rate, burstiness, rng)
    if kind == "constant":
        return constant_offsets(n, rate)
    if kind == "replay":
        return replay_offsets(list(trace_arrivals)[:n], speedup)
    raise ValueError(f"unknown arrival process {kind!r} (expected one of {', '.join(ARRIVALS)})")
