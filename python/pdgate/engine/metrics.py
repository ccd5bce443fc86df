"""Prometheus metrics, read from the engine's own counters at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "pdgate_engine_"


class EngineCollector:
    def __init__(self, engine):
        self.e = engine

    def collect(self):
        e, pool, st = self.e, self.e.pool.counters(), self.e.ctx.stats
        g = GaugeMetricFamily(P + "kv_pages", "KV pages by state", labels=["state"])
        for state in ("free", "reserved", "in_use", "pinned", "cached"):
            g.add_metric([state], pool[state])
        yield g
        yield GaugeMetricFamily(P + "num_running_reqs", "Sequences decoding", value=len(e.scheduler.running))
        yield GaugeMetricFamily(P + "num_waiting_reqs", "Sequences waiting to prefill",
                                value=e.scheduler.num_waiting)
        yield GaugeMetricFamily(P + "num_live_reqs", "Requests in the engine", value=len(e.live))
        for name, help_ in (("requests", "Generation items accepted"),
                            ("prompt_tokens", "Prompt tokens accepted"),
                            ("generation_tokens", "Tokens generated"),
                            ("local_recompute", "PD requests served by recomputing locally"),
                            ("aborted", "Requests aborted")):
            yield CounterMetricFamily(P + name, help_, value=e.counters[name])
        yield CounterMetricFamily(P + "prefill_tokens", "Tokens prefilled by the model",
                                  value=e.scheduler.tokens_prefilled)
        yield CounterMetricFamily(P + "decode_tokens", "Tokens decoded by the model",
                                  value=e.scheduler.tokens_decoded)
        b = CounterMetricFamily(P + "kv_transfer_bytes", "KV payload bytes moved", labels=["direction"])
        b.add_metric(["sent"], st.bytes_sent)
        b.add_metric(["received"], st.bytes_received)
        yield b
        t = CounterMetricFamily(P + "kv_transfers", "KV transfers by outcome",
                                labels=["protocol", "role", "result"])
        for (proto, role, result), n in sorted(st.results.items()):
            t.add_metric([proto, role, result], n)
        yield t


def render(engine) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine))
    return generate_latest(reg)
