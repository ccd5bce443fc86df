//! Brings the registry's discovered workers to the desired set: adds what is missing (with a
//! first health check, so a new worker serves at once), drains what left. Level-triggered: it
//! runs after every batch of watch events and on a timer, so an edit that has to wait (a URL
//! still draining from its previous pod) happens on a later pass. Workers from static flags or
//! the `/workers` API are never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::fleet::health::check_and_record;
use crate::fleet::membership::{self, Change};
use crate::fleet::registry::{Entry, RegistryError, Source};
use crate::fleet::Fleet;

use super::pod::Candidate;

#[derive(Default)]
pub struct Syncer {
    /// URLs owned by another source, already logged (once each).
    conflicts_logged: BTreeSet<String>,
}

/// Whether a registered worker still is what the pod describes (a recreated pod on a reused IP
/// has a new uid; a changed annotation changes the spec).
fn same_worker(e: &Entry, c: &Candidate) -> bool {
    let (a, b) = (&*e.spec, &c.spec);
    a.role == b.role
        && a.bootstrap_port == b.bootstrap_port
        && a.kv_connector == b.kv_connector
        && a.labels == b.labels
        && a.kv_engine_id == b.kv_engine_id
        && a.kv_events == b.kv_events
        && a.kv_events_replay == b.kv_events_replay
}

impl Syncer {
    pub fn sync(&mut self, state: &Arc<Fleet>, desired: &BTreeMap<String, Candidate>) {
        let entries = state.registry.list();
        let mut present: BTreeMap<&str, &Entry> = BTreeMap::new();
        for e in &entries {
            present.insert(e.spec.url.as_str(), e);
            if e.source != Source::Discovery || e.draining {
                continue;
            }
            let keep = desired.get(&e.spec.url).is_some_and(|c| same_worker(e, c));
            if !keep && membership::apply(state, Change::Drain(e.id.clone())).is_ok() {
                state.metrics.discovery_events.with_label_values(&["worker_removed"]).inc();
                tracing::info!(worker = %e.spec.url, role = e.spec.role.as_str(), pod = e.spec.labels.get(super::pod::POD_LABEL).map(String::as_str).unwrap_or(""), "discovered worker left; draining it");
            }
        }
        for (url, c) in desired {
            match present.get(url.as_str()) {
                // Still draining from an earlier pod (or changed spec): re-added on a later pass.
                Some(e) if e.source == Source::Discovery => continue,
                Some(e) => {
                    if self.conflicts_logged.insert(url.clone()) {
                        tracing::warn!(worker = %url, source = e.source.as_str(), "a discovered pod has the URL of a worker added by hand; leaving that worker alone");
                    }
                    continue;
                }
                None => {}
            }
            self.add(state, c);
        }
        self.conflicts_logged.retain(|u| desired.contains_key(u));
        super::refresh_worker_gauge(state);
    }

    fn add(&mut self, state: &Arc<Fleet>, c: &Candidate) {
        // A pod at this gateway's own address (e.g. selectors that match the gateway's pod).
        if state.own.is_me_literal(&c.spec.url) == Some(true) {
            state.metrics.edge.loops.with_label_values(&["registration"]).inc();
            if matches!(state.log.check(&c.spec.url, std::time::Instant::now()), crate::observe::log_limit::Verdict::Log { .. }) {
                tracing::warn!(worker = %c.spec.url, "discovered pod skipped: {}", state.own.refusal(&c.spec.url));
            }
            return;
        }
        match membership::apply(state, Change::Add(c.spec.clone(), Source::Discovery)) {
            Ok(entry) => {
                state.metrics.discovery_events.with_label_values(&["worker_added"]).inc();
                tracing::info!(worker = %entry.spec.url, role = entry.spec.role.as_str(), id = %entry.id, pod = entry.spec.labels.get(super::pod::POD_LABEL).map(String::as_str).unwrap_or(""), "discovered worker added");
                let state = state.clone();
                tokio::spawn(async move { check_and_record(&state, entry).await });
            }
            // Raced with another source between `list` and `add`: the next pass sorts it out.
            Err(RegistryError::Duplicate(_) | RegistryError::NotFound(_)) => {}
        }
    }
}
