//! Where `/v1/responses` keeps responses (`store: true`) for `GET /v1/responses/{id}` and
//! `previous_response_id`: the [`ResponseStore`] trait, so a database can back it, and the
//! default, [`MemoryStore`]: in this gateway's memory, bounded in entries and bytes, each entry
//! expiring after a fixed time (oldest evicted first). Replicas do not share it: a deployment
//! with several gateway replicas and multi-turn clients pins a conversation to one replica
//! (session affinity) or implements the trait on a shared database.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use serde_json::Value;

/// One kept response: the Response object as answered (its JSON, the bytes the client got),
/// and the conversation it ends: `input` (every item of the earlier turns, then this turn's
/// input items) and the output items, which stay in `response` until a next turn reads them
/// ([`Self::items`]); instructions are not part of it, as OpenAI does not carry them over.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredResponse {
    pub response: Bytes,
    /// Where the output items lie in `response` (the `output` array's contents).
    pub output: Range<usize>,
    pub input: Vec<Value>,
}

impl StoredResponse {
    fn bytes(&self) -> usize {
        // Close enough for a bound: the JSON text of what is kept (counted, not written).
        self.response.len() + self.input.iter().map(json_len).sum::<usize>()
    }

    /// The whole conversation: `input`, then the output items (parsed here, so only a turn
    /// that continues this response pays for it).
    pub fn items(&self) -> Vec<Value> {
        let mut items = self.input.clone();
        let mut array = Vec::with_capacity(self.output.len() + 2);
        array.push(b'[');
        array.extend_from_slice(self.response.get(self.output.clone()).unwrap_or_default());
        array.push(b']');
        if let Ok(output) = serde_json::from_slice::<Vec<Value>>(&array) {
            items.extend(output);
        }
        items
    }
}

/// The length of a value's JSON text, without writing it anywhere.
fn json_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    let _ = serde_json::to_writer(&mut n, v);
    n.0
}

pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A place to keep responses. Async so that a database can back it.
pub trait ResponseStore: Send + Sync {
    fn get<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<Arc<StoredResponse>>>;
    /// Keeps `value` under `id` (replacing one there). A store may refuse or later evict it.
    fn put(&self, id: String, value: StoredResponse) -> StoreFuture<'_, ()>;
    /// Whether there was such a response.
    fn delete<'a>(&'a self, id: &'a str) -> StoreFuture<'a, bool>;
}

/// The bounds of a [`MemoryStore`] (`--responses-store-max-entries`, `--responses-store-max-bytes`,
/// `--responses-store-ttl-secs`).
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub max_entries: usize,
    pub max_bytes: usize,
    pub ttl: Duration,
}

type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

struct Entry {
    value: Arc<StoredResponse>,
    bytes: usize,
    expires: Instant,
    seq: u64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Entry>,
    /// Insertion order (the expiry order too: one ttl for all), with each entry's `seq` so a
    /// replaced or deleted id's old place is skipped.
    order: VecDeque<(u64, String)>,
    bytes: usize,
    seq: u64,
}

/// The default store: see the module doc.
pub struct MemoryStore {
    bounds: Bounds,
    clock: Clock,
    inner: Mutex<Inner>,
}

impl MemoryStore {
    pub fn new(bounds: Bounds) -> Self {
        Self::with_clock(bounds, Arc::new(Instant::now))
    }

