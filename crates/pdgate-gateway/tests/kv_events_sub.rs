//! The KV event subscription against a real pyzmq publisher (XPUB + replay ROUTER) on loopback:
//! both event encodings, signed hashes, a lost batch recovered by replay, the catch-up of a new
//! subscriber from the replay socket, a gap with no replay
//! socket, AllBlocksCleared, a payload that is no batch, and a removed worker.
//!
//! Needs a Python with pyzmq and msgpack (the package's own dependencies): `PDGATE_TEST_PYTHON`,
//! else `python3`. Waits are bounded polls (a missing event fails the test, never hangs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use pdgate_gateway::kv_sub::{KvView, SubTimings};
use serde_json::{json, Value};

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub_ep: String,
    replay_ep: String,
}

impl Publisher {
    fn start() -> Publisher {
        let python = std::env::var("PDGATE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_pub.py");
        let mut child = Command::new(python).arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("python runs");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ports: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("publisher did not start ({e}): {line:?}; needs pyzmq + msgpack"));
        Publisher { child, stdin, stdout, pub_ep: format!("tcp://127.0.0.1:{}", ports["pub"]), replay_ep: format!("tcp://127.0.0.1:{}", ports["replay"]) }
    }

    /// Send one command; blocks (in a blocking thread) until the script acknowledges it.
    async fn send(&mut self, cmd: Value) {
        let this = &mut *self;
        tokio::task::block_in_place(|| {
            writeln!(this.stdin, "{cmd}").unwrap();
            this.stdin.flush().unwrap();
            let mut ack = String::new();
            this.stdout.read_line(&mut ack).unwrap();
            assert_eq!(ack.trim(), "ok", "{cmd}");
        });
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stored_map(hash: i64, parent: Option<i64>, tokens: std::ops::Range<u32>) -> Value {
    json!({"type": "BlockStored", "block_hashes": [hash], "parent_block_hash": parent, "token_ids": tokens.collect::<Vec<_>>(), "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null})
}

fn stored_array(hash: i64, parent: Option<i64>, tokens: std::ops::Range<u32>) -> Value {
    json!(["BlockStored", [hash], parent, tokens.collect::<Vec<_>>(), 16, null, "GPU", null])
}

fn timings() -> SubTimings {
    SubTimings { connect: Duration::from_secs(5), replay_answer: Duration::from_secs(5), backoff_min: Duration::from_millis(20), backoff_max: Duration::from_millis(200) }
}

const W: &str = "http://w:1";

/// Poll until `view` matches `want` tokens of `tokens` on W (or fail after ~10 s).
async fn wait_match(view: &KvView, tokens: &[u32], want: usize) {
    for _ in 0..1000 {
        if view.matches(tokens).get(W).copied().unwrap_or(0) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("W never matched {want} tokens; it matches {:?}", view.matches(tokens));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_encodings_a_gap_filled_by_replay_and_a_clear() {
    let mut publisher = Publisher::start();
    let view = KvView::new(7, 1 << 20, timings());
    view.watch(W, &publisher.pub_ep, Some(&publisher.replay_ep));
    let prompt: Vec<u32> = (0..64).collect();

    // Positional arrays (older vLLM), a signed hash; then maps tagged by type.
    publisher.send(json!({"seq": 0, "events": [stored_array(-5, None, 0..16)]})).await;
    publisher.send(json!({"seq": 1, "events": [stored_map(6, Some(-5), 16..32)]})).await;
    wait_match(&view, &prompt, 32).await;

    // Batch 2 is lost on the wire; batch 3 shows the gap, and replay brings 2 back.
    publisher.send(json!({"seq": 2, "events": [stored_map(7, Some(6), 32..48)], "publish": false})).await;
    publisher.send(json!({"seq": 3, "events": [stored_map(8, Some(7), 48..64)]})).await;
    wait_match(&view, &prompt, 64).await;
    let (stats, bytes) = view.stats();
    assert_eq!((stats.gaps, stats.orphans), (1, 0), "{stats:?}");
    assert!(view.metrics().replays.load(Ordering::Relaxed) >= 1);
    assert_eq!(view.metrics().replay_failures.load(Ordering::Relaxed), 0);
    assert!(bytes > 0);

    // Eviction, then a flush: the view follows.
    publisher.send(json!({"seq": 4, "events": [{"type": "BlockRemoved", "block_hashes": [8], "medium": "GPU"}]})).await;
    wait_match(&view, &prompt, 48).await;
    publisher.send(json!({"seq": 5, "events": [{"type": "AllBlocksCleared"}]})).await;
    wait_match(&view, &prompt, 0).await;
    assert_eq!(view.worker_blocks(W), Some(0));
    assert_eq!(view.worker_blocks("http://not-watched:1"), None);

    // A payload that is no batch is counted, and its seq is not taken for a gap.
    publisher.send(json!({"seq": 6, "raw": "c1"})).await;
    publisher.send(json!({"seq": 7, "events": [stored_map(9, None, 0..16)]})).await;
    wait_match(&view, &prompt, 16).await;
    let (stats, _) = view.stats();
    assert_eq!((stats.undecodable, stats.gaps), (1, 1), "{stats:?}");

    // The worker leaves: its subscription ends and its view is gone.
    view.unwatch(W);
    assert!(view.matches(&prompt).is_empty());
    assert!(!view.is_watched(W));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_subscriber_learns_what_an_idle_engine_buffered_without_waiting_for_its_next_event() {
    let mut publisher = Publisher::start();
    let first = KvView::new(7, 1 << 20, timings());
    first.watch(W, &publisher.pub_ep, Some(&publisher.replay_ep));
    // Two batches the engine published before the second gateway came; then it stays idle.
    publisher.send(json!({"seq": 0, "events": [stored_map(1, None, 0..16)]})).await;
    publisher.send(json!({"seq": 1, "events": [stored_map(2, Some(1), 16..32)]})).await;
    let prompt: Vec<u32> = (0..48).collect();
    wait_match(&first, &prompt, 32).await;
    let second = KvView::new(7, 1 << 20, timings());
    second.watch(W, &publisher.pub_ep, Some(&publisher.replay_ep));
    wait_match(&second, &prompt, 32).await;
    assert_eq!(second.metrics().catch_ups.load(Ordering::Relaxed), 1);
    assert_eq!(second.metrics().replay_failures.load(Ordering::Relaxed), 0);
    assert!(second.metrics_text().contains("pdgate_kv_events_caught_up_total 1\n"));
    // The next live batch follows on from the replayed ones: no gap, no second replay.
    publisher.send(json!({"seq": 2, "events": [stored_map(3, Some(2), 32..48)]})).await;
    wait_match(&second, &prompt, 48).await;
    assert_eq!((second.stats().0.gaps, second.metrics().replays.load(Ordering::Relaxed)), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_without_a_replay_socket_resets_the_view() {
    let mut publisher = Publisher::start();
    let view = KvView::new(7, 1 << 20, timings());
    view.watch(W, &publisher.pub_ep, None);
    let prompt: Vec<u32> = (0..48).collect();
    publisher.send(json!({"seq": 0, "events": [stored_map(1, None, 0..16)]})).await;
    publisher.send(json!({"seq": 1, "events": [stored_map(2, Some(1), 16..32)]})).await;
    wait_match(&view, &prompt, 32).await;
    // Lost: batch 2 evicted block 1. Without replay the view cannot know, so it starts over
    // from batch 3 rather than keep a block the worker no longer has.
    publisher.send(json!({"seq": 2, "events": [{"type": "BlockRemoved", "block_hashes": [1]}], "publish": false})).await;
    publisher.send(json!({"seq": 3, "events": [stored_map(3, None, 100..116)]})).await;
    let other: Vec<u32> = (100..116).collect();
    wait_match(&view, &other, 16).await;
    assert_eq!(view.matches(&prompt).get(W), None, "the stale blocks are gone");
    let (stats, _) = view.stats();
    assert!(stats.resets >= 2, "one reset at connect, one for the gap: {stats:?}");
}

#[path = "common/mod.rs"]
mod common;

/// The gateway wires it: a worker registered with `kv_events=` is subscribed to, its view shows
/// in `/metrics`, and `--kv-index-max-blocks` bounds it (an eviction, counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_worker_is_subscribed_and_shows_in_metrics() {
    let mut publisher = Publisher::start();
    let prefill = json!([["http://127.0.0.1:9", "none", format!("kv_events={}", publisher.pub_ep), format!("kv_events_replay={}", publisher.replay_ep)]]);
    let config = json!({"pd_disaggregation": true, "admin_api_open": true, "prefill": prefill, "decode": [["http://127.0.0.1:10"]], "kv_index_max_blocks": 1});
    let (_gw, url) = common::gateway(config).await;
    publisher.send(json!({"seq": 0, "events": [stored_map(1, None, 0..16)]})).await;
    let client = reqwest::Client::new();
    let metrics_with = |want: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let mut text = String::new();
            for _ in 0..1000 {
                text = client.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
                if text.contains(want) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            text
        }
    };
    let text = metrics_with("pdgate_kv_index_blocks 1\n").await;
    assert!(text.contains("pdgate_kv_index_blocks 1\n") && text.contains("pdgate_kv_events_subscriptions 1\n"), "{text}");
    assert!(text.contains("pdgate_kv_index_max_blocks 1\n") && text.contains("pdgate_kv_index_evictions_total 0\n"), "{text}");
    // a second block does not fit: the oldest goes
    publisher.send(json!({"seq": 1, "events": [stored_map(2, Some(1), 16..32)]})).await;
    let text = metrics_with("pdgate_kv_index_evictions_total 1\n").await;
    assert!(text.contains("pdgate_kv_index_evictions_total 1\n") && text.contains("pdgate_kv_index_blocks 1\n"), "{text}");
    let workers: Value = client.get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap();
    let listed = workers.to_string();
    assert!(listed.contains(&publisher.pub_ep) && listed.contains(&publisher.replay_ep), "{listed}");
}
