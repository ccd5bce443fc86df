"""Images in prompts: OpenAI `image_url` parts, placeholder runs, the embedding cache, and the
EPD fields a prefill reads (docs/protocols.md, "EPD").

A chat message's content parts render in order; an image part becomes `tokens_per_image`
copies of the model's image token. The prompt's token ids are the same on every worker (the
decode of a PD pair needs only them); a worker that computes the prompt puts the image's
embeddings in place of those tokens' embeddings (`Seq.mm_slice`, `Model.forward`).

An image is named by its content hash: SHA-256 (hex) of the image file's bytes as sent (SMG
names it by BLAKE3 of the same bytes; blake3 is not in the standard library).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .sampling import BadRequest
from .vision import ImageError, VisionTower, preprocess

MAX_IMAGE_BYTES = 32 << 20
# The data planes that move embeddings between workers (transfer/embed.py, embed_plane.py).
EMBED_BACKENDS = ("tcp", "mooncake")


@dataclass
class ImageItem:
    """One image of a prompt: its bytes' hash, decoded pixels and placeholder run."""

    index: int           # order among the prompt's images (TokenSpeed's item_index)
    content_hash: str
    pixels: np.ndarray   # [3, S, S], float32
    offset: int = 0      # position of the first placeholder token in the prompt
    length: int = 0


def image_bytes(url: object, param: str = "image_url") -> bytes:
    """The bytes of a `data:image/...;base64,` URL. Remote URLs are refused: the engine fetches
    nothing (a gateway that allows fetching inlines the image before it reaches a worker)."""
    if not isinstance(url, str) or not url:
        raise BadRequest("image_url.url must be a non-empty string", param, "invalid_image")
    if not url.startswith("data:"):
        raise BadRequest("only data: URLs are accepted for images (the engine fetches nothing)",
                         param, "image_url_not_supported")
    head, sep, b64 = url[5:].partition(",")
    if not sep or ";base64" not in head:
        raise BadRequest("an image data URL must be base64 (data:image/png;base64,...)", param, "invalid_image")
    mime = head.split(";", 1)[0]
    if mime and not mime.startswith("image/"):
        raise BadRequest(f"an image data URL must have an image/* type, not {mime!r}", param, "invalid_image")
    if len(b64) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest(f"the image is larger than {MAX_IMAGE_BYTES} bytes", param, "invalid_image")
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("the image data URL is not valid base64", param, "invalid_image") from None


def load_image(url: object, index: int, cfg: ModelConfig, param: str = "image_url") -> ImageItem:
    data = image_bytes(url, param)
    try:
        pixels = preprocess(data, cfg.vision)
    except ImageError as e:
        raise BadRequest(str(e), param, "invalid_image") from None
    return ImageItem(index, hashlib.sha256(data).hexdigest(), pixels)


def _part_url(part: dict) -> object:
    v = part.get("image_url")
    return v.get("url") if isinstance(v, dict) else v


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(p, dict) and p.get("type") == "image_url"
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def chat_inputs(tok, cfg: ModelConfig, messages: list[dict]) -> tuple[list[int], list[ImageItem]]:
    """Token ids of the engine's chat template with image parts as placeholder runs, and the
    images in prompt order. Text renders exactly as `tokenizer.chat_prompt` renders it."""
    if cfg.vision is None or cfg.image_token_id is None:
        raise BadRequest(f"model {cfg.name!r} takes no images (use a multimodal preset: tiny-mm)",
                         "messages", "multimodal_not_supported")
    n = cfg.vision.tokens_per_image
    ids = [tok.bos_id] if tok.bos_id is not None else []
    images: list[ImageItem] = []

    def text(s: str) -> None:
        ids.extend(tok.encode(s, add_bos=False))

    for m in messages:
        text(f"<|{m.get('role', 'user')}|>\n")
        content = m.get("content") or ""
        for part in (content if isinstance(content, list) else [{"text": content}]):
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url":
                img = load_image(_part_url(part), len(images), cfg, "messages")
                img.offset, img.length = len(ids), n
                ids.extend([cfg.image_token_id] * n)
                images.append(img)
            else:
                text(part.get("text", ""))
        text("\n")
    text("<|assistant|>\n")
    return ids, images


def encode_items(body: dict, n_images: int) -> dict[int, dict] | None:
    """`encode_bootstrap_info.items` (TokenSpeed's EncodeItemBootstrapInfo, as JSON) by item index:
    where each image's embedding waits (the encode worker's bootstrap server) and its room."""
    info = body.get("encode_bootstrap_info")
    if info is None:
        return None
    items = info.get("items") if isinstance(info, dict) else None
    if not isinstance(items, list):
        raise BadRequest("encode_bootstrap_info must be {\"items\": [...]}", "encode_bootstrap_info")
    out: dict[int, dict] = {}
    for it in items:
        ok = isinstance(it, dict) and isinstance(it.get("bootstrap_host"), str)
        idx, room, port = (it.get(k) if isinstance(it, dict) else None
                           for k in ("item_index", "bootstrap_room", "bootstrap_port"))
        for v in (idx, room, port):
            ok = ok and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        if not ok or not idx < n_images or idx in out or not 0 < port < 65536:
            raise BadRequest("each encode_bootstrap_info item needs item_index (an image of the prompt, "
                             "once), bootstrap_host, bootstrap_port and bootstrap_room", "encode_bootstrap_info")
        out[idx] = it
    return out


class ImageEncoder:
    """The vision tower behind an LRU cache keyed by content hash, with its counters:
    computed (the tower ran), cached (served from the cache), received (arrived from an encode
    worker), sent (shipped to a prefill), ec_storage (loaded from vLLM-style shared storage,
    `ec_connector.py`)."""

    def __init__(self, cfg: ModelConfig, seed: int, cache_items: int):
        self.tower = VisionTower(cfg.vision, cfg.hidden_size, seed)
        self.tokens_per_image = cfg.vision.tokens_per_image
        self.dim = cfg.hidden_size
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.cache_items = cache_items
        self.counts = {"computed": 0, "cached": 0, "received": 0, "sent": 0, "ec_storage": 0}
        # embedding bytes moved to / from other workers, by the data plane that moved them
        self.bytes = {backend: {"sent": 0, "received": 0} for backend in EMBED_BACKENDS}

    def embed(self, img: ImageItem,
              load: Callable[[str], np.ndarray | None] | None = None) -> tuple[np.ndarray, bool]:
        """(embeddings [tokens_per_image, hidden], whether they came from the cache). On a cache
        miss `load(content_hash)` (an EC consumer's shared storage) is asked before the tower."""
        hit = self.cache.get(img.content_hash)
        if hit is not None:
            self.cache.move_to_end(img.content_hash)
            self.counts["cached"] += 1
            return hit, True
        emb = load(img.content_hash) if load is not None else None
        if emb is not None:
            self.counts["ec_storage"] += 1
        else:
            emb = self.tower.forward(img.pixels)
            self.counts["computed"] += 1
        if self.cache_items > 0:
            self.cache[img.content_hash] = emb
            while len(self.cache) > self.cache_items:
                self.cache.popitem(last=False)
        return emb, False

    def stats(self) -> dict:
        return {"tokens_per_image": self.tokens_per_image, "embedding_dim": self.dim,
                "embeddings": dict(self.counts),
                "embedding_bytes": {d: sum(b[d] for b in self.bytes.values()) for d in ("sent", "received")},
                "embedding_bytes_by_backend": {k: dict(v) for k, v in self.bytes.items()},
                "cache": {"items": len(self.cache), "capacity": self.cache_items}}
