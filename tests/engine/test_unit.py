"""In-process tests of the model, KV pool, sampler and transfer framing (no subprocesses)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdgate.engine.config import PRESETS
from pdgate.engine.kv import KVPool, OutOfPages
from pdgate.engine.model import Model, Segment
from pdgate.engine.sampling import SamplingParams, sample
from pdgate.engine.sequence import EngineError
from pdgate.engine.transfer import wire
from pdgate.engine.transfer.context import Timeouts, TransferContext
from pdgate.engine.transfer.kvio import recv_kv, send_kv
from pdgate.engine.transfer.regions import compatible, describe_pool, page_runs, regions
from pdgate.engine.weights import random_weights

CFG = PRESETS["tiny"]
pytestmark = pytest.mark.timeout(60)


def make(num_pages=64, page=4, seed=0):
    pool = KVPool(num_pages, page, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    return Model(CFG, random_weights(CFG, seed)), pool


def dense_logits(model: Model, tokens: list[int]) -> np.ndarray:
    """Reference: the same network without pages or caching, straight from the definition."""
    w, c = model.w, model.cfg
    pos = np.arange(len(tokens))
    x = w["embed"][np.asarray(tokens)]
    g = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"layers.{i}."
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * w[p + "attn_norm"]
        q = model._rope((h @ w[p + "wq"]).reshape(len(tokens), c.num_heads, c.head_dim), pos)
        k = model._rope((h @ w[p + "wk"]).reshape(len(tokens), c.num_kv_heads, c.head_dim), pos)
        v = (h @ w[p + "wv"]).reshape(len(tokens), c.num_kv_heads, c.head_dim)
        out = np.zeros_like(q)
        for head in range(c.num_heads):
            kv = head // g
            s = q[:, head] @ k[:, kv].T / np.sqrt(c.head_dim)
            s = np.where(np.tril(np.ones_like(s)) > 0, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(len(tokens), -1) @ w[p + "wo"]
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * w[p + "mlp_norm"]
        gate = h @ w[p + "w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "w_up"])) @ w[p + "w_down"]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * w["final_norm"]
    return x @ w["lm_head"]


def test_paged_prefill_chunked_and_decode_match_dense():
    model, pool = make()
    rng = np.random.default_rng(3)
    tokens = [256] + rng.integers(0, 256, 29).tolist()
    want = dense_logits(model, tokens)
    pages = pool.reserve(8)
    rng.shuffle(pages)  # a scattered page table must not matter
    whole = model.forward(pool, [Segment(pages, 0, tokens, all_logits=True)])[0]
    np.testing.assert_allclose(whole, want, atol=2e-4)
    pages2 = pool.reserve(8)
    got = []
    for start, end in [(0, 7), (7, 8), (8, 21), (21, 30)]:  # chunks, then one token at a time
        got.append(model.forward(pool, [Segment(pages2, start, tokens[start:end], all_logits=True)])[0])
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-4)


def test_batched_segments_match_single():
    model, pool = make()
    a, b = [256, 1, 2, 3, 4, 5, 6], [256, 9, 8]
    pa, pb = pool.reserve(4), pool.reserve(4)
    la, lb = model.forward(pool, [Segment(pa, 0, a), Segment(pb, 0, b)])
    np.testing.assert_allclose(la[-1], dense_logits(model, a)[-1], atol=2e-4)
    np.testing.assert_allclose(lb[-1], dense_logits(model, b)[-1], atol=2e-4)


def test_batched_decode_matches_dense():
    """Several sequences of different lengths each adding one token in one batched step."""
    model, pool = make(num_pages=128)
    rng = np.random.default_rng(5)
    seqs = [[256] + rng.integers(0, 256, n).tolist() for n in (3, 9, 17, 30)]
    tables = [pool.reserve(9) for _ in seqs]
    for t, s in zip(tables, seqs):
        model.forward(pool, [Segment(t, 0, s[:-1])])
    got = model.forward(pool, [Segment(t, len(s) - 1, [s[-1]]) for t, s in zip(tables, seqs)])
    for g, s in zip(got, seqs):
        np.testing.assert_allclose(g[-1], dense_logits(model, s)[-1], atol=2e-4)


def test_weights_are_deterministic_per_seed():
    w1, w2, w3 = random_weights(CFG, 5), random_weights(CFG, 5), random_weights(CFG, 6)
    assert all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert not np.array_equal(w1["embed"], w3["embed"])


def test_small_preset_is_tens_of_millions():
    assert 10e6 < PRESETS["small"].num_params() < 100e6


def test_pool_counters_are_exact():
    pool = KVPool(10, 4, 1, 1, 2)
    a = pool.reserve(4)
    assert pool.counters() | {} == {"free": 6, "reserved": 4, "in_use": 0, "pinned": 0, "cached": 0, "total": 10, "page_size": 4}
    pool.commit(a[:2])
    pool.pin(a[2:])
    assert (pool.counters()["in_use"], pool.counters()["pinned"]) == (2, 2)
    pool.unpin(a[2:])
    assert pool.counters()["in_use"] == 4
    with pytest.raises(OutOfPages):
        pool.reserve(7)
    pool.free(a)
    assert pool.counters()["free"] == 10
    with pytest.raises(RuntimeError):
        pool.free(a)  # double free is a bug, never silent


def test_page_bytes_roundtrip():
    src = KVPool(4, 2, 2, 1, 3)
    src.k[:] = np.arange(src.k.size, dtype=np.float32).reshape(src.k.shape)
    src.v[:] = -src.k
    dst = KVPool(4, 2, 2, 1, 3)
    dst.write_pages([3, 0], src.read_pages([1, 2]))
    np.testing.assert_array_equal(dst.k[:, [3, 0]], src.k[:, [1, 2]])
    np.testing.assert_array_equal(dst.v[:, [3, 0]], src.v[:, [1, 2]])
    # out of order on both sides (a gather and a scatter, not views)
    dst.write_pages([2, 1], src.read_pages([3, 0]))
    np.testing.assert_array_equal(dst.k[:, [2, 1]], src.k[:, [3, 0]])
    np.testing.assert_array_equal(dst.v[:, [2, 1]], src.v[:, [3, 0]])
    # consecutive pages are sent straight from the pool: a view, no copy
    run = src.read_pages([1, 2])
    assert len(run) == 2 * src.page_bytes and np.shares_memory(np.frombuffer(run, np.float32), src.kv)
    with pytest.raises(ValueError):
        dst.write_pages([0], b"\0" * 8)


def test_pool_is_page_major_and_hands_out_lowest_pages():
    pool = KVPool(8, 2, 3, 1, 2)
    pool.k[:] = np.arange(pool.k.size, dtype=np.float32).reshape(pool.k.shape)
    pool.v[:] = -pool.k
    for p in range(8):  # everything page p holds is one contiguous block of kv
        assert np.array_equal(pool.kv[p, 0], pool.k[:, p]) and np.array_equal(pool.kv[p, 1], pool.v[:, p])
    assert pool.page_bytes == pool.kv.strides[0] == 2 * pool.k[:, 0].nbytes
    a = pool.reserve(3)
    assert a == [0, 1, 2]
    b = pool.reserve(2)
    pool.free(a)
    assert pool.reserve(4) == [0, 1, 2, 5]  # lowest free first, ascending
    pool.free(b)


def test_page_runs_merge_in_any_order():
    assert page_runs([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]
    assert page_runs([3, 2, 1, 0], [13, 12, 11, 10]) == [(0, 10, 4)]  # descending: one run
    assert page_runs([5, 6, 9], [1, 2, 3]) == [(5, 1, 2), (9, 3, 1)]
    assert page_runs([0, 1], [1, 0]) == [(0, 1, 1), (1, 0, 1)]  # crossed: never merged
    assert page_runs([], []) == []


def test_regions_move_exactly_the_pages_asked():
    """Apply the regions with memmove, as a library would; every pair lands, nothing else."""
    import ctypes
    src, dst = KVPool(12, 2, 2, 1, 3), KVPool(12, 2, 2, 1, 3)
    src.kv[:] = np.arange(src.kv.size, dtype=np.float32).reshape(src.kv.shape)
    sp, dp = [7, 6, 5, 1, 2], [3, 2, 1, 10, 9]
    regs = regions(src, describe_pool(dst), sp, dp)
    assert len(regs) == 3
    for local, remote, n in regs:
        ctypes.memmove(remote, local, n)
    np.testing.assert_array_equal(dst.kv[dp], src.kv[sp])
    untouched = [p for p in range(12) if p not in dp]
    assert not dst.kv[untouched].any()
    ours = {"backend": "nixl", **describe_pool(src)}
    assert compatible(ours, dict(ours, base=1))  # a peer's pool is elsewhere, laid out alike
    assert not compatible(ours, dict(ours, pool_layout="layer-major"))  # -> TCP frames
    assert not compatible(ours, None)


def test_sampling_greedy_and_seeded():
    logits = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    tok, lp, _ = sample(logits, SamplingParams(temperature=0), 0)
    assert tok == int(np.argmax(logits)) and lp < 0
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    draws = [sample(logits, p, i)[0] for i in range(20)]
    assert draws == [sample(logits, p, i)[0] for i in range(20)]  # keyed by (seed, index)
    assert len(set(draws)) > 1
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=1), 0)[0] == tok


def _ctx(pool):
    async def nope(*a):
        raise AssertionError
    return TransferContext(pool, {"x": 1}, "e", "127.0.0.1", Timeouts(1, 1, 1, 1), nope, nope, lambda s: None)


def test_sink_rejects_frames_of_another_attempt_and_outside_reservation():
    async def run(tamper):
        src, dst = KVPool(8, 2, 1, 1, 2), KVPool(8, 2, 1, 1, 2)
        src.k[:] = 1.0
        got = {}

        async def source(reader, writer):
            tag = {"protocol": "bootstrap", "key": 1, "attempt": "a"}
            frames = tamper(tag)
            await send_kv(_ctx(src), writer, [0, 1], frames["dst"], frames["tag"])
            await wire.send(writer, {"op": "done", **frames["tag"], "meta": {}})

        server = await asyncio.start_server(source, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            got["meta"] = await recv_kv(_ctx(dst), reader, [4, 5],
                                        {"protocol": "bootstrap", "key": 1, "attempt": "a"}, lambda: None)
        finally:
            writer.close()
            server.close()
        return got, dst

    got, dst = asyncio.run(run(lambda t: {"tag": t, "dst": [4, 5]}))
    assert dst.k[:, [4, 5]].min() == 1.0
    with pytest.raises(EngineError, match="another transfer"):
        asyncio.run(run(lambda t: {"tag": dict(t, attempt="old"), "dst": [4, 5]}))
    with pytest.raises(EngineError, match="outside the reservation"):
        asyncio.run(run(lambda t: {"tag": t, "dst": [4, 6]}))


def test_output_after_a_prompt_ending_inside_a_character_completes_it():
    """A continued answer (prompt + generated ids) yields exactly the text the first stream still
    held back: the output is decoded after the prompt's tail (the SGLang flavour; the vLLM
    flavour sends what vLLM does, the next tests)."""
    from types import SimpleNamespace

    from pdgate.engine.outputs import output_text, visible_text
    from pdgate.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    answer = list("é€!".encode()) + [0xFF, 0x41]  # multi-byte characters and an invalid byte
    prompt = [256, 104, 105]

    def seq(prompt_ids: list[int], out: list[int]) -> SimpleNamespace:
        return SimpleNamespace(tokens=prompt_ids + out, prompt_len=len(prompt_ids), output_ids=out,
                               finish_reason=None, finished=False, params=SamplingParams())

    whole = output_text(tok, seq(prompt, answer))
    for k in range(1, len(answer)):
        sent = visible_text(tok, seq(prompt, answer[:k]), False)
        rest = output_text(tok, seq(prompt + answer[:k], answer[k:]))
        assert sent + rest == whole, k
    assert output_text(tok, seq(prompt, [104])) == "h", "a clean prompt end: the output alone"


def test_the_vllm_flavour_never_sends_a_tail_that_ends_inside_a_character():
    """vLLM's detokenizer (tokenizers' DecodeStream) holds text while it ends in U+FFFD and drops
    what it still holds at the end; the vLLM flavour's OpenAI text is that (`vllm_tail`), so a
    gateway decoding a vLLM gRPC worker's ids can be compared with it. SGLang's keeps the tail."""
    from types import SimpleNamespace

    from pdgate.engine.outputs import visible_text
    from pdgate.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    def seq(out: list[int], finished: bool) -> SimpleNamespace:
        return SimpleNamespace(tokens=[256] + out, prompt_len=1, output_ids=out,
                               finish_reason={"type": "length"} if finished else None,
                               finished=finished, params=SamplingParams())

    cut = list("ab".encode()) + list("é".encode())[:1]  # ends inside a character
    assert visible_text(tok, seq(cut, True), True) == "ab\ufffd"
    assert visible_text(tok, seq(cut, True), True, vllm_tail=True) == "ab"
    # An invalid byte followed by more text was sent once the text after it came.
    mid = [104, 0xFF, 0x41]
    assert visible_text(tok, seq(mid, True), True, vllm_tail=True) == "h\ufffdA"
    # Streamed: every partial text is a prefix of the next and of the final one.
    answer = list("é€".encode()) + [0xFF] + list("ok".encode()) + list("€".encode())[:2]
    final = visible_text(tok, seq(answer, True), True, vllm_tail=True)
    assert final == "é€\ufffdok"
    sent = ""
    for k in range(1, len(answer) + 1):
        now = visible_text(tok, seq(answer[:k], False), False, vllm_tail=True)
        assert now.startswith(sent) and final.startswith(now), k
        sent = now


def test_the_vllm_flavour_sends_the_prompt_again_when_the_prompt_ends_inside_a_character():
    """vLLM 0.32 primes tokenizers' DecodeStream with the whole prompt; when that text ends in
    U+FFFD, the first text it sends is the whole prompt's and then the output's (measured with
    tokenizers 0.23.3 and the tiny64 tokenizer). A gateway must not continue from such ids."""
    from types import SimpleNamespace

    from pdgate.engine.outputs import visible_text
    from pdgate.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    def seq(prompt: list[int], out: list[int]) -> SimpleNamespace:
        return SimpleNamespace(tokens=prompt + out, prompt_len=len(prompt), output_ids=out, finish_reason=None,
                               finished=False, params=SamplingParams())

    e_acute = list("é".encode())
    held = [256] + list(b"hi ") + e_acute[:1]
    assert visible_text(tok, seq(held, e_acute[1:2]), False, vllm_tail=True) == "hi é"
    assert visible_text(tok, seq(held, e_acute[1:2] + [0x41]), False, vllm_tail=True) == "hi éA"
    assert visible_text(tok, seq([256] + list(b"hi "), [0x41]), False, vllm_tail=True) == "A", "a clean end: the output alone"
    assert visible_text(tok, seq(held, e_acute[1:2]), False) == "é", "the SGLang flavour completes the character"


@pytest.mark.parametrize("hold_at, want", [(3, 3), (0, 16)])
def test_a_held_scheduler_decodes_no_sequence_past_the_fault_point(hold_at, want):
    """`Scheduler.hold_at` (set by `--fault-*-after-tokens N`): with nobody reading the sequence
    the engine runs as far ahead as it can, and still stops at N output tokens, unfinished, so a
    fault checked by a slow stream always comes mid-answer. Without a hold it finishes."""
    from pdgate.engine.scheduler import Scheduler
    from pdgate.engine.sequence import Seq
    from pdgate.engine.tokenizer import ByteTokenizer

    async def run() -> Seq:
        model, pool = make()
        sched = Scheduler(model, pool, ByteTokenizer(), None, hold_at=hold_at)
        seq = Seq("held-1", [256, 1, 2, 3, 4], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
        seq.pages = pool.reserve(pool.pages_for(seq.prompt_len + 17))
        loop = asyncio.create_task(sched.run())
        sched.add(seq)
        try:
            for _ in range(500):  # the loop's steps, not a clock: until it has nothing to do
                await asyncio.sleep(0.01)
                if seq.finished or (hold_at and len(seq.output_ids) >= hold_at and not sched.wake.is_set()):
                    break
            await asyncio.sleep(0.05)  # one more chance to (wrongly) decode past the hold
            return seq
        finally:
            loop.cancel()
            sched.exec.shutdown(wait=False)

    seq = asyncio.run(run())
    assert len(seq.output_ids) == want, seq.output_ids
    assert seq.finished == (hold_at == 0)


def test_a_cancel_that_meets_the_work_ending_is_never_lost():
    """`with_timeout` under a cancel that arrives in the same loop step as the work's result
    (before Python 3.12 `asyncio.wait_for` then returns the result and the cancel is lost: an
    aborted decode whose bootstrap lookup answered just then registered with its prefill and
    waited there for KV, its request no longer live). The cancel propagates; a connection the
    work opened in that step is closed."""
    from pdgate.engine.transfer.context import with_timeout

    async def run(result_of):
        loop = asyncio.get_running_loop()
        work: asyncio.Future = loop.create_future()
        outer = asyncio.create_task(with_timeout(work, 60, "the test's work"))
        await asyncio.sleep(0)  # outer now waits on the work
        work.set_result(await result_of())
        outer.cancel()  # same step: both are ready when outer next runs
        try:
            await outer
        except asyncio.CancelledError:
            return "cancelled", work.result()
        return "returned", work.result()

    async def nothing():
        return 7

    assert asyncio.run(run(nothing)) == ("cancelled", 7)

    async def connection():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        try:
            return await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        finally:
            server.close()

    async def opened_then_cancelled():
        outcome, (_reader, writer) = await run(connection)
        await asyncio.sleep(0)  # the close is a done-callback of the work
        return outcome, writer.is_closing()

    assert asyncio.run(opened_then_cancelled()) == ("cancelled", True)


def test_with_timeout_times_out_and_returns():
    from pdgate.engine.transfer.context import with_timeout

    async def run():
        slow = asyncio.ensure_future(asyncio.sleep(60))
        with pytest.raises(EngineError, match="timed out after 0.05s doing it") as e:
            await with_timeout(slow, 0.05, "doing it")
        assert e.value.code == "kv_transfer_timeout" and slow.cancelled()
        return await with_timeout(asyncio.sleep(0, "ok"), 60, "doing it")

    assert asyncio.run(run()) == "ok"
