//! The blame between concurrent legs (`race`), with mock legs on a paused clock: a decode
//! whose KV source failed is blamed only after the prefill leg had its say.

use std::sync::Mutex;

use pdgate_core::plan::AbortStyle;
use pdgate_core::ErrorKind;

use super::*;
use crate::clients::client::{LegAnswer, LegFuture};
use crate::clients::client::{LegRequest, WorkerClient};

/// The reference decode's answer when its prefill told it that the KV will not come.
const KV_SOURCE_FAILED: &str =
    r#"{"error": {"message": "KV source failed: encode worker: room 7 holds image 00", "type": "server_error", "code": "kv_transfer_failed", "param": null}}"#;

fn kv_source_failed() -> GatewayError {
    GatewayError::worker_status(Leg::Decode, 500, Some(KV_SOURCE_FAILED.to_string()))
}

/// What `encode::blame` makes of a prefill that could not take an image's embedding.
fn encode_failure() -> GatewayError {
    GatewayError::protocol(Leg::Encode, "the prefill could not take the embedding of encode worker http://e0")
}

/// A client whose only use here is to record the aborts an [`AbortGuard`] sends.
#[derive(Default)]
struct Aborts(Mutex<Vec<String>>);

impl Aborts {
    fn sent(&self) -> Vec<String> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl WorkerClient for Arc<Aborts> {
    fn send(&self, _: LegRequest) -> LegFuture<LegAnswer> {
        Box::pin(async { Err(GatewayError::internal("not a sending client")) })
    }
    fn call(&self, _: LegRequest, _: usize) -> LegFuture<Bytes> {
        Box::pin(async { Err(GatewayError::internal("not a sending client")) })
    }
    fn abort(&self, url: &str, _: &AbortStyle) {
        if let Ok(mut v) = self.0.lock() {
            v.push(url.to_string());
        }
    }
    fn engine_id(&self, _: &str, _: &str, _: Instant) -> LegFuture<String> {
        Box::pin(async { Err(GatewayError::internal("not a sending client")) })
    }
}

/// The decode's abort guard, armed, over a recording client.
fn decode_guard(aborts: &Arc<Aborts>) -> Option<AbortGuard> {
    let client: Arc<dyn WorkerClient> = Arc::new(aborts.clone());
    Some(AbortGuard::new(&client, "http://decode", &AbortStyle::AbortRequest { rid: "r1".into() }))
}

/// A concurrent prefill leg that ends with `out` after `after` (never, for `None`).
fn watched(after: Option<Duration>, out: Result<Bytes, GatewayError>) -> Watched {
    watched_keeping(after, out, true)
}

/// [`watched`], keeping the prefill's answer or not.
fn watched_keeping(after: Option<Duration>, out: Result<Bytes, GatewayError>, keep_answer: bool) -> Watched {
    let answer: LegFuture<Bytes> = Box::pin(async move {
        match after {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending::<()>().await,
        }
        out
    });
    let leg = PrefillLeg { url: "http://prefill".into(), sent: std::time::Instant::now(), answer };
    Watched { leg: Some(leg), answer: None, keep_answer, blame_silent_prefill: true, release: None }
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(600)
}

/// The decode's failure, heard at once (it was told by its prefill before the prefill answered).
async fn decode_fails(e: GatewayError) -> Result<(), GatewayError> {
    Err(e)
}

#[tokio::test(start_paused = true)]
async fn a_kv_source_failure_heard_first_is_blamed_on_the_prefill_leg_that_failed() {
    let aborts = Arc::new(Aborts::default());
    let mut guard = decode_guard(&aborts);
    let mut w = watched(Some(Duration::from_millis(200)), Err(encode_failure()));
    let t = Instant::now();
    let err = race(&mut w, far(), &mut guard, decode_fails(kv_source_failed())).await.err();
    let err = err.map(|e| (e.leg, e.code(), e.retryable()));
    assert_eq!(err, Some((Some(Leg::Encode), "encode_bad_response".to_string(), true)));
    assert_eq!(t.elapsed(), Duration::from_millis(200), "the prefill leg's end, not the grace's");
    assert!(w.leg.is_none(), "the prefill leg ended");
    // the decode's request ended at its worker (its 500): nothing there to abort
    drop(guard);
    assert!(aborts.sent().is_empty(), "{:?}", aborts.sent());
}

#[tokio::test(start_paused = true)]
async fn a_prefill_that_answers_leaves_the_kv_source_failure_with_the_decode() {
    let aborts = Arc::new(Aborts::default());
    let mut guard = decode_guard(&aborts);
    let mut w = watched(Some(Duration::from_millis(50)), Ok(Bytes::from_static(b"{}")));
    let err = race(&mut w, far(), &mut guard, decode_fails(kv_source_failed())).await.err();
    assert_eq!(err.map(|e| e.leg), Some(Some(Leg::Decode)));
    assert!(w.leg.is_none() && w.answer.is_some());
    drop(guard);
    assert_eq!(aborts.sent(), vec!["http://decode".to_string()], "the guard is the caller's to disarm, as before");
}

#[tokio::test(start_paused = true)]
async fn a_silent_prefill_is_waited_for_a_grace_bounded_by_the_deadline() {
    for (deadline_in, waited) in [(Duration::from_secs(600), KV_SOURCE_GRACE), (Duration::from_secs(1), Duration::from_secs(1))] {
        let mut guard = None;
        let mut w = watched(None, Ok(Bytes::new()));
        let t = Instant::now();
        let err = race(&mut w, t + deadline_in, &mut guard, decode_fails(kv_source_failed())).await.err();
        assert_eq!(err.map(|e| e.leg), Some(Some(Leg::Decode)));
        assert_eq!(t.elapsed(), waited);
        assert!(w.leg.is_some(), "the prefill leg is left to the caller (dropped, so aborted)");
    }
}

#[tokio::test(start_paused = true)]
async fn other_decode_failures_are_the_decodes_at_once() {
    let decode_own = [
        GatewayError::worker_status(Leg::Decode, 500, Some(r#"{"error": {"message": "internal error", "code": "internal"}}"#.into())),
        GatewayError::worker_status(Leg::Decode, 503, Some(r#"{"error": {"message": "no KV memory", "code": "kv_cache_full"}}"#.into())),
        GatewayError::unreachable(Leg::Decode, "refused"),
    ];
    for e in decode_own {
        let mut guard = None;
        let mut w = watched(Some(Duration::from_millis(200)), Err(encode_failure()));
        let t = Instant::now();
        let err = race(&mut w, far(), &mut guard, decode_fails(e.clone())).await.err();
        assert_eq!(err.map(|x| (x.leg, x.kind)), Some((e.leg, e.kind.clone())));
        assert_eq!(t.elapsed(), Duration::ZERO);
        assert!(w.leg.is_some());
    }
    // and without a prefill leg (a regular or sequential attempt) nothing is waited for
    let mut w = Watched { leg: None, answer: None, keep_answer: false, blame_silent_prefill: false, release: None };
    let err = race(&mut w, far(), &mut None, decode_fails(kv_source_failed())).await.err();
    assert!(matches!(err.map(|e| e.kind), Some(ErrorKind::WorkerStatus { status: 500, .. })));
}

#[tokio::test(start_paused = true)]
async fn a_prefill_that_fails_first_is_the_result_as_before() {
    let mut w = watched(Some(Duration::ZERO), Err(encode_failure()));
    let decode = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Err::<(), _>(kv_source_failed())
    };
    let err = race(&mut w, far(), &mut None, decode).await.err();
    assert_eq!(err.map(|e| e.leg), Some(Some(Leg::Encode)));
}

/// The prefill's answer is held past its arrival only when its logprobs will be merged: held
/// until the decode's first data, it would keep its connection's read buffer alive.
#[tokio::test(start_paused = true)]
async fn a_prefill_answer_is_kept_only_when_its_logprobs_are_merged() {
    for keep in [false, true] {
        let mut w = watched_keeping(Some(Duration::ZERO), Ok(Bytes::from_static(b"{}")), keep);
        let decode = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<(), GatewayError>(())
        };
        assert!(race(&mut w, far(), &mut None, decode).await.is_ok());
        assert!(w.leg.is_none(), "the prefill leg ended");
        assert_eq!(w.answer.is_some(), keep, "keep_answer {keep}");
    }
}
