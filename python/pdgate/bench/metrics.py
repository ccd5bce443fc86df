"""Turn per-request outputs into the result keys of vLLM's `bench serve`, plus pdgate's extras.

Definitions (vLLM's, so results compare):
- a request is *completed* when it succeeded; TPOT = (E2E − TTFT) / (output tokens − 1), only for
  requests with more than one output token (it excludes the first token); for goodput a request
  with one token counts TPOT 0;
- *goodput* = completed requests meeting every objective of `--goodput` (value ≥ measured, ms),
  divided by the duration; without `--goodput` it is None;
- mean / median / std / percentiles use numpy's defaults (linear interpolation), over completed
  requests for TTFT, TPOT, E2EL and over every gap of every completed request for ITL; an empty
  list yields 0, as vLLM does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence

import numpy as np

from .client import RequestOutput

__all__ = ["GOODPUT_METRICS", "PERCENTILE_METRICS", "DETAILED_KEYS", "compute_metrics",
           "latency_stats", "meets_goodput", "parse_goodput", "percentile_key"]

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# Per-request lists, written only with --save-detailed (vLLM drops the same ones without it).
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors",
                 "statuses")


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput {name}: must not be negative, got {ms}")
        out[name] = ms
    return out


def percentile_key(p: float, metric: str) -> str:
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def latency_stats(metric: str, values_s: Sequence[float], percentiles: Sequence[float],
                  weights: Sequence[float] | None = None) -> dict[str, float]:
    """mean/median/std/percentiles in ms of values in seconds (weights: a histogram's counts)."""
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
    if weights is None or not len(values_s):
        stats = {f"mean_{metric}_ms": float(np.mean(arr)), f"median_{metric}_ms": float(np.median(arr)),
                 f"std_{metric}_ms": float(np.std(arr))}
        stats.update({percentile_key(p, metric): float(np.percentile(arr, p)) for p in percentiles})
        return stats
    return _weighted_stats(metric, arr, np.asarray(weights, dtype=float), percentiles)


def _weighted_stats(metric: str, arr: np.ndarray, w: np.ndarray, percentiles: Sequence[float]) -> dict[str, float]:
    order = np.argsort(arr)
    arr, w = arr[order], w[order]
    mean = float(np.average(arr, weights=w))
    cum = np.cumsum(w) / w.sum()

    def pct(p: float) -> float:
        return float(arr[min(int(np.searchsorted(cum, p / 100.0)), len(arr) - 1)])

    stats = {f"mean_{metric}_ms": mean, f"median_{metric}_ms": pct(50),
             f"std_{metric}_ms": float(np.sqrt(np.average((arr - mean) ** 2, weights=w)))}
    stats.update({percentile_key(p, metric): pct(p) for p in percentiles})
    return stats


def meets_goodput(goodput: dict[str, float], ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
    measured = {"ttft": ttft_s, "tpot": tpot_s, "e2el": e2el_s}
    return all(limit / 1000.0 >= measured[name] for name, limit in goodput.items())


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float, goodput: dict[str, float],
                    percentiles: Sequence[float] = (99,),
                    percentile_metrics: Sequence[str] = PERCENTILE_METRICS) -> dict[str, Any]:
    """The result dict for one load level (detailed lists included; the caller may drop them)."""
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    good = sum(1 for o in ok if meets_goodput(
        goodput, o.ttft, (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0, o.latency))
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(output_lens)
    dur = duration_s if duration_s > 0 else float("nan")
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if goodput else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "errors_by_kind": dict(Counter(o.error_kind for o in outputs if not o.success)),
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "errors": [o.error for o in outputs],
        "statuses": [o.status for o in outputs],
    }
    series = {"ttft": [o.ttft for o in ok], "tpot": tpots, "itl": [g for o in ok for g in o.itl],
              "e2el": [o.latency for o in ok]}
    for metric in percentile_metrics:
        if metric not in series:
            raise ValueError(f"unknown percentile metric {metric!r} (expected {', '.join(PERCENTILE_METRICS)})")
        result.update(latency_stats(metric, series[metric], percentiles))
    if any(o.images for o in outputs):
        # EPD: image requests and text requests apart (an image request's TTFT includes its tower)
        epd: dict[str, Any] = {"image_requests": sum(1 for o in outputs if o.images),
                               "images": sum(o.images for o in outputs)}
        for name, want in (("image_ttft", True), ("text_ttft", False)):
            epd.update(latency_stats(name, [o.ttft for o in ok if bool(o.images) == want], percentiles))
        result["epd"] = epd
    return result
