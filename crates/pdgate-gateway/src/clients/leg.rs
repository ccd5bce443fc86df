//! One leg of a request: send to a worker, get a success response or a classified error, all
//! under the request's deadline.

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::Response;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::answer::check_encoding;
use tokio::time::{timeout_at, Instant};

use crate::clients::upstream::{Upstream, WorkerBody};

/// Error bodies from workers are kept for the client up to this size.
const ERROR_BODY_LIMIT: usize = 64 * 1024;
/// Bound on small answers read outside the relay path (a bootstrap server's `/query`); the
/// relayed and prefill answers are bounded by `--max-response-bytes`.
pub const RESPONSE_LIMIT: usize = 64 * 1024 * 1024;

/// The deadline passed and the worker had not answered (no response head, no stream data):
/// this counts against the worker.
pub fn deadline_error(leg: Leg) -> GatewayError {
    GatewayError::timeout(format!("request deadline passed while waiting for the {} worker", leg.as_str())).on(leg)
}

/// The deadline passed while the worker was still sending its answer: the request was long,
/// the worker is not to blame (its breaker is left alone).
pub fn answering_deadline_error(leg: Leg) -> GatewayError {
    let w = leg.as_str();
    GatewayError::timeout_while_answering(leg, format!("request deadline passed while the {w} worker was still answering"))
}

/// Sends one leg and waits for a 2xx response head. A non-2xx answer becomes an error carrying
/// the worker's error body (read within the deadline).
pub async fn send(upstream: &Upstream, url: &str, path: &str, body: Bytes, request_id: &str, leg: Leg, deadline: Instant) -> Result<Response<WorkerBody>, GatewayError> {
    let resp = timeout_at(deadline, upstream.post_json(url, path, body, request_id, leg)).await.map_err(|_| deadline_error(leg))??;
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = read_limited(resp.into_body(), ERROR_BODY_LIMIT, leg, deadline).await.ok();
    let text = body.map(|b| String::from_utf8_lossy(&b).into_owned()).filter(|t| !t.is_empty());
    Err(GatewayError::worker_status(leg, status.as_u16(), text))
}

/// Reads a whole body, failing on a broken connection, the size limit or the deadline. The
/// head has arrived, so a deadline here is one the worker met while answering.
pub async fn read_limited(body: WorkerBody, limit: usize, leg: Leg, deadline: Instant) -> Result<Bytes, GatewayError> {
    // One timer for the whole body, not one per frame: a timer registration per frame was a
    // measurable share of the gateway's CPU per request.
    timeout_at(deadline, read_all(body, limit, leg)).await.map_err(|_| answering_deadline_error(leg))?
}

async fn read_all(mut body: WorkerBody, limit: usize, leg: Leg) -> Result<Bytes, GatewayError> {
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Ok(first.unwrap_or_else(|| buf.freeze())),
            Some(Err(e)) => {
                return Err(GatewayError::unreachable(leg, format!("{} worker's response broke off: {e}", leg.as_str())));
            }
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else { continue };
                let have = first.as_ref().map_or(buf.len(), Bytes::len);
                if have + data.len() > limit {
                    return Err(GatewayError::bad_worker_response(leg, format!("{} answer exceeds {limit} bytes", whose(leg))));
                }
                // A body in one frame (the usual small answer) is passed on without a copy.
                match first.take() {
                    None if buf.is_empty() => first = Some(data),
                    None => buf.extend_from_slice(&data),
                    Some(f) => {
                        buf.extend_from_slice(&f);
                        buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// Refuses an answer in a content encoding the gateway did not ask for.
pub fn check_head_encoding(resp: &Response<WorkerBody>, leg: Leg) -> Result<(), GatewayError> {
    let encoding = resp.headers().get(hyper::header::CONTENT_ENCODING).map(|v| v.to_str().unwrap_or("(not text)"));
    check_encoding(encoding).map_err(|b| GatewayError::bad_worker_response(leg, format!("{} {}", whose(leg), b.message)))
}

/// "the worker's" / "the decode worker's", for messages about an answer.
pub fn whose(leg: Leg) -> String {
    match leg {
        Leg::Regular => "the worker's".into(),
        other => format!("the {} worker's", other.as_str()),
    }
}
