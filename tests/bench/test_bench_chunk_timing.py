"""`pdgate bench --chunk-timing`: which stream chunks time a token. A real HTTP server on loopback
streams a completion whose chunks include empty-text ones (what vLLM sends while it holds the
bytes of an unfinished UTF-8 character, and its last chunk with only `finish_reason`); `text`
times only the chunks with text, `choices` every chunk with `choices`, as `vllm bench serve`
does. Only the order of events is asserted, never a duration."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdgate.bench.client import RequestSpec, send_request
from pdgate.bench.dataset import SampleRequest

# (text, finish_reason) of each chunk, in order; the server waits between chunks, so each one
# reaches the client after the one before it.
CHUNKS = [("", None), ("a", None), ("", None), ("b", None), ("", "length")]


class _Stream(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text, finish in CHUNKS:
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.05)
        usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1/completions"
    srv.shutdown()


def _run(url: str, timing: str):
    spec = RequestSpec(url=url, model="m", chat=False, stream=True, chunk_timing=timing)
    req = SampleRequest(prompt="abc", prompt_len=3, output_len=2)

    async def go():
        async with httpx.AsyncClient() as client:
            return await send_request(client, spec, req, 30.0)

    return asyncio.run(go())


def test_text_timing_counts_only_chunks_with_text(server_url: str) -> None:
    out = _run(server_url, "text")
    assert out.success, out.error
    assert len(out.itl) == 1  # "a" starts the clock, "b" is the one gap
    # "a" is written 50 ms after the empty first chunk: timing that chunk would read less.
    assert out.ttft >= 0.05
    assert out.output_tokens == 2


def test_choices_timing_counts_every_chunk_with_choices_as_vllm_bench_does(server_url: str) -> None:
    out = _run(server_url, "choices")
    assert out.success, out.error
    assert len(out.itl) == len(CHUNKS) - 1  # the usage chunk has no choices: not a token
    assert out.ttft + out.itl[0] >= 0.05  # the second timed chunk is "a"
    assert out.output_tokens == 2  # the count is the server's usage either way


def test_the_cli_takes_chunk_timing() -> None:
    from pdgate.bench.cli import build_parser

    assert build_parser().parse_args(["--base-url", "http://x", "--chunk-timing", "choices"]).chunk_timing == "choices"
    assert build_parser().parse_args(["--base-url", "http://x"]).chunk_timing == "text"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--base-url", "http://x", "--chunk-timing", "bytes"])
