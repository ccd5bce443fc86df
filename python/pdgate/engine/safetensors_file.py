"""The safetensors file format with numpy alone: write float32 tensors, read one back checked.

A file is an 8-byte little-endian header length, a JSON header (each tensor's `dtype`, `shape`
and `data_offsets` into the data that follows, plus an optional `__metadata__` of strings),
padded with spaces so the data starts 8-byte aligned, then the raw little-endian bytes. The
`safetensors` package and torch read what is written here; the engine does not depend on them
(the `hf` extra is only for loading checkpoints).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping

import numpy as np

MAX_HEADER_BYTES = 100 << 20  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A file that is not the tensor it should be: truncated, not safetensors, wrong
    name, dtype, shape or size, or non-finite values."""


def header_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and the padded JSON header of `tensors` (float32, in order)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        nbytes = int(np.prod(t.shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def dumps(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """A whole file's bytes."""
    return header_bytes(tensors, metadata) + b"".join(
        np.ascontiguousarray(t, dtype="<f4").tobytes() for t in tensors.values())


def write_atomic(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write the file under a temporary name in the same folder, then rename it into place, so
    a reader sees the whole file or none (never half of one), and two writers of the same
    path do not mix their bytes."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(dumps(tensors, metadata))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def loads_f32(data: bytes, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` of a file's bytes, which must be float32 of exactly `shape`, finite, and
    the file exactly header plus data (no trailing or missing bytes)."""
    if len(data) < 8:
        raise SafetensorsError(f"{len(data)} bytes: shorter than the header length")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise SafetensorsError(f"header length {n} does not fit a file of {len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, ValueError):
        raise SafetensorsError("the header is not JSON") from None
    entry = header.get(name) if isinstance(header, dict) else None
    if not isinstance(entry, dict):
        raise SafetensorsError(f"no tensor named {name!r}")
    want = int(np.prod(shape, dtype=np.int64)) * 4
    if entry.get("dtype") != "F32" or entry.get("shape") != list(shape):
        raise SafetensorsError(f"{name}: {entry.get('dtype')} {entry.get('shape')}, expected F32 {list(shape)}")
    body = data[8 + n:]
    begin, end = (entry.get("data_offsets") or [None, None])[:2]
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin and end - begin == want
            and end <= len(body)):
        raise SafetensorsError(f"{name}: data_offsets {entry.get('data_offsets')} do not hold {want} bytes "
                               f"of a {len(body)}-byte body")
    if len(body) != _data_end(header):
        raise SafetensorsError(f"the body is {len(body)} bytes, not what the header describes")
    out = np.frombuffer(body, dtype="<f4", count=want // 4, offset=begin).reshape(shape).astype(np.float32)
    if not np.isfinite(out).all():
        raise SafetensorsError(f"{name}: non-finite values")
    return out


def _data_end(header: dict) -> int:
    """Where the header says the last tensor's data ends."""
    ends = [0]
    for key, e in header.items():
        offsets = e.get("data_offsets") if isinstance(e, dict) and key != "__metadata__" else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            if key != "__metadata__":
                raise SafetensorsError(f"{key}: no valid data_offsets")
            continue
        ends.append(offsets[1])
    return max(ends)


def read_f32(path: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """`loads_f32` of a file; OSError when it cannot be read (FileNotFoundError: not there)."""
    with open(path, "rb") as f:
        return loads_f32(f.read(), name, shape)
