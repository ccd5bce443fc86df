"""Tool calls through pdgate to real vLLM (NIXL PD), on the three APIs, with the official SDKs:
chat completions (`openai`), the Messages API (`anthropic`: `tools`, `tool_choice`, `tool_use`
out, `tool_result` in the next turn) and the Responses API (`openai`: function tools,
`function_call` out, `function_call_output` with `previous_response_id`). Each tool call equals
the one real vLLM colocated makes for the same conversation, and each answer after a tool result
equals the colocated chat answer, on greedy decoding.

Two ways vLLM makes tool calls, both used (the fleet's workers run with
`--enable-auto-tool-choice --tool-call-parser pythonic` and xgrammar without free whitespace:
conftest.py):
- `tool_choice: auto` goes through vLLM's tool parser: the model writes a pythonic call,
  `[get_weather(city="Paris", unit="c")]`, and `PythonicToolParser` turns it into `tool_calls`.
  A random-weight model writes that only when told to, so these requests carry vLLM's
  `structured_outputs: {"regex": ...}` (chat's and Responses' engine extensions): the call's
  text is constrained, its parsing is vLLM's own.
- A named `tool_choice` (Messages' `{"type": "tool"}`) is vLLM's structured output for that
  function's parameters: the JSON arguments come straight from the grammar, no parser.
The parameters are enums, so each call is a few tokens whatever the weights are.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.real_vllm.conftest import DEADLINE_S, MODEL

pytestmark = pytest.mark.timeout(1200)

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
DESCRIPTION = "The weather in a city"
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}]
# What the pythonic parser reads; vLLM's regex constraint makes the model write it.
PYTHONIC_CALL = {"structured_outputs": {"regex": r'\[get_weather\(city="(Paris|Oslo|Lima)", unit="(c|f)"\)\]'}}
# The anthropic SDK has no sampling parameters of its own; the API takes them.
GREEDY = {"temperature": 0}
QUESTION = "What is the weather in Paris?"
RESULT = "sunny, 21 C"
CALL_MAX_TOKENS = 48
ANSWER_MAX_TOKENS = 8


def _openai(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)


def _calls(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _colocated_call(fleet, **choice: Any) -> tuple[str, str, dict]:
    """Real vLLM colocated: the tool call it makes for QUESTION, as (id, name, arguments)."""
    r = _openai(fleet.colocated.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS, temperature=0,
        max_tokens=CALL_MAX_TOKENS, **choice)
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1, r
    return calls[0].id, calls[0].function.name, json.loads(calls[0].function.arguments)


def _colocated_answer_after(fleet, call_id: str, name: str, arguments: dict) -> str:
    """Real vLLM colocated: the text after the tool's result, the conversation spelt as chat."""
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]
    r = _openai(fleet.colocated.url).chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                                            temperature=0, max_tokens=ANSWER_MAX_TOKENS)
    return r.choices[0].message.content or ""


def test_chat_tool_calls_through_vllms_parser_equal_colocated(fleet):
    _, name, arguments = _colocated_call(fleet, tool_choice="auto", extra_body=PYTHONIC_CALL)
    assert name == "get_weather" and set(arguments) == {"city", "unit"}, arguments
    client = _openai(fleet.url)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
                                         tool_choice="auto", temperature=0, max_tokens=CALL_MAX_TOKENS, extra_body=PYTHONIC_CALL)
    assert got.choices[0].finish_reason == "tool_calls", got
    assert _calls(got.choices[0].message) == [(name, arguments)]
    # Streamed: vLLM's parser streams the call in deltas; pdgate relays them as they come.
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
                                            tool_choice="auto", temperature=0, max_tokens=CALL_MAX_TOKENS, stream=True,
                                            extra_body=PYTHONIC_CALL)
    names, args, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    args += call.function.arguments
            finish = choice.finish_reason or finish
    assert (names, json.loads(args), finish) == ([name], arguments, "tool_calls")


def test_messages_tool_use_then_tool_result_equal_colocated(fleet):
    """`tool_choice: {"type": "tool"}` is OpenAI's named choice; vLLM answers it with the
    function's JSON arguments (and finish_reason `stop`, which pdgate's Messages answer still
    calls `tool_use`, as Anthropic does for a turn that ends in a call)."""
    _, name, arguments = _colocated_call(fleet, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    client = anthropic.Anthropic(base_url=fleet.url, api_key="none", timeout=DEADLINE_S, max_retries=0)
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}]
    question = [{"role": "user", "content": QUESTION}]
    got = client.messages.create(model=MODEL, max_tokens=CALL_MAX_TOKENS, extra_body=GREEDY, tools=tools,
                                 tool_choice={"type": "tool", "name": "get_weather"}, messages=question)
    uses = [b for b in got.content if b.type == "tool_use"]
    assert got.stop_reason == "tool_use", got
    assert [(u.name, u.input) for u in uses] == [(name, arguments)], got
    # The next turn: the tool's result, answered as colocated vLLM answers the same chat.
    use = uses[0]
    turn = question + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    answer = client.messages.create(model=MODEL, max_tokens=ANSWER_MAX_TOKENS, extra_body=GREEDY, tools=tools, messages=turn)
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text == _colocated_answer_after(fleet, use.id, use.name, use.input)


def test_responses_function_call_then_output_by_previous_response_id_equal_colocated(fleet):
    _, name, arguments = _colocated_call(fleet, tool_choice="auto", extra_body=PYTHONIC_CALL)
    client = _openai(fleet.url)
    tools = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}]
    first = client.responses.create(model=MODEL, input=QUESTION, tools=tools, tool_choice="auto", temperature=0,
                                    max_output_tokens=CALL_MAX_TOKENS, store=True, extra_body=PYTHONIC_CALL)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, arguments)], first
    call = calls[0]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=tools, temperature=0,
                                     max_output_tokens=ANSWER_MAX_TOKENS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert second.output_text == _colocated_answer_after(fleet, call.call_id, call.name, json.loads(call.arguments))
