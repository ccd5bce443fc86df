"""KV events interop: a subscriber written here from vLLM's documented format alone (plain
pyzmq + msgpack, nothing from pdgate) decodes the reference engine's events for a cache fill,
an eviction and a flush, and the replay socket returns missed batches, then seq -1.

vLLM's format: PUB multipart (topic, 8-byte big-endian seq, msgpack payload); payload
[ts, events, data_parallel_rank]; events are maps tagged by "type". Replay: a ROUTER socket that
takes the start seq as 8 big-endian bytes and answers each buffered batch from there as
(seq, payload), then (-1, b"")."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from conftest import assert_clean, loads
from pdgate.workers import ReferenceWorker, free_port

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")
pytestmark = pytest.mark.timeout(120)
TOPIC = b"kv@test-pod@tiny"
PAGE = 16


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(256) for _ in range(n - 1)]


class Subscriber:
    """vLLM's consumer side: SUB for the live stream (bound here; the engine's PUB connects,
    as vLLM does for an endpoint without a wildcard) and a DEALER for replay requests."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = free_port()

    def config(self) -> str:
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": f"tcp://127.0.0.1:{self.port}",
                           "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
                           "topic": TOPIC.decode(), "buffer_steps": 1000})

    def live(self, until, timeout_ms: int = 20_000) -> dict[int, list]:
        """Batches received by seq until `until(batches)` holds (or the deadline passes)."""
        got: dict[int, list] = {}
        while not until(got) and self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            got[int.from_bytes(seq, "big")] = msgpack.unpackb(payload, raw=False)
        return got

    def replay(self, start: int) -> list[tuple[int, list]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while dealer.poll(20_000):
                empty, seq, payload = dealer.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    assert payload == b""
                    return out
                out.append((n, msgpack.unpackb(payload, raw=False)))
            raise AssertionError(f"no end-of-replay marker after {len(out)} batches")
        finally:
            dealer.close(0)

    def close(self):
        self.sub.close(0)
        self.ctx.term()


def events_of(batches: dict[int, list]) -> list[dict]:
    return [ev for seq in sorted(batches) for ev in batches[seq][1]]


@pytest.fixture
def publishing_worker():
    sub = Subscriber()
    # 8 pages of 16 tokens: the third 100-token request must evict
    w = ReferenceWorker(mode="null", extra_args=["--max-total-tokens", "128", "--kv-events-config", sub.config()])
    w.start(90)
    try:
        yield w, sub
    finally:
        w.stop()
        sub.close()


def generate(w, prompt, max_new=1):
    r = httpx.post(w.url + "/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_plain_subscriber_decodes_fill_eviction_and_flush(publishing_worker):
    w, sub = publishing_worker
    a = ids(40, 1)
    generate(w, a)                      # 2 full pages stored
    for seed in (2, 3):                 # 7 pages each: the second evicts
        generate(w, ids(100, seed))
    assert loads(w)["prefix_cache"]["evicted_pages"] > 0
    assert httpx.post(w.url + "/reset_prefix_cache", timeout=10).status_code == 200
    assert_clean(w)

    def complete(batches):
        return any(ev["type"] == "AllBlocksCleared" for ev in events_of(batches))

    live = sub.live(complete)
    # the PUB side may have been connecting while the first batches went out: whatever the
    # live stream missed, the replay socket still has (from seq 0)
    replayed = dict(sub.replay(0))
    assert complete(replayed), replayed
    assert set(live) <= set(replayed) and all(replayed[s] == live[s] for s in live)
    assert sorted(replayed) == list(range(len(replayed)))  # seq counts batches from 0

    for ts, events, rank in replayed.values():
        assert isinstance(ts, float) and rank == 0 and events
    evs = events_of(replayed)
    stored = [e for e in evs if e["type"] == "BlockStored"]
    removed = [e for e in evs if e["type"] == "BlockRemoved"]
    first = stored[0]
    assert first["token_ids"] == a[:32] and first["block_size"] == PAGE
    assert first["parent_block_hash"] is None and len(first["block_hashes"]) == 2
    assert first["medium"] == "GPU" and first["lora_name"] is None and "lora_id" in first
    all_stored = [h for e in stored for h in e["block_hashes"]]
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in all_stored)
    for e in stored:
        assert len(e["token_ids"]) == PAGE * len(e["block_hashes"])
    # what was evicted had been stored, and a's tail page goes before its head (LRU, tail first)
    gone = [h for e in removed for h in e["block_hashes"]]
    assert gone and set(gone) <= set(all_stored) and set(e.keys()) >= {"block_hashes", "medium"}
    if first["block_hashes"][0] in gone:
        assert gone.index(first["block_hashes"][1]) < gone.index(first["block_hashes"][0])
    assert evs[-1] == {"type": "AllBlocksCleared"}


def test_replay_after_a_missed_range_returns_those_batches_then_minus_one(publishing_worker):
    w, sub = publishing_worker
    for seed in range(4):
        generate(w, ids(40, 10 + seed))
    everything = dict(sub.replay(0))
    assert len(everything) >= 4
    # a subscriber that saw batches 0..1 and missed the rest asks from 2
    tail = sub.replay(2)
    assert [s for s, _ in tail] == sorted(s for s in everything if s >= 2)
    assert all(everything[s] == b for s, b in tail)
    assert sub.replay(10_000) == []  # nothing that new: just the end marker


def test_bad_kv_events_config_is_refused_at_start():
    from pdgate.engine.errors import EngineConfigError
    from pdgate.engine.kv_events import parse_config

    for bad, why in (('{"enable_kv_cache_events": true, "publishr": "zmq"}', "unknown field"),
                     ('{"publisher": "kafka"}', "publisher"), ('{"hwm": "x"}', "wrong type"),
                     ("not json", "not JSON"), ('{"buffer_steps": 0}', ">= 1")):
        with pytest.raises(EngineConfigError, match=why):
            parse_config(bad)
    cfg = parse_config('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size,
            cfg.topic) == ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert not parse_config(None).active and not parse_config('{"publisher": "zmq"}').active
