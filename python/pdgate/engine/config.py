"""Model presets and their shapes.

A preset is a Llama-architecture shape plus a seed: weights are drawn from the seed, so every
process that loads `tiny` with the same seed holds bit-identical weights (a PD pair must).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    """Shape of the small vision tower of a multimodal preset (`vision.py`).

    An image is resized to `image_size` square RGB, cut into `patch_size` square patches, and
    each patch becomes one embedding: (image_size // patch_size) ** 2 per image, always."""

    image_size: int = 32
    patch_size: int = 8
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    rms_eps: float = 1e-5

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_id: int = 256
    eos_ids: tuple[int, ...] = (257,)
    # Multimodal presets: the vision tower's shape and the placeholder token whose runs in a
    # prompt are replaced by the tower's embeddings (never sampled).
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V for every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    def num_params(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def fingerprint(self, weights_id: str) -> str:
        """Identity of shape plus weights; a PD pair must agree on it before KV moves."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True) + weights_id
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Byte-level vocabulary: 0..255 are bytes, 256 = BOS, 257 = EOS.
BYTE_VOCAB = 258

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=BYTE_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128,
    ),
    # `tiny`'s size with head_dim 64, the smallest head size vLLM's CPU attention takes (it
    # refuses 16): the preset `--export-model` writes for real vLLM and this engine to share.
    "tiny64": ModelConfig(
        name="tiny64", vocab_size=BYTE_VOCAB, hidden_size=128, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=64, intermediate_size=256,
    ),
    # `tiny` plus a vision tower: token 258 is the image placeholder (16 per image).
    "tiny-mm": ModelConfig(
        name="tiny-mm", vocab_size=BYTE_VOCAB + 1, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, vision=VisionConfig(),
        image_token_id=BYTE_VOCAB,
    ),
    "small": ModelConfig(
        name="small", vocab_size=BYTE_VOCAB, hidden_size=512, num_layers=8, num_heads=8,
        num_kv_heads=4, head_dim=64, intermediate_size=1536, max_position=8192,
    ),
}
