"""The OpenAI answers of vLLM's encoder-only instance (`--ec-transfer-config` ec_role ec_producer).

vLLM's disaggregated-encoder proxy sends each image to the encoder as a chat request of its own;
the encoder runs the vision tower, writes the embeddings to the shared storage
(`ec_connector.py`) and stops once the prompt is consumed, without sampling a token. So the
answer is HTTP 200 with empty content, `finish_reason` "stop", `completion_tokens` 0, and the
top-level `ec_transfer_params` (one entry per distinct image: `{"item_indices": [...],
"metadata": {}}`). A text-only request, or `/v1/completions`, is answered the same empty way
(with `ec_transfer_params` null). A stream is the role chunk, a final chunk with `finish_reason`
"stop", the usage chunk when `stream_options.include_usage` asks for it, and `[DONE]`; like
vLLM's streams, it carries no `ec_transfer_params`.
"""

from __future__ import annotations

from aiohttp import web

from .http_common import SSE
from .items import GenItem


def _usage(items: list[GenItem], n: int) -> dict:
    prompt = sum(len(it.input_ids) for it in items[::n])  # with n choices the prompt counts once
    return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def answer(request: web.Request, engine, items: list[GenItem], body: dict, ctx: dict) -> web.StreamResponse:
    """Embed and store the request's images (`Engine.encode_only`: a failure to write them is
    an error answer, raised before any byte is sent), then answer without a token."""
    params = engine.encode_only(items)
    if body.get("stream"):
        return await _stream(request, items, body, ctx)
    chat = ctx["chat"]
    choices = []
    for i in range(len(items)):
        c: dict = {"index": i, "logprobs": None, "finish_reason": "stop"}
        if chat:
            c["message"] = {"role": "assistant", "content": ""}
        else:
            c["text"] = ""
        if ctx["token_ids"]:
            c["token_ids"] = []
            if not chat:
                c["prompt_token_ids"] = list(items[i].input_ids)
        choices.append(c)
    out = {"id": ctx["id"], "object": "chat.completion" if chat else "text_completion",
           "created": ctx["created"], "model": ctx["model"], "choices": choices,
           "usage": _usage(items, ctx["n"])}
    if chat and ctx["token_ids"]:
        out["prompt_token_ids"] = list(items[0].input_ids)
    out["kv_transfer_params"] = None
    out["ec_transfer_params"] = params
    return web.json_response(out)


async def _stream(request: web.Request, items: list[GenItem], body: dict, ctx: dict) -> web.StreamResponse:
    sse, chat = SSE(request), ctx["chat"]
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list, **extra) -> dict:
        return {"id": ctx["id"], "object": obj, "created": ctx["created"], "model": ctx["model"],
                "choices": choices, **extra}

    for i in range(len(items)):
        if chat:
            await sse.send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]))
            last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": "stop"}
        else:
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": "stop"}
        await sse.send(chunk([last]))
    if (body.get("stream_options") or {}).get("include_usage"):
        await sse.send(chunk([], usage=_usage(items, ctx["n"])))
    return await sse.finish()
