//! The per-worker series of `/metrics` that read the fleet (breaker, health, in flight, token
//! load): set from the registry at each scrape, and the in-flight guard a leg holds. Here, not
//! in `observe`, because they read the registry and observe must not.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::fleet::registry::{Entry, Routing, Runtime};
use crate::observe::metrics::Metrics;

/// Per-worker series at their current values, so a worker has its breaker, health and
/// in-flight series from registration on, not from its first event. Called at each scrape.
pub fn refresh_workers(m: &Metrics, entries: &[Entry], breaker: &pdgate_core::BreakerConfig) {
    let now = std::time::Instant::now();
    for e in entries {
        let (url, role) = (e.spec.url.as_str(), e.spec.role.as_str());
        m.breaker_state.with_label_values(&[url]).set(i64::from(e.runtime.breaker().state(now, breaker).as_gauge()));
        m.worker_healthy.with_label_values(&[url, role]).set(i64::from(e.health.healthy));
        m.inflight.with_label_values(&[url, role]);
    }
}

/// The token load routing sees (`load`'s view), per worker; called at each scrape.
pub fn refresh_token_load(m: &Metrics, routing: &Routing, view: &dyn pdgate_core::policy::LoadView) {
    for (i, w) in routing.snapshot.workers().iter().enumerate() {
        let labels = [w.spec.url.as_str(), w.spec.role.as_str()];
        let queued = routing.runtime.get(i).map_or(0, |rt| rt.tokens.queued_requests.load(Ordering::Relaxed)).min(i64::MAX as u64) as i64;
        m.worker_queued.with_label_values(&labels).set(queued);
        m.worker_prompt_tokens.with_label_values(&labels).set(view.prompt_tokens(i).min(i64::MAX as u64) as i64);
        m.worker_free_kv_tokens.with_label_values(&labels).set(view.free_kv_tokens(i).map_or(-1, |f| f.min(i64::MAX as u64) as i64));
    }
}

/// Counts one request in flight on a worker for as long as it lives: in the worker's runtime
/// counter (load-aware routing, draining) and in the Prometheus gauge.
pub struct InflightGuard(prometheus::IntGauge, Arc<Runtime>);

impl InflightGuard {
    pub fn new(metrics: &Metrics, runtime: &Arc<Runtime>, worker: &str, role: &str) -> Self {
        let g = metrics.inflight.with_label_values(&[worker, role]);
        g.inc();
        runtime.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard(g, runtime.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.dec();
        self.1.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}
