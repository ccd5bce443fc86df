"""Plots of one bench (or simulate) run: TTFT and ITL CDFs per load level, goodput and p99s
against the request rate. matplotlib is optional (`pip install 'pdgate[bench]'`)."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

__all__ = ["PlotsUnavailable", "write_comparison_plot", "write_plots"]


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotsUnavailable("plots need matplotlib: pip install 'pdgate[bench]'") from exc
    return plt


def _cdf(ax: Any, values_ms: Sequence[float], weights: Sequence[float] | None, label: str) -> None:
    if not len(values_ms):
        return
    v = np.asarray(values_ms, dtype=float)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)
    order = np.argsort(v)
    ax.step(v[order], np.cumsum(w[order]) / w.sum(), where="post", label=label)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_plots(levels: Sequence[dict[str, Any]], out_dir: str, prefix: str = "bench") -> list[str]:
    """`levels`: one dict per load level with `label`, `rate`, `ttfts_ms`, `itls_ms` (optionally
    `itl_weights`) and the result (`request_goodput`, `p99_*_ms`). Returns the written paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for key, title in (("ttfts_ms", "TTFT"), ("itls_ms", "ITL")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for level in levels:
            weights = level.get("itl_weights") if key == "itls_ms" else None
            _cdf(ax, level[key], weights, level["label"])
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if key == "ttfts_ms" else "gaps"))
        ax.set_title(f"{title} CDF")
        ax.legend(fontsize="small")
        paths.append(_save(fig, os.path.join(out_dir, f"{prefix}_{title.lower()}_cdf.png")))
        plt.close(fig)
    # An unbounded level (--request-rate inf) is placed at the rate it achieved.
    rates = [level["rate"] if np.isfinite(level["rate"]) else level["result"]["request_throughput"]
             for level in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, [level["result"].get("request_goodput") or 0 for level in levels], "o-", label="goodput")
    ax.plot(rates, [level["result"]["request_throughput"] for level in levels], "s--", label="throughput")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("req/s")
    ax.legend()
    paths.append(_save(fig, os.path.join(out_dir, f"{prefix}_goodput_vs_rate.png")))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        ys = [level["result"].get(f"p99_{metric}_ms") for level in levels]
        if all(y is not None for y in ys):
            ax.plot(rates, ys, "o-", label=f"p99 {metric}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend()
    paths.append(_save(fig, os.path.join(out_dir, f"{prefix}_p99_vs_rate.png")))
    plt.close(fig)
    return paths


def write_comparison_plot(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str, *,
                          ylabel: str = "goodput (req/s)", title: str = "") -> str:
    """One curve per configuration (e.g. placement): `series[label] = (rates, values)`, against
    the request rate; the offered rate is drawn as a dotted diagonal for reference. `path` may
    end in .png or .svg."""
    plt = _pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)  # small enough to keep in the repository
    top = 0.0
    for (label, (rates, values)), marker in zip(series.items(), "osd^v<>"):
        ax.plot(rates, values, marker + "-", label=label)
        top = max([top, *rates])
    ax.plot([0, top], [0, top], ":", color="grey", label="offered rate")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")
    out = _save(fig, path)
    plt.close(fig)
    return out
