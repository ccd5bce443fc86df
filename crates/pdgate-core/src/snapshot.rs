//! An immutable view of the whole pool: every routing decision reads one snapshot, so it never
//! sees half an update. The registry in `pdgate-gateway` rebuilds and swaps it atomically when
//! membership or health changes; nothing here changes after `build`.

use std::collections::HashMap;
use std::sync::Arc;

use crate::worker::{KvConnector, WorkerRole, WorkerSpec};

/// One worker as routing sees it.
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub spec: Arc<WorkerSpec>,
    /// Result of active health checks (with thresholds applied).
    pub healthy: bool,
    /// Administrative switch; a disabled worker is not a failed one.
    pub enabled: bool,
    /// Model names the worker serves, when known.
    pub models: Vec<String>,
}

impl WorkerView {
    pub fn eligible(&self) -> bool {
        self.healthy && self.enabled
    }
}

#[derive(Clone, Debug, Default)]
pub struct PoolSnapshot {
    workers: Vec<WorkerView>,
    default_connector: KvConnector,
    /// Indices of eligible workers per role.
    regular: Vec<usize>,
    prefill: Vec<usize>,
    decode: Vec<usize>,
    /// Eligible decodes by connector: the pairing index.
    decode_by_connector: HashMap<KvConnector, Vec<usize>>,
    /// Eligible prefills that have at least one compatible eligible decode.
    pairable_prefill: Vec<usize>,
}

impl PoolSnapshot {
    pub fn build(workers: Vec<WorkerView>, default_connector: KvConnector) -> Self {
        let mut snap = PoolSnapshot { workers, default_connector, ..Default::default() };
        for (i, w) in snap.workers.iter().enumerate() {
            if !w.eligible() {
                continue;
            }
            match w.spec.role {
                WorkerRole::Regular => snap.regular.push(i),
                WorkerRole::Prefill => snap.prefill.push(i),
                WorkerRole::Decode => {
                    snap.decode.push(i);
                    snap.decode_by_connector.entry(w.spec.connector(default_connector)).or_default().push(i);
                }
            }
        }
        snap.pairable_prefill = snap
            .prefill
            .iter()
            .copied()
            .filter(|&p| !snap.compatible_decodes(p).is_empty())
            .collect();
        snap
    }

    pub fn workers(&self) -> &[WorkerView] {
        &self.workers
    }

    pub fn worker(&self, index: usize) -> &WorkerView {
        &self.workers[index]
    }

    pub fn default_connector(&self) -> KvConnector {
        self.default_connector
    }

    /// The connector worker `index` speaks.
    pub fn connector_of(&self, index: usize) -> KvConnector {
        self.workers[index].spec.connector(self.default_connector)
    }

    pub fn eligible(&self, role: WorkerRole) -> &[usize] {
        match role {
            WorkerRole::Regular => &self.regular,
            WorkerRole::Prefill => &self.prefill,
            WorkerRole::Decode => &self.decode,
        }
    }

    /// Prefills that can be paired with some eligible decode.
    pub fn pairable_prefills(&self) -> &[usize] {
        &self.pairable_prefill
    }

    /// Eligible decodes that speak the same KV connector as prefill `prefill`.
    pub fn compatible_decodes(&self, prefill: usize) -> &[usize] {
        self.decode_by_connector.get(&self.connector_of(prefill)).map(Vec::as_slice).unwrap_or(&[])
    }

    /// PD mode is ready when at least one prefill can be paired with a decode.
    pub fn pd_ready(&self) -> bool {
        !self.pairable_prefill.is_empty()
    }

    /// Why no pair exists, for the `no_compatible_pd_pair` message.
    pub fn pairing_gap(&self) -> String {
        let names = |idx: &[usize]| {
            let mut v: Vec<&str> = idx.iter().map(|&i| self.connector_of(i).as_str()).collect();
            v.sort_unstable();
            v.dedup();
            v.join(",")
        };
        format!(
            "no decode worker speaks the KV transport of any healthy prefill (prefill transports: [{}], decode transports: [{}])",
            names(&self.prefill),
            names(&self.decode)
        )
    }

    /// Models served by eligible workers, sorted and deduplicated.
    pub fn models(&self) -> Vec<String> {
        let mut out: Vec<String> = self.workers.iter().filter(|w| w.eligible()).flat_map(|w| w.models.iter().cloned()).collect();
        out.sort();
        out.dedup();
        out
    }
}
