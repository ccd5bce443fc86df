"""What the SGLang and vLLM gRPC servicers share: error statuses, the tokenizer bundle, the
pairing keys, and streaming a sequence's new tokens.

The engine's HTTP surfaces and these servicers submit the same `GenItem`s to the same engine;
only the wire differs (token ids in and out, no text).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import tempfile
import time
import zipfile
from typing import AsyncIterator

import grpc

from .hf_export import export
from .items import GenItem
from .sampling import BadRequest, params_from_dict
from .sequence import EngineError, Seq

CHUNK_SIZE = 64 * 1024  # GetTokenizer chunk size (what SMG's servicers send)

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
           409: grpc.StatusCode.ALREADY_EXISTS, 499: grpc.StatusCode.CANCELLED,
           503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_of(err: Exception) -> grpc.StatusCode:
    """The gRPC status an engine error maps to (the HTTP surfaces' status, translated)."""
    if isinstance(err, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, EngineError):
        return _STATUS.get(err.status, grpc.StatusCode.INTERNAL)
    return grpc.StatusCode.INTERNAL


async def deltas(seqs: list[Seq]) -> AsyncIterator[tuple[int, list[int], int]]:
    """Yield (index, new token ids, offset of the first new one) whenever a sequence grows, and
    once more when it ends; a failed sequence raises its error (the stream ends with its status).

    The finished state is read before the ids, so the last step's ids are never lost while the
    consumer was slow (http_common.watch reads it after its consumer resumed)."""
    sent = [0] * len(seqs)
    pending = set(range(len(seqs)))
    while pending:
        for i in sorted(pending):
            s = seqs[i]
            s.changed.clear()
            finished = s.finished
            if s.error is not None:
                raise s.error
            new = s.output_ids[sent[i]:]
            if new or finished:
                start, sent[i] = sent[i], sent[i] + len(new)
                if finished:
                    pending.discard(i)
                yield i, list(new), start
        if pending:
            waiters = [asyncio.ensure_future(seqs[i].changed.wait()) for i in pending]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in waiters:
                    t.cancel()


async def fault_point(engine, out: int, context) -> None:
    """The HTTP surfaces' fault hooks (`http_common.fault_kill_point`) over gRPC, at the same
    moment: once a sequence has `out` >= N output tokens out (handed to the call in stream
    chunks; for a whole answer, generated). `out` counts what was handed out, not the live
    sequence, which may already be ahead of the stream.

    `--fault-kill-after-tokens N`: the engine SIGKILLs itself (no status, no last bytes).
    `--fault-drop-after-tokens N`: on every call, the call ends with `UNAVAILABLE` (what a gRPC
    client reports for a lost connection) and its sequences are aborted (the caller's finally);
    the process and its other calls live on. One HTTP/2 connection carries every call, so
    closing it, as the HTTP hook closes its socket, would break unrelated calls too."""
    n = engine.config.fault_kill_after_tokens
    if n and out >= n:
        os.kill(os.getpid(), signal.SIGKILL)
    d = engine.config.fault_drop_after_tokens
    if d and out >= d:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "--fault-drop-after-tokens: the call was dropped mid-answer")


def faults_on(engine) -> bool:
    return bool(engine.config.fault_kill_after_tokens or engine.config.fault_drop_after_tokens)


def finish_reason(seq: Seq) -> tuple[str, dict]:
    """(finish reason, matched-stop kwargs) of a finished sequence, SGLang's way."""
    r = seq.finish_reason or {}
    reason = "length" if r.get("type") == "length" else ("abort" if r.get("type") == "abort" else "stop")
    matched = r.get("matched")
    if isinstance(matched, int) and not isinstance(matched, bool):
        return reason, {"matched_token_id": matched}
    if isinstance(matched, str):
        return reason, {"matched_stop_str": matched}
    return reason, {}


def pairing_keys(engine) -> dict:
    """What a gateway pairs a prefill with a decode by, read from GetServerInfo."""
    cfg = engine.kv_transfer_config or {}
    backend = engine.config.disaggregation_transfer_backend
    connector = cfg.get("kv_connector") or {"mooncake": "MooncakeConnector", "nixl": "NixlConnector"}.get(backend, "")
    role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(engine.mode, "kv_both" if cfg else "")
    return {"kv_connector": connector, "kv_role": cfg.get("kv_role", role), "kv_cache_dtype": "float32",
            "block_size": engine.config.page_size, "page_size": engine.config.page_size,
            "attention_backend": "pdgate-numpy", "disaggregation_mode": engine.mode,
            "disaggregation_transfer_backend": backend, "kv_engine_id": engine.engine_id}


class TokenizerBundle:
    """The model directory (`--export-tokenizer`'s files) as a zip, built once, for GetTokenizer."""

    def __init__(self, model: str):
        self.model = model
        self._zip: tuple[bytes, str] | None = None

    def build(self) -> tuple[bytes, str]:
        if self._zip is None:
            with tempfile.TemporaryDirectory(prefix="pdgate-tok-") as d:
                files = export(self.model, d)
                buf = io.BytesIO()
                with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
                    for path in files:
                        zf.write(path, os.path.basename(path))
            data = buf.getvalue()
            self._zip = (data, hashlib.sha256(data).hexdigest())
        return self._zip

    async def chunks(self, chunk_type):
        data, digest = await asyncio.to_thread(self.build)
        for off in range(0, len(data), CHUNK_SIZE):
            end = min(off + CHUNK_SIZE, len(data))
            yield chunk_type(data=data[off:end], sha256=digest if end == len(data) else "")


HEALTH_TIMEOUT_S = 20.0


async def health_probe(e) -> tuple[bool, str]:
    """Healthy when ready and, on a colocated worker, a one-token generation succeeds within
    HEALTH_TIMEOUT_S (a PD worker cannot generate alone; SGLang skips the probe there too)."""
    if not e.ready:
        return False, "starting"
    if e.mode != "null":
        return True, "ready"
    item = GenItem(rid=f"health-{time.monotonic_ns()}", input_ids=e.tokenizer.encode("hi"),
                   params=params_from_dict({"max_new_tokens": 1, "temperature": 0}))
    seq = e.submit(item)
    try:
        await asyncio.wait_for(asyncio.shield(seq.done), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return False, "generation timed out"
    finally:
        e.abort(seq)
    if seq.error is not None:
        return False, str(seq.error)
    return True, "ready"


def flush_cache(e):
    """FlushCache: empty the prefix cache, refused (success false) while requests hold pages."""
    from smg_grpc_proto.generated import common_pb2

    if e.flush_cache():
        return common_pb2.FlushCacheResponse(success=True, message="Cache flushed.")
    return common_pb2.FlushCacheResponse(success=False, message="Cache not flushed: requests are holding KV pages")
