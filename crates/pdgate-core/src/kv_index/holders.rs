//! The set of workers holding one key. Most keys have one holder (kept inline), some a few (a
//! sorted boxed slice), and a prefix cached across the fleet has many: those are a bitset over
//! worker slots, so a lookup intersects 1,000 holders in 16 word operations instead of 1,000
//! searches, and the set takes 128 bytes instead of 4,000.

use super::WorkerSlot;

#[derive(Debug)]
pub(super) enum Holders {
    One(WorkerSlot),
    /// Sorted, at most [`few_max`] long.
    Few(Box<[WorkerSlot]>),
    /// Bit `s` set: slot `s` holds the key. Never empty.
    Bits(Box<[u64]>),
}

/// The longest `Few` list for a fleet of `n_slots`: beyond it a bitset is smaller (4 bytes per
/// listed slot against one bit per slot) and faster to intersect.
pub(super) fn few_max(n_slots: usize) -> usize {
    (n_slots.div_ceil(64) * 2).max(8)
}

impl Holders {
    pub(super) fn contains(&self, slot: WorkerSlot) -> bool {
        match self {
            Holders::One(s) => *s == slot,
            Holders::Few(v) => v.binary_search(&slot).is_ok(),
            Holders::Bits(b) => bit(b, slot),
        }
    }

    /// Add `slot`; `n_slots` sizes a new bitset.
    pub(super) fn insert(&mut self, slot: WorkerSlot, n_slots: usize) {
        match self {
            Holders::One(s) if *s == slot => {}
            Holders::One(s) => *self = Holders::Few(if *s < slot { Box::new([*s, slot]) } else { Box::new([slot, *s]) }),
            Holders::Few(v) => {
                let Err(at) = v.binary_search(&slot) else { return };
                if v.len() < few_max(n_slots) {
                    let mut grown = Vec::with_capacity(v.len() + 1);
                    grown.extend_from_slice(&v[..at]);
                    grown.push(slot);
                    grown.extend_from_slice(&v[at..]);
                    *v = grown.into_boxed_slice();
                } else {
                    let mut bits = vec![0u64; n_slots.max(slot as usize + 1).div_ceil(64)];
                    for &s in v.iter().chain(std::iter::once(&slot)) {
                        bits[s as usize / 64] |= 1 << (s % 64);
                    }
                    *self = Holders::Bits(bits.into_boxed_slice());
                }
            }
            Holders::Bits(b) => {
                let word = slot as usize / 64;
                if word >= b.len() {
                    let mut grown = b.to_vec();
                    grown.resize(word + 1, 0);
                    *b = grown.into_boxed_slice();
                }
                b[word] |= 1 << (slot % 64);
            }
        }
    }

    /// Remove `slot`; true when nobody holds the key any more (the caller drops the entry).
    pub(super) fn remove(&mut self, slot: WorkerSlot, n_slots: usize) -> bool {
        match self {
            Holders::One(s) => *s == slot,
            Holders::Few(v) => {
                if let Ok(at) = v.binary_search(&slot) {
                    let rest: Vec<WorkerSlot> = v.iter().enumerate().filter(|(i, _)| *i != at).map(|(_, s)| *s).collect();
                    *self = match rest.len() {
                        0 => return true,
                        1 => Holders::One(rest[0]),
                        _ => Holders::Few(rest.into_boxed_slice()),
                    };
                }
                false
            }
            Holders::Bits(b) => {
                if let Some(w) = b.get_mut(slot as usize / 64) {
                    *w &= !(1 << (slot % 64));
                }
                let count: u32 = b.iter().map(|w| w.count_ones()).sum();
                // back to a list at half the threshold, so a set at the edge does not flip-flop
                if count as usize <= few_max(n_slots) / 2 {
                    let list: Vec<WorkerSlot> = iter_bits(b).collect();
                    *self = match list.len() {
                        0 => return true,
                        1 => Holders::One(list[0]),
                        _ => Holders::Few(list.into_boxed_slice()),
                    };
                }
                false
            }
        }
    }

    /// Heap bytes of this set (beyond the table entry), for the size gauge.
    pub(super) fn heap_bytes(&self) -> usize {
        match self {
            Holders::One(_) => 0,
            Holders::Few(v) => v.len() * 4,
            Holders::Bits(b) => b.len() * 8,
        }
    }
}

pub(super) fn bit(words: &[u64], slot: WorkerSlot) -> bool {
    words.get(slot as usize / 64).is_some_and(|w| w & (1 << (slot % 64)) != 0)
}

/// The set bits of `words`, ascending.
pub(super) fn iter_bits(words: &[u64]) -> impl Iterator<Item = WorkerSlot> + '_ {
    words.iter().enumerate().flat_map(|(i, &w)| BitIter(w).map(move |b| (i * 64) as WorkerSlot + b))
}

pub(super) struct BitIter(pub(super) u64);

impl Iterator for BitIter {
    type Item = WorkerSlot;
    fn next(&mut self) -> Option<WorkerSlot> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(b)
    }
}
