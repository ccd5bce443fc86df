//! Where a finished request's figures go: the TTFT/TPOT/E2E histograms by placement, the SLO
//! result counter, the goodput window and gauge, and the request log line.
//!
//! The figures are measured by `exec/accounting.rs` and judged by `pdgate_core::slo`; this file
//! only records them.

use std::sync::Mutex;

use pdgate_core::slo::{classify, GoodputWindow, RequestFigures, SloResult, SloTargets};
use pdgate_core::GatewayConfig;
use prometheus::{Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};
use serde::Serialize;
use tokio::time::Instant;

use crate::observe::request_log::RequestLog;

const TTFT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0];
const TPOT_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0];
const E2E_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0];

/// Placements a request can be served by (the label values primed at 0).
pub const PLACEMENTS: [&str; 2] = ["colocated", "disaggregated"];

/// The SLO series, registered with the gateway's other metrics.
pub struct SloMetrics {
    pub ttft: HistogramVec,
    pub tpot: HistogramVec,
    pub e2e: HistogramVec,
    pub results: IntCounterVec,
    pub goodput: Gauge,
    pub log_dropped: IntCounter,
}

fn histogram(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), &["placement"]).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    r.register(Box::new(h.clone())).unwrap_or_else(|e| panic!("metric {name}: {e}"));
    h
}

impl SloMetrics {
    /// Names and labels are constants: a failure is a programming error every test catches.
    pub fn new(r: &Registry) -> Self {
        let results = IntCounterVec::new(Opts::new("pdgate_slo_requests_total", "Finished requests by how they met the TTFT and TPOT objectives"), &["result"])
            .unwrap_or_else(|e| panic!("metric pdgate_slo_requests_total: {e}"));
        r.register(Box::new(results.clone())).unwrap_or_else(|e| panic!("metric pdgate_slo_requests_total: {e}"));
        let goodput = Gauge::new("pdgate_goodput_requests_per_second", "Requests per second that met both objectives, over --goodput-window-secs")
            .unwrap_or_else(|e| panic!("metric pdgate_goodput_requests_per_second: {e}"));
        r.register(Box::new(goodput.clone())).unwrap_or_else(|e| panic!("metric pdgate_goodput_requests_per_second: {e}"));
        let log_dropped = IntCounter::new("pdgate_request_log_dropped_total", "Request log lines dropped because the writer was behind")
            .unwrap_or_else(|e| panic!("metric pdgate_request_log_dropped_total: {e}"));
        r.register(Box::new(log_dropped.clone())).unwrap_or_else(|e| panic!("metric pdgate_request_log_dropped_total: {e}"));
        let m = SloMetrics {
            ttft: histogram(r, "pdgate_ttft_seconds", "Arrival at the gateway to the first content token relayed to the client", TTFT_BUCKETS),
            tpot: histogram(r, "pdgate_tpot_seconds", "Time per output token after the first, (E2E - TTFT) / (output tokens - 1), streams only", TPOT_BUCKETS),
            e2e: histogram(r, "pdgate_e2e_seconds", "Arrival at the gateway to the end of the response", E2E_BUCKETS),
            results,
            goodput,
            log_dropped,
        };
        for result in SloResult::ALL {
            m.results.with_label_values(&[result.as_str()]);
        }
        for p in PLACEMENTS {
            m.ttft.with_label_values(&[p]);
            m.tpot.with_label_values(&[p]);
            m.e2e.with_label_values(&[p]);
        }
        m
    }
}

/// One finished request, as recorded: its figures, its objectives and who served it.
#[derive(Clone, Debug, Serialize)]
pub struct Finished {
    pub arrival_unix_s: f64,
    pub request_id: String,
    pub client_request_id: Option<String>,
    pub route: &'static str,
    pub model: Option<String>,
    pub stream: bool,
    pub placement: &'static str,
    pub protocol: &'static str,
    pub worker: Option<String>,
    pub prefill: Option<String>,
    pub decode: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
    pub slo_result: &'static str,
    pub status: u16,
    pub error: Option<String>,
    pub attempts: u32,
    /// Times the answer was continued on a new pair after its decode died, and where.
    pub resumes: u32,
    pub resumed_on: Vec<ResumedOn>,
}

