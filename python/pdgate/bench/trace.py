"""Read a JSONL trace: one request per line, with an optional arrival time.

Accepted field names (the first present wins), so that pdgate's own `--request-log` lines, vLLM
custom datasets and hand-written traces all replay:

- arrival, relative seconds: `arrival_s`, `offset_s`, `timestamp`; relative milliseconds:
  `arrival_ms`, `offset_ms`; absolute unix seconds: `arrival_time`, `arrival_unix_s`,
  `arrival_unix`; absolute unix milliseconds: `arrival_unix_ms`. Offsets are taken relative to the
  earliest line, so absolute and relative times replay the same way.
- prompt: `prompt` (text), `messages` (chat; their text is joined), or a token count:
  `prompt_tokens`, `input_tokens`, `input_len`, `prompt_len`.
- output tokens: `output_tokens`, `completion_tokens`, `output_len`, `max_tokens`.

pdgate's `--request-log` lines (docs/goodput.md) carry `arrival_unix_s`, `prompt_tokens` and
`output_tokens`. A logged request that failed before its engine reported the prompt's length
(`prompt_tokens` null, no prompt text: the log never holds prompts) cannot be replayed and is
skipped; tests/bench/test_bench_dataset.py and tests/gateway/test_goodput_e2e.py read real lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["TraceLine", "TraceError", "parse_trace_line", "read_trace"]

_RELATIVE_S = ("arrival_s", "offset_s", "timestamp")
_RELATIVE_MS = ("arrival_ms", "offset_ms")
_ABSOLUTE_S = ("arrival_time", "arrival_unix_s", "arrival_unix")
_ABSOLUTE_MS = ("arrival_unix_ms",)
_PROMPT_COUNT = ("prompt_tokens", "input_tokens", "input_len", "prompt_len")
_OUTPUT_COUNT = ("output_tokens", "completion_tokens", "output_len", "max_tokens")


class TraceError(ValueError):
    """A trace line that cannot be replayed (the message names the line)."""


@dataclass(frozen=True)
class TraceLine:
    arrival_s: float | None
    prompt: str | None
    prompt_tokens: int | None
    output_tokens: int | None


def _first(obj: dict[str, Any], names: Iterable[str]) -> Any:
    for name in names:
        value = obj.get(name)
        if value is not None:
            return value
    return None


def _arrival(obj: dict[str, Any]) -> float | None:
    for names, scale in ((_RELATIVE_S, 1.0), (_RELATIVE_MS, 1e-3), (_ABSOLUTE_S, 1.0), (_ABSOLUTE_MS, 1e-3)):
        value = _first(obj, names)
        if value is not None:
            return float(value) * scale
    return None


def _count(obj: dict[str, Any], names: Iterable[str], what: str) -> int | None:
    value = _first(obj, names)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise TraceError(f"{what} must be a non-negative number, got {value!r}")
    return int(value)


def parse_trace_line(text: str) -> TraceLine:
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise TraceError("a trace line must be a JSON object")
    prompt = obj.get("prompt")
    if prompt is None and isinstance(obj.get("messages"), list):
        prompt = "\n".join(str(m.get("content", "")) for m in obj["messages"] if isinstance(m, dict))
    if prompt is not None and not isinstance(prompt, str):
        raise TraceError("prompt must be text")
    line = TraceLine(_arrival(obj), prompt, _count(obj, _PROMPT_COUNT, "prompt tokens"),
                     _count(obj, _OUTPUT_COUNT, "output tokens"))
    if line.prompt is None and line.prompt_tokens is None:
        raise TraceError("a trace line needs a prompt or a prompt token count")
    return line


def _unreplayable_log_line(text: str) -> bool:
    """A request-log line whose prompt length is unknown (the request failed early)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and "slo_result" in obj and obj.get("prompt_tokens") is None
            and obj.get("prompt") is None)


def read_trace(path: str) -> list[TraceLine]:
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip() or _unreplayable_log_line(text):
                continue
            try:
                lines.append(parse_trace_line(text))
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{number}: {exc}") from None
    return lines
