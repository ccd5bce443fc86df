//! The admission queue: `limit` permits and a bounded line of waiters ordered by priority
//! (higher first), then arrival. When the line is full, a newcomer with a higher priority than
//! the lowest waiter takes that waiter's place (the lowest is shed first, the newest of equal
//! priority before older ones); otherwise the newcomer is refused.
//!
//! tower's `ConcurrencyLimit` (a FIFO semaphore) cannot order by priority, hence this small
//! queue: one mutex around a `BTreeMap`, taken for microseconds, never across an await.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

/// Why no permit was given.
#[derive(Debug, PartialEq, Eq)]
pub enum Denied {
    /// The line was full of waiters of at least this priority.
    Full,
    /// A higher-priority request took this one's place in line.
    Shed,
    TimedOut,
}

/// (−priority, arrival): the first key is served first, the last is shed first.
type Key = (i64, u64);

#[derive(Debug)]
struct Line {
    running: usize,
    next: u64,
    waiting: BTreeMap<Key, oneshot::Sender<Permit>>,
}

#[derive(Debug)]
struct Shared {
    limit: usize,
    queue_size: usize,
    line: Mutex<Line>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A permit ends: hand it to the first waiter still there, else free it.
    fn release(self: &Arc<Self>) {
        let mut line = self.lock();
        while let Some((_, tx)) = line.waiting.pop_first() {
            // A waiter that gave up between being picked and receiving drops the permit, which
            // comes back here through its Drop: nothing leaks.
            match tx.send(Permit { shared: Some(self.clone()) }) {
                Ok(()) => return,
                Err(mut unsent) => unsent.shared = None,
            }
        }
        line.running = line.running.saturating_sub(1);
    }
}

/// One running request's place; dropping it lets the next waiter in.
#[derive(Debug)]
pub struct Permit {
    shared: Option<Arc<Shared>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(s) = self.shared.take() {
            s.release();
        }
    }
}

#[derive(Clone)]
pub struct PriorityQueue {
    shared: Arc<Shared>,
}

/// Takes a waiter's key out of the line when its wait ends early (timeout, client gone).
struct InLine<'a> {
    shared: &'a Shared,
    key: Key,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.shared.lock().waiting.remove(&self.key);
    }
}

impl PriorityQueue {
    pub fn new(limit: usize, queue_size: usize) -> Self {
        PriorityQueue { shared: Arc::new(Shared { limit, queue_size, line: Mutex::new(Line { running: 0, next: 0, waiting: BTreeMap::new() }) }) }
    }

    /// A permit now, after a wait in line of at most `timeout`, or why not.
    pub async fn acquire(&self, priority: i64, timeout: Duration) -> Result<Permit, Denied> {
        let (key, rx) = {
            let mut line = self.shared.lock();
            if line.running < self.shared.limit {
                line.running += 1;
                return Ok(Permit { shared: Some(self.shared.clone()) });
            }
            let key = (priority.saturating_neg(), line.next);
            line.next += 1;
            if line.waiting.len() >= self.shared.queue_size {
                match line.waiting.last_key_value() {
                    // Dropping the shed waiter's sender wakes it with `Shed`.
                    Some((last, _)) if *last > key => {
                        line.waiting.pop_last();
                    }
                    _ => return Err(Denied::Full),
                }
            }
            let (tx, rx) = oneshot::channel();
            line.waiting.insert(key, tx);
            (key, rx)
        };
        let _in_line = InLine { shared: &self.shared, key };
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(Denied::Shed),
            Err(_) => Err(Denied::TimedOut),
        }
    }

    pub fn waiting(&self) -> usize {
        self.shared.lock().waiting.len()
    }

    #[cfg(test)]
    pub fn running(&self) -> usize {
        self.shared.lock().running
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn waiter(q: &PriorityQueue, priority: i64, tx: tokio::sync::mpsc::UnboundedSender<(i64, Result<(), Denied>)>) {
        let q = q.clone();
        tokio::spawn(async move {
            let got = q.acquire(priority, Duration::from_secs(60)).await;
            let ok = got.as_ref().map(|_| ()).map_err(|e| match e {
                Denied::Full => Denied::Full,
                Denied::Shed => Denied::Shed,
                Denied::TimedOut => Denied::TimedOut,
            });
            tx.send((priority, ok)).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(got);
        });
        tokio::task::yield_now().await;
    }

    #[tokio::test(start_paused = true)]
    async fn higher_priority_is_served_first_then_arrival_order() {
        let q = PriorityQueue::new(1, 10);
        let held = q.acquire(0, Duration::from_secs(1)).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for p in [0, 5, 0, 9, 5] {
            waiter(&q, p, tx.clone()).await;
        }
        assert_eq!(q.waiting(), 5);
        drop(held);
        let mut order = Vec::new();
        for _ in 0..5 {
            let (p, r) = rx.recv().await.unwrap();
            assert_eq!(r, Ok(()));
            order.push(p);
        }
        assert_eq!(order, [9, 5, 5, 0, 0]);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!((q.running(), q.waiting()), (0, 0), "every permit came back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_line_sheds_its_lowest_priority_for_a_higher_one() {
        let q = PriorityQueue::new(1, 2);
        let held = q.acquire(0, Duration::from_secs(1)).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        waiter(&q, 1, tx.clone()).await;
        waiter(&q, 0, tx.clone()).await;
        assert_eq!(q.acquire(0, Duration::from_secs(1)).await.err(), Some(Denied::Full), "no lower waiter to shed");
        waiter(&q, 3, tx.clone()).await;
        assert_eq!(rx.recv().await.unwrap(), (0, Err(Denied::Shed)), "the lowest waiter was shed");
        drop(held);
        assert_eq!(rx.recv().await.unwrap(), (3, Ok(())));
        assert_eq!(rx.recv().await.unwrap(), (1, Ok(())));
    }

    #[tokio::test(start_paused = true)]
    async fn a_timed_out_or_abandoned_waiter_leaves_the_line_and_leaks_nothing() {
        let q = PriorityQueue::new(1, 4);
        let held = q.acquire(0, Duration::from_secs(1)).await.unwrap();
        assert_eq!(q.acquire(0, Duration::from_millis(100)).await.err(), Some(Denied::TimedOut));
        assert_eq!(q.waiting(), 0);
        let abandoned = tokio::spawn({
            let q = q.clone();
            async move { q.acquire(0, Duration::from_secs(60)).await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        assert_eq!(q.waiting(), 1);
        abandoned.abort();
        let _ = abandoned.await;
        assert_eq!(q.waiting(), 0);
        drop(held);
        assert_eq!(q.running(), 0);
        assert!(q.acquire(0, Duration::from_secs(1)).await.is_ok());
    }
}
