//! The discovery task: a kube client, one pod watcher per role, and the loop that turns watch
//! events into `Change`s and syncs the registry.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{select_all, BoxStream};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use pdgate_core::{GatewayConfig, WorkerRole};
use rand::Rng;
use tokio::sync::watch;

use super::pod::{pod_key, verdict, RoleSelector, Selector, Verdict};
use super::state::{desired, Change, PodSet};
use super::sync::Syncer;
use crate::fleet::Fleet;

/// Registry re-sync without events: retries edits that had to wait (a URL still draining).
const RESYNC: Duration = Duration::from_secs(1);
/// Server-side watch timeout; the watch is resumed from its resourceVersion after it.
const WATCH_TIMEOUT_SECS: u32 = 120;
/// Backoff after a failed list or watch: doubles from the first to the last, with jitter.
const BACKOFF_FIRST: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(15);

/// Exponential backoff with jitter, reset by the first event after a failure.
struct WatchBackoff(Duration);

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let base = self.0;
        self.0 = (base * 2).min(BACKOFF_MAX);
        let jitter = rand::rng().random_range(0..=base.as_millis() as u64 / 4);
        Some(base + Duration::from_millis(jitter))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.0 = BACKOFF_FIRST;
    }
}

/// The roles to watch and their selectors: `--selector` in regular mode; in PD mode
/// `--selector` plus the role's own, each refusing pods that match the other role's too.
pub fn role_selectors(config: &GatewayConfig) -> Vec<RoleSelector> {
    let common = Selector::parse(&config.selector);
    if !config.pd_disaggregation {
        return vec![RoleSelector { role: WorkerRole::Regular, selector: common, conflicting: None }];
    }
    let prefill = common.and(&Selector::parse(&config.prefill_selector));
    let decode = common.and(&Selector::parse(&config.decode_selector));
    vec![
        RoleSelector { role: WorkerRole::Prefill, selector: prefill.clone(), conflicting: Some(decode.clone()) },
        RoleSelector { role: WorkerRole::Decode, selector: decode, conflicting: Some(prefill) },
    ]
}

/// The kube client from `--kubeconfig` or the in-cluster service account. Built at start: a
/// gateway asked to discover workers but unable to reach Kubernetes refuses to start.
pub async fn client(config: &GatewayConfig) -> Result<Client, String> {
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| format!("--kubeconfig {path}: {e}"))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default()).await.map_err(|e| format!("--kubeconfig {path}: {e}"))?
        }
        None => kube::Config::incluster().map_err(|e| format!("no in-cluster Kubernetes config ({e}); outside a cluster pass --kubeconfig"))?,
    };
    Client::try_from(kube_config).map_err(|e| format!("cannot build a Kubernetes client: {e}"))
}

type RoleEvent = (usize, Result<Event<Pod>, watcher::Error>);

fn watch_streams(client: Client, config: &GatewayConfig, roles: &[RoleSelector]) -> BoxStream<'static, RoleEvent> {
    let api: Api<Pod> = match &config.service_discovery_namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let streams = roles.iter().enumerate().map(|(i, role)| {
        let wc = watcher::Config::default().labels(&role.selector.to_query()).timeout(WATCH_TIMEOUT_SECS);
        watcher::watcher(api.clone(), wc).backoff(WatchBackoff(BACKOFF_FIRST)).map(move |ev| (i, ev)).boxed()
    });
    select_all(streams).boxed()
}

/// Runs discovery until shutdown.
pub async fn run(state: Arc<Fleet>, client: Client, mut shutdown: watch::Receiver<bool>) {
    let roles = role_selectors(&state.config);
    // Export the counter at 0 from the start.
    state.metrics.discovery_watch_restarts.with_label_values(&[] as &[&str]).inc_by(0);
    for r in &roles {
        let ns = state.config.service_discovery_namespace.as_deref().unwrap_or("(all namespaces)");
        tracing::info!(role = r.role.as_str(), selector = %r.selector.to_query(), namespace = ns, "watching pods");
    }
    let mut events = watch_streams(client, &state.config, &roles);
    let mut sets: Vec<PodSet> = roles.iter().map(|_| PodSet::default()).collect();
    let mut syncer = Syncer::default();
    let mut clashes_logged = BTreeSet::new();
    let mut tick = tokio::time::interval(RESYNC);
    loop {
        tokio::select! {
            ev = events.next() => match ev {
                Some((i, ev)) => handle(&state, &roles[i], &mut sets[i], ev),
                None => return,
            },
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let (want, clashes) = desired(&sets);
        for c in clashes {
            if clashes_logged.insert(c.clone()) {
                tracing::warn!("{c}; ignoring it");
            }
        }
        syncer.sync(&state, &want);
    }
}

fn judged(state: &Fleet, pod: &Pod, role: &RoleSelector) -> (String, Verdict) {
    let key = pod_key(pod);
    let v = verdict(pod, role, state.config.service_discovery_port);
    match &v {
        Verdict::Refused(reason) => {
            state.metrics.discovery_events.with_label_values(&["pod_refused"]).inc();
            tracing::warn!(pod = %key, role = role.role.as_str(), reason = %reason, "pod refused as a worker");
        }
        Verdict::NotServing(why) => tracing::debug!(pod = %key, why, "pod is not serving"),
        Verdict::Worker(_) => {}
    }
    (key, v)
}

fn handle(state: &Fleet, role: &RoleSelector, set: &mut PodSet, ev: Result<Event<Pod>, watcher::Error>) {
    let count = |kind: &str| state.metrics.discovery_events.with_label_values(&[kind]).inc();
    let change = match ev {
        Ok(Event::Init) => {
            count("relist");
            Change::Reset
        }
        Ok(Event::InitApply(pod)) => {
            let (key, v) = judged(state, &pod, role);
            Change::Listed(key, v)
        }
        Ok(Event::InitDone) => Change::ResetDone,
        Ok(Event::Apply(pod)) => {
            count("apply");
            let (key, v) = judged(state, &pod, role);
            Change::Upsert(key, v)
        }
        Ok(Event::Delete(pod)) => {
            count("delete");
            Change::Remove(pod_key(&pod))
        }
        Err(e) => {
            state.metrics.discovery_watch_restarts.with_label_values(&[] as &[&str]).inc();
            tracing::warn!(role = role.role.as_str(), error = %e, "pod watch interrupted; resuming with backoff");
            return;
        }
    };
    set.apply(change);
}
