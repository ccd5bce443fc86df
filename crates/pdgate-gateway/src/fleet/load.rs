//! Load as routing sees it: the gateway's own queued work per worker (requests, prompt tokens,
//! KV tokens: token_load.rs) plus what the engine reports, polled in the background from
//! SGLang `/v1/loads`, else `/get_load`, else Prometheus `/metrics` (SGLang or vLLM names; the
//! parsers are in pdgate-protocol `engine_load`). Stale reports age out. The same scrape gives
//! a vLLM worker's pairing keys (`cache_config_info`: `block_size`, `cache_dtype`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use http_body_util::BodyExt;
use pdgate_core::policy::LoadView;
use pdgate_core::{KvLayout, Leg};
use pdgate_protocol::engine_load::{self, EngineLoad, TransferTotals};
use tokio::sync::watch;
use tokio::time::{timeout, MissedTickBehavior};

use crate::fleet::health::get_json;
use crate::fleet::registry::{Entry, Runtime};
use crate::fleet::Fleet;

/// Polls in flight at once.
const CONCURRENT_POLLS: usize = 64;
/// A report older than this many poll intervals is ignored.
const STALE_INTERVALS: u64 = 3;

/// The load view a policy reads, by snapshot index: the gateway's own queued work plus the
/// engine's fresh report. A report older than `stale_after_ms` is ignored.
pub struct GatewayLoads<'a> {
    pub runtime: &'a [Arc<Runtime>],
    pub now_ms: u64,
    pub stale_after_ms: u64,
}

impl GatewayLoads<'_> {
    /// The worker's runtime and whether its engine report is fresh.
    fn worker(&self, worker: usize) -> Option<(&Runtime, bool)> {
        let rt = self.runtime.get(worker)?;
        let fresh = self.now_ms.saturating_sub(rt.polled_at_ms.load(Ordering::Relaxed)) <= self.stale_after_ms;
        Some((rt, fresh))
    }
}

impl LoadView for GatewayLoads<'_> {
    /// Queued requests (a prefill's end at its KV handoff) + the engine's running and waiting.
    fn load(&self, worker: usize) -> u64 {
        let Some((rt, fresh)) = self.worker(worker) else { return 0 };
        let queued = rt.tokens.queued_requests.load(Ordering::Relaxed);
        let polled = rt.polled_load.load(Ordering::Relaxed);
        if polled >= 0 && fresh {
            queued + polled as u64
        } else {
            queued
        }
    }

    fn prompt_tokens(&self, worker: usize) -> u64 {
        let Some((rt, fresh)) = self.worker(worker) else { return 0 };
        let own = rt.tokens.prompt_tokens.load(Ordering::Relaxed);
        let waiting = if fresh { rt.tokens.reported_waiting_tokens().unwrap_or(0) } else { 0 };
        own.saturating_add(waiting)
    }

    fn free_kv_tokens(&self, worker: usize) -> Option<u64> {
        let (rt, fresh) = self.worker(worker)?;
        if fresh {
            rt.tokens.free_kv()
        } else {
            None
        }
    }

    fn running(&self, worker: usize) -> u64 {
        let Some((rt, fresh)) = self.worker(worker) else { return 0 };
        match rt.tokens.reported_running().filter(|_| fresh) {
            Some(r) => r,
            None => rt.tokens.queued_requests.load(Ordering::Relaxed),
        }
    }
}

pub fn stale_after_ms(state: &Fleet) -> u64 {
    if state.config.load_poll_interval_secs == 0 {
        0
    } else {
        state.config.load_poll_interval_secs * 1000 * STALE_INTERVALS
    }
}

/// Where the engines' cumulative KV-transfer counters go: the placement cost model
/// (exec/placement.rs). The fleet reports them; the decision owns what they teach.
pub trait TransferSink: Send + Sync {
    fn observe_transfers(&self, worker: &str, totals: TransferTotals);
}

pub fn spawn_poller(state: &Arc<Fleet>, transfers: Arc<dyn TransferSink>, mut shutdown: watch::Receiver<bool>) {
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
            futures_util::stream::iter(entries).for_each_concurrent(CONCURRENT_POLLS, |e| poll_one(&state, &*transfers, e)).await;
        }
    });
}

/// Where a worker's load report comes from, in the order tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// SGLang `/v1/loads` (and the reference engine).
    Loads = 1,
    /// SGLang's older `/get_load`.
    GetLoad = 2,
    /// Prometheus `/metrics`, SGLang's or vLLM's names.
    Metrics = 3,
}

const SOURCES: [Source; 3] = [Source::Loads, Source::GetLoad, Source::Metrics];

