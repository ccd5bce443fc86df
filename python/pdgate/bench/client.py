"""Send one request to an OpenAI-compatible endpoint and time it at the client.

TTFT is send → first non-empty content chunk; each later content chunk adds one inter-token gap
(ITL); E2E is send → end of the response. Without streaming the client cannot see the first
token, so TTFT is reported equal to E2E and there are no gaps (said in docs/placement.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .dataset import SampleRequest

__all__ = ["RequestOutput", "RequestSpec", "build_body", "send_request"]


@dataclass(frozen=True)
class RequestSpec:
    url: str               # base URL + endpoint
    model: str
    chat: bool
    stream: bool
    ignore_eos: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    # Which stream chunks time a token (TTFT, ITL): "text", those that carry text (a token the
    # client can show); "choices", every chunk with a non-empty `choices`, text or not, as `vllm
    # bench serve` counts (vllm/benchmarks/lib/endpoint_request_func.py). They differ where a
    # server sends empty-text chunks: vLLM holding the bytes of an unfinished UTF-8 character,
    # a chat stream's role chunk, a last chunk with only `finish_reason`.
    chunk_timing: str = "text"


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0          # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0       # E2E, seconds
    start_time: float = 0.0    # perf_counter at send
    status: int | None = None  # HTTP status, None when no response arrived
    error: str = ""
    error_kind: str = ""       # "" on success; e.g. http_429:overloaded, timeout, connect, stream
    images: int = 0            # EPD: images the request carried


def build_body(spec: RequestSpec, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model, "max_tokens": req.output_len, "stream": spec.stream}
    if spec.chat and req.images:
        parts = [{"type": "text", "text": req.prompt}]
        parts += [{"type": "image_url", "image_url": {"url": u}} for u in req.images]
        body["messages"] = [{"role": "user", "content": parts}]
    elif spec.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    elif req.images:
        raise ValueError("images need the chat endpoint (--endpoint /v1/chat/completions)")
    else:
        body["prompt"] = req.prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


def _content(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _error_kind(status: int, body: bytes) -> str:
    code = ""
    try:
        err = json.loads(body).get("error") or {}
        code = str(err.get("code") or err.get("type") or "")
    except (ValueError, AttributeError):
        pass
    return f"http_{status}:{code}" if code else f"http_{status}"


def _apply_usage(out: RequestOutput, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens"):
        out.prompt_len = int(usage["prompt_tokens"])


async def _read_stream(resp: httpx.Response, spec: RequestSpec, out: RequestOutput) -> None:
    last = out.start_time
    chunks, first = 0, True  # chunks with text: the token count when the server sends no usage
    usage = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise _StreamError(str(chunk["error"]))
        usage = chunk.get("usage") or usage
        has_text = bool(_content(chunk, spec.chat))
        timed = bool(chunk.get("choices")) if spec.chunk_timing == "choices" else has_text
        if timed:
            now = time.perf_counter()
            if first:
                out.ttft = now - out.start_time
                first = False
            else:
                out.itl.append(now - last)
            last = now
        chunks += has_text
    out.output_tokens = chunks
    _apply_usage(out, usage)


class _StreamError(Exception):
    pass


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, req: SampleRequest,
                       timeout_s: float) -> RequestOutput:
    """Never raises for a failed request: the failure is the output's `error_kind`."""
    out = RequestOutput(prompt_len=req.prompt_len, images=len(req.images))
    out.start_time = time.perf_counter()
    try:
        async with client.stream("POST", spec.url, json=build_body(spec, req), headers=spec.headers,
                                 timeout=timeout_s) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error_kind = _error_kind(resp.status_code, await resp.aread())
                out.error = out.error_kind
            elif spec.stream:
                await _read_stream(resp, spec, out)
            else:
                body = json.loads(await resp.aread())
                out.output_tokens = len(_content(body, spec.chat) or "") if not body.get("usage") else 0
                _apply_usage(out, body.get("usage"))
        out.latency = time.perf_counter() - out.start_time
        if not spec.stream:
            out.ttft = out.latency
        if not out.error_kind and spec.stream and out.output_tokens == 0 and out.ttft == 0.0:
            out.error_kind, out.error = "empty_stream", "the stream ended without a content token"
    except httpx.TimeoutException as exc:
        out.error_kind, out.error = "timeout", f"timeout: {exc!r}"
    except httpx.ConnectError as exc:
        out.error_kind, out.error = "connect", f"connect: {exc!r}"
    except (httpx.HTTPError, _StreamError, ValueError) as exc:
        out.error_kind, out.error = "stream", f"{type(exc).__name__}: {exc}"
    out.success = not out.error_kind
    if not out.success:
        out.latency = time.perf_counter() - out.start_time
    return out
