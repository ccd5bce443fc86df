//! Load in what it costs: the prompt tokens and KV tokens this gateway has placed on each
//! worker, and the engine's last token report.
//!
//! Two counts that look alike are kept apart:
//!
//! - **drain** (`Runtime::inflight`): a worker is still owed something by a request (a NIXL
//!   decode still pulls the KV from its prefill, a Mooncake prefill still pushes). Draining
//!   waits for it; it lives until the decode is done.
//! - **routing** (here): work queued on the worker. A prefill's ends when its KV has been
//!   handed off (the prefill leg is done: SGLang bootstrap, NIXL's answer with
//!   `kv_transfer_params`, Mooncake), not when the decode elsewhere finishes; otherwise a
//!   prefill worker whose requests all decode elsewhere looks busy.
//!
//! Everything is atomics: the routing view reads these on every decision without a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pdgate_protocol::engine_load::EngineLoad;

use crate::fleet::registry::Runtime;

/// Stands for "the engine did not say" in the report's atomics.
const UNKNOWN: u64 = u64::MAX;

/// One worker's token counters.
#[derive(Debug)]
pub struct TokenLoad {
    /// Requests of this gateway queued or running on the worker (routing), see module doc.
    pub queued_requests: AtomicU64,
    /// Prompt tokens sent to the worker whose prefill has not ended yet.
    pub prompt_tokens: AtomicU64,
    /// KV tokens (prompt + output) of requests decoding on the worker.
    pub kv_tokens: AtomicU64,
    /// Every KV token ever placed on the worker: what was placed since a report is the
    /// difference to `placed_at_report`.
    kv_placed_total: AtomicU64,
    placed_at_report: AtomicU64,
    reported_running: AtomicU64,
    reported_waiting_tokens: AtomicU64,
    reported_free_kv: AtomicU64,
}

impl Default for TokenLoad {
    fn default() -> Self {
        let unknown = || AtomicU64::new(UNKNOWN);
        TokenLoad {
            queued_requests: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            kv_tokens: AtomicU64::new(0),
            kv_placed_total: AtomicU64::new(0),
            placed_at_report: AtomicU64::new(0),
            reported_running: unknown(),
            reported_waiting_tokens: unknown(),
            reported_free_kv: unknown(),
        }
    }
}

fn known(v: &AtomicU64) -> Option<u64> {
    Some(v.load(Ordering::Relaxed)).filter(|v| *v != UNKNOWN)
}

impl TokenLoad {
    /// Keeps the engine's report; KV placed from now on counts against its free KV.
    pub fn store_report(&self, r: &EngineLoad) {
        let put = |slot: &AtomicU64, v: Option<u64>| slot.store(v.map_or(UNKNOWN, |v| v.min(UNKNOWN - 1)), Ordering::Relaxed);
        self.placed_at_report.store(self.kv_placed_total.load(Ordering::Relaxed), Ordering::Relaxed);
        put(&self.reported_running, r.running);
        put(&self.reported_waiting_tokens, r.waiting_prompt_tokens);
        put(&self.reported_free_kv, r.free_kv_tokens());
    }

    /// Forgets the report (the worker gave none this time).
    pub fn clear_report(&self) {
        self.store_report(&EngineLoad::default());
    }

    pub fn reported_running(&self) -> Option<u64> {
        known(&self.reported_running)
    }

    pub fn reported_waiting_tokens(&self) -> Option<u64> {
        known(&self.reported_waiting_tokens)
    }

    /// Free KV as of the report minus what this gateway placed since. Conservative: KV freed
    /// since the report is not credited until the next one.
    pub fn free_kv(&self) -> Option<u64> {
        let free = known(&self.reported_free_kv)?;
        let placed = self.kv_placed_total.load(Ordering::Relaxed).saturating_sub(self.placed_at_report.load(Ordering::Relaxed));
        Some(free.saturating_sub(placed))
    }
}

/// Counts one request's work on a worker for as long as it lives: one queued request, its
/// prompt tokens (until the prefill ends) and/or its KV tokens (until the decode ends).
pub struct TokenGuard {
    runtime: Arc<Runtime>,
    prompt: u64,
    kv: u64,
    /// The worker had no other prompt to prefill when this one was sent: none of this
    /// gateway's, and none waiting in the engine's last report.
    sent_to_idle: bool,
}

impl TokenGuard {
    pub fn new(runtime: &Arc<Runtime>, prompt: u64, kv: u64) -> Self {
        let t = &runtime.tokens;
        t.queued_requests.fetch_add(1, Ordering::Relaxed);
        let ahead = t.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
        t.kv_tokens.fetch_add(kv, Ordering::Relaxed);
        t.kv_placed_total.fetch_add(kv, Ordering::Relaxed);
        let sent_to_idle = ahead == 0 && t.reported_waiting_tokens().unwrap_or(0) == 0;
        TokenGuard { runtime: runtime.clone(), prompt, kv, sent_to_idle }
    }

