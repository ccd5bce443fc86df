"""The vision tower of the multimodal presets: a small ViT in numpy with weights from a seed.

pixels [3, S, S] -> patches [(S/p)^2, 3*p*p] -> patch embedding + learned positions -> pre-norm
transformer layers (bidirectional attention, SwiGLU) -> final norm -> a two-layer projector into
the language model's hidden size. Each output row is RMS-normalised so an image embedding has
the scale of a token embedding. One image always gives `tokens_per_image` rows.

Images arrive as bytes (PNG, JPEG, anything Pillow opens); `preprocess` decodes, converts to
RGB, resizes to `image_size` square (bilinear) and scales to [-1, 1]. Pillow is imported lazily:
a worker without it refuses images with a clear error instead of failing to start.
"""

from __future__ import annotations

import io

import numpy as np

from .config import VisionConfig


class ImageError(ValueError):
    """The bytes are not an image this engine can read."""


def preprocess(data: bytes, vc: VisionConfig) -> np.ndarray:
    """Image file bytes -> float32 [3, S, S] in [-1, 1]."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - Pillow is present where the tests run
        raise ImageError("this worker cannot decode images: Pillow is not installed") from None
    try:
        with Image.open(io.BytesIO(data)) as im:
            im = im.convert("RGB").resize((vc.image_size, vc.image_size), Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image could not be decoded: {e}") from None
    return (arr / 127.5 - 1.0).transpose(2, 0, 1).copy()


def vision_weights(vc: VisionConfig, out_size: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic weights; a separate stream from the language model's (same seed, other key)."""
    rng = np.random.default_rng([seed, 0x5649])  # "VI"

    def mat(n_in: int, n_out: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) * (gain / np.sqrt(n_in))).astype(np.float32)

    d, p = vc.hidden_size, vc.patch_size
    n = vc.tokens_per_image
    w = {"patch": mat(3 * p * p, d), "pos": (rng.standard_normal((n, d)) * 0.5).astype(np.float32),
         "final_norm": np.ones(d, dtype=np.float32),
         "proj1": mat(d, out_size), "proj2": mat(out_size, out_size)}
    for i in range(vc.num_layers):
        q = f"layers.{i}."
        w[q + "attn_norm"] = np.ones(d, dtype=np.float32)
        w[q + "mlp_norm"] = np.ones(d, dtype=np.float32)
        for name in ("wq", "wk", "wv"):
            w[q + name] = mat(d, d)
        w[q + "wo"] = mat(d, d, 0.5)
        w[q + "w_gate"] = mat(d, vc.intermediate_size)
        w[q + "w_up"] = mat(d, vc.intermediate_size)
        w[q + "w_down"] = mat(vc.intermediate_size, d, 0.5)
    return w


class VisionTower:
    def __init__(self, vc: VisionConfig, out_size: int, seed: int):
        if vc.image_size % vc.patch_size or vc.hidden_size % vc.num_heads:
            raise ValueError("image_size must be a multiple of patch_size, hidden of heads")
        self.vc, self.out_size = vc, out_size
        self.w = vision_weights(vc, out_size, seed)

    def patches(self, pixels: np.ndarray) -> np.ndarray:
        """[3, S, S] -> [(S/p)^2, 3*p*p], row-major over the patch grid."""
        p, g = self.vc.patch_size, self.vc.image_size // self.vc.patch_size
        x = pixels.reshape(3, g, p, g, p).transpose(1, 3, 0, 2, 4)
        return x.reshape(g * g, 3 * p * p)

    def forward(self, pixels: np.ndarray) -> np.ndarray:
        """One image's embeddings: float32 [tokens_per_image, out_size]."""
        vc, w = self.vc, self.w
        x = self.patches(pixels.astype(np.float32)) @ w["patch"] + w["pos"]
        for i in range(vc.num_layers):
            q = f"layers.{i}."
            x = x + self._attention(q, _rms(x, w[q + "attn_norm"], vc.rms_eps))
            h = _rms(x, w[q + "mlp_norm"], vc.rms_eps)
            gate = h @ w[q + "w_gate"]
            x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[q + "w_up"])) @ w[q + "w_down"]
        x = _rms(x, w["final_norm"], vc.rms_eps)
        h = x @ w["proj1"]
        h = h / (1.0 + np.exp(-h)) @ w["proj2"]
        return _rms(h, np.ones(self.out_size, dtype=np.float32), vc.rms_eps).astype(np.float32)

    def _attention(self, q: str, h: np.ndarray) -> np.ndarray:
        w, nh = self.w, self.vc.num_heads
        n, d = h.shape
        hd = d // nh
        qq = (h @ w[q + "wq"]).reshape(n, nh, hd).transpose(1, 0, 2)
        kk = (h @ w[q + "wk"]).reshape(n, nh, hd).transpose(1, 2, 0)
        vv = (h @ w[q + "wv"]).reshape(n, nh, hd).transpose(1, 0, 2)
        sc = (qq @ kk) * np.float32(1.0 / np.sqrt(hd))
        sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
        sc /= sc.sum(axis=-1, keepdims=True)
        return (sc @ vv).transpose(1, 0, 2).reshape(n, d) @ w[q + "wo"]


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight
