//! Prometheus metrics, registered once per gateway (not globally, so several gateways can run in
//! one process, e.g. embedded from Python and in tests).

use std::sync::Arc;

use prometheus::{Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

use pdgate_core::error::{worker_error_codes, RETRY_REASONS};
use pdgate_core::{GatewayConfig, KvConnector, Leg};

const LATENCY_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub ttfb: HistogramVec,
    pub leg_duration: HistogramVec,
    pub retries: IntCounterVec,
    /// Retries the shared retry budget did not allow (`reason`: budget).
    pub retries_refused: IntCounterVec,
    /// Streams continued after their decode died (`result`: resumed, failed, refused; `reason`).
    pub resumes: IntCounterVec,
    pub leg_errors: IntCounterVec,
    pub inflight: IntGaugeVec,
    pub worker_healthy: IntGaugeVec,
    /// 1 while a role is under panic routing (all its workers out by unanswered checks alone).
    pub health_panic: IntGaugeVec,
    /// Times a role entered panic routing.
    pub health_panic_total: IntCounterVec,
    /// Unanswered health checks not counted because the worker was serving requests.
    pub health_unanswered_serving: IntCounterVec,
    pub worker_load: IntGaugeVec,
    /// What token-aware routing sees per worker, set at each scrape (`refresh_token_load`).
    pub worker_queued: IntGaugeVec,
    pub worker_prompt_tokens: IntGaugeVec,
    pub worker_free_kv_tokens: IntGaugeVec,
    pub decisions: IntCounterVec,
    pub pairing_refusals: IntCounterVec,
    pub breaker_state: IntGaugeVec,
    pub silent_recompute: IntCounterVec,
    /// EPD, vLLM style: images whose encoder stored nothing a prefill can find (it answered
    /// without `ec_transfer_params`), so the prefill encodes them itself.
    pub unstored_images: IntCounterVec,
    /// Worker answers refused as broken (`bad_worker_response`), by leg and reason.
    pub bad_worker_responses: IntCounterVec,
    /// Streams that ended without `data: [DONE]`, by leg.
    pub streams_truncated: IntCounterVec,
    /// Kubernetes discovery (src/discovery): events by type, watch restarts, workers by source.
    #[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
    pub discovery_events: IntCounterVec,
    #[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
    pub discovery_watch_restarts: IntCounterVec,
    pub workers: IntGaugeVec,
    /// Admission (`--max-concurrent-requests`): requests holding a slot, refusals by reason
    /// (queue_full, queue_timeout), and the time spent waiting for a slot.
    pub admission_running: IntGauge,
    pub admission_waiting: IntGauge,
    pub admission_refused: IntCounterVec,
    pub queue_wait: prometheus::Histogram,
    /// The client edge (conn.rs, front.rs, hops.rs, log_limit.rs): every limit that fires.
    pub edge: Arc<EdgeMetrics>,
    /// Placement decisions, recoveries and the cost model (exec/placement.rs).
    pub placement: crate::observe::placement_metrics::PlacementMetrics,
    /// Latency objectives: TTFT/TPOT/E2E by placement, SLO results, goodput (goodput.rs).
    pub slo: crate::observe::goodput::SloMetrics,
}

/// Counters of the client edge, each present at 0 from the start so alerts can rate() them.
pub struct EdgeMetrics {
    /// `kind`: header (headers not complete in time), body (body not complete: 408), idle
    /// (keep-alive connection closed between requests).
    pub client_timeouts: IntCounterVec,
    pub connections_rejected: IntCounter,
    pub connections_open: IntGauge,
    /// Client requests whose response has not ended yet (streams included): what a graceful
    /// shutdown waits for.
    pub requests_in_flight: IntGauge,
    pub panics: IntCounter,
    /// `kind`: via (came back to this gateway), hops (too many gateways), registration (a
    /// worker at this gateway's own address refused).
    pub loops: IntCounterVec,
    pub log_suppressed: IntCounter,
    /// Per connection thread (`thread`: 1..=N): share of one CPU it used in the last 250 ms.
    pub thread_cpu: GaugeVec,
    /// Keep-alive connections closed after a response to move load off a busy thread.
    pub connections_shed: IntCounter,
}

