//! The discovered truth: which pods are workers right now, per watched role. It is fed the
//! watchers' stream of changes (`Reset` as a re-list, `Upsert`, `Remove`) and answers with the
//! desired worker set. Pure state, no IO: applying the desired set to the registry is `sync`'s
//! job, which makes the whole thing level-triggered (nothing is lost when one change is missed or
//! one registry edit has to wait).

use std::collections::BTreeMap;

use super::pod::{Candidate, Verdict};

/// One change from a watcher, for the pods of one role.
#[derive(Clone, Debug)]
pub enum Change {
    /// A re-list began: what follows (`Listed`) until `ResetDone` replaces everything known.
    Reset,
    Listed(String, Verdict),
    /// The re-list is complete: pods not listed since `Reset` are gone.
    ResetDone,
    /// A pod was added or changed.
    Upsert(String, Verdict),
    /// A pod was deleted.
    Remove(String),
}

/// The pods of one role, keyed by `namespace/name`, with their verdicts.
#[derive(Debug, Default)]
pub struct PodSet {
    current: BTreeMap<String, Verdict>,
    /// A re-list in progress; replaces `current` at `ResetDone`, so a half-done re-list never
    /// removes workers.
    listing: Option<BTreeMap<String, Verdict>>,
}

impl PodSet {
    pub fn apply(&mut self, change: Change) {
        match change {
            Change::Reset => self.listing = Some(BTreeMap::new()),
            Change::Listed(key, verdict) => {
                self.listing.get_or_insert_with(BTreeMap::new).insert(key, verdict);
            }
            Change::ResetDone => {
                if let Some(listed) = self.listing.take() {
                    self.current = listed;
                }
            }
            Change::Upsert(key, verdict) => {
                self.current.insert(key, verdict);
            }
            Change::Remove(key) => {
                self.current.remove(&key);
            }
        }
    }

    pub fn workers(&self) -> impl Iterator<Item = (&String, &Candidate)> {
        self.current.iter().filter_map(|(k, v)| match v {
            Verdict::Worker(c) => Some((k, c)),
            _ => None,
        })
    }
}

/// The desired worker set over all roles, by URL. Two pods claiming one URL: the first (by role,
/// then pod key) wins; the loser is reported so it can be logged.
pub fn desired<'a>(sets: impl IntoIterator<Item = &'a PodSet>) -> (BTreeMap<String, Candidate>, Vec<String>) {
    let mut out: BTreeMap<String, Candidate> = BTreeMap::new();
    let mut clashes = Vec::new();
    for set in sets {
        for (key, c) in set.workers() {
            if out.contains_key(&c.spec.url) {
                clashes.push(format!("pod {key} has the same URL {} as another worker pod", c.spec.url));
                continue;
            }
            out.insert(c.spec.url.clone(), c.clone());
        }
    }
    (out, clashes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdgate_core::{WorkerRole, WorkerSpec};

    fn worker(url: &str) -> Verdict {
        Verdict::Worker(Candidate { spec: Box::new(WorkerSpec::new(url, WorkerRole::Decode).unwrap()) })
    }

    fn urls(set: &PodSet) -> Vec<String> {
        desired([set]).0.into_keys().collect()
    }

    #[test]
    fn upserts_and_removes_track_the_pods() {
        let mut s = PodSet::default();
        s.apply(Change::Upsert("ns/a".into(), worker("http://10.0.0.1:8000")));
        s.apply(Change::Upsert("ns/b".into(), Verdict::NotServing("not ready")));
        assert_eq!(urls(&s), ["http://10.0.0.1:8000"]);
        s.apply(Change::Upsert("ns/b".into(), worker("http://10.0.0.2:8000")));
        s.apply(Change::Upsert("ns/a".into(), Verdict::NotServing("terminating")));
        assert_eq!(urls(&s), ["http://10.0.0.2:8000"]);
        s.apply(Change::Remove("ns/b".into()));
        assert!(urls(&s).is_empty());
    }

    #[test]
    fn a_relist_replaces_the_set_only_when_complete() {
        let mut s = PodSet::default();
        s.apply(Change::Upsert("ns/a".into(), worker("http://10.0.0.1:8000")));
        s.apply(Change::Upsert("ns/b".into(), worker("http://10.0.0.2:8000")));
        s.apply(Change::Reset);
        s.apply(Change::Listed("ns/b".into(), worker("http://10.0.0.2:8000")));
        assert_eq!(urls(&s).len(), 2, "nothing removed mid-relist");
        s.apply(Change::Listed("ns/c".into(), worker("http://10.0.0.3:8000")));
        s.apply(Change::ResetDone);
        // `a` was deleted while the watch was down: the re-list notices.
        assert_eq!(urls(&s), ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]);
    }

    #[test]
    fn one_url_claimed_twice_is_reported() {
        let mut p = PodSet::default();
        let mut d = PodSet::default();
        p.apply(Change::Upsert("ns/a".into(), worker("http://10.0.0.1:8000")));
        d.apply(Change::Upsert("ns/b".into(), worker("http://10.0.0.1:8000")));
        let (set, clashes) = desired([&p, &d]);
        assert_eq!(set.len(), 1);
        assert_eq!(clashes.len(), 1);
    }
}
