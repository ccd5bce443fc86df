"""Fitting the service-time model of `pdgate simulate` from samples measured by
`pdgate bench --calibrate` (pure functions: the measurement is in calibrate.py).

Every fit takes the median of the samples at each size first, then least squares over those
medians: a shared, loaded machine adds long one-sided outliers that a plain least-squares fit
would chase. Slopes are never negative (more tokens never take less time).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from pdgate.simulate.model import GIB

__all__ = ["LinearFit", "fit_line", "fit_transfer", "kv_bytes_per_token", "service_model_fields",
           "MAX_LINK_GIB_PER_S"]

# A transfer too fast to resolve against the noise (its slope fits to 0) gets this bandwidth.
MAX_LINK_GIB_PER_S = 1000.0


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope·x over the per-x medians; `points` is (x, median y, samples)."""

    intercept: float
    slope: float
    points: tuple[tuple[float, float, int], ...]
    max_rel_error: float  # largest |fit − median| / median over the points

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _medians(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float, int]]:
    groups: dict[float, list[float]] = {}
    for x, y in samples:
        if math.isfinite(x) and math.isfinite(y):
            groups.setdefault(float(x), []).append(float(y))
    return [(x, statistics.median(ys), len(ys)) for x, ys in sorted(groups.items())]


def fit_line(samples: Sequence[tuple[float, float]], *, min_intercept: float | None = 0.0) -> LinearFit:
    """Least squares over the per-x medians, slope clamped at 0 (then the intercept is the
    median of the medians) and the intercept at `min_intercept` (None: unclamped)."""
    points = _medians(samples)
    if not points:
        raise ValueError("no samples to fit")
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    if len(points) == 1 or max(xs) == min(xs):
        slope, intercept = 0.0, statistics.median(ys)
    else:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        intercept = my - slope * mx
        if slope < 0:
            slope, intercept = 0.0, statistics.median(ys)
    if min_intercept is not None and intercept < min_intercept:
        # Refit the slope through the clamped intercept (least squares with a fixed intercept).
        intercept = min_intercept
        sxx = sum(x * x for x in xs)
        slope = max(0.0, sum(x * (y - intercept) for x, y in zip(xs, ys)) / sxx) if sxx else 0.0
    errors = [abs(intercept + slope * x - y) / y for x, y in zip(xs, ys) if y > 0]
    return LinearFit(intercept, slope, tuple(points), max(errors) if errors else 0.0)


def kv_bytes_per_token(bytes_sent: float, prompt_tokens: float) -> float:
    """KV bytes the prefill workers reported sending, per prompt token sent through them."""
    if prompt_tokens <= 0 or bytes_sent <= 0:
        raise ValueError(f"cannot derive KV bytes per token from {bytes_sent} bytes over {prompt_tokens} tokens")
    return bytes_sent / prompt_tokens


def fit_transfer(pd_ttft: Sequence[tuple[float, float]], prefill: LinearFit, first_step_ms: float,
                 bytes_per_token: float) -> tuple[float, float, LinearFit]:
    """The exposed KV transfer, by difference: at each prompt length on an idle pipeline,
    TTFT(disaggregated) − prefill(tokens) − one decode step is what the hand-off cost (the
    gateway's second leg, the transfer, the decode picking it up). Fitted as
    setup + bytes / bandwidth; returns (setup_ms, GiB/s, the fit over (bytes, ms))."""
    extra = [(tokens * bytes_per_token, ttft - prefill.at(tokens) - first_step_ms) for tokens, ttft in pd_ttft]
    fit = fit_line(extra, min_intercept=0.0)
    gib_per_s = MAX_LINK_GIB_PER_S if fit.slope <= 0 else min(MAX_LINK_GIB_PER_S, 1000.0 / (fit.slope * GIB))
    return fit.intercept, gib_per_s, fit


def service_model_fields(prefill: LinearFit, decode: LinearFit, *, kv_bpt: float, link_setup_ms: float,
                         link_gib_per_s: float, prefill_chunk_tokens: int, max_batch: int) -> dict[str, float]:
    """The `ServiceModel` fields (`pdgate simulate --service-model`) from the fits. The decode
    step is base + per_seq·batch; a measured base of 0 would make the model invalid, so it is
    kept at least 0.1 ms. KV is sent in one piece after the prefill (`send_chunk_tokens` 0): the
    reference engine sends a prompt's pages when its prefill has finished."""
    return {
        "prefill_a_ms": round(prefill.intercept, 4),
        "prefill_b_ms": round(prefill.slope, 6),
        "decode_step_ms": round(max(0.1, decode.intercept), 4),
        "decode_step_per_seq_ms": round(decode.slope, 6),
        "kv_bytes_per_token": round(kv_bpt, 3),
        "link_setup_ms": round(max(0.0, link_setup_ms), 4),
        "link_gib_per_s": round(link_gib_per_s, 6),
        "send_chunk_tokens": 0,
        "prefill_chunk_tokens": int(prefill_chunk_tokens),
        "max_batch": int(max_batch),
    }
