"""A deterministic stand-in for a model, and the engines' response shapes.

Token i of the output depends only on the prompt, so a PD path (first token from the prefill,
the rest from the decode) must produce exactly what a single regular worker produces.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
DEFAULT_MAX_TOKENS = 16


class BadRequest(Exception):
    """The client (or gateway) sent something an engine would reject with 4xx."""


def tokenize(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 50000 for w in text.split()] or [0]


def prompt_key(ids: list[int]) -> int:
    return zlib.crc32(json.dumps(ids).encode())


def token(ids: list[int], i: int) -> tuple[int, str]:
    """Output token i for a prompt: (id, text)."""
    k = (prompt_key(ids) + 7919 * i) % len(WORDS)
    return k, " " + WORDS[k]


@dataclass
class Item:
    """One sequence to generate: a prompt of a batch, times n."""

    prompt_ids: list[int]
    max_tokens: int
    index: int
    first_token: tuple[int, str] | None = None  # delivered by a KV transfer
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def tokens(self, count: int | None = None) -> list[tuple[int, str]]:
        n = self.max_tokens if count is None else count
        out = [token(self.prompt_ids, i) for i in range(n)]
        if self.first_token is not None and out:
            out[0] = self.first_token
        return out


def _as_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer")
    return value


def parse_items(api: str, body: Any) -> list[Item]:
    """The sequences a request asks for, validated like an engine would."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if api == "generate":
        sp = body.get("sampling_params") or {}
        max_tokens = _as_int(sp.get("max_new_tokens", DEFAULT_MAX_TOKENS), "max_new_tokens")
        n = _as_int(sp.get("n", 1), "n")
        if "text" in body:
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            prompts = [tokenize(str(t)) for t in texts]
        elif "input_ids" in body:
            ids = body["input_ids"]
            prompts = ids if ids and isinstance(ids[0], list) else [ids]
        else:
            raise BadRequest("text or input_ids is required")
    elif api == "completions":
        if "prompt" not in body:
            raise BadRequest("prompt is required")
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]  # one prompt as token ids
        elif isinstance(prompt, list):
            prompts = [p if isinstance(p, list) else tokenize(str(p)) for p in prompt]
        else:
            prompts = [tokenize(str(prompt))]
        max_tokens = _as_int(body.get("max_tokens") or DEFAULT_MAX_TOKENS, "max_tokens")
        n = _as_int(body.get("n", 1), "n")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)
        prompts = [tokenize(text)]
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        max_tokens = _as_int(limit, "max_tokens")
        n = _as_int(body.get("n", 1), "n")
    return [Item(p, max_tokens, i * n + j) for i, p in enumerate(prompts) for j in range(n)]


def is_batch(api: str, body: dict[str, Any]) -> bool:
    if api == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        return isinstance(text, list) or bool(ids and isinstance(ids[0], list))
    return False


def input_logprobs(item: Item, side: str) -> list[list[Any]]:
    """SGLang `input_token_logprobs`: the prefill has the prompt's; the decode adds one entry."""
    if side == "decode":
        return [[-0.5, item.prompt_ids[-1], None]]
    return [[None if j == 0 else -1.0 - j / 100, t, None] for j, t in enumerate(item.prompt_ids)]


def generate_object(item: Item, produced: list[tuple[int, str]], finished: bool, rid: str,
                    logprob_side: str | None, prefill_only: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": None,
        "prompt_tokens": len(item.prompt_ids),
        "completion_tokens": len(produced),
        "cached_tokens": item.cached_tokens,
    }
    if finished:
        length = 0 if prefill_only else len(produced)
        meta["finish_reason"] = {"type": "length", "length": length}
    if logprob_side:
        meta["input_token_logprobs"] = input_logprobs(item, logprob_side)
        meta["output_token_logprobs"] = [[-0.25, t, None] for t, _ in produced]
    return {"text": "".join(s for _, s in produced), "output_ids": [t for t, _ in produced], "meta_info": meta}


def usage(items: list[Item], produced: int) -> dict[str, Any]:
    prompt = sum(len(i.prompt_ids) for i in items)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": produced,
        "total_tokens": prompt + produced,
        "prompt_tokens_details": {"cached_tokens": sum(i.cached_tokens for i in items)},
    }


def openai_object(api: str, model: str, rid: str, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
    kind = {"completions": "text_completion", "chat": "chat.completion"}[api]
    if chunk and api == "chat":
        kind = "chat.completion.chunk"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def openai_choice(api: str, index: int, text: str, finish: str | None, chunk: bool, first: bool = False) -> dict[str, Any]:
    if api == "completions":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if chunk:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def new_id(api: str) -> str:
    prefix = {"completions": "cmpl", "chat": "chatcmpl", "generate": ""}[api]
    return f"{prefix}-{uuid.uuid4().hex}" if prefix else uuid.uuid4().hex


def expected_text(api: str, body: dict[str, Any]) -> list[str]:
    """What any correct path (regular or PD) returns for `body`, one string per item."""
    return ["".join(s for _, s in item.tokens()) for item in parse_items(api, body)]
