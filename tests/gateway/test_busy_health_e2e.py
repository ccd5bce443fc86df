"""A busy engine is not a dead one, end to end: `pdgate launch` in front of reference-engine
processes whose `/health` stalls (`--fault-slow-health`) while their completions answer, driven
with the official `openai` client. Nothing is refused for health while the workers serve, and a
fleet whose every decode is only silent is routed to anyway (panic routing, counted)."""

from __future__ import annotations

import re
import time

import httpx
import openai

from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import launch

# One-second checks that time out after one second, out after two: the slow health (5 s) is
# unanswered at every check.
HEALTH = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "1", "--health-failure-threshold", "2"]
SLOW = ["--fault-slow-health", "5"]


def _metric(url: str, series: str) -> float | None:
    m = re.search(re.escape(series) + r" (\S+)", httpx.get(url + "/metrics", timeout=10).text)
    return float(m.group(1)) if m else None


def test_busy_pd_workers_serve_every_request_and_a_silent_pool_is_routed_in_panic(processes: Processes) -> None:
    prefill = ReferenceWorker(mode="prefill", extra_args=SLOW)
    decode = ReferenceWorker(mode="decode", extra_args=SLOW)
    try:
        prefill.start(timeout=60)
        decode.start(timeout=60)
        gw = launch(processes, ["--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port),
                                "--decode", decode.url, *HEALTH])
        gw.wait_ready(timeout=60)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=30)
        # Six seconds of traffic: every check after the first goes unanswered.
        statuses: list[int | str] = []
        until = time.monotonic() + 6
        while time.monotonic() < until:
            try:
                client.completions.create(model="tiny", prompt="busy, not down", max_tokens=4, temperature=0)
                statuses.append(200)
            except openai.APIStatusError as e:
                statuses.append(e.status_code)
        refused = [s for s in statuses if s != 200]
        assert statuses and not refused, f"{len(refused)} of {len(statuses)} refused: {refused[:5]}"
        assert (_metric(gw.url, 'pdgate_health_unanswered_while_serving_total{role="decode"}') or 0) >= 1
        # Idle, the passive signal runs out: both roles go out by silence alone, and panic
        # routing still serves (and readiness stays up).
        deadline = time.monotonic() + 20
        while _metric(gw.url, 'pdgate_health_panic{role="decode"}') != 1:
            assert time.monotonic() < deadline, "the silent decode never put its role in panic"
            time.sleep(0.2)
        assert httpx.get(gw.url + "/readiness", timeout=5).status_code == 200
        answer = client.completions.create(model="tiny", prompt="still served", max_tokens=4, temperature=0)
        assert answer.choices[0].text
        assert (_metric(gw.url, 'pdgate_health_panic_total{role="decode"}') or 0) >= 1
        assert any("panic routing" in line and decode.url in line for line in gw.output), "the warning names the workers"
    finally:
        prefill.stop()
        decode.stop()
