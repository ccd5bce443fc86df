//! Unit tests of the pump (mod.rs): how the call's end becomes the leg's.

use std::sync::Arc;

use futures_util::StreamExt;
use pdgate_core::{GatewayError, Leg};
use pdgate_tokenizer::ReplacementTail;
use serde_json::Value;
use tokio::sync::mpsc;

use super::request::Route;
use super::response::tests::{counts, data, shape, tok};
use super::response::Gen;
use super::{events as stream_of, pump, wire, Answer, EVENT_BUFFER};
use crate::clients::client::LegEvent;
use crate::clients::grpc::logprobs::LpPart;

/// The leg's events for the engine's `events`, read to the end.
async fn leg_events(stream: bool, events: Vec<Result<Gen, GatewayError>>) -> Vec<LegEvent> {
    let gen: wire::GenStream = Box::pin(futures_util::stream::iter(events));
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let sh = shape(Route::Completions, stream, &[], 1);
    let (_, events) = tokio::join!(
        pump(Arc::new(tok()), Answer { shape: sh, served: "served".into(), tail: ReplacementTail::Lossy }, gen, tx, Leg::Decode, None),
        stream_of(rx).collect::<Vec<_>>()
    );
    events
}

fn answer(ids: &[u32]) -> Vec<Result<Gen, GatewayError>> {
    vec![
        Ok(Gen::Chunk { index: 0, ids: ids[..1].to_vec(), counts: counts(1), lp: LpPart::default() }),
        Ok(Gen::Complete { index: 0, ids: ids[1..].to_vec(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32), lp: LpPart::default() }),
    ]
}

fn dropped() -> GatewayError {
    GatewayError::unreachable(Leg::Decode, "the call was dropped")
}

fn bytes_of(events: &[LegEvent]) -> Vec<u8> {
    events.iter().flat_map(|e| if let LegEvent::Chunk(b) = e { b.to_vec() } else { vec![] }).collect()
}

#[tokio::test]
async fn a_call_dropped_after_every_choice_completed_is_a_whole_stream() {
    let mut events = answer(&[40, 41, 42]);
    events.push(Err(dropped()));
    let got = leg_events(true, events).await;
    assert!(got.iter().all(|e| matches!(e, LegEvent::Chunk(_))), "no error event");
    let body = String::from_utf8(bytes_of(&got)).unwrap();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    let finish: Vec<Value> = data(&bytes_of(&got).into()).into_iter().filter_map(|e| e["choices"][0].get("finish_reason").cloned()).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, vec![Value::from("length")]);
}

#[tokio::test]
async fn a_call_dropped_after_every_choice_completed_is_a_whole_answer() {
    let mut events = answer(&[40, 41]);
    events.push(Err(dropped()));
    let got = leg_events(false, events).await;
    assert_eq!(got.len(), 1);
    let whole: Value = serde_json::from_slice(&bytes_of(&got)).unwrap();
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_call_dropped_before_its_choice_completed_ends_with_the_error() {
    let mut events = answer(&[40, 41, 42]);
    events.pop();
    events.push(Err(dropped()));
    let got = leg_events(true, events).await;
    assert!(matches!(got.last(), Some(LegEvent::Error(e)) if e.message.contains("dropped")), "the error ends the leg");
    assert!(!String::from_utf8(bytes_of(&got)).unwrap().contains("[DONE]"));
}