    /// The prompt was this worker's only one (as this gateway sees it) from send until now:
    /// its leg time is the engine's service time, not a queue wait. The online prefill fit
    /// learns only from such legs; under load a leg's time is mostly queueing, which the
    /// placement decision already counts apart (it had learned a 130 ms prefill as 10-29 s).
    pub fn alone_since_sent(&self) -> bool {
        self.sent_to_idle && self.runtime.tokens.prompt_tokens.load(Ordering::Relaxed) == self.prompt
    }

    /// The worker has prefilled the prompt (its answer began): the prompt no longer queues
    /// there, while the KV it placed stays until the response ends.
    pub fn prefilled(&mut self) {
        self.runtime.tokens.prompt_tokens.fetch_sub(self.prompt, Ordering::Relaxed);
        self.prompt = 0;
    }
}

impl Drop for TokenGuard {
    fn drop(&mut self) {
        let t = &self.runtime.tokens;
        t.queued_requests.fetch_sub(1, Ordering::Relaxed);
        t.prompt_tokens.fetch_sub(self.prompt, Ordering::Relaxed);
        t.kv_tokens.fetch_sub(self.kv, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefilled_prompt_stops_queueing_but_its_kv_stays() {
        let rt = Arc::new(Runtime::default());
        let mut g = TokenGuard::new(&rt, 100, 600);
        g.prefilled();
        assert_eq!(rt.tokens.prompt_tokens.load(Ordering::Relaxed), 0);
        assert_eq!(rt.tokens.kv_tokens.load(Ordering::Relaxed), 600);
        drop(g);
        assert_eq!((rt.tokens.prompt_tokens.load(Ordering::Relaxed), rt.tokens.kv_tokens.load(Ordering::Relaxed)), (0, 0));
    }

    #[test]
    fn a_prompt_is_alone_only_when_nothing_else_prefilled_beside_it() {
        let rt = Arc::new(Runtime::default());
        let a = TokenGuard::new(&rt, 100, 0);
        assert!(a.alone_since_sent());
        let b = TokenGuard::new(&rt, 30, 0);
        assert!(!b.alone_since_sent(), "sent behind another prompt");
        assert!(!a.alone_since_sent(), "another prompt joined it");
        drop(a);
        assert!(!b.alone_since_sent(), "queued behind a prompt that has ended since");
        drop(b);
        rt.tokens.store_report(&EngineLoad { waiting_prompt_tokens: Some(500), ..EngineLoad::default() });
        assert!(!TokenGuard::new(&rt, 10, 0).alone_since_sent(), "the engine reported a queue");
    }

    #[test]
    fn guards_count_while_they_live() {
        let rt = Arc::new(Runtime::default());
        let a = TokenGuard::new(&rt, 100, 0);
        let b = TokenGuard::new(&rt, 30, 530);
        assert_eq!(rt.tokens.queued_requests.load(Ordering::Relaxed), 2);
        assert_eq!(rt.tokens.prompt_tokens.load(Ordering::Relaxed), 130);
        assert_eq!(rt.tokens.kv_tokens.load(Ordering::Relaxed), 530);
        drop(a);
        assert_eq!(rt.tokens.prompt_tokens.load(Ordering::Relaxed), 30);
        drop(b);
        assert_eq!((rt.tokens.queued_requests.load(Ordering::Relaxed), rt.tokens.kv_tokens.load(Ordering::Relaxed)), (0, 0));
    }

    #[test]
    fn free_kv_is_the_report_minus_what_was_placed_since() {
        let rt = Arc::new(Runtime::default());
        assert_eq!(rt.tokens.free_kv(), None);
        let before = TokenGuard::new(&rt, 0, 1_000);
        rt.tokens.store_report(&EngineLoad { used_kv_tokens: Some(2_000), total_kv_tokens: Some(10_000), ..EngineLoad::default() });
        assert_eq!(rt.tokens.free_kv(), Some(8_000), "placed before the report: the engine counted it");
        let after = TokenGuard::new(&rt, 0, 3_000);
        assert_eq!(rt.tokens.free_kv(), Some(5_000));
        drop((before, after));
        assert_eq!(rt.tokens.free_kv(), Some(5_000), "freed KV waits for the next report");
        rt.tokens.store_report(&EngineLoad { used_kv_tokens: Some(0), total_kv_tokens: Some(10_000), ..EngineLoad::default() });
        assert_eq!(rt.tokens.free_kv(), Some(10_000));
        let _huge = TokenGuard::new(&rt, 0, 50_000);
        assert_eq!(rt.tokens.free_kv(), Some(0));
        rt.tokens.clear_report();
        assert_eq!(rt.tokens.free_kv(), None);
    }
}
