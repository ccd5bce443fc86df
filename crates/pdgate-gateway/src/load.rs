//! Load as routing sees it: the gateway's own in-flight count per worker plus what the engine
//! reports about its queue, polled in the background. Stale reports age out.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use http_body_util::BodyExt;
use pdgate_core::policy::LoadView;
use pdgate_core::Leg;
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::{timeout, MissedTickBehavior};

use crate::health::get_json;
use crate::registry::{Entry, Runtime};
use crate::state::AppState;

/// Polls in flight at once.
const CONCURRENT_POLLS: usize = 64;
/// A report older than this many poll intervals is ignored.
const STALE_INTERVALS: u64 = 3;

/// The load view a policy reads: in-flight + fresh polled load, by snapshot index.
pub struct GatewayLoads<'a> {
    pub runtime: &'a [Arc<Runtime>],
    pub now_ms: u64,
    pub stale_after_ms: u64,
}

impl LoadView for GatewayLoads<'_> {
    fn load(&self, worker: usize) -> u64 {
        let Some(rt) = self.runtime.get(worker) else { return 0 };
        let inflight = rt.inflight.load(Ordering::Relaxed);
        let polled = rt.polled_load.load(Ordering::Relaxed);
        let fresh = self.now_ms.saturating_sub(rt.polled_at_ms.load(Ordering::Relaxed)) <= self.stale_after_ms;
        if polled >= 0 && fresh {
            inflight + polled as u64
        } else {
            inflight
        }
    }
}

pub fn stale_after_ms(state: &AppState) -> u64 {
    if state.config.load_poll_interval_secs == 0 {
        0
    } else {
        state.config.load_poll_interval_secs * 1000 * STALE_INTERVALS
    }
}

pub fn spawn_poller(state: &Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let interval = state.config.load_poll_interval_secs;
    if interval == 0 {
        return;
    }
    let state = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(interval));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let entries: Vec<Entry> = state.registry.list().into_iter().filter(|e| e.health.healthy).collect();
            futures_util::stream::iter(entries).for_each_concurrent(CONCURRENT_POLLS, |e| poll_one(&state, e)).await;
        }
    });
}

async fn poll_one(state: &AppState, entry: Entry) {
    let load = match get_json(state, &format!("{}/v1/loads", entry.spec.url)).await {
        Some(v) => sglang_load(&v),
        None => vllm_load(state, &entry.spec.url).await,
    };
    let rt = &entry.runtime;
    rt.polled_load.store(load.map(|l| l as i64).unwrap_or(-1), Ordering::Relaxed);
    rt.polled_at_ms.store(state.registry.now_ms(), Ordering::Relaxed);
    state.metrics.worker_load.with_label_values(&[&entry.spec.url, entry.spec.role.as_str()]).set(load.map(|l| l as i64).unwrap_or(-1));
}

/// SGLang `/v1/loads`: `{"loads": [{num_running_reqs, num_waiting_reqs, ...}, ...]}` (one per
/// data-parallel rank): the sum of running and waiting requests.
pub fn sglang_load(v: &Value) -> Option<u64> {
    let ranks = v.get("loads")?.as_array()?;
    let mut total = 0;
    for r in ranks {
        total += r.get("num_running_reqs").and_then(Value::as_u64).unwrap_or(0);
        total += r.get("num_waiting_reqs").and_then(Value::as_u64).unwrap_or(0);
    }
    Some(total)
}

/// vLLM `/metrics`: `vllm:num_requests_running` + `vllm:num_requests_waiting` gauges.
async fn vllm_load(state: &AppState, base: &str) -> Option<u64> {
    let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
    let text = timeout(limit, async {
        let resp = state.upstream.get(&format!("{base}/metrics"), Leg::Regular).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    })
    .await
    .ok()??;
    vllm_metrics_load(&text)
}

pub fn vllm_metrics_load(text: &str) -> Option<u64> {
    let mut found = false;
    let mut total = 0.0;
    for line in text.lines() {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        if name == "vllm:num_requests_running" || name == "vllm:num_requests_waiting" {
            if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                total += v;
                found = true;
            }
        }
    }
    found.then_some(total as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sglang_loads_sum_ranks() {
        let v = json!({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 2}, {"num_running_reqs": 1, "num_waiting_reqs": 0}]});
        assert_eq!(sglang_load(&v), Some(6));
        assert_eq!(sglang_load(&json!({})), None);
    }

    #[test]
    fn vllm_gauges_are_read() {
        let text = "# HELP x\nvllm:num_requests_running{model_name=\"m\"} 4.0\nvllm:num_requests_waiting{model_name=\"m\"} 3.0\nvllm:other 9\n";
        assert_eq!(vllm_metrics_load(text), Some(7));
        assert_eq!(vllm_metrics_load("nothing 1\n"), None);
    }

    #[test]
    fn stale_reports_age_out() {
        let rt = Arc::new(Runtime::default());
        rt.inflight.store(2, Ordering::Relaxed);
        rt.polled_load.store(10, Ordering::Relaxed);
        rt.polled_at_ms.store(1_000, Ordering::Relaxed);
        let fresh = GatewayLoads { runtime: std::slice::from_ref(&rt), now_ms: 2_000, stale_after_ms: 6_000 };
        assert_eq!(fresh.load(0), 12);
        let stale = GatewayLoads { runtime: std::slice::from_ref(&rt), now_ms: 10_000, stale_after_ms: 6_000 };
        assert_eq!(stale.load(0), 2);
    }
}
