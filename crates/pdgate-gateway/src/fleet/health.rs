//! Active health checks: every interval, each worker is checked (concurrently, bounded), the
//! result goes through the thresholds of `HealthState`, and a change rebuilds the routing view.
//! A healthy worker's models and disaggregation mode are learned once from the engine.
//!
//! A busy engine is not a dead one (docs/fleet.md, "Busy is not down"): a check that went
//! unanswered does not count against a worker whose data-path requests succeeded within the
//! last interval (the passive signal, `Runtime::served_within`); a refused connection or an
//! error status counts at once. A role whose workers are all out by unanswered checks alone is
//! routed to anyway (panic routing, `PoolSnapshot::in_panic`), counted and logged here.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use http_body_util::BodyExt;
use pdgate_core::{Leg, Probe, WorkerRole};
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::{timeout, MissedTickBehavior};

use crate::clients::engine_info::{model_cards, server_info_facts, EngineInfo};
use crate::fleet::registry::Entry;
use crate::fleet::Fleet;

/// Checks in flight at once, so a large fleet does not open thousands of sockets per round.
const CONCURRENT_CHECKS: usize = 64;

pub fn spawn_supervisor(state: &Arc<Fleet>, mut shutdown: watch::Receiver<bool>) {
    let state = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(state.config.health_check_interval_secs.max(1)));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let entries = state.registry.list();
            futures_util::stream::iter(entries).for_each_concurrent(CONCURRENT_CHECKS, |e| check_and_record(&state, e)).await;
        }
    });
}

/// One check of one worker, recorded. Also used right after a worker is added. With
/// `--disable-health-check` the worker is not asked and counts as healthy.
pub async fn check_and_record(state: &Fleet, entry: Entry) {
    let cfg = &state.config;
    let checked = if cfg.disable_health_check { Ok(()) } else { check(state, &entry.spec.url).await };
    let probe = match &checked {
        Ok(()) => Probe::Ok,
        Err(f) if f.unanswered => Probe::Unanswered,
        Err(_) => Probe::Failed,
    };
    if let Err(f) = &checked {
        tracing::debug!(worker = %entry.spec.url, reason = %f.reason, "health check failed");
        entry.runtime.note_error(format!("health check: {}", f.reason));
    }
    // The passive signal: an unanswered check of a worker that is serving requests is not held
    // against it (its health endpoint shares the busy process).
    let window_ms = (cfg.health_check_interval_secs.max(1) + cfg.health_check_timeout_secs.max(1)) * 1000;
    if probe == Probe::Unanswered && entry.runtime.served_within(state.registry.now_ms(), window_ms) {
        tracing::debug!(worker = %entry.spec.url, "health check unanswered, but the worker served a request within the last interval: not counted");
        state.metrics.health_unanswered_serving.with_label_values(&[entry.spec.role.as_str()]).inc();
        return;
    }
    let result = checked.map_err(|f| f.reason);
    // What the engine says about itself (its pairing key: a gRPC worker's connector and role
    // come from GetServerInfo) is learned before it first turns healthy, so it is never paired
    // by the gateway-wide default connector in between. Unchecked workers (health checks off)
    // count as healthy at once and learn it afterwards, so a silent one is not waited on.
    let unknown = entry.info.models.is_empty();
    if result.is_ok() && unknown && !cfg.disable_health_check {
        state.registry.set_info(&entry.id, engine_info(state, &entry.spec.url).await);
    }
    let role = entry.spec.role;
    let was_panic = state.registry.routing().snapshot.in_panic(role);
    let changed = state.registry.observe_health(&entry.id, probe, cfg.health_failure_threshold, cfg.health_success_threshold);
    announce_panic(state, role, was_panic);
    if let Some(healthy) = changed {
        match &result {
            Err(reason) => tracing::warn!(worker = %entry.spec.url, role = entry.spec.role.as_str(), reason = %reason, "worker unhealthy"),
            Ok(()) => tracing::info!(worker = %entry.spec.url, role = entry.spec.role.as_str(), healthy, "worker health changed"),
        }
    } else if let (Err(reason), false) = (&result, entry.health.checked) {
        // A new worker that never answered stays unhealthy without a change: say why once.
        tracing::warn!(worker = %entry.spec.url, role = entry.spec.role.as_str(), reason = %reason, "worker unreachable at its first health check");
    }
    let healthy = state.registry.get(&entry.id).is_some_and(|e| e.health.healthy);
    state.metrics.worker_healthy.with_label_values(&[&entry.spec.url, entry.spec.role.as_str()]).set(i64::from(healthy));
    if healthy && unknown && cfg.disable_health_check {
        state.registry.set_info(&entry.id, engine_info(state, &entry.spec.url).await);
    }
}

