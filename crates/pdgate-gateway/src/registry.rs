//! The worker registry: the mutable list of workers and their health, and the immutable
//! snapshot that routing reads. Every change rebuilds the snapshot and swaps it in atomically.

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use pdgate_core::{HealthState, KvConnector, PoolSnapshot, WorkerSpec, WorkerView};

#[derive(Clone, Debug)]
struct Entry {
    spec: Arc<WorkerSpec>,
    health: HealthState,
    enabled: bool,
    models: Vec<String>,
}

pub struct Registry {
    entries: Mutex<Vec<Entry>>,
    snapshot: ArcSwap<PoolSnapshot>,
    default_connector: KvConnector,
}

impl Registry {
    pub fn new(specs: Vec<WorkerSpec>, default_connector: KvConnector) -> Self {
        let entries: Vec<Entry> = specs
            .into_iter()
            .map(|s| Entry { spec: Arc::new(s), health: HealthState::default(), enabled: true, models: vec![] })
            .collect();
        let reg = Registry { entries: Mutex::new(entries), snapshot: ArcSwap::from_pointee(PoolSnapshot::default()), default_connector };
        reg.rebuild();
        reg
    }

    /// The current routing view; cheap (one atomic load).
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.snapshot.load_full()
    }

    pub fn specs(&self) -> Vec<Arc<WorkerSpec>> {
        self.lock().iter().map(|e| e.spec.clone()).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        // A panic while holding this lock cannot leave the list half-edited (edits are single
        // assignments), so a poisoned lock is still safe to use.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn rebuild_from(&self, entries: &[Entry]) {
        let views = entries
            .iter()
            .map(|e| WorkerView { spec: e.spec.clone(), healthy: e.health.healthy, enabled: e.enabled, models: e.models.clone() })
            .collect();
        self.snapshot.store(Arc::new(PoolSnapshot::build(views, self.default_connector)));
    }

    fn rebuild(&self) {
        let entries = self.lock();
        self.rebuild_from(&entries);
    }

    /// Records a health check result; returns the new health when it changed.
    pub fn observe_health(&self, url: &str, ok: bool, failure_threshold: u32, success_threshold: u32) -> Option<bool> {
        let mut entries = self.lock();
        let entry = entries.iter_mut().find(|e| e.spec.url == url)?;
        let changed = entry.health.observe(ok, failure_threshold, success_threshold);
        let healthy = entry.health.healthy;
        if changed {
            self.rebuild_from(&entries);
            return Some(healthy);
        }
        None
    }

    /// Whether the models of `url` are still unknown.
    pub fn models_unknown(&self, url: &str) -> bool {
        self.lock().iter().any(|e| e.spec.url == url && e.models.is_empty())
    }

    pub fn set_models(&self, url: &str, models: Vec<String>) {
        let mut entries = self.lock();
        if let Some(e) = entries.iter_mut().find(|e| e.spec.url == url) {
            e.models = models;
            self.rebuild_from(&entries);
        }
    }
}
