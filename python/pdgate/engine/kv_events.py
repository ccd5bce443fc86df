"""KV cache events, published as vLLM publishes them (`--kv-events-config`).

Wire format (vLLM's `ZmqEventPublisher`):
- a ZMQ PUB socket sends multipart messages `(topic, seq, payload)`: `seq` is an 8-byte
  big-endian sequence number counting batches from 0, `payload` a msgpack batch
  `[ts, events, data_parallel_rank]`;
- events are maps tagged by `type`, as vLLM's msgspec structs encode them:
  `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`,
  `{"type": "AllBlocksCleared"}`;
- an optional ROUTER socket (`replay_endpoint`) answers a request `(empty, start seq as 8 bytes
  big-endian)` with every buffered batch from that seq on, each as `(empty, seq, payload)`,
  then `(empty, -1 as 8 signed bytes, b"")`; the last `buffer_steps` batches are kept.
- The PUB endpoint is bound when it holds a wildcard (`*`, `::`) or is `ipc://`/`inproc://`,
  otherwise connected (vLLM's rule: bind the stable side, connect the volatile one).

The engine loop never waits on the network: events gathered during one turn of the event loop
go out as one batch, handed to a publisher thread through a bounded queue (`max_queue_size`).
A batch that does not fit is dropped and counted; its sequence number is skipped, so a
subscriber sees the gap (and cannot replay it: it must resynchronise).

`listeners` get every batch with its sequence number on the event loop thread, before the ZMQ
queue (the gRPC `SubscribeKvEvents` stream, `grpc_kv_events.py`, is one): both surfaces carry
the same batches under the same numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from .errors import EngineConfigError

log = logging.getLogger("pdgate.engine.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class KVEventsConfig:
    """vLLM's `KVEventsConfig`: the same field names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "null" | "zmq"; default "zmq" when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES = {"enable_kv_cache_events": bool, "publisher": (str, type(None)), "endpoint": str,
          "replay_endpoint": (str, type(None)), "buffer_steps": int, "hwm": int,
          "max_queue_size": int, "topic": str}


def parse_config(text: str | dict | None) -> KVEventsConfig:
    """`--kv-events-config` JSON (or its dict, or a parsed config) -> config; EngineConfigError
    naming the problem otherwise."""
    if text is None:
        return KVEventsConfig()
    if isinstance(text, KVEventsConfig):
        return text
    try:
        raw = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise EngineConfigError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise EngineConfigError("--kv-events-config must be a JSON object")
    for k, v in raw.items():
        want = _TYPES.get(k)
        if want is None:
            raise EngineConfigError(f"--kv-events-config: unknown field {k!r} (known: {', '.join(_TYPES)})")
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise EngineConfigError(f"--kv-events-config: {k} has the wrong type ({v!r})")
    cfg = KVEventsConfig(**raw)
    if cfg.publisher not in ("null", "zmq"):
        raise EngineConfigError(f"--kv-events-config: publisher {cfg.publisher!r} is not one of null, zmq")
    if min(cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) < 1:
        raise EngineConfigError("--kv-events-config: buffer_steps, hwm and max_queue_size must be >= 1")
    return cfg


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Batches events per event-loop turn and publishes them from a thread (see module doc)."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0):
        self.cfg, self.rank = cfg, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._pending: list[dict] = []
        self._flush_scheduled = False
        self._next_seq = 0
        self.published = 0  # batches handed to the socket
        self.dropped = 0    # batches that did not fit the queue
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.listeners: list = []  # callables (seq, batch), see the module doc

    # ---- engine side (event loop thread) -------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        """Open the sockets (in the publisher thread); raise if they cannot be opened."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("KV event publisher did not start")
        if self._error is not None:
            raise RuntimeError(f"KV event publisher: {self._error}") from self._error

    def add(self, event: dict) -> None:
        """Queue one event; everything added in this loop turn leaves as one batch."""
        self._pending.append(event)
        if self._flush_scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self.flush)
            self._flush_scheduled = True
        except RuntimeError:  # no loop (unit use): publish now
            self.flush()

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        batch, self._pending = [time.time(), self._pending, self.rank], []
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        for listener in self.listeners:
            listener(seq, batch)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            log.warning("KV event queue full (%d batches): dropped batch %d", self.cfg.max_queue_size, seq)

    def stop(self, timeout: float = 2.0) -> None:
        self.flush()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict:
        return {"enabled": True, "batches_published": self.published, "batches_dropped": self.dropped,
                "next_seq": self._next_seq, "queued": self._queue.qsize()}

    # ---- publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        import msgpack
        import zmq

        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(self.cfg.hwm)
            (pub.bind if binds(self.cfg.endpoint) else pub.connect)(self.cfg.endpoint)
            if self.cfg.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(self.cfg.replay_endpoint)
        except Exception as e:  # bad endpoint, port taken: reported by start()
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._started.set()
            return
        self._started.set()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.cfg.buffer_steps)
        try:
            while not (self._stop.is_set() and self._queue.empty()):
                try:
                    seq, batch = self._queue.get(timeout=0.02)
                    payload = msgpack.packb(batch, use_bin_type=True)
                    pub.send_multipart((self.cfg.topic.encode(), seq.to_bytes(8, "big"), payload))
                    buffer.append((seq, payload))
                    self.published += 1
                except queue.Empty:
                    pass
                while replay is not None and replay.poll(0):
                    self._replay(replay, buffer)
        except Exception:  # the engine keeps serving without events rather than dying
            log.exception("KV event publisher failed; no more events are published")
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    @staticmethod
    def _replay(sock, buffer: deque) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid KV event replay request (%d frames)", len(frames))
            if frames:
                sock.send_multipart((frames[0], b"", END_SEQ, b""))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if seq >= start_seq:
                sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", END_SEQ, b""))


def config_dict(cfg: KVEventsConfig) -> dict:
    return dataclasses.asdict(cfg)
