"""The simulator's own plot: each stage's queue length over time (bench's plots cover the rest)."""

from __future__ import annotations

import os
from typing import Any

from pdgate.bench.plots import _pyplot

__all__ = ["write_queue_plot"]


def write_queue_plot(series: dict[str, list[tuple[float, int]]], path: str, title: str) -> str:
    plt = _pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for stage, samples in series.items():
        if samples:
            ax.step([t / 1000.0 for t, _ in samples], [v for _, v in samples], where="post", label=stage)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def queue_plot_name(level: dict[str, Any]) -> str:
    return f"simulate_{level['placement']}_{level['rate']}_queues.png"
