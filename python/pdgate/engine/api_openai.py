"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models`."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from . import api_ec
from .ec_connector import transfer_params
from .http_common import SSE, error_response, fault_kill_point, first_error, read_json, wait_all, watch
from .items import GenItem, bootstrap_fields, ec_params, item_rid, kv_params
from .multimodal import chat_inputs, encode_items, has_images
from .outputs import finish_reason_openai, usage, visible_text
from .sampling import BadRequest, params_from_dict
from .sequence import EngineError, Seq
from .tokenizer import chat_prompt

CHAT_DEFAULT_MAX_TOKENS = 256


def _sampling(body: dict, max_default: int, chat: bool) -> dict:
    mt = body.get("max_completion_tokens") if chat else None
    mt = mt if mt is not None else body.get("max_tokens")
    d = {"max_new_tokens": max_default if mt is None else mt}
    for k in ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "ignore_eos",
              "stop_token_ids", "skip_special_tokens"):
        if body.get(k) is not None:
            d[k] = body[k]
    if not isinstance(d["max_new_tokens"], int) or isinstance(d["max_new_tokens"], bool):
        raise BadRequest("max_tokens must be an integer", "max_tokens")
    return d


def _prompt_ids(tok, body: dict) -> list[list[int]]:
    p = body.get("prompt")
    if isinstance(p, str):
        return [tok.encode(p)]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [tok.encode(x) for x in p]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [p]
        if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p):
            return p
    raise BadRequest("prompt must be a string, a list of strings, or token ids", "prompt")


def _items(body: dict, prompts: list[list[int]], sp: dict, rid_base: str, lp: tuple[bool, int],
           images: list | None = None, enc: dict | None = None):
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise BadRequest("n must be an integer in [1, 64]", "n")
    total = len(prompts) * n
    kvp = kv_params(body, total)
    ec_params(body)
    if enc and total != 1:  # one room is one delivery: it cannot feed several choices
        raise BadRequest("encode_bootstrap_info supports n=1", "encode_bootstrap_info")
    items = []
    for i in range(total):
        pi, c = divmod(i, n)
        d = dict(sp)
        if isinstance(d.get("seed"), int) and c:
            d["seed"] += c
        items.append(GenItem(rid=_item_rid(body, rid_base, i, total), input_ids=list(prompts[pi]),
                             params=params_from_dict(d), return_logprob=lp[0], top_logprobs_num=lp[1], input_logprobs=False,
                             kv_transfer_params=kvp, images=list(images or []), encode_items=enc,
                             **bootstrap_fields(body, i, total)))
    return items, n


def _item_rid(body: dict, rid_base: str, i: int, n: int) -> str:
    """SGLang's OpenAI endpoints take the request id from the body's `rid` (the gateway puts
    the same one on both PD legs, so `/abort_request` finds them); otherwise vLLM's
    `{cmpl|chatcmpl}-{X-Request-Id}-{i}`."""
    rid = body.get("rid")
    if isinstance(rid, str) and rid:
        return item_rid(rid, rid_base, i, n)
    return f"{rid_base}-{i}"


def _rid_base(request: web.Request, prefix: str) -> str:
    return f"{prefix}-{request.headers.get('X-Request-Id') or uuid.uuid4().hex}"


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


def _parse(engine, request, body: dict, chat: bool):
    tok = engine.tokenizer
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("messages must be a non-empty list of objects", "messages")
        images: list = []
        if has_images(msgs):
            ids, images = chat_inputs(tok, engine.cfg, msgs)
            prompts = [ids]
        else:
            prompts = [tok.encode(chat_prompt(msgs))]
        enc = encode_items(body, len(images))
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise BadRequest("top_logprobs must be an integer in [0, 20]", "top_logprobs")
        lp = (bool(body.get("logprobs")), top if body.get("logprobs") else 0)
        sp = _sampling(body, CHAT_DEFAULT_MAX_TOKENS, True)
    else:
        if body.get("echo"):
            raise BadRequest("echo is not supported by the reference engine", "echo")
        prompts = _prompt_ids(tok, body)
        k = body.get("logprobs")
        if k is not None and (not isinstance(k, int) or not 0 <= k <= 20):
            raise BadRequest("logprobs must be an integer in [0, 20]", "logprobs")
        lp = (k is not None, k or 0)
        sp = _sampling(body, 16, False)
    prefix = "chatcmpl" if chat else "cmpl"
    if chat:
        return _items(body, prompts, sp, _rid_base(request, prefix), lp, images, enc)
    return _items(body, prompts, sp, _rid_base(request, prefix), lp)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app["engine"]
    seqs: list[Seq] = []
    try:
        body = await read_json(request)
        items, n = _parse(engine, request, body, chat)
        rid = body.get("rid")
        ctx = {"id": rid if isinstance(rid, str) and rid else items[0].rid.rsplit("-", 1)[0],
               "created": int(time.time()),
               "model": body.get("model") or engine.served_name, "chat": chat, "n": n,
               "token_ids": body.get("return_token_ids") is True}
        if engine.ec_encode_only:  # vLLM's encoder instance: embeds the images, generates nothing
            return await api_ec.answer(request, engine, items, body, ctx)
        seqs = [engine.submit(it) for it in items]
        if body.get("stream"):
            return await _stream(request, engine, seqs, body, ctx)
        if engine.config.fault_kill_after_tokens or engine.config.fault_drop_after_tokens:
            async for _ in watch(seqs):
                fault_kill_point(engine, seqs, request)
        await wait_all(seqs)
        err = first_error(seqs)
        if err is not None:
            return error_response(err)
        return web.json_response(_full(engine, seqs, ctx))
    except (BadRequest, EngineError) as e:
        return error_response(e)
    finally:
        for s in seqs:
            engine.abort(s)


