"""SGLang's native `POST /generate`."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from .http_common import SSE, error_response, fault_kill_point, first_error, read_json, wait_all, watch
from .items import GenItem, bootstrap_fields, item_rid, kv_params
from .outputs import native_logprobs, visible_text
from .sampling import BadRequest, params_from_dict
from .sequence import EngineError, Seq


def _prompts(tok, body: dict) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("give either text or input_ids, not both", "text")
    if text is not None:
        if isinstance(text, str):
            return [tok.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tok.encode(t) for t in text], True
        raise BadRequest("text must be a string or a non-empty list of strings", "text")
    if ids is not None:
        if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
            return [ids], False
        if isinstance(ids, list) and ids and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in ids):
            return ids, True
        raise BadRequest("input_ids must be a list of integers or a list of such lists", "input_ids")
    raise BadRequest("one of text or input_ids is required", "text")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_generate(tok, body: dict) -> tuple[list[GenItem], bool]:
    prompts, batch = _prompts(tok, body)
    sp = body.get("sampling_params") or {}
    if isinstance(sp, list) and len(sp) != len(prompts):
        raise BadRequest("sampling_params list must match the prompts", "sampling_params")
    if not isinstance(sp, (dict, list)) or (isinstance(sp, list) and not all(isinstance(x, dict) for x in sp)):
        raise BadRequest("sampling_params must be an object", "sampling_params")
    top = body.get("top_logprobs_num") or 0
    if not _is_int(top) or not 0 <= top <= 20:
        raise BadRequest("top_logprobs_num must be an integer in [0, 20]", "top_logprobs_num")
    n = (sp[0] if isinstance(sp, list) else sp).get("n", 1) if sp else 1
    if not _is_int(n) or not 1 <= n <= 64:
        raise BadRequest("n must be an integer in [1, 64]", "n")
    total = len(prompts) * n
    rids = body.get("rid")
    base = uuid.uuid4().hex
    kvp = kv_params(body, total)
    items = []
    for i in range(total):
        pd, c = divmod(i, n)
        d = dict(sp[pd] if isinstance(sp, list) else sp)
        if _is_int(d.get("seed")) and c:
            d["seed"] += c
        rid = rids[i] if isinstance(rids, list) and i < len(rids) else item_rid(
            rids if isinstance(rids, str) and rids else None, base, i, total)
        items.append(GenItem(
            rid=str(rid), input_ids=list(prompts[pd]), params=params_from_dict(d),
            return_logprob=bool(body.get("return_logprob", False)),
            top_logprobs_num=top,
            kv_transfer_params=kvp, **bootstrap_fields(body, i, total)))
    return items, batch or total > 1


def native_result(engine, seq: Seq, body: dict, index: int | None) -> dict:
    meta = {"id": seq.rid, "finish_reason": seq.finish_reason, "prompt_tokens": seq.prompt_len,
            "completion_tokens": len(seq.output_ids), "cached_tokens": seq.cached_tokens,
            "e2e_latency": round(time.monotonic() - seq.created, 6)}
    meta.update(seq.meta_extra)
    if seq.return_logprob:
        meta.update(native_logprobs(engine.tokenizer, seq, bool(body.get("return_text_in_logprobs"))))
    # The vLLM flavour's text is what vLLM's detokenizer sends, on every route (`released_text`).
    out = {"text": visible_text(engine.tokenizer, seq, False, engine.config.api_flavor == "vllm"), "output_ids": list(seq.output_ids),
           "meta_info": meta}
    if seq.kv_transfer_params is not None:
        out["kv_transfer_params"] = seq.kv_transfer_params
    if index is not None:
        out["index"] = index
    return out


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app["engine"]
    seqs: list[Seq] = []
    try:
        body = await read_json(request)
        items, batch = parse_generate(engine.tokenizer, body)
        seqs = [engine.submit(it) for it in items]
        if body.get("stream"):
            return await _stream(request, engine, seqs, body, batch)
        if engine.config.fault_kill_after_tokens or engine.config.fault_drop_after_tokens:
            async for _ in watch(seqs):
                fault_kill_point(engine, seqs, request)
        await wait_all(seqs)
        err = first_error(seqs)
        if err is not None:
            return error_response(err)
        results = [native_result(engine, s, body, None) for s in seqs]
        return web.json_response(results if batch else results[0])
    except (BadRequest, EngineError) as e:
        return error_response(e)
    finally:
        for s in seqs:
            engine.abort(s)


async def _stream(request, engine, seqs: list[Seq], body: dict, batch: bool):
    sse = SSE(request)
    sent = [0] * len(seqs)
    async for i in watch(seqs):
        s = seqs[i]
        if s.error is not None:
            if sse.resp is None and all(x.error is not None for x in seqs):
                return error_response(s.error)
            await sse.send({"error": {"message": str(s.error), "type": "server_error",
                                      "code": s.error.code}, "index": i})
            continue
        if len(s.output_ids) > sent[i] or s.finished:
            sent[i] = len(s.output_ids)
            await sse.send(native_result(engine, s, body, i if batch else None))
            fault_kill_point(engine, [s], request)
    return await sse.finish()
