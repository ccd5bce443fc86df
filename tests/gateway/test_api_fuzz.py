"""API fuzz over the gateway's OpenAPI document (docs/openapi.json).

Bodies are generated from the documented request schemas (hypothesis-jsonschema), then mutated:
a field replaced by an arbitrary JSON value, by an extreme integer (the `n` = 10^12 class of
finding), or the whole body replaced by arbitrary JSON or raw bytes. Whatever comes in:
- the connection is never dropped and every request gets an answer within its deadline;
- the gateway never answers 5xx for its own fault: a 5xx must be a worker's (error type
  `upstream_error`), and these mock workers only fail on purpose, so in practice none at all;
- every non-2xx answer is an OpenAI-style error object;
- the process is alive and serving afterwards.

The mock workers stream `max_tokens` tokens, so generated token budgets are kept small; huge
budgets are the hardening tests' job (test_hardening.py), against workers that report their
context length. PDGATE_FUZZ_EXAMPLES sets the examples per route (default 40); the examples are
derandomized (the same every run, so CI is reproducible) unless PDGATE_FUZZ_RANDOM=1.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Any, Iterator

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
hjs = pytest.importorskip("hypothesis_jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.conftest import Processes  # noqa: E402
from tests.gateway.stacks import Stack, pd_stack, regular_stack  # noqa: E402
from tests.mock_workers import MockHost  # noqa: E402

pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")

SPEC = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs" / "openapi.json").read_text())
EXAMPLES = int(os.environ.get("PDGATE_FUZZ_EXAMPLES", "40"))
DERANDOMIZE = os.environ.get("PDGATE_FUZZ_RANDOM") != "1"
ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"]
BUDGET_FIELDS = {"max_tokens", "max_completion_tokens", "max_new_tokens", "max_output_tokens"}
EXTREME_INTS = [-1, 0, 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**64 - 1, 10**12, 10**30, -(2**63)]
# Fields whose size the gateway must bound, and fields it reads for routing or rendezvous.
TARGET_FIELDS = ["n", "best_of", "prompt", "messages", "text", "input_ids", "stop", "logit_bias", "tools",
                 "stream", "stream_options", "model", "user", "sampling_params", "bootstrap_room",
                 "bootstrap_host", "bootstrap_port", "kv_transfer_params", "return_logprob", "temperature",
                 "input", "instructions", "previous_response_id", "max_output_tokens", "tool_choice"]


def request_schema(path: str) -> dict[str, Any]:
    ref = SPEC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    name = ref.rsplit("/", 1)[1]
    schemas = copy.deepcopy(SPEC["components"]["schemas"])
    # Small token budgets: the mocks generate exactly that many tokens.
    for schema in schemas.values():
        for field in BUDGET_FIELDS & set(schema.get("properties", {})):
            schema["properties"][field] = {"type": "integer", "minimum": 0, "maximum": 8}
        if "n" in schema.get("properties", {}):
            schema["properties"]["n"] = {"type": "integer", "minimum": 1, "maximum": 4}
    return {"$ref": f"#/components/schemas/{name}", "components": {"schemas": schemas}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def mutated(valid: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def mutate(draw: Any) -> dict:
        body = dict(draw(valid))
        field = draw(st.sampled_from(TARGET_FIELDS))
        value = draw(st.one_of(json_values, st.sampled_from(EXTREME_INTS), st.text(max_size=64)))
        if field == "n" and draw(st.booleans()):
            body.setdefault("sampling_params", {})
        body[field] = value
        return body

    return st.composite(lambda draw: mutate(draw))()


def bodies(path: str) -> st.SearchStrategy[bytes]:
    valid = hjs.from_schema(request_schema(path))
    as_json = st.one_of(valid, mutated(valid), json_values).map(lambda b: json.dumps(b).encode())
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=64))


def check_answer(resp: httpx.Response, what: str) -> None:
    if resp.status_code < 300:
        return
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"{what}: {resp.status_code} without an OpenAI-style error: {resp.text[:300]}")
    assert isinstance(err.get("message"), str) and err["message"], (what, err)
    assert isinstance(err.get("type"), str) and err.get("code") is not None, (what, err)
    if resp.status_code >= 500:
        assert err["type"] == "upstream_error", f"{what}: the gateway's own {resp.status_code}: {err}"


@pytest.fixture(scope="module", params=["regular", "bootstrap"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    mocks, processes = MockHost(), Processes()
    try:
        # No breaker: a worker error is judged per request here, not by the fleet state it causes.
        args = ["--request-timeout-secs", "20", "--disable-circuit-breaker"]
        if request.param == "regular":
            yield regular_stack(mocks, processes, args=args)
        else:
            yield pd_stack(mocks, processes, "bootstrap", args=args)
    finally:
        processes.kill_all()
        mocks.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ROUTES)
def test_generated_requests_never_break_the_gateway(stack: Stack, path: str) -> None:
    client = httpx.Client(base_url=stack.url, timeout=30)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(body=bodies(path))
    def one(body: bytes) -> None:
        try:
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:  # a dropped connection or a hang past the client timeout
            raise AssertionError(f"{path} {body[:300]!r}: no answer: {exc!r}") from exc
        check_answer(resp, f"{path} {body[:300]!r}")
        if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
            assert "data:" in resp.text, resp.text[:300]

    try:
        one()
    finally:
        client.close()
    assert stack.gateway.proc.poll() is None, "the gateway died:\n" + "".join(stack.gateway.output[-50:])
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
