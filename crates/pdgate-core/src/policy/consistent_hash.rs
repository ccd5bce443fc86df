//! Consistent hashing by session key: the same key goes to the same worker while it is
//! eligible, and adding or removing a worker moves only about 1/N of the keys.
//!
//! A ring with virtual nodes per role, built once per worker membership (not per request, not
//! per health change: ineligible workers stay on the ring and are skipped, so their keys fall to
//! the next point and come back when they recover). A lookup is a binary search plus a short
//! walk. If the candidates are a tiny fraction of the ring (most workers excluded), the walk is
//! cut off after [`MAX_WALK`] points and rendezvous hashing over the candidates decides.
//! Without a key the choice is random.

use rand::{Rng, RngCore};

use super::{is_candidate, Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;

/// Points per worker on the ring.
pub const VNODES: usize = 40;
/// Ring points looked at before falling back to rendezvous hashing.
pub const MAX_WALK: usize = 128;

/// Stable 64-bit hash (FNV-1a, then the murmur3 finaliser to spread the bits). Not
/// `std::hash`: it must not change between processes or releases.
pub fn hash64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Sorted ring points `(hash, worker index)`.
#[derive(Clone, Debug, Default)]
pub struct HashRing {
    points: Vec<(u64, u32)>,
}

impl HashRing {
    /// `workers`: `(snapshot index, stable key)`; the key (URL) places the points.
    pub fn build<'a>(workers: impl IntoIterator<Item = (usize, &'a str)>) -> Self {
        let mut points = Vec::new();
        for (index, key) in workers {
            for v in 0..VNODES as u32 {
                points.push((hash64(&[key.as_bytes(), &v.to_le_bytes()]), index as u32));
            }
        }
        points.sort_unstable();
        HashRing { points }
    }

    pub fn len(&self) -> usize {
        self.points.len()
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The first worker at or after `hash` (clockwise) that is a candidate, within `MAX_WALK`.
    pub fn lookup(&self, hash: u64, candidates: &[usize]) -> Option<usize> {
        let n = self.points.len();
        if n == 0 {
            return None;
        }
        let start = self.points.partition_point(|&(h, _)| h < hash);
        (0..n.min(MAX_WALK)).map(|i| self.points[(start + i) % n].1 as usize).find(|&w| is_candidate(candidates, w))
    }
}

#[derive(Debug, Default)]
pub struct ConsistentHashPolicy;

impl Policy for ConsistentHashPolicy {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn select(&self, snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        let first = *candidates.first()?;
        let Some(key) = input.key else {
            let w = candidates[rng.random_range(0..candidates.len())];
            return Some(Selection::with_reason(w, "hash_no_key", "consistent_hash no_key random".into()));
        };
        let h = hash64(&[key.as_bytes()]);
        if let Some(w) = snap.hash_ring(snap.worker(first).spec.role).lookup(h, candidates) {
            return Some(Selection::new(w, "consistent_hash"));
        }
        // Rendezvous: the candidate with the highest hash of (key, worker key).
        let w = candidates.iter().copied().max_by_key(|&w| hash64(&[key.as_bytes(), snap.worker(w).spec.url.as_bytes()]))?;
        Some(Selection::with_reason(w, "consistent_hash", "consistent_hash rendezvous".into()))
    }
}
