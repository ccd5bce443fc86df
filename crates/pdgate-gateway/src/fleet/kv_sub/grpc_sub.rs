//! One gRPC worker's KV events: its `SubscribeKvEvents` stream (the SMG contract's
//! `smg.grpc.common.KvEventBatch`), applied to the shared index like the ZMQ batches.
//!
//! - Every (re)connect resets the worker's view and subscribes from 0: the engine answers from
//!   the start of its event history (its whole state while the history reaches back to batch 0;
//!   the engine may also have restarted, so nothing of the old view is trusted).
//! - A gap inside a stream (a sequence number skipped) is asked for again on a new stream from
//!   the missing number, keeping the view; if that stream does not start there either (the
//!   history no longer has it), the view is reset and the stream taken from where it starts.
//! - A snapshot chunk (`KvEventBatch.snapshot`, sent by relays) restarts the view at chunk 0.
//! - `UNIMPLEMENTED` (the worker does not offer the stream, e.g. an engine without KV events)
//!   ends the task: the worker is matched on the text tree under `--cache-source auto`.
//! - Load-only batches (`EngineLoad.load_only`) carry no events and are skipped; the gateway
//!   does not ask for them.
//!
//! Connecting and opening the stream have deadlines; waiting for the next batch has none on
//! purpose (an idle engine sends nothing), and a broken connection ends the stream.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::StreamExt;
use pdgate_core::kv_events::{DecodedBatch, KvEvent};
use pdgate_core::kv_index::{SeqCheck, WorkerSlot};
use tonic::Code;

use super::subscriber::SubTimings;
use super::KvShared as KvView;
use crate::clients::grpc::pb::smg::grpc::common::{kv_cache_event, KvCacheEvent, KvEventBatch};
use crate::clients::grpc::GrpcClient;

/// How a stream ended.
enum End {
    /// The connection or the stream failed (or the engine ended it): reconnect from empty.
    Lost,
    /// A sequence gap: resubscribe from `expected`, keeping the view.
    Gap { expected: u64 },
}

/// Subscribe until the task is aborted (the worker was removed) or the worker does not offer
/// the stream.
pub async fn run(view: Arc<KvView>, slot: WorkerSlot, url: String, grpc: Arc<GrpcClient>, timings: SubTimings) {
    let mut backoff = timings.backoff_min;
    let mut resume: Option<u64> = None;
    loop {
        let start = resume.unwrap_or(0);
        match grpc.kv_events(&url, start, timings.connect).await {
            Ok(stream) => {
                backoff = timings.backoff_min;
                view.metrics.connects.fetch_add(1, Ordering::Relaxed);
                if resume.is_none() {
                    view.lock().reset(slot);
                } else {
                    view.metrics.replays.fetch_add(1, Ordering::Relaxed);
                }
                view.set_grpc_live(slot, true);
                match follow(&view, slot, stream, resume).await {
                    End::Gap { expected } => {
                        resume = Some(expected);
                        continue; // at once: the stream is fine, a batch is missing
                    }
                    End::Lost => {
                        view.set_grpc_live(slot, false);
                        resume = None;
                        tracing::warn!(url, "KV events (gRPC): stream lost; the worker's view is reset on reconnect");
                    }
                }
            }
            Err(s) if s.code() == Code::Unimplemented => {
                view.set_grpc_live(slot, false);
                tracing::info!(url, "KV events (gRPC): the worker does not offer SubscribeKvEvents; its cache is matched on the text tree (--cache-source auto)");
                return;
            }
            Err(s) => {
                view.set_grpc_live(slot, false);
                resume = None;
                tracing::debug!(url, error = %s.message(), "KV events (gRPC): cannot subscribe");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(timings.backoff_max);
    }
}

/// Apply batches until the stream ends or skips a number. `resumed`: the number this stream
/// was asked to start at, after a gap.
async fn follow(view: &KvView, slot: WorkerSlot, mut stream: tonic::Streaming<KvEventBatch>, resumed: Option<u64>) -> End {
    let mut first = true;
    while let Some(next) = stream.next().await {
        let Ok(b) = next else { return End::Lost };
        if b.load.as_ref().is_some_and(|l| l.load_only) {
            continue;
        }
        let seq = b.sequence_number;
        if b.snapshot.is_some_and(|s| s.index == 0) {
            view.lock().reset(slot); // a relay's state snapshot starts over
        }
        let batch = decode(&b);
        let check = view.apply(slot, seq, &batch);
        if first && resumed.is_some() && check != SeqCheck::Next {
            // the gap could not be filled (the history starts later): start over from here
            view.metrics.replay_failures.fetch_add(1, Ordering::Relaxed);
            view.lock().reset(slot);
            view.apply(slot, seq, &batch);
        } else if let SeqCheck::Gap { expected, .. } = check {
            return End::Gap { expected };
        }
        first = false;
    }
    End::Lost
}

/// The proto's batch as the index's batch: hashes as the same 64 bits (signed on this wire),
/// one stored event per block (each block names its parent: the previous block, or the event's
/// parent for the first), unknown event kinds counted undecodable.
pub fn decode(b: &KvEventBatch) -> DecodedBatch {
    let mut out = DecodedBatch { ts: b.timestamp, events: Vec::with_capacity(b.events.len()), data_parallel_rank: b.dp_rank.map(i64::from), undecodable: 0 };
    for ev in &b.events {
        if !push_event(ev, &mut out.events) {
            out.undecodable += 1;
        }
    }
    out
}

fn push_event(ev: &KvCacheEvent, out: &mut Vec<KvEvent>) -> bool {
    match &ev.data {
        Some(kv_cache_event::Data::Stored(s)) => {
            let mut parent = s.parent_block_hash.map(|h| h as u64);
            for blk in &s.blocks {
                let Ok(block_size) = u32::try_from(blk.block_size) else { return false };
                if block_size == 0 || blk.token_ids.len() != block_size as usize {
                    return false; // a partial or empty block names no full page
                }
                let hash = blk.block_hash as u64;
                out.push(KvEvent::BlockStored { block_hashes: vec![hash], parent_block_hash: parent, token_ids: blk.token_ids.clone(), block_size, medium: s.medium.clone() });
                parent = Some(hash);
            }
            true
        }
        Some(kv_cache_event::Data::Removed(r)) => {
            out.push(KvEvent::BlockRemoved { block_hashes: r.block_hashes.iter().map(|&h| h as u64).collect(), medium: r.medium.clone() });
            true
        }
        Some(kv_cache_event::Data::Cleared(_)) => {
            out.push(KvEvent::AllBlocksCleared);
            true
        }
        None => false,
    }
}
