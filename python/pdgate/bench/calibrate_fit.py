"""Fitting the service-time model of `pdgate simulate` from samples measured by
`pdgate bench --calibrate` (pure functions: the measurement is in calibrate.py).

Every fit takes the median of the samples at each size first, then least squares over those
medians: a shared, loaded machine adds long one-sided outliers that a plain least-squares fit
would chase. Times are fitted by *relative* error (each median weighted 1/y²), so a short
prompt's 40 ms counts as much as a long one's second: the reference engine's prefill is
superlinear (attention grows with the square of the prompt), and an absolute fit would give short
prompts a zero or negative fixed cost. Slopes are never negative (more tokens never take less
time).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from pdgate.simulate.model import GIB

__all__ = ["MAX_LINK_GIB_PER_S", "LinearFit", "fit_engine_transfer", "fit_line", "fit_prefill", "fit_transfer",
           "handoff_overhead_ms", "kv_bytes_per_token", "service_model_fields", "shared_cores_estimate"]

# A transfer too fast to resolve against the noise (its slope fits to 0) gets this bandwidth.
MAX_LINK_GIB_PER_S = 1000.0


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope·x (+ curvature·x², see fit_prefill) over the per-x medians;
    `points` is (x, median y, samples)."""

    intercept: float
    slope: float
    points: tuple[tuple[float, float, int], ...]
    max_rel_error: float  # largest |fit − median| / median over the points
    curvature: float = 0.0

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x + self.curvature * x * x

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _medians(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float, int]]:
    groups: dict[float, list[float]] = {}
    for x, y in samples:
        if math.isfinite(x) and math.isfinite(y):
            groups.setdefault(float(x), []).append(float(y))
    return [(x, statistics.median(ys), len(ys)) for x, ys in sorted(groups.items())]


