//! Active health checks: one task per worker, results fed through the thresholds of
//! `HealthState`; a change rebuilds the routing snapshot. Also learns each worker's models.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use pdgate_core::Leg;
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::{timeout, MissedTickBehavior};

use crate::state::AppState;

pub fn spawn_checks(state: &Arc<AppState>, shutdown: watch::Receiver<bool>) {
    for spec in state.registry.specs() {
        let state = state.clone();
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let cfg = &state.config;
            let mut tick = tokio::time::interval(Duration::from_secs(cfg.health_check_interval_secs.max(1)));
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let url = format!("{}{}", spec.url, cfg.health_check_endpoint);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.changed() => return,
                }
                let ok = check(&state, &url).await;
                let m = state.metrics.worker_healthy.with_label_values(&[&spec.url, spec.role.as_str()]);
                if let Some(healthy) = state.registry.observe_health(&spec.url, ok, cfg.health_failure_threshold, cfg.health_success_threshold) {
                    tracing::info!(worker = %spec.url, role = spec.role.as_str(), healthy, "worker health changed");
                }
                let healthy = state.registry.snapshot().workers().iter().any(|w| w.spec.url == spec.url && w.healthy);
                m.set(i64::from(healthy));
                if healthy && state.registry.models_unknown(&spec.url) {
                    if let Some(models) = fetch_models(&state, &spec.url).await {
                        state.registry.set_models(&spec.url, models);
                    }
                }
            }
        });
    }
}

async fn check(state: &AppState, url: &str) -> bool {
    let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
    let result = timeout(limit, async {
        let resp = state.upstream.get(url, Leg::Regular).await.ok()?;
        let ok = resp.status().is_success();
        // Read the body so the connection can be reused.
        resp.into_body().collect().await.ok()?;
        Some(ok)
    })
    .await;
    matches!(result, Ok(Some(true)))
}

async fn fetch_models(state: &AppState, base: &str) -> Option<Vec<String>> {
    let limit = Duration::from_secs(state.config.health_check_timeout_secs.max(1));
    let body = timeout(limit, async {
        let resp = state.upstream.get(&format!("{base}/v1/models"), Leg::Regular).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.into_body().collect().await.ok().map(|b| b.to_bytes())
    })
    .await
    .ok()??;
    let v: Value = serde_json::from_slice(&body).ok()?;
    let ids: Vec<String> = v.get("data")?.as_array()?.iter().filter_map(|m| m.get("id")?.as_str().map(str::to_string)).collect();
    Some(ids)
}
