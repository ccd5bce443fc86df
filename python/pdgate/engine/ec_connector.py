"""vLLM's ECExampleConnector: image embeddings handed from an encoder to its consumers through a
shared folder (`--ec-transfer-config`, docs/engine.md "vLLM's disaggregated encoder").

Layout, as vLLM's connector writes it: `<shared_storage_path>/<mm_hash>/encoder_cache.safetensors`,
one tensor `ec_cache` holding the image's embedding rows. A producer (`ec_producer`, `ec_both`)
writes the file of every image it embeds whose file is not there yet (an existing file counts as
done, as in vLLM); a consumer (`ec_consumer`, `ec_both`) that computes a prompt loads an image's
rows from its file when there is one and otherwise runs its own tower. The mm_hash here is the
engine's content hash (SHA-256 hex of the image's bytes); vLLM names items by its own BLAKE3-based
hash, so the folders of the two engines are not interchangeable.

Files are written atomically (temporary name, then rename), so a consumer never reads half of
one. A file that is there but wrong (truncated, another shape or dtype, not finite) is counted
`invalid` and the consumer computes the rows itself; nothing fails because of a file.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np

from .safetensors_file import SafetensorsError, read_f32, write_atomic

log = logging.getLogger("pdgate.engine")

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"


class ECExampleConnector:
    """The shared folder of one worker's `--ec-transfer-config` (resolved: see engine_config),
    with what happened to its files: saved, save_failed (producer); loaded, missing, invalid
    (consumer lookups)."""

    def __init__(self, config: dict, shape: tuple[int, int]):
        self.role: str = config["ec_role"]
        self.path: str = config["ec_connector_extra_config"]["shared_storage_path"]
        self.shape = shape
        self.producer = self.role in ("ec_producer", "ec_both")
        self.consumer = self.role in ("ec_consumer", "ec_both")
        self.counts = {"saved": 0, "save_failed": 0, "loaded": 0, "missing": 0, "invalid": 0}

    @property
    def encode_only(self) -> bool:
        """An `ec_producer` alone runs the tower and answers without generating (vLLM's
        `is_encode_only`)."""
        return self.producer and not self.consumer

    def filename(self, mm_hash: str) -> str:
        return os.path.join(self.path, mm_hash, FILE_NAME)

    def exists(self, mm_hash: str) -> bool:
        return os.path.isfile(self.filename(mm_hash))

    def save(self, mm_hash: str, rows: np.ndarray) -> bool:
        """Write an image's rows (its folder is made as needed); False (logged, counted) when
        the folder cannot be written."""
        path = self.filename(mm_hash)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_atomic(path, {TENSOR_NAME: rows}, {"format": "pt", "mm_hash": mm_hash})
        except OSError as e:
            self.counts["save_failed"] += 1
            log.warning("ec connector: cannot write %s (%s)", path, e)
            return False
        self.counts["saved"] += 1
        return True

    def load(self, mm_hash: str) -> Optional[np.ndarray]:
        """An image's rows from its file, or None when there is no file or it is not a
        [tokens, hidden] float32 tensor named ec_cache (then counted invalid and logged)."""
        path = self.filename(mm_hash)
        try:
            rows = read_f32(path, TENSOR_NAME, self.shape)
        except FileNotFoundError:
            self.counts["missing"] += 1
            return None
        except (OSError, SafetensorsError) as e:
            self.counts["invalid"] += 1
            log.warning("ec connector: ignoring %s, computing the embedding here (%s)", path, e)
            return None
        self.counts["loaded"] += 1
        return rows

    def stats(self) -> dict:
        return {"connector": "ECExampleConnector", "role": self.role, "shared_storage_path": self.path,
                "files": dict(self.counts)}


def transfer_params(images: list) -> Optional[dict]:
    """A producer's answer field `ec_transfer_params`: one entry per distinct image (by hash)
    with its positions among the request's images, as vLLM's `collect_ec_item_metadata` builds
    it (no placeholder metadata: every image here is 16 rows). None without images, as vLLM."""
    out: dict[str, dict] = {}
    for img in images:
        entry = out.setdefault(img.content_hash, {"item_indices": [], "metadata": {}})
        entry["item_indices"].append(img.index)
    return out or None
