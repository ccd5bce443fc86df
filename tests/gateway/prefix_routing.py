"""Prefix-cache routing end to end: reference engines that publish KV events, pdgate replicas in
front, and a seeded multi-turn chat workload whose prompts share prefixes. Shared by
tests/gateway/test_cache_source_e2e.py (assertions) and bench/cache_source.py (numbers).

The hit rate is the engines' own figure: sum of `usage.prompt_tokens_details.cached_tokens` over
sum of `usage.prompt_tokens`, from the answers.

Loopback only. The engine's PUB socket binds only for a wildcard endpoint (vLLM's rule), which
would listen on every interface; here each engine's PUB connects to a small XSUB/XPUB forwarder
bound on 127.0.0.1 instead, and every gateway replica subscribes to the forwarder (as it would to
the engine). The replay ROUTER is the engine's own, bound on 127.0.0.1.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from pdgate.workers import ReferenceWorker, free_port
from tests.gateway.harness import GatewayProcess, launch

ADMIN_KEY = "prefix-routing-admin"
FAST_HEALTH = ["--health-check-interval-secs", "1", "--health-success-threshold", "1", "--health-failure-threshold", "1"]


class Forwarders:
    """One XSUB (engine side) / XPUB (gateway side) forwarder per engine, on 127.0.0.1."""

    def __init__(self, n: int):
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.ports: list[tuple[int, int]] = []
        self.threads: list[threading.Thread] = []
        for _ in range(n):
            xsub, xpub = self.ctx.socket(zmq.XSUB), self.ctx.socket(zmq.XPUB)
            ports = (xsub.bind_to_random_port("tcp://127.0.0.1"), xpub.bind_to_random_port("tcp://127.0.0.1"))
            self.ports.append(ports)
            t = threading.Thread(target=self._run, args=(xsub, xpub), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, xsub: Any, xpub: Any) -> None:
        try:
            self._zmq.proxy(xsub, xpub)
        except self._zmq.ZMQError:
            pass  # the context was terminated: close() ends the forwarder
        finally:
            xsub.close(0)
            xpub.close(0)

    def close(self) -> None:
        self.ctx.term()
        for t in self.threads:
            t.join(timeout=5)


@dataclass
class Engines:
    workers: list[ReferenceWorker]
    forwarders: Forwarders
    replay_ports: list[int]

    def registrations(self) -> list[dict[str, Any]]:
        """`POST /workers` bodies: each worker with its publisher (the forwarder) and replay socket."""
        return [
            {"url": w.url, "kv_events": f"tcp://127.0.0.1:{pub}", "kv_events_replay": f"tcp://127.0.0.1:{replay}"}
            for w, (_, pub), replay in zip(self.workers, self.forwarders.ports, self.replay_ports)
        ]

    def reset_caches(self) -> None:
        """Empties every engine's prefix cache (its subscribers see AllBlocksCleared)."""
        for w in self.workers:
            r = httpx.post(w.url + "/reset_prefix_cache", timeout=10)
            assert r.status_code == 200, r.text

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.forwarders.close()


def start_engines(n: int, cache_tokens: int, start_timeout: float = 90.0) -> Engines:
    """`n` colocated tiny reference engines, each with a `cache_tokens` KV pool (small, so that
    the prefix cache evicts) and KV events on."""
    fwd = Forwarders(n)
    replay_ports = [free_port() for _ in range(n)]
    workers = []
    for i, ((xsub, _), replay) in enumerate(zip(fwd.ports, replay_ports)):
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{xsub}",
               "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": f"kv@engine{i}@tiny"}
        workers.append(ReferenceWorker(mode="null", extra_args=["--max-total-tokens", str(cache_tokens), "--kv-events-config", json.dumps(cfg)]))
    try:
        for w in workers:
            w.start(start_timeout)
    except BaseException:
        for w in workers:
            w.stop()
        fwd.close()
        raise
    return Engines(workers, fwd, replay_ports)


