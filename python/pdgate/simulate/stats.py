"""Time-weighted stage counters (queue lengths over time) and per-request records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SimRequest", "StageCounter"]


class SimRequest:
    """One simulated request; times in ms."""

    __slots__ = ("rid", "arrival", "prompt", "output", "placement", "reason", "first_token", "finish",
                 "queued_at", "prefill_wait", "attempts", "failed", "left", "remaining", "decode", "images",
                 "tower_ms", "encode_pending")

    def __init__(self, rid: int, arrival: float, prompt: int, output: int):
        self.rid, self.arrival, self.prompt, self.output = rid, arrival, prompt, output
        self.placement = ""
        self.reason = ""
        self.first_token: float | None = None
        self.finish: float | None = None
        self.queued_at = arrival
        self.prefill_wait = 0.0
        self.attempts = 0
        self.failed = False
        self.left = prompt       # local prefill tokens still to run
        self.remaining = output  # decode steps still to run
        self.decode: Any = None  # the decode worker it holds a reservation on
        self.images = 0          # EPD: images in the prompt
        self.tower_ms = 0.0      # their tower time where the prefill runs it (no encode workers)
        self.encode_pending = 0  # images still on encode workers


@dataclass
class StageCounter:
    """A count that changes at event times; keeps its time integral, maximum and samples."""
    name: str
    value: int = 0
    last_t: float = 0.0
    area: float = 0.0
    peak: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, t: float, delta: int) -> None:
        self.area += self.value * (t - self.last_t)
        self.last_t = t
        self.value += delta
        self.peak = max(self.peak, self.value)

    def mean(self, end_t: float) -> float:
        area = self.area + self.value * (end_t - self.last_t)
        return area / end_t if end_t > 0 else 0.0
