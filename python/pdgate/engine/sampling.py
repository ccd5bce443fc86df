"""Sampling parameters, the sampler, and stop conditions.

Randomness is keyed by (request seed, output index): the token at output index i is drawn from
`default_rng([seed, i])`. So a decode that continues after a prefill's first token draws exactly
what a colocated engine would, and sampled (not only greedy) PD output equals colocated output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np


class BadRequest(ValueError):
    """Invalid client input: rendered as an OpenAI-style 400."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise BadRequest("max_new_tokens must be a non-negative integer", "max_new_tokens")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise BadRequest(f"{name} must be a number", name)
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise BadRequest("temperature must be in [0, 100]", "temperature")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise BadRequest("top_p must be in (0, 1]", "top_p")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise BadRequest("top_k must be -1 (off) or a positive integer", "top_k")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise BadRequest("min_p must be in [0, 1]", "min_p")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise BadRequest("seed must be an integer", "seed")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(isinstance(t, int) for t in self.stop_token_ids):
            raise BadRequest("stop_token_ids must be integers", "stop_token_ids")
        return self


_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
           "ignore_eos", "skip_special_tokens", "seed"}


def params_from_dict(d: dict | None, default_max: int = 128) -> SamplingParams:
    """SGLang's `sampling_params` object; unknown keys are ignored like SGLang ignores them."""
    if d is not None and not isinstance(d, dict):
        raise BadRequest("sampling_params must be an object", "sampling_params")
    d = dict(d or {})
    if "sampling_seed" in d and "seed" not in d:
        d["seed"] = d["sampling_seed"]
    kw = {k: v for k, v in d.items() if k in _FIELDS and v is not None}
    kw.setdefault("max_new_tokens", default_max)
    if isinstance(kw.get("stop"), str):
        kw["stop"] = [kw["stop"]]
    if "seed" not in kw:
        kw["seed"] = random.getrandbits(63)
    try:
        return SamplingParams(**kw).validate()
    except TypeError as e:
        raise BadRequest(str(e), "sampling_params") from e


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, p: SamplingParams, index: int) -> tuple[int, float, np.ndarray]:
    """Pick the token at output `index`. Returns (token, its logprob, the logprob vector).

    Logprobs are those of the model's distribution before temperature and truncation.
    """
    lp = log_softmax(logits)
    if p.greedy:
        tok = int(np.argmax(lp))
        return tok, float(lp[tok]), lp
    z = lp / float(p.temperature)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones(len(order), dtype=bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    if p.top_p < 1.0:
        csum = np.cumsum(probs[order])
        keep &= (csum - probs[order]) < p.top_p
    if p.min_p > 0.0:
        keep &= probs[order] >= p.min_p * probs[order[0]]
    keep[0] = True
    mask = np.zeros_like(probs)
    mask[order[keep]] = probs[order[keep]]
    mask /= mask.sum()
    rng = np.random.default_rng([p.seed & (2**63 - 1), index])
    tok = int(rng.choice(len(mask), p=mask))
    return tok, float(lp[tok]), lp


def top_logprobs(lp: np.ndarray, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    idx = np.argsort(-lp, kind="stable")[:k]
    return [(float(lp[i]), int(i)) for i in idx]
