"""What to send: prompts with their lengths, from a random spec, ShareGPT, or a JSONL trace.

Token counts assume the reference engine's byte tokenizer (one ASCII character is one token), so
a random prompt of N characters is N prompt tokens there. Against engines with other tokenizers
the planned length is approximate; the result file then reports the server's own
`usage.prompt_tokens` where the server sends it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .trace import TraceLine, read_trace

__all__ = ["LENGTH_DISTRIBUTIONS", "SampleRequest", "random_requests", "sharegpt_requests",
           "trace_requests", "draw_lengths", "random_text", "with_images"]

LENGTH_DISTRIBUTIONS = ("uniform", "fixed", "lognormal")
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int
    arrival_s: float | None = None
    images: tuple[str, ...] = ()   # EPD: data URLs, sent after the text as image_url parts


def draw_lengths(mean: int, n: int, dist: str, range_ratio: float, sigma: float,
                 rng: np.random.Generator) -> np.ndarray:
    """`n` lengths around `mean`: fixed; uniform over [mean(1-r), mean(1+r)] (vLLM's random
    dataset); or lognormal with median `mean` and shape `sigma`. Always at least 1."""
    if mean < 1:
        raise ValueError(f"a length must be at least 1, got {mean}")
    if dist == "fixed" or (dist == "uniform" and range_ratio == 0):
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        if not 0 <= range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
        low = max(1, math.floor(mean * (1 - range_ratio)))
        high = math.ceil(mean * (1 + range_ratio))
        return rng.integers(low, high + 1, size=n)
    if dist == "lognormal":
        if sigma <= 0:
            raise ValueError(f"lognormal sigma must be positive, got {sigma}")
        return np.maximum(1, np.rint(rng.lognormal(math.log(mean), sigma, size=n))).astype(np.int64)
    raise ValueError(f"unknown length distribution {dist!r}")


def random_text(n: int, rng: np.random.Generator) -> str:
    """`n` ASCII characters of letters and spaces (n byte-tokens)."""
    return rng.choice(_ALPHABET, size=n).tobytes().decode("ascii")


def random_requests(num: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    prefix_len: int = 0, num_prefixes: int = 1, dist: str = "uniform",
                    sigma: float = 0.5, rng: np.random.Generator) -> list[SampleRequest]:
    """vLLM's random dataset: a shared prefix (one of `num_prefixes`, round robin, so
    cache-aware routing has something to find) followed by a random body."""
    in_lens = draw_lengths(input_len, num, dist, range_ratio, sigma, rng)
    out_lens = draw_lengths(output_len, num, dist, range_ratio, sigma, rng)
    prefixes = [random_text(prefix_len, rng) for _ in range(max(1, num_prefixes))]
    out = []
    for i in range(num):
        body = random_text(int(in_lens[i]), rng)
        prompt = prefixes[i % len(prefixes)] + body
        out.append(SampleRequest(prompt, prefix_len + int(in_lens[i]), int(out_lens[i])))
    return out


def with_images(requests: list[SampleRequest], fraction: float, per_request: int, size: int,
                seed: int) -> list[SampleRequest]:
    """EPD: give a `fraction` of the requests `per_request` images each: PNGs of `size`x`size`
    random pixels, every one different (so no embedding cache hides the tower), drawn from a
    generator of their own so the prompts and arrivals stay those of the text-only run. Needs
    Pillow."""
    if not 0.0 <= fraction <= 1.0 or per_request < 1 or size < 1:
        raise ValueError("--image-fraction must be in [0, 1], --images-per-request and --image-size >= 1")
    if fraction == 0.0:
        return requests
    import base64
    import io
    from dataclasses import replace

    from PIL import Image

    rng = np.random.default_rng([seed, 31])
    picks = rng.random(len(requests)) < fraction
    out = []
    for req, pick in zip(requests, picks):
        if not pick:
            out.append(req)
            continue
        urls = []
        for _ in range(per_request):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
            urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        out.append(replace(req, images=tuple(urls)))
    return out


def sharegpt_requests(path: str, num: int, output_len: int | None,
                      rng: np.random.Generator) -> list[SampleRequest]:
    """The first human turn of each conversation; output length from the reply (in byte tokens)
    unless `output_len` fixes it. Conversations are shuffled with the seed, as vLLM does."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    pairs = [(c[0].get("value", ""), c[1].get("value", "")) for c in convs if isinstance(c, list) and len(c) >= 2]
    order = rng.permutation(len(pairs))
    out = []
    for idx in order:
        prompt, reply = pairs[int(idx)]
        if not prompt:
            continue
        n_out = output_len or max(1, len(reply.encode("utf-8")))
        out.append(SampleRequest(prompt, len(prompt.encode("utf-8")), n_out))
        if len(out) == num:
            break
    return out


def _from_trace_line(line: TraceLine, default_output: int, rng: np.random.Generator) -> SampleRequest:
    prompt = line.prompt if line.prompt is not None else random_text(line.prompt_tokens or 1, rng)
    prompt_len = line.prompt_tokens if line.prompt_tokens is not None else len(prompt.encode("utf-8"))
    output_len = line.output_tokens if line.output_tokens else default_output
    return SampleRequest(prompt, prompt_len, output_len, line.arrival_s)


def trace_requests(path: str, num: int | None, default_output: int,
                   rng: np.random.Generator) -> list[SampleRequest]:
    """A JSONL trace (see trace.py): lines in file order, the first `num` of them."""
    lines: Sequence[TraceLine] = read_trace(path)
    if num is not None:
        lines = lines[:num]
    return [_from_trace_line(line, default_output, rng) for line in lines]