impl EdgeMetrics {
    fn new(r: &Registry) -> Self {
        let client_timeouts = counter(r, "pdgate_client_timeouts_total", "Client connections or requests cut by a timeout, by kind (header, body, idle)", &["kind"]);
        for kind in ["header", "body", "idle"] {
            client_timeouts.with_label_values(&[kind]);
        }
        let loops = counter(r, "pdgate_loops_refused_total", "Request loops cut (via, hops) and workers refused for being this gateway (registration)", &["kind"]);
        for kind in ["via", "hops", "registration"] {
            loops.with_label_values(&[kind]);
        }
        let single = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"));
            r.register(Box::new(c.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
            c
        };
        let open = IntGauge::new("pdgate_client_connections", "Client connections open now").unwrap_or_else(|e| panic!("metric pdgate_client_connections: {e}"));
        r.register(Box::new(open.clone())).unwrap_or_else(|e| panic!("metric pdgate_client_connections: {e}"));
        let in_flight = IntGauge::new("pdgate_client_requests_in_flight", "Client requests whose response has not ended (streams included)")
            .unwrap_or_else(|e| panic!("metric pdgate_client_requests_in_flight: {e}"));
        r.register(Box::new(in_flight.clone())).unwrap_or_else(|e| panic!("metric pdgate_client_requests_in_flight: {e}"));
        EdgeMetrics {
            client_timeouts,
            requests_in_flight: in_flight,
            connections_rejected: single("pdgate_connections_rejected_total", "Client connections closed at once because --max-connections were open"),
            connections_open: open,
            panics: single("pdgate_request_panics_total", "Request handlers that panicked (answered 500)"),
            loops,
            log_suppressed: single("pdgate_log_lines_suppressed_total", "Repeated identical warnings left out of the log by the rate limit"),
            thread_cpu: float_gauge(r, "pdgate_connection_thread_cpu_ratio", "Share of one CPU each connection thread used in the last 250 ms", &["thread"]),
            connections_shed: single("pdgate_connections_shed_total", "Keep-alive connections answered with Connection: close to move load off a busy connection thread"),
        }
    }
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    r.register(Box::new(c.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    c
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    r.register(Box::new(g.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    g
}

fn float_gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    r.register(Box::new(g.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    g
}

fn single_gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    r.register(Box::new(g.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    g
}

fn histogram(r: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
    let h = HistogramVec::new(opts, labels).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    r.register(Box::new(h.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    h
}

impl Metrics {
    /// Metric names and labels are constants: a failure here is a programming error caught by
    /// every test, hence the panics.
    pub fn new() -> Self {
        let r = Registry::new();
        crate::observe::tracing_export::register_metrics(&r);
        let m = Metrics {
            requests: counter(&r, "pdgate_requests_total", "Client requests by route and HTTP status", &["route", "status"]),
            duration: histogram(&r, "pdgate_request_duration_seconds", "End-to-end request latency", &["route"]),
            ttfb: histogram(&r, "pdgate_time_to_first_byte_seconds", "Time until the first response byte was ready", &["route"]),
            leg_duration: histogram(&r, "pdgate_pd_leg_duration_seconds", "Duration of one PD leg", &["leg", "protocol"]),
            retries: counter(&r, "pdgate_retries_total", "Attempts retried, by reason", &["reason"]),
            retries_refused: counter(&r, "pdgate_retries_refused_total", "Retries not made because the shared retry budget was spent", &["reason"]),
            resumes: counter(&r, "pdgate_resumes_total", "Streams whose decode died mid-answer, by what resuming did (resumed, failed, refused) and why", &["result", "reason"]),
            leg_errors: counter(&r, "pdgate_worker_errors_total", "Failed worker legs by leg and error code", &["leg", "code"]),
            inflight: gauge(&r, "pdgate_worker_inflight", "Requests in flight per worker", &["worker", "role"]),
            worker_healthy: gauge(&r, "pdgate_worker_healthy", "1 when the worker passes health checks", &["worker", "role"]),
            health_panic: gauge(&r, "pdgate_health_panic", "1 while every worker of the role is out by unanswered health checks alone and is routed to anyway (panic routing)", &["role"]),
            health_panic_total: counter(&r, "pdgate_health_panic_total", "Times a role entered panic routing (docs/fleet.md)", &["role"]),
            health_unanswered_serving: counter(
                &r,
                "pdgate_health_unanswered_while_serving_total",
                "Unanswered health checks not counted against a worker that served a request within the last interval",
                &["role"],
            ),
            decisions: counter(&r, "pdgate_policy_decisions_total", "Routing decisions by pool and outcome (cache_hit, cache_miss, rebalance, ...)", &["pool", "outcome"]),
            pairing_refusals: counter(&r, "pdgate_pairing_refusals_total", "Requests refused for want of a compatible prefill/decode pair", &["mode"]),
            breaker_state: gauge(&r, "pdgate_worker_breaker_state", "Circuit breaker: 0 closed, 1 open, 2 half-open", &["worker"]),
            worker_load: gauge(&r, "pdgate_worker_load", "Engine-reported running + waiting requests (-1: unknown)", &["worker", "role"]),
            worker_queued: gauge(
                &r,
                "pdgate_worker_queued_requests",
                "Requests of this gateway queued or running on the worker, as routing counts them (a prefill's end at KV handoff)",
                &["worker", "role"],
            ),
            worker_prompt_tokens: gauge(
                &r,
                "pdgate_worker_prompt_tokens",
                "Prompt tokens queued on the worker as routing sees them: this gateway's + the engine-reported waiting",
                &["worker", "role"],
            ),
            worker_free_kv_tokens: gauge(
                &r,
                "pdgate_worker_free_kv_tokens",
                "Free KV tokens as routing sees them: engine report minus what this gateway placed since (-1: unknown)",
                &["worker", "role"],
            ),
            silent_recompute: counter(
                &r,
                "pdgate_pd_silent_recompute_total",
                "PD requests whose decode recomputed the prompt because no (or not all) KV arrived",
                &["protocol", "cause"],
            ),
            unstored_images: counter(
                &r,
                "pdgate_epd_unstored_images_total",
                "EPD images whose encode worker answered without storing an embedding for the prefill (no ec_transfer_params): the prefill encodes them itself",
                &["protocol"],
            ),
            bad_worker_responses: counter(
                &r,
                "pdgate_bad_worker_responses_total",
                "Worker answers refused: not JSON of the route's shape, not SSE, an encoding, over a size limit",
                &["leg", "reason"],
            ),
            streams_truncated: counter(&r, "pdgate_worker_streams_truncated_total", "Worker streams that ended without data: [DONE]", &["leg"]),
            discovery_events: counter(
                &r,
                "pdgate_discovery_events_total",
                "Kubernetes discovery events: pod apply/delete/relist, worker_added/worker_removed, pod_refused",
                &["type"],
            ),
            discovery_watch_restarts: counter(&r, "pdgate_discovery_watch_restarts_total", "Pod watches that failed and were resumed or re-listed", &[]),
            workers: gauge(&r, "pdgate_workers", "Registered workers by source (static, api, discovery)", &["source"]),
            admission_running: single_gauge(&r, "pdgate_admission_running", "Requests holding a --max-concurrent-requests slot"),
            admission_waiting: single_gauge(&r, "pdgate_admission_waiting", "Requests waiting in the admission queue (at scrape time)"),
            admission_refused: counter(
                &r,
                "pdgate_admission_refused_total",
                "Requests refused by admission: queue_full (429), shed (429: a higher x-pdgate-priority took the place), queue_timeout (408), no_kv_room (408: no decode had KV room in time)",
                &["reason"],
            ),
            queue_wait: {
                let opts =
                    HistogramOpts::new("pdgate_admission_queue_wait_seconds", "Time a request waited for a --max-concurrent-requests slot").buckets(LATENCY_BUCKETS.to_vec());
                let h = prometheus::Histogram::with_opts(opts).unwrap_or_else(|e| panic!("metric pdgate_admission_queue_wait_seconds: {e}"));
                r.register(Box::new(h.clone())).unwrap_or_else(|e| panic!("metric pdgate_admission_queue_wait_seconds: {e}"));
                h
            },
            edge: Arc::new(EdgeMetrics::new(&r)),
            placement: crate::observe::placement_metrics::PlacementMetrics::new(&r),
            slo: crate::observe::goodput::SloMetrics::new(&r),
            registry: r,
        };
        // Present at 0 from the start, so an alert on them needs no prior failure.
        m.retries_refused.with_label_values(&["budget"]);
        m.resumes.with_label_values(&["resumed", "decode_died"]);
        for leg in ["worker", "decode"] {
            m.streams_truncated.with_label_values(&[leg]);
            for reason in pdgate_protocol::answer::REASONS {
                m.bad_worker_responses.with_label_values(&[leg, reason]);
            }
        }
        for reason in ["queue_full", "shed", "queue_timeout", "no_kv_room"] {
            m.admission_refused.with_label_values(&[reason]);
        }
        m
    }

    /// Creates at 0 every labelled series a dashboard or an alert reads, for this gateway's
    /// mode, so that `rate()` and ratios work before the first event (retries, worker errors,
    /// silent recomputes, pairing refusals, request outcomes by route).
    pub fn prime(&self, config: &GatewayConfig) {
        for reason in RETRY_REASONS {
            self.retries.with_label_values(&[reason]);
        }
        let legs: &[Leg] = if config.pd_disaggregation { &[Leg::Prefill, Leg::Decode] } else { &[Leg::Regular] };
        let roles: &[&str] = if config.pd_disaggregation { &["prefill", "decode", "regular"] } else { &["regular"] };
        for role in roles {
            self.health_panic.with_label_values(&[role]).set(0);
            self.health_panic_total.with_label_values(&[role]);
            self.health_unanswered_serving.with_label_values(&[role]);
        }
        for leg in legs {
            for code in worker_error_codes(*leg) {
                self.leg_errors.with_label_values(&[leg.as_str(), &code]);
            }
        }
        for route in ["/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages"] {
            for status in ["200", "503", "504"] {
                self.requests.with_label_values(&[route, status]);
            }
        }
        if config.pd_disaggregation {
            let mode = format!("{:?}", config.pd_pairing_mode).to_ascii_lowercase();
            self.pairing_refusals.with_label_values(&[&mode]);
            for protocol in [KvConnector::Bootstrap, KvConnector::Nixl, KvConnector::Mooncake] {
                self.silent_recompute.with_label_values(&[protocol.as_str(), "decode_reported"]);
            }
            for cause in ["incomplete_params", "no_params"] {
                self.silent_recompute.with_label_values(&[KvConnector::Nixl.as_str(), cause]);
            }
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