def _weighted(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx
    return my - slope * mx, slope


def fit_line(samples: Sequence[tuple[float, float]], *, min_intercept: float | None = 0.0,
             relative: bool = True) -> LinearFit:
    """Least squares over the per-x medians (by relative error when `relative` and every median
    is positive), slope clamped at 0 (then the intercept is the median of the medians) and the
    intercept at `min_intercept` (None: unclamped)."""
    points = _medians(samples)
    if not points:
        raise ValueError("no samples to fit")
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    ws = [1.0 / (y * y) for y in ys] if relative and min(ys) > 0 else [1.0] * len(ys)
    if len(points) == 1 or max(xs) == min(xs):
        slope, intercept = 0.0, statistics.median(ys)
    else:
        intercept, slope = _weighted(xs, ys, ws)
        if slope < 0:
            slope, intercept = 0.0, statistics.median(ys)
    if min_intercept is not None and intercept < min_intercept:
        # Refit the slope through the clamped intercept (weighted least squares, fixed intercept).
        intercept = min_intercept
        sxx = sum(w * x * x for w, x in zip(ws, xs))
        slope = max(0.0, sum(w * x * (y - intercept) for w, x, y in zip(ws, xs, ys)) / sxx) if sxx else 0.0
    errors = [abs(intercept + slope * x - y) / y for x, y in zip(xs, ys) if y > 0]
    return LinearFit(intercept, slope, tuple(points), max(errors) if errors else 0.0)


def fit_prefill(samples: Sequence[tuple[float, float]]) -> LinearFit:
    """a + b·x + c·x², all three ≥ 0, by relative error over the per-x medians: the reference
    engine's prefill is superlinear (attention), and a line misses the long prompts that make
    the p99 TTFT. The best of the non-negative fits over {a, b, c} ⊇ {c}; the line of `fit_line`
    when no fit with a positive c is better."""
    import numpy as np

    line = fit_line(samples)
    points = _medians(samples)
    if len(points) < 3:
        return line
    xs = np.array([p[0] for p in points])
    ys = np.array([p[1] for p in points])
    w = 1.0 / ys if min(ys) > 0 else np.ones_like(ys)  # rows scaled by 1/y: relative error
    columns = {"a": np.ones_like(xs), "b": xs, "c": xs * xs}
    best = line
    best_err = float(np.sum(((np.array([line.at(x) for x in xs]) - ys) * w) ** 2))
    for terms in (("a", "b", "c"), ("b", "c"), ("a", "c"), ("c",)):
        design = np.column_stack([columns[t] * w for t in terms])
        coef, *_ = np.linalg.lstsq(design, ys * w, rcond=None)
        if min(coef) < 0:
            continue
        got = dict(zip(terms, (float(v) for v in coef)))
        fit = np.array([got.get("a", 0.0) + got.get("b", 0.0) * x + got.get("c", 0.0) * x * x for x in xs])
        err = float(np.sum(((fit - ys) * w) ** 2))
        if err < best_err and got["c"] > 0:
            rel = [abs(f - y) / y for f, y in zip(fit, ys) if y > 0]
            best, best_err = LinearFit(got.get("a", 0.0), got.get("b", 0.0), tuple(points),
                                       max(rel) if rel else 0.0, got["c"]), err
    return best


def kv_bytes_per_token(bytes_sent: float, prompt_tokens: float) -> float:
    """KV bytes the prefill workers reported sending, per prompt token sent through them."""
    if prompt_tokens <= 0 or bytes_sent <= 0:
        raise ValueError(f"cannot derive KV bytes per token from {bytes_sent} bytes over {prompt_tokens} tokens")
    return bytes_sent / prompt_tokens


def fit_transfer(pd_ttft: Sequence[tuple[float, float]], local_ttft: Sequence[tuple[float, float]],
                 first_step_ms: float, bytes_per_token: float) -> tuple[float, float, LinearFit]:
    """The exposed KV transfer, by difference: at each prompt length measured on both idle
    paths, median TTFT(disaggregated) − median TTFT(colocated) − one decode step is what the
    hand-off cost (the gateway's second leg, the transfer, the decode picking it up). Medians of
    the same length are compared, not a prefill fit, so the fit's error does not land in the
    transfer. Fitted as setup + bytes / bandwidth by absolute error; returns (setup_ms, GiB/s,
    the fit over (bytes, ms))."""
    local = {x: y for x, y, _ in _medians(local_ttft)}
    extra = [(x * bytes_per_token, y - local[x] - first_step_ms) for x, y, _ in _medians(pd_ttft) if x in local]
    if not extra:
        raise ValueError("the PD and colocated TTFT tables share no prompt length")
    fit = fit_line(extra, min_intercept=0.0, relative=False)
    return fit.intercept, _gib_per_s(fit.slope), fit


def _gib_per_s(ms_per_byte: float) -> float:
    return MAX_LINK_GIB_PER_S if ms_per_byte <= 0 else min(MAX_LINK_GIB_PER_S, 1000.0 / (ms_per_byte * GIB))


def fit_engine_transfer(samples: Sequence[tuple[float, float]]) -> tuple[float, float, LinearFit]:
    """The KV transfer from the engines' own reports: one (bytes, ms) sample per transfer, as
    the decode worker timed it (first KV frame to `done`). The same prompt length moves the same
    page-rounded bytes, so the per-size medians are taken over the repeats; fitted as setup +
    bytes / bandwidth by absolute error (intercept ≥ 0). Returns (setup_ms, GiB/s, the fit)."""
    if not samples:
        raise ValueError("no per-transfer reports to fit")
    fit = fit_line(samples, min_intercept=0.0, relative=False)
    return fit.intercept, _gib_per_s(fit.slope), fit


def handoff_overhead_ms(pd_ttft: Sequence[tuple[float, float]], local_ttft: Sequence[tuple[float, float]],
                        first_step_ms: float, transfer_ms: Callable[[float], float]) -> tuple[float, list[float]]:
    """What the client waits for on the PD path beyond prefill, transfer and one decode step:
    the gateway's second leg, the bootstrap hand-shake, the decode picking the KV up. Per pair
    of samples taken back to back at the same prompt length (the two tables alternate, so
    `pd_ttft[i]` and `local_ttft[i]` are a pair), TTFT(PD) − TTFT(colocated) − one decode step
    − the engine-reported transfer at that length; the median over all pairs (one number: it
    does not grow with the prompt), at least 0. Returns (overhead, the per-pair values)."""
    diffs = [pd - local - first_step_ms - transfer_ms(x)
             for (x, pd), (lx, local) in zip(pd_ttft, local_ttft) if x == lx]
    if not diffs:
        raise ValueError("the PD and colocated TTFT tables share no paired samples")
    return max(0.0, statistics.median(diffs)), diffs


def service_model_fields(prefill: LinearFit, decode: LinearFit, *, kv_bpt: float, link_setup_ms: float,
                         link_gib_per_s: float, prefill_chunk_tokens: int, max_batch: int) -> dict[str, float]:
    """The `ServiceModel` fields (`pdgate simulate --service-model`) from the fits. The decode
    step is base + per_seq·batch; a measured base of 0 would make the model invalid, so it is
    kept at least 0.1 ms. KV is sent in one piece after the prefill (`send_chunk_tokens` 0): the
    reference engine sends a prompt's pages when its prefill has finished."""
    return {
        "prefill_a_ms": round(prefill.intercept, 4),
        "prefill_b_ms": round(prefill.slope, 6),
        "prefill_c_ms": round(prefill.curvature, 9),
        "decode_step_ms": round(max(0.1, decode.intercept), 4),
        "decode_step_per_seq_ms": round(decode.slope, 6),
        "kv_bytes_per_token": round(kv_bpt, 3),
        "link_setup_ms": round(max(0.0, link_setup_ms), 4),
        "link_gib_per_s": round(link_gib_per_s, 6),
        "send_chunk_tokens": 0,
        "prefill_chunk_tokens": int(prefill_chunk_tokens),
        "max_batch": int(max_batch),
    }


def shared_cores_estimate(alone_gaps_ms: Sequence[float], contended_gaps_ms: Sequence[float],
                          busy: int = 2) -> tuple[float, float]:
    """How many cores the workers effectively share (`pdgate simulate --shared-cores`), from
    one decode stream's inter-token gaps alone and while `busy` − 1 other workers compute
    beside it (a prefill). Under processor sharing each of `busy` workers runs at min(1, N /
    busy), so the median gap grows by busy / N when N < busy: N = busy / slowdown. A slowdown
    of at most 1 (no contention seen) gives N = 0: cores not shared. Returns (N, slowdown)."""
    if not alone_gaps_ms or not contended_gaps_ms:
        raise ValueError("no decode gaps to compare (alone and contended both needed)")
    slowdown = statistics.median(contended_gaps_ms) / statistics.median(alone_gaps_ms)
    return (busy / slowdown if slowdown > 1.0 else 0.0), slowdown