/// Entering or leaving panic routing for `role`: a warning naming the workers it now routes to
/// although their checks go unanswered, counted in `pdgate_health_panic_total{role}`, and the
/// `pdgate_health_panic{role}` gauge.
fn announce_panic(state: &Fleet, role: WorkerRole, was: bool) {
    let routing = state.registry.routing();
    let snap = &routing.snapshot;
    let now = snap.in_panic(role);
    if now == was {
        return;
    }
    state.metrics.health_panic.with_label_values(&[role.as_str()]).set(i64::from(now));
    if now {
        state.metrics.health_panic_total.with_label_values(&[role.as_str()]).inc();
        tracing::warn!(
            role = role.as_str(),
            workers = ?snap.panic_workers(role),
            "panic routing: every {} worker is out by unanswered health checks alone (busy, not known down); routing to them anyway, the breaker still takes out one that fails requests",
            role.as_str()
        );
    } else {
        tracing::info!(role = role.as_str(), "panic routing over: a worker of this role passes its health checks again, or none is only silent");
    }
}

/// One health check of the worker at `base` (`--health-check-endpoint`), as the supervisor
/// makes it: healthy only on a 2xx read in full within `--health-check-timeout-secs`. Also
/// asked when a request got no answer by its deadline (`Fleet::ask_worker`, fleet/mod.rs).
pub async fn probe(state: &Fleet, base: &str) -> bool {
    check(state, base).await.is_ok()
}

/// Why a health check failed, and whether the worker answered at all.
#[derive(Debug)]
pub struct CheckFailure {
    pub reason: String,
    /// No answer within `--health-check-timeout-secs` (a busy engine); otherwise the worker or
    /// its host answered no (refused, non-2xx, broken body).
    pub unanswered: bool,
}

/// One health check of the worker at `base`, with the reason when it fails: unreachable,
/// a non-2xx status, a broken body or no answer within the timeout.
pub async fn check(state: &Fleet, base: &str) -> Result<(), CheckFailure> {
    if pdgate_core::worker::is_grpc_url(base) {
        // gRPC workers: the service's HealthCheck (the endpoint flag is HTTP's).
        let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
        return state.grpc.health(base, limit).await.map_err(|(reason, unanswered)| CheckFailure { reason, unanswered });
    }
    let url = format!("{base}{}", state.config.health_check_endpoint);
    let secs = state.config.health_check_timeout_secs.max(1);
    let result = timeout(Duration::from_secs(secs), async {
        let resp = state.upstream.get(&url, Leg::Regular).await.map_err(|e| format!("GET {url}: {}", e.message))?;
        let status = resp.status();
        // Read the body so the connection can be reused.
        resp.into_body().collect().await.map_err(|e| format!("GET {url}: body: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("GET {url}: HTTP {}", status.as_u16()))
        }
    })
    .await;
    match result {
        Ok(r) => r.map_err(|reason| CheckFailure { reason, unanswered: false }),
        Err(_) => Err(CheckFailure { reason: format!("GET {url}: no answer within {secs} s"), unanswered: true }),
    }
}

/// GETs a worker's JSON endpoint within the health-check timeout.
pub async fn get_json(state: &Fleet, url: &str) -> Option<Value> {
    let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
    let body = timeout(limit, async {
        let resp = state.upstream.get(url, Leg::Regular).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.into_body().collect().await.ok().map(|b| b.to_bytes())
    })
    .await
    .ok()??;
    serde_json::from_slice(&body).ok()
}

/// Models from `/v1/models`; mode and runtime from `/server_info` (SGLang, reference engine);
/// the context length from the model cards' `max_model_len` (vLLM, SGLang, reference engine),
/// else `/server_info`'s `context_length` (SGLang).
pub async fn engine_info(state: &Fleet, base: &str) -> EngineInfo {
    if pdgate_core::worker::is_grpc_url(base) {
        return state.grpc.engine_info(base, Duration::from_secs(state.config.health_check_timeout_secs.max(1))).await;
    }
    let cards = get_json(state, &format!("{base}/v1/models")).await;
    let (models, card_context) = cards.as_ref().map(model_cards).unwrap_or_default();
    let server = get_json(state, &format!("{base}/server_info")).await;
    let facts = server.as_ref().map(server_info_facts).unwrap_or_default();
    EngineInfo { models, context_length: card_context.or(facts.context_length), ..facts }
}
