"""The service-time model: how long each stage takes, as plain functions of its size.

prefill_ms(tokens) = a + b·tokens + c·tokens² (c, attention's quadratic share, is 0 unless a
calibration measured it; the gateway's decision models a + b·tokens only); a decode step takes base + per_seq·batch (0 with no batch);
a KV transfer costs setup + bytes / bandwidth, sent in chunks of `send_chunk_tokens` as the
prefill produces them (each chunk pays the setup), over one link per prefill worker; a colocated
worker prefills in chunks of `prefill_chunk_tokens`, each chunk fused with one decode step.
EPD: the vision tower takes `encode_image_ms` per image, on an encode worker (one image at a
time) or, without encode workers, on the worker that prefills, before its prefill.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

__all__ = ["ServiceModel", "GIB"]

GIB = 1024 ** 3


@dataclass(frozen=True)
class ServiceModel:
    prefill_a_ms: float = 20.0
    prefill_b_ms: float = 0.035            # per prompt token
    prefill_c_ms: float = 0.0              # per prompt token squared (attention)
    decode_step_ms: float = 45.0           # one decode step, whatever the batch ...
    decode_step_per_seq_ms: float = 0.0    # ... plus this per running sequence
    kv_bytes_per_token: float = 320 * 1024
    link_setup_ms: float = 12.0
    link_gib_per_s: float = 22.0
    send_chunk_tokens: int = 2000          # chunked KV sends (0: one send after the prefill)
    prefill_chunk_tokens: int = 2048       # chunked prefill on a colocated worker
    max_batch: int = 32
    encode_image_ms: float = 0.0           # the vision tower, per image (EPD)

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must not be negative, got {getattr(self, f.name)}")
        if self.decode_step_ms <= 0 or self.link_gib_per_s <= 0 or self.max_batch < 1:
            raise ValueError("decode_step_ms and link_gib_per_s must be positive and max_batch at least 1")

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_a_ms + self.prefill_b_ms * tokens + self.prefill_c_ms * tokens * tokens

    def prefill_chunk_ms(self, start: int, size: int) -> float:
        """Tokens [start, start + size) of one prompt; the fixed cost rides with the first chunk."""
        end = start + size
        return (self.prefill_b_ms * size + self.prefill_c_ms * (end * end - start * start)
                + (self.prefill_a_ms if start == 0 else 0.0))

    def decode_step(self, batch: int) -> float:
        return self.decode_step_ms + self.decode_step_per_seq_ms * batch if batch > 0 else 0.0

    def kv_bytes(self, tokens: int) -> float:
        return self.kv_bytes_per_token * tokens

    def send_ms(self, tokens: int) -> float:
        """One KV send of `tokens` tokens' pages."""
        return self.link_setup_ms + self.kv_bytes(tokens) / (self.link_gib_per_s * GIB) * 1000.0

    def transfer_ms(self, tokens: int) -> float:
        """The whole KV in one send, after the prefill."""
        return self.send_ms(tokens)

    def chunked_sends_done_ms(self, tokens: int, link_free_ms: float = 0.0) -> float:
        """When the last chunk lands, counted from the prefill's start: chunk k leaves when the
        prefill has produced it and the link is free (sends are serial on the link)."""
        chunk = self.send_chunk_tokens if self.send_chunk_tokens > 0 else tokens
        link = link_free_ms
        done = 0
        while done < tokens:
            size = min(chunk, tokens - done)
            done += size
            ready = self.prefill_ms(done)
            link = max(ready, link) + self.send_ms(size)
        return link

    def exposed_transfer_ms(self, tokens: int) -> float:
        """Transfer time left after the prefill ends (what chunked sends do not hide)."""
        return self.chunked_sends_done_ms(tokens) - self.prefill_ms(tokens)

    def prefill_chunks(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.prefill_chunk_tokens)) if self.prefill_chunk_tokens > 0 else 1

    @classmethod
    def from_json(cls, path: str, **overrides: float) -> "ServiceModel":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data.pop("calibration", None)  # how `pdgate bench --calibrate` measured it
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown service-model fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{**data, **overrides})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
