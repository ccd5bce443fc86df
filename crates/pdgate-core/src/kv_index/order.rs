//! Every worker-block entry of the index in one slab, linked oldest to newest, so the memory
//! bound can evict the oldest entry in O(1) and an event can unlink any entry in O(1). Each
//! worker's map names its blocks by their slab index.

use super::WorkerSlot;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    /// The engine's hash of the block (the worker's map key).
    pub hash: u64,
    /// The index's content key of the block.
    pub key: u64,
    pub slot: WorkerSlot,
    pub block_size: u32,
    /// The lookup clock when the entry was (re)queued: a lookup hitting its key after that
    /// gives it a second chance at eviction.
    pub queued_at: u32,
    prev: u32,
    next: u32,
}

#[derive(Default)]
pub(super) struct Order {
    entries: Vec<Entry>,
    free: Vec<u32>,
    head: Option<u32>,
    tail: Option<u32>,
}

impl Order {
    pub(super) fn get(&self, idx: u32) -> &Entry {
        &self.entries[idx as usize]
    }

    pub(super) fn front(&self) -> Option<u32> {
        self.head
    }

    /// Append a new entry (the newest); returns its index.
    pub(super) fn push_back(&mut self, hash: u64, key: u64, slot: WorkerSlot, block_size: u32, now: u32) -> u32 {
        let e = Entry { hash, key, slot, block_size, queued_at: now, prev: NIL, next: NIL };
        let idx = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as u32
            }
        };
        self.link_back(idx);
        idx
    }

    /// Unlink and free an entry; returns it.
    pub(super) fn remove(&mut self, idx: u32) -> Entry {
        self.unlink(idx);
        self.free.push(idx);
        self.entries[idx as usize]
    }

    /// Make an entry the newest (re-stored, or given a second chance).
    pub(super) fn move_to_back(&mut self, idx: u32, now: u32) {
        self.unlink(idx);
        self.entries[idx as usize].queued_at = now;
        self.link_back(idx);
    }

    fn link_back(&mut self, idx: u32) {
        let prev = self.tail.unwrap_or(NIL);
        {
            let e = &mut self.entries[idx as usize];
            e.prev = prev;
            e.next = NIL;
        }
        match self.tail {
            Some(t) => self.entries[t as usize].next = idx,
            None => self.head = Some(idx),
        }
        self.tail = Some(idx);
    }

    fn unlink(&mut self, idx: u32) {
        let Entry { prev, next, .. } = self.entries[idx as usize];
        match prev {
            NIL => self.head = (next != NIL).then_some(next),
            p => self.entries[p as usize].next = next,
        }
        match next {
            NIL => self.tail = (prev != NIL).then_some(prev),
            n => self.entries[n as usize].prev = prev,
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>() + self.free.capacity() * 4
    }
}
