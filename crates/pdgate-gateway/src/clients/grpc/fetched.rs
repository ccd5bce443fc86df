//! Tokenizers fetched from the workers (`GetTokenizer`) when the gateway was given no
//! `--model-path` / `--tokenizer-path`: one per model, fetched once.
//!
//! Requests that arrive while a model's fetch runs wait on that fetch (one fetch, not one per
//! request) and share its outcome. A failed fetch is not remembered: it fails the requests that
//! waited on it, and the next request fetches again.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures_util::future::{BoxFuture, FutureExt, Shared};
use pdgate_tokenizer::ModelTokenizer;

type Fetch = Shared<BoxFuture<'static, Result<Arc<ModelTokenizer>, String>>>;

enum Slot {
    Ready(Arc<ModelTokenizer>),
    /// A fetch in progress, numbered so that only its own outcome settles the slot.
    Fetching(u64, Fetch),
}

/// The per-model cache. The fetch itself is the caller's (a worker's `GetTokenizer`, or a fake).
#[derive(Default)]
pub struct FetchedTokenizers {
    by_model: Mutex<HashMap<String, Slot>>,
    next_fetch: std::sync::atomic::AtomicU64,
}

impl FetchedTokenizers {
    /// The model's tokenizer if it has been fetched (what the tests look at).
    #[cfg(test)]
    pub fn get(&self, model: &str) -> Option<Arc<ModelTokenizer>> {
        match self.by_model.lock().unwrap_or_else(|p| p.into_inner()).get(model) {
            Some(Slot::Ready(t)) => Some(t.clone()),
            _ => None,
        }
    }

    /// The model's tokenizer: cached, or the fetch in progress, or `fetch()` started now.
    pub async fn get_or_fetch<F, Fut>(&self, model: &str, fetch: F) -> Result<Arc<ModelTokenizer>, String>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<ModelTokenizer, String>> + Send + 'static,
    {
        let (number, shared) = {
            let mut map = self.by_model.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(model) {
                Some(Slot::Ready(t)) => return Ok(t.clone()),
                Some(Slot::Fetching(number, f)) => (*number, f.clone()),
                None => {
                    let number = self.next_fetch.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let f = fetch().map(|r| r.map(Arc::new)).boxed().shared();
                    map.insert(model.to_string(), Slot::Fetching(number, f.clone()));
                    (number, f)
                }
            }
        };
        let out = shared.await;
        // Whoever sees the outcome first settles the slot (if it is still this fetch's).
        let mut map = self.by_model.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(map.get(model), Some(Slot::Fetching(n, _)) if *n == number) {
            match &out {
                Ok(t) => {
                    map.insert(model.to_string(), Slot::Ready(t.clone()));
                }
                Err(_) => {
                    map.remove(model);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn fixture() -> ModelTokenizer {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
    }

    /// A fake fetch that counts its calls and finishes when told to.
    fn counted(calls: &Arc<AtomicUsize>, gate: &Arc<tokio::sync::Notify>, ok: bool) -> impl Future<Output = Result<ModelTokenizer, String>> + Send + 'static {
        calls.fetch_add(1, Ordering::SeqCst);
        let gate = gate.clone();
        async move {
            gate.notified().await;
            if ok {
                Ok(fixture())
            } else {
                Err("worker said no".to_string())
            }
        }
    }

    #[tokio::test]
    async fn concurrent_first_requests_fetch_once_and_later_ones_use_the_cache() {
        let cache = Arc::new(FetchedTokenizers::default());
        let calls = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Notify::new());
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let (cache, calls, gate) = (cache.clone(), calls.clone(), gate.clone());
                tokio::spawn(async move { cache.get_or_fetch("m", || counted(&calls, &gate, true)).await })
            })
            .collect();
        // Every waiter is parked on the one fetch before it is let through.
        while calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        gate.notify_waiters();
        gate.notify_one();
        let toks: Vec<_> = futures_util::future::join_all(waiters).await.into_iter().map(|r| r.unwrap().unwrap()).collect();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(toks.windows(2).all(|w| Arc::ptr_eq(&w[0], &w[1])));
        let again = cache.get_or_fetch("m", || counted(&calls, &gate, true)).await.unwrap();
        assert!(Arc::ptr_eq(&again, &toks[0]));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(cache.get("m").is_some());
        assert!(cache.get("other").is_none());
    }

    #[tokio::test]
    async fn a_failed_fetch_is_an_error_and_the_next_request_fetches_again() {
        let cache = FetchedTokenizers::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Notify::new());
        gate.notify_one();
        let err = cache.get_or_fetch("m", || counted(&calls, &gate, false)).await.unwrap_err();
        assert_eq!(err, "worker said no");
        assert!(cache.get("m").is_none());
        gate.notify_one();
        cache.get_or_fetch("m", || counted(&calls, &gate, true)).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn models_are_cached_apart() {
        let cache = FetchedTokenizers::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Notify::new());
        for model in ["a", "b", "a"] {
            gate.notify_one();
            cache.get_or_fetch(model, || counted(&calls, &gate, true)).await.unwrap();
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}