/// A request refused before execution, as `Goodput::refused` records it.
pub struct Refused {
    pub route: &'static str,
    pub status: u16,
    pub error: String,
    pub slo: SloTargets,
    pub started: std::time::Instant,
    pub arrival_unix_s: f64,
    pub client_request_id: Option<String>,
}

/// The goodput window, its clock, and the request log.
pub struct Goodput {
    window: Mutex<GoodputWindow>,
    epoch: Instant,
    log: Option<RequestLog>,
}

impl Goodput {
    pub fn new(config: &GatewayConfig, log: Option<RequestLog>) -> Self {
        Goodput { window: Mutex::new(GoodputWindow::new(config.goodput_window_secs)), epoch: Instant::now(), log }
    }

    /// Whether finished requests are written to `--request-log` (their identity is kept only then).
    pub fn logging(&self) -> bool {
        self.log.is_some()
    }

    fn now_secs(&self) -> u64 {
        self.epoch.elapsed().as_secs()
    }

    /// Records one finished request; returns how it fared. `line` builds the request log's
    /// entry, only when there is a log.
    pub fn record(&self, m: &SloMetrics, placement: &str, f: &RequestFigures, slo: &SloTargets, line: impl FnOnce(SloResult) -> Finished) -> SloResult {
        let result = classify(f, slo);
        m.results.with_label_values(&[result.as_str()]).inc();
        m.e2e.with_label_values(&[placement]).observe(f.e2e.as_secs_f64());
        if let Some(ttft) = f.ttft {
            m.ttft.with_label_values(&[placement]).observe(ttft.as_secs_f64());
        }
        if let Some(tpot) = f.tpot() {
            m.tpot.with_label_values(&[placement]).observe(tpot.as_secs_f64());
        }
        let now = self.now_secs();
        let rate = {
            let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
            if result == SloResult::Met {
                w.record(now);
            }
            w.rate(now)
        };
        m.goodput.set(rate);
        if let Some(log) = &self.log {
            match serde_json::to_string(&line(result)) {
                Ok(s) => log.write(s),
                Err(e) => tracing::warn!(error = %e, "cannot encode a request log line"),
            }
        }
        result
    }

    /// A request refused before it was parsed or placed (the admission queue: full, shed, timed
    /// out): `pdgate_slo_requests_total{result="failed"}`, its E2E, and a log line.
    pub fn refused(&self, m: &SloMetrics, r: Refused) -> SloResult {
        let f = RequestFigures { e2e: r.started.elapsed(), failed: true, ..RequestFigures::default() };
        let placement = "rejected";
        self.record(m, placement, &f, &r.slo, |result| Finished {
            arrival_unix_s: r.arrival_unix_s,
            request_id: crate::request_id::mint(r.client_request_id.as_deref()),
            client_request_id: r.client_request_id,
            route: r.route,
            model: None,
            stream: false,
            placement,
            protocol: "none",
            worker: None,
            prefill: None,
            decode: None,
            prompt_tokens: None,
            output_tokens: None,
            cached_tokens: None,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: f.e2e.as_secs_f64() * 1000.0,
            slo_ttft_ms: r.slo.ttft_ms,
            slo_tpot_ms: r.slo.tpot_ms,
            slo_result: result.as_str(),
            status: r.status,
            error: Some(r.error),
            attempts: 0,
            resumes: 0,
            resumed_on: Vec::new(),
        })
    }

    /// The gauge at scrape time: seconds with no finished request still age the window.
    pub fn refresh(&self, m: &SloMetrics) {
        let rate = self.window.lock().unwrap_or_else(|p| p.into_inner()).rate(self.now_secs());
        m.goodput.set(rate);
    }
}

/// Where a resumed answer went on: the continuation's prefill and decode (PD) or worker.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ResumedOn {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode: Option<String>,
}
