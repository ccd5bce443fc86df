"""EPD pieces without worker processes: the tower, the prompt with placeholders, a chunked
prefill over an image, and the embedding transfer on loopback (either order, a wrong image,
and an embedding nobody collects, which must not stay)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from pdgate.engine.config import PRESETS
from pdgate.engine.kv import KVPool
from pdgate.engine.model import Model, Segment
from pdgate.engine.multimodal import ImageEncoder, chat_inputs, encode_items, load_image
from pdgate.engine.sampling import BadRequest
from pdgate.engine.sequence import EngineError
from pdgate.engine.tokenizer import ByteTokenizer, chat_prompt
from pdgate.engine.transfer.context import Timeouts, TransferContext
from pdgate.engine.transfer.embed import EmbedSource, embed_receive
from pdgate.engine.transfer.server import TransferServer
from pdgate.engine.vision import VisionTower
from pdgate.engine.weights import random_weights

CFG = PRESETS["tiny-mm"]


def png(color=(10, 200, 30), size=(20, 12)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_tower_is_seeded_and_fixed_size():
    img = load_image(png(), 0, CFG)
    a = VisionTower(CFG.vision, CFG.hidden_size, 0).forward(img.pixels)
    b = VisionTower(CFG.vision, CFG.hidden_size, 0).forward(img.pixels)
    c = VisionTower(CFG.vision, CFG.hidden_size, 1).forward(img.pixels)
    assert a.shape == (16, 64) and a.dtype == np.float32
    assert np.array_equal(a, b) and not np.allclose(a, c)
    big = load_image(png(size=(300, 200)), 0, CFG)
    assert VisionTower(CFG.vision, CFG.hidden_size, 0).forward(big.pixels).shape == (16, 64)


def test_prompt_places_one_run_per_image_and_text_renders_as_before():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": png()}},
                {"type": "text", "text": "b"}, {"type": "image_url", "image_url": png((1, 2, 3))}]}]
    ids, imgs = chat_inputs(tok, CFG, msgs)
    assert [(i.index, i.length) for i in imgs] == [(0, 16), (1, 16)]
    for img in imgs:
        assert ids[img.offset:img.offset + 16] == [CFG.image_token_id] * 16
    assert ids.count(CFG.image_token_id) == 32
    without = [t for t in ids if t != CFG.image_token_id]
    assert without == tok.encode(chat_prompt(msgs))  # the text is the text-only template's
    assert imgs[0].content_hash != imgs[1].content_hash
    with pytest.raises(BadRequest) as e:
        chat_inputs(tok, PRESETS["tiny"], msgs)
    assert e.value.code == "multimodal_not_supported"


def test_encode_bootstrap_info_is_checked():
    item = {"item_index": 0, "bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 3}
    assert encode_items({"encode_bootstrap_info": {"items": [item]}}, 1) == {0: item}
    assert encode_items({}, 1) is None
    for bad in ({"items": [dict(item, item_index=1)]}, {"items": [item, item]},
                {"items": [dict(item, bootstrap_room=-1)]}, {"items": [dict(item, bootstrap_port=0)]},
                [item], {"items": "x"}):
        with pytest.raises(BadRequest):
            encode_items({"encode_bootstrap_info": bad}, 1)


def test_chunked_prefill_over_an_image_equals_one_pass():
    """Segment.embeds puts each chunk's share of the image rows in place: the logits of the
    last token agree whether the prompt ran whole or in chunks that cut the image."""
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": png()}},
        {"type": "text", "text": "ok?"}]}]
    ids, imgs = chat_inputs(tok, CFG, msgs)
    emb = ImageEncoder(CFG, 0, 0).embed(imgs[0])[0]
    pos = np.arange(imgs[0].offset, imgs[0].offset + 16)
    model = Model(CFG, random_weights(CFG, 0))

    def run(cuts: list[int]) -> np.ndarray:
        pool = KVPool(8, 16, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
        pages = pool.reserve(pool.pages_for(len(ids)))
        out, start = None, 0
        for end in cuts + [len(ids)]:
            sel = (pos >= start) & (pos < end)
            embeds = (pos[sel] - start, emb[sel]) if sel.any() else None
            out = model.forward(pool, [Segment(pages, start, ids[start:end], embeds=embeds)])[0]
            start = end
        return out[-1]

    whole = run([])
    cut = run([imgs[0].offset + 5, imgs[0].offset + 11])
    np.testing.assert_allclose(whole, cut, rtol=1e-4, atol=1e-4)
    plain = run([])  # and the image matters: placeholders alone give other logits
    pool = KVPool(8, 16, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    no_img = model.forward(pool, [Segment(pool.reserve(pool.pages_for(len(ids))), 0, ids)])[0][-1]
    assert np.array_equal(whole, plain) and not np.allclose(whole, no_img)
    assert whole[CFG.image_token_id] < -1e8  # the placeholder is never sampled


def _ctx(bootstrap: float) -> TransferContext:
    pool = KVPool(2, 16, 1, 1, 4)
    return TransferContext(pool, {}, "e", "127.0.0.1", Timeouts(bootstrap=bootstrap, transfer=5),
                           None, None, None)


async def _with_source(bootstrap: float, body):
    counts, nbytes = {"sent": 0}, {"tcp": {"sent": 0}}
    src = EmbedSource(_ctx(bootstrap), counts, nbytes)
    server = TransferServer({"embed_register": src.on_register})
    port = await server.start("127.0.0.1", 0)
    try:
        return await body(src, ("127.0.0.1", port), counts)
    finally:
        await server.stop()


def test_embedding_moves_in_either_order():
    emb = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)

    async def body(src, addr, counts):
        rx = _ctx(10)
        src.offer(1, "h1", emb)  # encode first
        a, via = await embed_receive(rx, addr, 1, "h1", (16, 64))
        assert via == "tcp"
        task = asyncio.create_task(embed_receive(rx, addr, 2, "h2", (16, 64)))  # prefill first
        for _ in range(200):
            if 2 in src.claimed:
                break
            await asyncio.sleep(0.01)
        assert 2 in src.claimed
        src.offer(2, "h2", emb * 2)
        b, _ = await asyncio.wait_for(task, 10)
        for _ in range(200):  # the source counts a delivery once the prefill's ack is in
            if counts["sent"] == 2:
                break
            await asyncio.sleep(0.01)
        return a, b, counts["sent"], src.pending

    a, b, sent, pending = asyncio.run(_with_source(10, body))
    assert np.array_equal(a, emb) and np.array_equal(b, emb * 2)
    assert sent == 2 and pending == 0


def test_wrong_image_or_missing_encode_fails_and_nothing_stays():
    emb = np.ones((16, 64), dtype=np.float32)

    async def body(src, addr, counts):
        rx = _ctx(10)
        src.offer(1, "other", emb)
        with pytest.raises(EngineError) as wrong:
            await embed_receive(rx, addr, 1, "mine", (16, 64))
        with pytest.raises(EngineError) as missing:  # no encode for room 2 within the source's deadline
            await embed_receive(rx, addr, 2, "h", (16, 64))
        src.offer(3, "h", emb)  # nobody registers: dropped at the deadline
        with pytest.raises(EngineError):
            src.offer(3, "h", emb)  # one embedding per room
        for _ in range(300):
            if src.pending == 0:
                break
            await asyncio.sleep(0.01)
        return str(wrong.value), str(missing.value), src.pending, counts["sent"]

    wrong, missing, pending, sent = asyncio.run(_with_source(0.3, body))
    assert "holds image other" in wrong and "no embedding for room 2" in missing
    assert pending == 0 and sent == 0


def test_abort_drops_an_encode_calls_rooms_at_once():
    """`/abort_request` on an encode worker (`EmbedSource.abort`): an offered embedding is freed,
    a prefill's waiting registration gets an error, other calls' rooms stay, and the aborted
    req_id is refused if its `/encode` comes late. The bootstrap timeout is long (60 s), so
    what is gone was gone by the abort."""
    emb = np.ones((16, 64), dtype=np.float32)

    async def body(src, addr, counts):
        rx = _ctx(60)
        src.track("encode-r1-0", [1])
        src.offer(1, "h1", emb)                      # offered, nobody registered yet
        src.track("encode-r1-1", [2])                # still encoding; the prefill already waits
        waiter = asyncio.create_task(embed_receive(rx, addr, 2, "h2", (16, 64)))
        src.track("encode-r2-0", [3])
        src.offer(3, "h3", emb)                      # another request's: must stay
        for _ in range(200):
            if 2 in src.claimed:
                break
            await asyncio.sleep(0.01)
        assert src.pending == 3
        dropped = src.abort(lambda req: req.startswith("encode-r1"))
        with pytest.raises(EngineError) as aborted:
            await asyncio.wait_for(waiter, 10)
        for _ in range(200):
            if src.pending == 1:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineError) as late:
            src.track("encode-r1-0", [4])
        return dropped, str(aborted.value), src.pending, sorted(src.slots), late.value.code

    dropped, aborted, pending, rooms, late = asyncio.run(_with_source(60, body))
    assert dropped == 2 and "aborted" in aborted
    assert pending == 1 and rooms == [3]
    assert late == "aborted"


def test_a_registration_whose_prefill_hangs_up_is_dropped_at_once():
    """A prefill registered for a room and was then aborted (it closed its connection) before
    any embedding came, and no `/abort_request` reached the encode worker for that room (it
    came before the registration, or the encode call was never tracked): the registration is
    dropped when the connection closes, not at the bootstrap timeout (60 s here)."""
    async def body(src, addr, counts):
        rx = _ctx(60)
        waiter = asyncio.create_task(embed_receive(rx, addr, 5, "h5", (16, 64)))
        for _ in range(200):
            if 5 in src.claimed:
                break
            await asyncio.sleep(0.01)
        assert src.pending == 1 and 5 in src.claimed
        waiter.cancel()  # the prefill's request was aborted: its side closes the connection
        with pytest.raises(asyncio.CancelledError):
            await waiter
        for _ in range(500):
            if src.pending == 0:
                break
            await asyncio.sleep(0.01)
        return src.pending, sorted(src.claimed)

    assert asyncio.run(_with_source(60, body)) == (0, [])


def test_an_abort_that_overtakes_its_encode_call_refuses_it_later():
    """The gateway gave an attempt up while its `/encode` was still on the way: the abort came
    first and found no room of that req_id. The call is refused when it comes (for the
    bootstrap timeout), so it offers no embedding that nobody will collect; abort_all
    (no rid) refuses nothing later."""
    async def body(src, addr, counts):
        assert src.abort(lambda req: req.startswith("encode-r9-0"), "encode-r9-0") == 0
        with pytest.raises(EngineError) as late:
            src.track("encode-r9-0", [11])
        src.track("encode-r8-0", [12])  # another request's call is taken
        src.abort(lambda req: False, None)
        src.track("encode-r7-0", [13])
        return late.value.code, sorted(src.req_of.values())

    assert asyncio.run(_with_source(60, body)) == ("aborted", ["encode-r7-0", "encode-r8-0"])