async fn poll_one(state: &Fleet, transfers: &dyn TransferSink, entry: Entry) {
    let rt = &entry.runtime;
    // The source that answered last time first; the others only when it does not.
    let last = rt.load_source.load(Ordering::Relaxed);
    let order = SOURCES.iter().filter(|s| **s as u8 == last).chain(SOURCES.iter().filter(|s| **s as u8 != last));
    let mut report = None;
    if pdgate_core::worker::is_grpc_url(&entry.spec.url) {
        // gRPC workers report over GetLoads only; the HTTP sources below are not theirs.
        let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
        report = state.grpc.loads(&entry.spec.url, limit).await;
    }
    let order = order.filter(|_| !pdgate_core::worker::is_grpc_url(&entry.spec.url));
    for source in order {
        if let Some(r) = fetch(state, &entry.spec.url, *source).await {
            rt.load_source.store(*source as u8, Ordering::Relaxed);
            report = Some(r);
            break;
        }
    }
    let requests = report.as_ref().and_then(EngineLoad::requests);
    rt.polled_load.store(requests.map_or(-1, |l| l as i64), Ordering::Relaxed);
    match &report {
        Some(r) => rt.tokens.store_report(r),
        None => rt.tokens.clear_report(),
    }
    rt.polled_at_ms.store(state.registry.now_ms(), Ordering::Relaxed);
    state.metrics.worker_load.with_label_values(&[&entry.spec.url, entry.spec.role.as_str()]).set(requests.map_or(-1, |l| l as i64));
    // The engine's KV transfers since its last report: the placement's transfer fit.
    if let Some(t) = report.as_ref().and_then(|r| r.transfers) {
        transfers.observe_transfers(&entry.spec.url, t);
    }
    if let Some(r) = report.filter(|r| r.block_size.is_some() || r.cache_dtype.is_some()) {
        let layout = KvLayout { page_size: r.block_size, kv_dtype: r.cache_dtype.clone(), ..KvLayout::default() };
        state.registry.learn_pairing(&entry.id, r.runtime, &layout);
    }
}

async fn fetch(state: &Fleet, base: &str, source: Source) -> Option<EngineLoad> {
    match source {
        Source::Loads => engine_load::from_sglang_loads(&get_json(state, &format!("{base}/v1/loads")).await?),
        Source::GetLoad => engine_load::from_sglang_get_load(&get_json(state, &format!("{base}/get_load")).await?),
        Source::Metrics => engine_load::from_metrics(&get_text(state, &format!("{base}/metrics")).await?),
    }
}

/// Largest `/metrics` page read: engines' pages are tens of KiB; a worker is not trusted to
/// bound its own answer.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// GETs a text page within the health-check timeout.
async fn get_text(state: &Fleet, url: &str) -> Option<String> {
    let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
    timeout(limit, async {
        let resp = state.upstream.get(url, Leg::Regular).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES).collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    })
    .await
    .ok()?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::gauges::InflightGuard;
    use crate::fleet::token_load::TokenGuard;

    #[test]
    fn stale_reports_age_out() {
        let rt = Arc::new(Runtime::default());
        let _a = TokenGuard::new(&rt, 300, 0);
        let _b = TokenGuard::new(&rt, 200, 0);
        rt.polled_load.store(10, Ordering::Relaxed);
        rt.tokens.store_report(&EngineLoad { running: Some(7), waiting_prompt_tokens: Some(40), used_kv_tokens: Some(10), total_kv_tokens: Some(110), ..EngineLoad::default() });
        rt.polled_at_ms.store(1_000, Ordering::Relaxed);
        let fresh = GatewayLoads { runtime: std::slice::from_ref(&rt), now_ms: 2_000, stale_after_ms: 6_000 };
        assert_eq!((fresh.load(0), fresh.prompt_tokens(0), fresh.free_kv_tokens(0), fresh.running(0)), (12, 540, Some(100), 7));
        let stale = GatewayLoads { runtime: std::slice::from_ref(&rt), now_ms: 10_000, stale_after_ms: 6_000 };
        assert_eq!((stale.load(0), stale.prompt_tokens(0), stale.free_kv_tokens(0), stale.running(0)), (2, 500, None, 2));
    }

    /// The field's bug (issue 13): a prefill worker whose requests all decode elsewhere looked
    /// busy. Its drain count holds while the decodes run; its routing load is zero.
    #[test]
    fn a_prefill_whose_requests_decode_elsewhere_is_idle_for_routing() {
        let metrics = crate::observe::metrics::Metrics::new();
        let rt = Arc::new(Runtime::default());
        let drains: Vec<InflightGuard> = (0..3).map(|_| InflightGuard::new(&metrics, &rt, "http://p:1", "prefill")).collect();
        let prefills: Vec<TokenGuard> = (0..3).map(|_| TokenGuard::new(&rt, 1_000, 0)).collect();
        let view = GatewayLoads { runtime: std::slice::from_ref(&rt), now_ms: 0, stale_after_ms: 0 };
        assert_eq!((view.load(0), view.prompt_tokens(0)), (3, 3_000), "prefilling: busy");
        drop(prefills); // the KV was handed off; the decodes run elsewhere
        assert_eq!((view.load(0), view.prompt_tokens(0)), (0, 0), "idle for routing");
        assert_eq!(rt.inflight.load(Ordering::SeqCst), 3, "still owed the transfers: drain waits");
        drop(drains);
        assert_eq!(rt.inflight.load(Ordering::SeqCst), 0);
    }
}