def _logprobs(engine, seq: Seq, start: int, chat: bool):
    if not seq.return_logprob:
        return None
    tok = engine.tokenizer
    ids, lps, tops = seq.output_ids[start:], seq.output_logprobs[start:], seq.output_top[start:]
    if chat:
        def one(t, lp):
            s = tok.token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
        return {"content": [dict(one(t, lp), top_logprobs=[one(tt, tl) for tl, tt in top])
                            for t, lp, top in zip(ids, lps, tops)]}
    return {"tokens": [tok.token_text(t) for t in ids], "token_logprobs": lps,
            "top_logprobs": [{tok.token_text(tt): tl for tl, tt in top} for top in tops] if seq.top_logprobs_num else None,
            "text_offset": []}


def _full(engine, seqs: list[Seq], ctx: dict) -> dict:
    chat, choices = ctx["chat"], []
    for i, s in enumerate(seqs):
        text = visible_text(engine.tokenizer, s, True, engine.config.api_flavor == "vllm")
        c = {"index": i, "logprobs": _logprobs(engine, s, 0, chat), "finish_reason": finish_reason_openai(s)}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        if ctx["token_ids"]:  # vLLM's return_token_ids: the ids on each choice
            c["token_ids"] = list(s.output_ids)
            if not chat:
                c["prompt_token_ids"] = list(s.tokens[:s.prompt_len])
        choices.append(c)
    out = {"id": ctx["id"], "object": "chat.completion" if chat else "text_completion",
           "created": ctx["created"], "model": ctx["model"], "choices": choices,
           "usage": usage(seqs, ctx["n"])}
    if chat and ctx["token_ids"]:  # chat: the prompt ids at the top level, as vLLM
        out["prompt_token_ids"] = list(seqs[0].tokens[:seqs[0].prompt_len])
    if seqs[0].kv_transfer_params is not None:
        out["kv_transfer_params"] = seqs[0].kv_transfer_params
    if chat and engine.ec is not None and engine.ec.producer:  # ec_both: vLLM's producer answer field
        out["ec_transfer_params"] = transfer_params(seqs[0].images)
    return out


async def _stream(request, engine, seqs: list[Seq], body: dict, ctx: dict):
    sse, chat = SSE(request), ctx["chat"]
    sent_text, sent_tok = [""] * len(seqs), [0] * len(seqs)
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(choices: list, **extra) -> dict:
        return {"id": ctx["id"], "object": obj, "created": ctx["created"], "model": ctx["model"],
                "choices": choices, **extra}

    role_sent = [False] * len(seqs)
    ids_wanted = ctx["token_ids"]
    async for i in watch(seqs):
        s = seqs[i]
        if s.error is not None:
            if sse.resp is None and all(x.error is not None for x in seqs):
                return error_response(s.error)
            await sse.send({"error": {"message": str(s.error), "type": "server_error", "code": s.error.code}})
            continue
        # One snapshot of the sequence before any await: it grows (and may finish) while a
        # write waits on a slow client, and text, ids and finish must describe the same state
        # (`watch` yields it again for what came meanwhile).
        text = visible_text(engine.tokenizer, s, False, engine.config.api_flavor == "vllm")
        delta, lp = text[len(sent_text[i]):], _logprobs(engine, s, sent_tok[i], chat)
        new_tokens = len(s.output_ids) > sent_tok[i]
        new_ids = s.output_ids[sent_tok[i]:]
        reason = finish_reason_openai(s)
        sent_text[i], sent_tok[i] = text, sent_tok[i] + len(new_ids)
        prompt_ids = list(s.tokens[:s.prompt_len]) if ids_wanted and not role_sent[i] else None
        if chat and not role_sent[i]:  # OpenAI order: the role first, before any content
            role_sent[i] = True
            extra = {"prompt_token_ids": prompt_ids} if prompt_ids is not None else {}
            await sse.send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}], **extra))
            prompt_ids = None
        # With return_token_ids every new token goes out at once, with or without visible text,
        # so a reader always holds the ids of exactly the text it got.
        if delta or reason or (lp and new_tokens) or (ids_wanted and new_tokens):
            c = {"index": i, "logprobs": lp, "finish_reason": reason}
            if chat:
                c["delta"] = {"content": delta} if delta else {}
            else:
                c["text"] = delta
            if ids_wanted:
                c["token_ids"] = list(new_ids)
                if prompt_ids is not None:
                    c["prompt_token_ids"] = prompt_ids
                    role_sent[i] = True
            extra = {}
            if reason and s.kv_transfer_params is not None:
                extra["kv_transfer_params"] = s.kv_transfer_params
            await sse.send(chunk([c], **extra))
            fault_kill_point(engine, [s], request)
    if include_usage:
        await sse.send(chunk([], usage=usage(seqs, ctx["n"])))
    return await sse.finish()


async def models(request: web.Request) -> web.Response:
    e = request.app["engine"]
    return web.json_response({"object": "list", "data": [{
        "id": e.served_name, "object": "model", "created": int(e.started_at),
        "owned_by": e.owned_by, "root": e.config.model, "max_model_len": e.cfg.max_position}]})
