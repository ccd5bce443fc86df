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
/// `--selector` plus the role's own (prefill, decode and, in EPD mode with
/// `--encode-selector`, encode), each refusing pods that match another role's too.
pub fn role_selectors(config: &GatewayConfig) -> Vec<RoleSelector> {
    let common = Selector::parse(&config.selector);
    if !config.pd_disaggregation {
        return vec![RoleSelector { role: WorkerRole::Regular, selector: common, flag: "--selector", conflicting: Vec::new() }];
    }
    let mut roles = vec![(WorkerRole::Prefill, "--prefill-selector", &config.prefill_selector), (WorkerRole::Decode, "--decode-selector", &config.decode_selector)];
    if config.epd_disaggregation && !config.encode_selector.is_empty() {
        roles.push((WorkerRole::Encode, "--encode-selector", &config.encode_selector));
    }
    let selectors: Vec<(&'static str, Selector)> = roles.iter().map(|(_, flag, items)| (*flag, common.and(&Selector::parse(items.iter())))).collect();
    roles
        .iter()
        .zip(&selectors)
        .map(|((role, flag, _), (_, selector))| RoleSelector {
            role: *role,
            selector: selector.clone(),
            flag,
            conflicting: selectors.iter().filter(|(other, _)| other != flag).cloned().collect(),
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> GatewayConfig {
        let mut argv = vec!["pdgate-gateway", "--service-discovery", "--selector", "team=ml"];
        argv.extend_from_slice(args);
        GatewayConfig::parse_cli(argv).unwrap()
    }

    #[test]
    fn pd_watches_prefill_and_decode_and_epd_adds_encode_when_selected() {
        let pd = role_selectors(&config(&["--pd-disaggregation", "--prefill-selector", "app=p", "--decode-selector", "app=d"]));
        assert_eq!(pd.iter().map(|r| r.role).collect::<Vec<_>>(), [WorkerRole::Prefill, WorkerRole::Decode]);
        let epd_static = role_selectors(&config(&["--epd-disaggregation", "--prefill-selector", "app=p", "--decode-selector", "app=d"]));
        assert_eq!(epd_static.len(), 2, "no --encode-selector: encode workers come from --encode and the API");
        let epd = role_selectors(&config(&["--epd-disaggregation", "--prefill-selector", "app=p", "--decode-selector", "app=d", "--encode-selector", "app=e"]));
        assert_eq!(epd.iter().map(|r| r.role).collect::<Vec<_>>(), [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Encode]);
        let encode = &epd[2];
        assert_eq!((encode.flag, encode.selector.to_query()), ("--encode-selector", "app=e,team=ml".to_string()));
        let others: Vec<_> = encode.conflicting.iter().map(|(flag, s)| (*flag, s.to_query())).collect();
        assert_eq!(others, [("--prefill-selector", "app=p,team=ml".to_string()), ("--decode-selector", "app=d,team=ml".to_string())]);
        assert!(epd[0].conflicting.iter().any(|(flag, _)| *flag == "--encode-selector"), "a prefill pod must not match the encode selector either");
    }
}
