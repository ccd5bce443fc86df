//! Admission by decode capacity: a disaggregated request for which no decode has KV room for
//! prompt + max_tokens waits here (re-checking the load view) instead of being sent to a decode
//! that would pre-empt it later. The wait is bounded by `--queue-timeout-secs` and the request's
//! deadline; running out is answered 408 `queue_timeout`.

use std::time::Duration;

use pdgate_core::policy::{LoadView, SCAN_LIMIT};
use pdgate_core::{GatewayError, PoolSnapshot, WorkerRole};
use tokio::time::Instant;

use super::placement::DEFAULT_OUTPUT_TOKENS;
use super::Ctx;

/// How often a waiting request looks at the load view again.
const RECHECK: Duration = Duration::from_millis(20);

/// Whether some eligible decode can take `need` more KV tokens. A decode that does not report
/// its free KV counts as having room (nothing is known against it), and so does a pool with no
/// decode at all (routing answers that case with its own error).
pub fn decode_has_room(snap: &PoolSnapshot, loads: &dyn LoadView, need: u64) -> bool {
    let decodes = snap.eligible(WorkerRole::Decode);
    decodes.is_empty() || decodes.iter().take(SCAN_LIMIT).any(|&w| loads.free_kv_tokens(w).is_none_or(|free| free >= need))
}

/// Polls `has_room` every [`RECHECK`] until it holds (true) or `until` passes (false).
pub async fn wait_for(mut has_room: impl FnMut() -> bool, until: Instant) -> bool {
    loop {
        if has_room() {
            return true;
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        tokio::time::sleep(RECHECK.min(until - now)).await;
    }
}

/// Waits until a decode has room for this request, within the queue timeout and the deadline.
pub async fn admit(ctx: &Ctx) -> Result<(), GatewayError> {
    let need = ctx.req.prompt_tokens.saturating_add(ctx.req.max_tokens.map_or(DEFAULT_OUTPUT_TOKENS, |(n, _)| n));
    let room = || {
        let routing = ctx.state.fleet.registry.routing();
        decode_has_room(&routing.snapshot, &ctx.state.fleet.loads(&routing.runtime), need)
    };
    let limit = Duration::from_secs(ctx.state.config.queue_timeout_secs);
    let until = ctx.deadline.min(Instant::now() + limit);
    if wait_for(room, until).await {
        return Ok(());
    }
    ctx.state.metrics.admission_refused.with_label_values(&["no_kv_room"]).inc();
    Err(GatewayError::queue_timeout(format!("no decode worker had KV room for {need} tokens (prompt + max_tokens) within --queue-timeout-secs or the request deadline")))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use pdgate_core::{KvConnector, WorkerSpec, WorkerView};

    use super::*;

    struct FreeKv(Vec<Option<u64>>);

    impl LoadView for FreeKv {
        fn load(&self, _: usize) -> u64 {
            0
        }
        fn free_kv_tokens(&self, w: usize) -> Option<u64> {
            self.0.get(w).copied().flatten()
        }
    }

    fn pool() -> PoolSnapshot {
        let views = ["http://p:1", "http://d1:1", "http://d2:1"]
            .iter()
            .enumerate()
            .map(|(i, u)| WorkerView::new(Arc::new(WorkerSpec::new(u, if i == 0 { WorkerRole::Prefill } else { WorkerRole::Decode }).unwrap()), true))
            .collect();
        PoolSnapshot::build(views, KvConnector::Bootstrap)
    }

    #[test]
    fn room_is_free_kv_for_prompt_plus_output_on_some_decode() {
        let snap = pool();
        assert!(decode_has_room(&snap, &FreeKv(vec![None, Some(100), Some(5000)]), 4096));
        assert!(!decode_has_room(&snap, &FreeKv(vec![None, Some(100), Some(4000)]), 4096));
        assert!(decode_has_room(&snap, &FreeKv(vec![None, Some(100), None]), 4096), "an unreported decode counts as room");
        let no_decodes = PoolSnapshot::build(vec![], KvConnector::Bootstrap);
        assert!(decode_has_room(&no_decodes, &FreeKv(vec![]), 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_until_room_frees_up_and_no_longer_than_its_limit() {
        let checks = AtomicU32::new(0);
        let start = Instant::now();
        // Room appears at the fifth look (80 ms of waiting).
        assert!(wait_for(|| checks.fetch_add(1, Ordering::SeqCst) >= 4, start + Duration::from_secs(5)).await);
        assert_eq!(Instant::now() - start, RECHECK * 4);
        let start = Instant::now();
        assert!(!wait_for(|| false, start + Duration::from_millis(500)).await);
        assert_eq!(Instant::now() - start, Duration::from_millis(500), "gives up exactly at its limit");
    }
}
