//! One worker's KV event subscription: SUB to its publisher, decode each batch, apply it to the
//! shared index; fill sequence gaps from the replay socket, else reset the worker's view.
//!
//! Every (re)connect starts the worker's view from empty (what it published while we were away
//! is unknown), then at once asks the replay socket for everything it still buffers, so that
//! routing knows the worker's cache before its next event (an idle engine may publish none for
//! long, and a lazy catch-up would also hold the live stream back while the first requests are
//! routed). Waiting for the next event has no deadline on purpose: an idle engine publishes
//! nothing. Connecting, the handshake and each replay answer do.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pdgate_core::kv_events::{decode_batch, DecodedBatch};
use pdgate_core::kv_index::{SeqCheck, WorkerSlot};

use super::zmtp::{Peer, SocketType};
use super::KvShared as KvView;

/// Deadlines and backoff of one subscription.
#[derive(Clone, Copy, Debug)]
pub struct SubTimings {
    pub connect: Duration,
    /// For each replay answer (the replay ends when one does not come).
    pub replay_answer: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

impl Default for SubTimings {
    fn default() -> Self {
        SubTimings { connect: Duration::from_secs(5), replay_answer: Duration::from_secs(2), backoff_min: Duration::from_millis(200), backoff_max: Duration::from_secs(10) }
    }
}

/// The replay socket's end marker: seq -1 as 8 signed big-endian bytes.
const END_SEQ: u64 = u64::MAX;

/// Subscribe forever (until the task is aborted, when the worker is removed).
pub async fn run(view: Arc<KvView>, slot: WorkerSlot, endpoint: String, replay: Option<String>, timings: SubTimings) {
    let mut backoff = timings.backoff_min;
    loop {
        match Peer::connect(&endpoint, SocketType::Sub, timings.connect).await {
            Ok(mut peer) => {
                backoff = timings.backoff_min;
                view.lock().reset(slot);
                view.metrics.connects.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = peer.subscribe(b"").await {
                    tracing::warn!(endpoint, error = %e, "KV events: subscribe failed");
                } else {
                    let e = follow(&view, slot, &mut peer, replay.as_deref(), timings).await;
                    tracing::warn!(endpoint, error = %e, "KV events: subscription lost; the worker's view is reset on reconnect");
                }
            }
            Err(e) => tracing::debug!(endpoint, error = %e, "KV events: cannot connect"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(timings.backoff_max);
    }
}

/// Apply batches until the connection fails.
async fn follow(view: &KvView, slot: WorkerSlot, peer: &mut Peer, replay: Option<&str>, timings: SubTimings) -> std::io::Error {
    // Live batches queue on the socket meanwhile; those the replay already applied are stale.
    let mut fresh = match replay {
        Some(r) => !catch_up(view, slot, r, timings).await,
        None => true,
    };
    view.metrics.catch_ups.fetch_add(1, Ordering::Relaxed);
    loop {
        let frames = match peer.recv().await {
            Ok(f) => f,
            Err(e) => return e,
        };
        let Some((seq, batch)) = parse_message(view, &frames) else { continue };
        if fresh && seq > 0 {
            if let Some(r) = replay {
                // What the engine published before we came, as far as its buffer goes.
                let _ = replay_range(view, slot, r, 0, seq, timings).await;
            }
        }
        fresh = false;
        apply_live(view, slot, replay, seq, &batch, timings).await;
    }
}

/// Apply one live batch; on a gap, replay the missing ones first, or reset.
async fn apply_live(view: &KvView, slot: WorkerSlot, replay: Option<&str>, seq: u64, batch: &DecodedBatch, timings: SubTimings) {
    let check = view.apply(slot, seq, batch);
    let SeqCheck::Gap { expected, got } = check else { return };
    let filled = match replay {
        Some(r) => replay_range(view, slot, r, expected, got, timings).await,
        None => false,
    };
    if !filled {
        view.lock().reset(slot);
    }
    view.apply(slot, seq, batch);
}

/// Topic, seq, payload -> (seq, batch). A payload that is no batch is applied as an empty batch
/// counted undecodable, so its sequence number is not taken for a gap.
fn parse_message(view: &KvView, frames: &[Vec<u8>]) -> Option<(u64, DecodedBatch)> {
    let [_topic, seq, payload] = frames else {
        view.metrics.bad_messages.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
        view.metrics.bad_messages.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    let batch = decode_batch(payload).unwrap_or_else(|e| {
        tracing::debug!(error = %e, "KV events: undecodable batch");
        DecodedBatch { undecodable: 1, ..DecodedBatch::default() }
    });
    Some((seq, batch))
}

/// Ask the replay socket for batches `from..until` and apply them. True when the view now
/// expects `until` (the range was filled); a missing answer or a buffer that no longer holds
/// `from` is false.
pub async fn replay_range(view: &KvView, slot: WorkerSlot, endpoint: &str, from: u64, until: u64, timings: SubTimings) -> bool {
    view.metrics.replays.fetch_add(1, Ordering::Relaxed);
    let mut gap = false;
    let answered = replay_from(endpoint, from, timings, |seq, batch| {
        if seq >= until {
            return false;
        }
        // A gap: the buffer starts after what we miss.
        gap = matches!(view.apply(slot, seq, &batch), SeqCheck::Gap { .. });
        !gap
    })
    .await;
    let filled = answered && !gap && view.lock().next_seq(slot) == Some(until);
    if !filled {
        view.metrics.replay_failures.fetch_add(1, Ordering::Relaxed);
    }
    filled
}

/// After a connect: everything the replay socket still buffers, applied in order. A gap inside
/// the answer (the socket dropped batches past its high-water mark) restarts the view from the
/// batch after it, as a live gap without replay would. True when the view now follows the
/// engine's sequence (it applied at least one batch); false when the buffer was empty or the
/// socket did not answer in full (a failure, counted).
async fn catch_up(view: &KvView, slot: WorkerSlot, endpoint: &str, timings: SubTimings) -> bool {
    view.metrics.replays.fetch_add(1, Ordering::Relaxed);
    let mut gap = false;
    let answered = replay_from(endpoint, 0, timings, |seq, batch| {
        if let SeqCheck::Gap { .. } = view.apply(slot, seq, &batch) {
            gap = true;
            view.lock().reset(slot);
            view.apply(slot, seq, &batch);
        }
        true
    })
    .await;
    if !answered || gap {
        view.metrics.replay_failures.fetch_add(1, Ordering::Relaxed);
    }
    view.lock().next_seq(slot).is_some()
}

/// Asks the replay socket at `endpoint` for the batches from `from` on and hands each to
/// `take` until it returns false or the end marker comes. False when there was no connection,
/// or an answer was missing or malformed.
async fn replay_from(endpoint: &str, from: u64, timings: SubTimings, mut take: impl FnMut(u64, DecodedBatch) -> bool) -> bool {
    async {
        let mut peer = Peer::connect(endpoint, SocketType::Dealer, timings.connect).await.ok()?;
        peer.send(&[b"", &from.to_be_bytes()]).await.ok()?;
        loop {
            let frames = tokio::time::timeout(timings.replay_answer, peer.recv()).await.ok()?.ok()?;
            let [_empty, seq, payload] = frames.as_slice() else { return None };
            let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq.as_slice()).ok()?);
            if seq == END_SEQ {
                return Some(());
            }
            let batch = decode_batch(payload).unwrap_or(DecodedBatch { undecodable: 1, ..DecodedBatch::default() });
            if !take(seq, batch) {
                return Some(());
            }
        }
    }
    .await
    .is_some()
}
