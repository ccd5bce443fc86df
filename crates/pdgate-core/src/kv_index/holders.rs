//! The set of workers holding one key. Most keys have one holder (kept inline); the others point
//! at an interned set: every key with the same holders shares one set id, so a lookup walking a
//! long cached prefix compares 8-byte ids block after block and reads a set's members only where
//! the holders change. A set is a sorted list when short, a bitset over worker slots when many
//! hold it (a prefix on 1,000 workers intersects in 16 word operations and takes 128 bytes).

use std::collections::HashMap;
use std::sync::Arc;

use super::WorkerSlot;

pub(super) type SetId = u32;

/// Who holds one key: 8 bytes, so the key table stays small and a lookup's probe brings in
/// everything the walk needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holders {
    One(WorkerSlot),
    Set(SetId),
}

/// An interned set's members.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) enum Members {
    /// Sorted, at most [`few_max`] long, at least 2.
    Few(Box<[WorkerSlot]>),
    /// Bit `s` set: slot `s` holds the key. No trailing zero words (one set, one form).
    Bits(Box<[u64]>),
}

/// A set's members as the walk reads them.
pub(super) enum View<'a> {
    List(&'a [WorkerSlot]),
    Bits(&'a [u64]),
}

/// The longest `Few` list for a fleet of `n_slots`: beyond it a bitset is smaller (4 bytes per
/// listed slot against one bit per slot) and faster to intersect.
pub(super) fn few_max(n_slots: usize) -> usize {
    (n_slots.div_ceil(64) * 2).max(8)
}

struct Interned {
    members: Arc<Members>,
    /// Keys pointing at the set; at 0 it is freed and its id reused.
    refs: u32,
    /// See [`Sets::stamp`].
    stamp: u64,
}

/// The interned sets, by id and by content.
#[derive(Default)]
pub(super) struct Sets {
    slab: Vec<Option<Interned>>,
    free: Vec<SetId>,
    ids: HashMap<Arc<Members>, SetId>,
    bytes: usize,
    /// Stamps of the single-holder "sets", by slot.
    slot_stamps: Vec<u64>,
    /// The last stamp handed out: stamps are unique over the index's life.
    clock: u64,
}

impl Sets {
    pub(super) fn view<'a>(&'a self, h: &'a Holders) -> View<'a> {
        match h {
            Holders::One(s) => View::List(std::slice::from_ref(s)),
            Holders::Set(id) => match self.members(*id) {
                Members::Few(v) => View::List(v),
                Members::Bits(b) => View::Bits(b),
            },
        }
    }

    fn members(&self, id: SetId) -> &Members {
        match &self.slab[id as usize] {
            Some(i) => &i.members,
            None => unreachable!("a key points at a freed set"),
        }
    }

    pub(super) fn contains(&self, h: &Holders, slot: WorkerSlot) -> bool {
        match self.view(h) {
            View::List(v) => v.binary_search(&slot).is_ok(),
            View::Bits(b) => bit(b, slot),
        }
    }

    /// Add `slot` to a key's holders; `n_slots` decides list or bitset.
    pub(super) fn insert(&mut self, h: &mut Holders, slot: WorkerSlot, n_slots: usize) {
        if self.contains(h, slot) {
            return;
        }
        let grown = match self.view(h) {
            View::List(v) if v.len() < few_max(n_slots) => {
                let at = v.partition_point(|&s| s < slot);
                Members::Few([&v[..at], &[slot], &v[at..]].concat().into_boxed_slice())
            }
            View::List(v) => {
                let mut bits = vec![0u64; n_slots.max(slot as usize + 1).div_ceil(64)];
                for &s in v.iter().chain(std::iter::once(&slot)) {
                    bits[s as usize / 64] |= 1 << (s % 64);
                }
                Members::Bits(trimmed(bits))
            }
            View::Bits(b) => {
                let mut bits = b.to_vec();
                if bits.len() <= slot as usize / 64 {
                    bits.resize(slot as usize / 64 + 1, 0);
                }
                bits[slot as usize / 64] |= 1 << (slot % 64);
                Members::Bits(trimmed(bits))
            }
        };
        self.replace(h, grown);
    }

    /// Remove `slot`; true when nobody holds the key any more (the caller drops the key).
    pub(super) fn remove(&mut self, h: &mut Holders, slot: WorkerSlot, n_slots: usize) -> bool {
        if !self.contains(h, slot) {
            return false;
        }
        let rest: Vec<WorkerSlot> = match self.view(h) {
            View::List(v) => v.iter().copied().filter(|&s| s != slot).collect(),
            View::Bits(b) => {
                let count: u32 = b.iter().map(|w| w.count_ones()).sum();
                // back to a list at half the threshold, so a set at the edge does not flip-flop
                if count as usize - 1 > few_max(n_slots) / 2 {
                    let mut bits = b.to_vec();
                    bits[slot as usize / 64] &= !(1 << (slot % 64));
                    self.replace(h, Members::Bits(trimmed(bits)));
                    return false;
                }
                iter_bits(b).filter(|&s| s != slot).collect()
            }
        };
        match rest.len() {
            0 => {
                self.replace_with(h, Holders::One(slot)); // releases the set; the key goes
                true
            }
            1 => {
                self.replace_with(h, Holders::One(rest[0]));
                false
            }
            _ => {
                self.replace(h, Members::Few(rest.into_boxed_slice()));
                false
            }
        }
    }

    /// A stamp that changes whenever a key stops having holders `h` (its holders change, or it
    /// leaves the table), and that no other holders ever had: while a key's holders and their
    /// stamp are what a lookup saw, every key that had those holders then still has them.
    pub(super) fn stamp(&self, h: Holders) -> u64 {
        match h {
            Holders::One(s) => self.slot_stamps.get(s as usize).copied().unwrap_or(0),
            Holders::Set(id) => self.slab[id as usize].as_ref().map_or(0, |i| i.stamp),
        }
    }

    fn next_stamp(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A key stops having holders `h`: drop its reference (a set may be freed) and restamp.
    pub(super) fn release(&mut self, h: Holders) {
        let stamp = self.next_stamp();
        let id = match h {
            Holders::One(s) => {
                if self.slot_stamps.len() <= s as usize {
                    self.slot_stamps.resize(s as usize + 1, 0);
                }
                self.slot_stamps[s as usize] = stamp;
                return;
            }
            Holders::Set(id) => id,
        };
        let Some(i) = self.slab[id as usize].as_mut() else { return };
        i.stamp = stamp;
        i.refs -= 1;
        if i.refs == 0 {
            if let Some(i) = self.slab[id as usize].take() {
                self.ids.remove(&i.members);
                self.bytes -= heap_bytes(&i.members);
            }
            self.free.push(id);
        }
    }

    fn replace(&mut self, h: &mut Holders, m: Members) {
        let id = self.intern(m);
        self.release(*h);
        *h = Holders::Set(id);
    }

    fn replace_with(&mut self, h: &mut Holders, new: Holders) {
        self.release(*h);
        *h = new;
    }

    /// The id of a set with these members (one more reference to it).
    fn intern(&mut self, m: Members) -> SetId {
        if let Some(&id) = self.ids.get(&m) {
            if let Some(i) = self.slab[id as usize].as_mut() {
                i.refs += 1;
            }
            return id;
        }
        self.bytes += heap_bytes(&m);
        let members = Arc::new(m);
        let entry = Some(Interned { members: Arc::clone(&members), refs: 1, stamp: self.next_stamp() });
        let id = match self.free.pop() {
            Some(id) => {
                self.slab[id as usize] = entry;
                id
            }
            None => {
                self.slab.push(entry);
                (self.slab.len() - 1) as SetId
            }
        };
        self.ids.insert(members, id);
        id
    }

    /// Heap of the interned sets (members, both tables), for the size gauge.
    pub(super) fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<Option<Interned>>() + std::mem::size_of::<(Arc<Members>, SetId)>() + 1;
        self.bytes + self.slab.capacity().max(self.ids.capacity()) * entry + self.slot_stamps.capacity() * 8
    }

    /// Whether a key's holders are a bitset (tests).
    #[cfg(test)]
    pub(super) fn is_bits(&self, h: &Holders) -> bool {
        matches!(self.view(h), View::Bits(_))
    }

    /// Interned sets alive (tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }
}

fn heap_bytes(m: &Members) -> usize {
    16 + match m {
        Members::Few(v) => v.len() * 4,
        Members::Bits(b) => b.len() * 8,
    }
}

fn trimmed(mut bits: Vec<u64>) -> Box<[u64]> {
    while bits.last() == Some(&0) {
        bits.pop();
    }
    bits.into_boxed_slice()
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
