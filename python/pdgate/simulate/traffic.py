"""The simulated traffic: arrival times and lengths, from the same specs as `pdgate bench`."""

from __future__ import annotations

import numpy as np

from pdgate.bench.arrivals import arrival_offsets
from pdgate.bench.dataset import draw_lengths
from pdgate.bench.trace import read_trace

__all__ = ["draw_images", "random_traffic", "trace_traffic"]


def draw_images(n: int, fraction: float, per_request: int, seed: int) -> list[int]:
    """EPD: how many images each request carries: `per_request` for a `fraction` of them, drawn
    from a generator of their own, so the lengths and arrivals do not change with the mix."""
    if not 0.0 <= fraction <= 1.0 or per_request < 0:
        raise ValueError("--image-fraction must be in [0, 1] and --images-per-request >= 0")
    rng = np.random.default_rng([seed, 31])
    return [per_request if x < fraction else 0 for x in rng.random(n)]


def random_traffic(n: int, rate: float, *, burstiness: float, arrivals: str, input_len: int, output_len: int,
                   range_ratio: float, dist: str, sigma: float, prefix_len: int,
                   rng: np.random.Generator) -> tuple[list[float], list[int], list[int]]:
    """Arrival times (ms) and prompt / output token counts, drawn in bench's order and seed use."""
    prompts = draw_lengths(input_len, n, dist, range_ratio, sigma, rng) + prefix_len
    outputs = draw_lengths(output_len, n, dist, range_ratio, sigma, rng)
    if arrivals == "replay":
        raise ValueError("--arrivals replay needs --dataset-path (a trace)")
    offsets = arrival_offsets(arrivals, n, rate, burstiness, rng)
    return [o * 1000.0 for o in offsets], prompts.tolist(), outputs.tolist()


def trace_traffic(path: str, n: int | None, rate: float, *, burstiness: float, arrivals: str,
                  default_output: int, rng: np.random.Generator) -> tuple[list[float], list[int], list[int]]:
    lines = read_trace(path)[:n] if n else read_trace(path)
    prompts = [ln.prompt_tokens if ln.prompt_tokens is not None else len((ln.prompt or "").encode("utf-8"))
               for ln in lines]
    outputs = [ln.output_tokens or default_output for ln in lines]
    offsets = arrival_offsets(arrivals, len(lines), rate, burstiness, rng, [ln.arrival_s for ln in lines])
    return [o * 1000.0 for o in offsets], [max(1, p) for p in prompts], outputs