    /// With an injected clock (tests).
    pub fn with_clock(bounds: Bounds, clock: Clock) -> Self {
        MemoryStore { bounds, clock, inner: Mutex::new(Inner::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the map inconsistent enough to matter.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().map.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get_now(&self, id: &str) -> Option<Arc<StoredResponse>> {
        let now = (self.clock)();
        let mut inner = self.lock();
        let expired = inner.map.get(id)?.expires <= now;
        if expired {
            inner.remove(id);
            return None;
        }
        inner.map.get(id).map(|e| e.value.clone())
    }

    fn put_now(&self, id: String, value: StoredResponse) {
        let bytes = value.bytes();
        let now = (self.clock)();
        let mut inner = self.lock();
        inner.remove(&id);
        if self.bounds.max_entries == 0 || bytes > self.bounds.max_bytes {
            return;
        }
        // Expired first, then the oldest until the new entry fits.
        while let Some((_, front)) = inner.order.front() {
            let over = inner.map.len() + 1 > self.bounds.max_entries || inner.bytes + bytes > self.bounds.max_bytes;
            let expired = inner.map.get(front).is_none_or(|e| e.expires <= now);
            if !over && !expired {
                break;
            }
            inner.pop_front();
        }
        inner.seq += 1;
        let seq = inner.seq;
        inner.order.push_back((seq, id.clone()));
        inner.bytes += bytes;
        inner.map.insert(id, Entry { value: Arc::new(value), bytes, expires: now + self.bounds.ttl, seq });
    }
}

impl Inner {
    fn remove(&mut self, id: &str) -> bool {
        match self.map.remove(id) {
            Some(e) => {
                self.bytes -= e.bytes;
                true
            }
            None => false,
        }
    }

    /// Drops the oldest place in the order, and its entry if the place is still its own.
    fn pop_front(&mut self) {
        if let Some((seq, id)) = self.order.pop_front() {
            if self.map.get(&id).is_some_and(|e| e.seq == seq) {
                self.remove(&id);
            }
        }
    }
}

impl ResponseStore for MemoryStore {
    fn get<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<Arc<StoredResponse>>> {
        Box::pin(std::future::ready(self.get_now(id)))
    }

    fn put(&self, id: String, value: StoredResponse) -> StoreFuture<'_, ()> {
        self.put_now(id, value);
        Box::pin(std::future::ready(()))
    }

    fn delete<'a>(&'a self, id: &'a str) -> StoreFuture<'a, bool> {
        let found = self.lock().remove(id);
        Box::pin(std::future::ready(found))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use serde_json::json;

    use super::*;

    fn store(max_entries: usize, max_bytes: usize, ttl_s: u64) -> (MemoryStore, Arc<AtomicU64>) {
        let t0 = Instant::now();
        let offset = Arc::new(AtomicU64::new(0));
        let o = offset.clone();
        let clock: Clock = Arc::new(move || t0 + Duration::from_secs(o.load(Ordering::SeqCst)));
        (MemoryStore::with_clock(Bounds { max_entries, max_bytes, ttl: Duration::from_secs(ttl_s) }, clock), offset)
    }

    fn value(text: &str) -> StoredResponse {
        let response = serde_json::to_vec(&json!({"id": text, "output": []})).unwrap_or_default();
        StoredResponse { response: response.into(), output: 0..0, input: vec![json!({"type": "message", "content": text})] }
    }

    #[test]
    fn put_get_delete() {
        let (s, _) = store(10, 1 << 20, 60);
        s.put_now("a".into(), value("x"));
        assert_eq!(s.get_now("a").map(|v| v.response.clone()), Some(value("x").response));
        assert!(s.lock().remove("a"));
        assert!(s.get_now("a").is_none());
        assert!(!s.lock().remove("a"));
        assert_eq!(s.lock().bytes, 0);
    }

    #[test]
    fn entries_expire_on_the_injected_clock() {
        let (s, clock) = store(10, 1 << 20, 60);
        s.put_now("a".into(), value("x"));
        clock.store(59, Ordering::SeqCst);
        assert!(s.get_now("a").is_some());
        s.put_now("b".into(), value("y"));
        clock.store(60, Ordering::SeqCst);
        assert!(s.get_now("a").is_none(), "expired at its ttl");
        assert!(s.get_now("b").is_some());
        // A put drops what expired even if nobody asked for it.
        clock.store(200, Ordering::SeqCst);
        s.put_now("c".into(), value("z"));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn the_oldest_leave_first_at_the_entry_bound() {
        let (s, _) = store(2, 1 << 20, 60);
        for id in ["a", "b", "c"] {
            s.put_now(id.into(), value(id));
        }
        assert!(s.get_now("a").is_none());
        assert!(s.get_now("b").is_some() && s.get_now("c").is_some());
        // Replacing keeps one entry per id, and the replaced place is not counted twice.
        s.put_now("b".into(), value("b2"));
        s.put_now("d".into(), value("d"));
        assert_eq!(s.len(), 2);
        assert!(s.get_now("c").is_none() && s.get_now("b").is_some() && s.get_now("d").is_some());
    }

    #[test]
    fn the_byte_bound_holds_and_too_big_is_not_kept() {
        let one = value("0123456789").bytes();
        let (s, _) = store(100, one * 2, 60);
        for id in ["a", "b", "c"] {
            s.put_now(id.into(), value("0123456789"));
            assert!(s.lock().bytes <= one * 2);
        }
        assert_eq!(s.len(), 2);
        s.put_now("big".into(), value(&"x".repeat(one * 3)));
        assert!(s.get_now("big").is_none());
        assert_eq!(s.len(), 2);
        let (off, _) = store(0, 1 << 20, 60);
        off.put_now("a".into(), value("x"));
        assert!(off.is_empty(), "max entries 0 keeps nothing");
    }
}
