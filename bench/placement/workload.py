"""The placement benchmarks' traffic: a seeded mix of short and long prompts with Poisson
arrivals, written as a JSONL trace that `pdgate bench` and `pdgate simulate` both replay
(`--dataset-name custom --dataset-path F --arrivals replay` / `--dataset-path F --arrivals
replay`), so the simulator predicts exactly the run that is measured."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

__all__ = ["Mix", "write_trace"]


@dataclass(frozen=True)
class Mix:
    short: tuple[int, int] = (32, 128)       # prompt tokens, uniform
    long: tuple[int, int] = (512, 1024)
    long_fraction: float = 0.2
    output: tuple[int, int] = (16, 48)       # output tokens, uniform

    def describe(self) -> str:
        return (f"{100 * (1 - self.long_fraction):.0f}% short prompts {self.short[0]}-{self.short[1]} tokens, "
                f"{100 * self.long_fraction:.0f}% long {self.long[0]}-{self.long[1]}, "
                f"outputs {self.output[0]}-{self.output[1]}")


def write_trace(path: str, *, rate: float, duration_s: float, mix: Mix, seed: int) -> int:
    """Poisson arrivals at `rate` for `duration_s` seconds; returns the number of requests."""
    rng = np.random.default_rng(seed)
    n = max(1, int(round(rate * duration_s)))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    arrivals -= arrivals[0]
    long = rng.random(n) < mix.long_fraction
    short_len = rng.integers(mix.short[0], mix.short[1] + 1, size=n)
    long_len = rng.integers(mix.long[0], mix.long[1] + 1, size=n)
    out_len = rng.integers(mix.output[0], mix.output[1] + 1, size=n)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            prompt = int(long_len[i] if long[i] else short_len[i])
            f.write(json.dumps({"arrival_s": round(float(arrivals[i]), 6), "prompt_tokens": prompt,
                                "output_tokens": int(out_len[i])}) + "\n")
    return n