def export_tokenizer(directory: Path) -> Path:
    """The reference engine's tokenizer as a Hugging Face directory (what `--model-path` loads)."""
    cmd = [sys.executable, "-m", "pdgate.cli", "engine", "--model", "tiny", "--export-tokenizer", str(directory)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return directory


def launch_replica(processes: Any, engines: Engines, policy: str, cache_source: str, tokenizer_dir: Path,
                   seed: int | None = None) -> GatewayProcess:
    """One gateway replica with the engines registered through `/workers` (with their KV event
    endpoints: every replica subscribes to the same publishers). `seed`: the gateway's `--seed`
    (its routing rng), else random."""
    args = ["--policy", policy, "--cache-source", cache_source, "--model-path", str(tokenizer_dir), "--admin-api-key", ADMIN_KEY, *FAST_HEALTH]
    if seed is not None:
        args += ["--seed", str(seed)]
    gw = launch(processes, args)
    for body in engines.registrations():
        r = httpx.post(gw.url + "/workers", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        assert r.status_code == 201, r.text
    gw.wait_ready()
    return gw


def wait_subscribed(gw: GatewayProcess, n: int, timeout: float = 20.0) -> None:
    """Until the replica has connected to all `n` publishers and caught up on what each one's
    replay socket buffered (its view is then as current as the events)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        if _metric(text, "pdgate_kv_events_caught_up_total") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"not subscribed to {n} publishers after {timeout}s:\n{text[-2000:]}")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# ---- the workload -------------------------------------------------------------------------

WORDS = ("cache prefill decode token page worker gateway replica engine event block prompt answer "
         "route load batch stream latency memory transfer index policy tree hash evict").split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@dataclass
class Workload:
    """Multi-turn conversations: each belongs to a group whose long system prompt it shares;
    turn t's prompt is the system prompt and the previous turns (user, assistant) plus a new
    user message, so it extends turn t-1's prompt. Requests interleave a few live
    conversations at a time, as a chat service sees them."""

    prompts: list[str]
    conversation: list[int] = field(default_factory=list)


def conversations(seed: int, n_conversations: int = 40, turns: int = 5, groups: int = 4, live: int = 6,
                  system_words: int = 28, turn_words: int = 5) -> Workload:
    rng = random.Random(seed)
    systems = [f"System {g}: " + " ".join(_sentence(rng, 7) for _ in range(system_words // 7)) + "\n" for g in range(groups)]
    history = {c: systems[c % groups] for c in range(n_conversations)}
    left = {c: turns for c in range(n_conversations)}
    waiting = list(range(n_conversations))
    active: list[int] = []
    out = Workload([])
    last = -1
    while waiting or active:
        while len(active) < live and waiting:
            active.append(waiting.pop(0))
        choices = [c for c in active if c != last] or active
        c = rng.choice(choices)
        history[c] += "User: " + _sentence(rng, turn_words) + "\nAssistant:"
        out.prompts.append(history[c])
        out.conversation.append(c)
        history[c] += " " + _sentence(rng, turn_words) + "\n"
        left[c] -= 1
        if left[c] == 0:
            active.remove(c)
        last = c
    return out


@dataclass
class RunResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1000

    @property
    def ttft_mean_ms(self) -> float:
        return statistics.fmean(self.ttft_s) * 1000


def run(replicas: list[GatewayProcess], workload: Workload, max_tokens: int = 2, timeout: float = 60.0) -> RunResult:
    """Sends the prompts one at a time, request i to replica i mod len(replicas), streaming
    (TTFT = first content chunk), and sums the engines' usage."""
    clients = [openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=timeout) for gw in replicas]
    result = RunResult()
    for i, prompt in enumerate(workload.prompts):
        client = clients[i % len(clients)]
        start = time.perf_counter()
        first = None
        usage = None
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and first is not None, f"request {i}: no usage or no token"
        details = usage.prompt_tokens_details
        result.prompt_tokens += usage.prompt_tokens
        result.cached_tokens += (details.cached_tokens or 0) if details else 0
        result.ttft_s.append(first - start)
    return result
