"""Prometheus metrics, read from the engine's own counters at scrape time.

Besides its own `pdgate_engine_*` series, the engine exports its load under the names of the
engine it stands in for (`--api-flavor`), so that a gateway's scrape of real engines is tested
against it: SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
`sglang:max_total_num_tokens`, `sglang:cache_config_info{page_size,num_pages}`, or vLLM's
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction)
and `vllm:cache_config_info{block_size,cache_dtype,num_gpu_blocks}` (value 1). KV transfers
received go out as the engines' transfer histograms (count and sum; one `+Inf` bucket): vLLM's
NIXL `vllm:nixl_xfer_time_seconds` and `vllm:nixl_bytes_transferred`, SGLang's
`sglang:kv_transfer_latency_ms` and `sglang:kv_transfer_total_mb` (MiB). The prefix cache's
lookups go out as vLLM's counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt
tokens looked up / found cached) or SGLang's gauge `sglang:cache_hit_rate`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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
        if e.images is not None:
            m = CounterMetricFamily(P + "mm_embeddings", "Image embeddings by source: computed (the "
                                    "tower ran here), cached (embedding cache hit), received (from an "
                                    "encode worker), sent (to a prefill), ec_storage (loaded from "
                                    "--ec-transfer-config's shared storage)", labels=["source"])
            for source, n in e.images.counts.items():
                m.add_metric([source], n)
            yield m
            mb = CounterMetricFamily(P + "mm_embedding_bytes", "Image embedding bytes moved to / from "
                                     "other workers, by the data plane that moved them (tcp frames or "
                                     "mooncake TE writes)", labels=["direction", "backend"])
            for backend, by_direction in e.images.bytes.items():
                for direction, n in by_direction.items():
                    mb.add_metric([direction, backend], n)
            yield mb
            if e.embed_plane is not None:
                yield from staging_metrics(e.embed_plane.stats(time.monotonic()))
            yield GaugeMetricFamily(P + "mm_embedding_cache_items", "Embeddings in the cache",
                                    value=len(e.images.cache))
        if e.ec is not None:
            f = CounterMetricFamily(P + "ec_cache_files", "--ec-transfer-config shared storage files: saved / "
                                    "save_failed (producer), loaded / missing / invalid (consumer lookups)",
                                    labels=["result"])
            for result, n in e.ec.counts.items():
                f.add_metric([result], n)
            yield f
        yield from flavor_metrics(e, pool)


def staging_metrics(st: dict):
    """The Mooncake staging area of EPD embeddings (transfer/embed_plane.py)."""
    g = GaugeMetricFamily(P + "mm_embedding_staging_slots", "Staging slots for embeddings over Mooncake "
                          "TE: in_use (a transfer holds it), quarantined (given up before an answer, "
                          "out of use for the transfer timeout), free", labels=["state"])
    g.add_metric(["in_use"], st["in_use"])
    g.add_metric(["quarantined"], st["quarantined"])
    g.add_metric(["free"], st["slots"] - st["in_use"] - st["quarantined"])
    yield g
    f = CounterMetricFamily(P + "mm_embedding_fallbacks", "Embeddings sent as TCP frames although both "
                            "sides run Mooncake: no_slot (no free staging slot), write_failed (the TE "
                            "write failed)", labels=["reason"])
    for reason, n in st["fallbacks"].items():
        f.add_metric([reason], n)
    yield f


def flavor_metrics(e, pool: dict):
    """The load gauges in SGLang's or vLLM's names (see the module doc)."""
    model, total = e.served_name, pool["total"]
    # Cached pages are evictable: free for new requests, as /v1/loads counts them.
    usage = (total - pool["free"] - pool.get("cached", 0)) / total if total else 0.0
    running, waiting = len(e.scheduler.running), e.scheduler.num_waiting
    flavor = e.config.api_flavor
    if flavor == "vllm":
        labels, values = ["engine", "model_name"], ["0", model]
        names = (("vllm:num_requests_running", "Number of requests in model execution batches.", running),
                 ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
                 ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "engine", "num_gpu_blocks"])
        info.add_metric([str(e.pool.page_size), "auto", "0", str(total)], 1.0)
    else:
        labels, values = ["model_name"], [model]
        names = (("sglang:num_running_reqs", "The number of running requests.", running),
                 ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting),
                 ("sglang:token_usage", "The token usage.", usage),
                 ("sglang:max_total_num_tokens", "Maximum total number of tokens.", total * e.pool.page_size))
        info = GaugeMetricFamily("sglang:cache_config_info", "Information of the cache config.",
                                 labels=["num_pages", "page_size"])
        info.add_metric([str(total), str(e.pool.page_size)], 1.0)
    for name, help_, value in names:
        g = GaugeMetricFamily(name, help_, labels=labels)
        g.add_metric(values, value)
        yield g
    yield info
    cache = e.pool.cache  # its own counts (also in /v1/loads' prefix_cache); none when it is off
    queries, hits = (cache.query_tokens, cache.hit_tokens) if cache is not None else (0, 0)
    if flavor == "vllm":
        for name, help_, value in (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries),
                                   ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)):
            c = CounterMetricFamily(name, help_, labels=labels)
            c.add_metric(values, value)
            yield c
    else:
        g = GaugeMetricFamily("sglang:cache_hit_rate", "The prefix cache hit rate.", labels=labels)
        g.add_metric(values, hits / queries if queries else 0.0)
        yield g
    yield from transfer_histograms(e.ctx.stats, flavor == "vllm", labels, values)


def transfer_histograms(st, vllm: bool, labels: list, values: list):
    """The transfers received as the flavor's histograms: (name, help, sum in its unit)."""
    n = st.transfers_in
    if vllm:
        series = (("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                   st.transfer_seconds_in),
                  ("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                   float(st.transfer_bytes_in)))
    else:
        series = (("sglang:kv_transfer_latency_ms", "Histogram of KV transfer latency in ms.",
                   st.transfer_seconds_in * 1000.0),
                  ("sglang:kv_transfer_total_mb", "Histogram of KV cache transfer size in MB.",
                   st.transfer_bytes_in / (1024.0 * 1024.0)))
    for name, help_, total in series:
        h = HistogramMetricFamily(name, help_, labels=labels)
        h.add_metric(values, buckets=[("+Inf", n)], sum_value=total)
        yield h


def render(engine) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine))
    return generate_latest(reg)
