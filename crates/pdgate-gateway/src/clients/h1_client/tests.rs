//! The own HTTP/1.1 client: framing and heads as pure functions (every split of the wire bytes),
//! then real sockets on loopback against a scripted worker (reuse, staleness, aborts, errors).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use hyper::header::HeaderValue;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::framing::{Chunk, Framing, Step};
use super::head;
use super::{H1Client, H1Error};

/// Feeds `wire` to a decoder in pieces cut at `cuts`; the body, and what is left after its end.
fn decode(mut framing: Framing, wire: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, Vec<u8>), &'static str> {
    let mut buf = BytesMut::new();
    let mut body = Vec::new();
    let mut at = 0;
    let mut cuts: Vec<usize> = cuts.iter().copied().filter(|c| *c < wire.len()).collect();
    cuts.sort_unstable();
    cuts.push(wire.len());
    for cut in cuts {
        buf.extend_from_slice(&wire[at..cut.max(at)]);
        at = cut.max(at);
        loop {
            match framing.step(&mut buf).map_err(|m| m.0)? {
                Step::Data(d) => body.extend_from_slice(&d),
                Step::End => {
                    // What the worker sent after the body, whether or not it was read yet.
                    buf.extend_from_slice(&wire[at..]);
                    return Ok((body, buf.to_vec()));
                }
                Step::More => break,
            }
        }
    }
    Err("incomplete")
}

const CHUNKED: &[u8] = b"5\r\nhello\r\n1A;name=value\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";

#[test]
fn a_chunked_body_decodes_the_same_at_every_split() {
    for cut in 0..CHUNKED.len() {
        let (body, rest) = decode(Framing::Chunked(Chunk::Size), CHUNKED, &[cut]).unwrap();
        assert_eq!(body, b"helloabcdefghijklmnopqrstuvwxyz", "cut at {cut}");
        assert_eq!(rest, b"NEXT", "cut at {cut}");
    }
}

#[test]
fn a_length_body_ends_at_its_length() {
    let (body, rest) = decode(Framing::Length(5), b"hello, more", &[2]).unwrap();
    assert_eq!((body.as_slice(), rest.as_slice()), (&b"hello"[..], &b", more"[..]));
}

#[test]
fn bad_chunk_framing_is_refused() {
    assert_eq!(decode(Framing::Chunked(Chunk::Size), b"zz\r\n", &[]), Err("bad chunk size"));
    assert_eq!(decode(Framing::Chunked(Chunk::Size), b"2\r\nabc\r\n", &[]), Err("chunk data longer than its size"));
    assert_eq!(decode(Framing::Chunked(Chunk::Size), b"2 x\r\n", &[]), Err("bad chunk size"));
    let long = [b"1".repeat(5000), b"\r\n".to_vec()].concat();
    assert_eq!(decode(Framing::Chunked(Chunk::Size), &long, &[]), Err("chunk line too long"));
    assert_eq!(decode(Framing::Chunked(Chunk::Size), &b"1".repeat(5000), &[]), Err("chunk line too long"));
    // Sixteen hex digits would not fit the u64 the decoder counts in.
    assert_eq!(decode(Framing::Chunked(Chunk::Size), b"1000000000000000\r\n", &[]), Err("bad chunk size"));
}

proptest! {
    /// Any body, chunked any way (with LF-only line ends sometimes), cut anywhere, decodes to
    /// itself.
    #[test]
    fn any_chunking_and_any_cuts_decode_to_the_body(
        body in proptest::collection::vec(any::<u8>(), 0..600),
        sizes in proptest::collection::vec(1usize..90, 1..20),
        cuts in proptest::collection::vec(0usize..2000, 0..12),
        bare_lf in any::<bool>(),
    ) {
        let eol: &[u8] = if bare_lf { b"\n" } else { b"\r\n" };
        let mut wire = Vec::new();
        let mut at = 0;
        for size in sizes.iter().cycle() {
            if at >= body.len() { break; }
            let end = (at + size).min(body.len());
            wire.extend_from_slice(format!("{:x}", end - at).as_bytes());
            wire.extend_from_slice(eol);
            wire.extend_from_slice(&body[at..end]);
            wire.extend_from_slice(eol);
            at = end;
        }
        wire.extend_from_slice(b"0");
        wire.extend_from_slice(eol);
        wire.extend_from_slice(eol);
        let (got, rest) = decode(Framing::Chunked(Chunk::Size), &wire, &cuts).unwrap();
        prop_assert_eq!(got, body);
        prop_assert!(rest.is_empty());
    }
}

fn parsed(wire: &str) -> Result<Option<head::Head>, String> {
    head::parse(&mut BytesMut::from(wire))
}

#[test]
fn a_head_says_how_its_body_is_framed_and_whether_the_connection_stays() {
    let h = parsed("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").unwrap().unwrap();
    assert_eq!((h.status.as_u16(), h.framing, h.keep_alive), (200, Framing::Chunked(Chunk::Size), true));
    assert_eq!(h.headers["content-type"], "text/event-stream");
    let h = parsed("HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\nconnection: close\r\n\r\n").unwrap().unwrap();
    assert_eq!((h.status.as_u16(), h.framing, h.keep_alive), (400, Framing::Length(12), false));
    // No length and not chunked: the body runs to the close, and the connection cannot be reused.
    let h = parsed("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
    assert_eq!((h.framing, h.keep_alive), (Framing::UntilClose, false));
    let h = parsed("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n").unwrap().unwrap();
    assert!(!h.keep_alive, "HTTP/1.0 closes unless it says keep-alive");
    // An informational head before the answer is skipped.
    let h = parsed("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n").unwrap().unwrap();
    assert_eq!((h.status.as_u16(), h.framing), (204, Framing::Length(0)));
    assert!(parsed("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none(), "an incomplete head waits for more");
    assert!(parsed("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n").is_err());
    assert!(parsed("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n").is_err());
    assert!(parsed("SMTP ready\r\n\r\n").is_err());
}

#[test]
fn the_request_head_carries_host_length_and_the_given_headers() {
    let id = HeaderValue::from_static("req-1");
    let mut out = BytesMut::new();
    head::write_post(&mut out, "127.0.0.1:9", "/v1/completions", &[("x-request-id", &id)], 42);
    assert_eq!(&out[..], b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:9\r\ncontent-length: 42\r\nx-request-id: req-1\r\n\r\n");
}

/// A scripted worker: answers each request it reads with the next of `answers` (all of them
/// on the connection it accepted); `None` closes the connection instead of answering, and an
/// answer ending in [`THEN_CLOSE`] closes it right after answering.
struct Worker {
    url: String,
    accepts: Arc<AtomicUsize>,
    requests: Arc<std::sync::Mutex<Vec<String>>>,
}

async fn worker(answers: Vec<Option<&'static str>>) -> Worker {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepts = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (a, r) = (accepts.clone(), requests.clone());
    tokio::spawn(async move {
        let mut answers = answers.into_iter();
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            a.fetch_add(1, Ordering::SeqCst);
            loop {
                let Some(req) = read_request(&mut conn).await else { break };
                r.lock().unwrap().push(req);
                match answers.next() {
                    Some(Some(answer)) => match answer.strip_suffix(THEN_CLOSE) {
                        Some(answer) => {
                            conn.write_all(answer.as_bytes()).await.unwrap();
                            break;
                        }
                        None => conn.write_all(answer.as_bytes()).await.unwrap(),
                    },
                    _ => break,
                }
            }
        }
    });
    Worker { url, accepts, requests }
}

/// Reads one request (head and a content-length body); `None` at the end of the connection.
async fn read_request(conn: &mut TcpStream) -> Option<String> {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        got.push(byte[0]);
    }
    let text = String::from_utf8(got).unwrap();
    let len: usize = text.lines().find_map(|l| l.strip_prefix("content-length: ")).unwrap().parse().unwrap();
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body).await.ok()?;
    Some(text + &String::from_utf8(body).unwrap())
}

const THEN_CLOSE: &str = "<close>";
const SSE: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n5\r\nhello\r\n0\r\n\r\n";
const JSON: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";

fn client() -> H1Client {
    H1Client::new(Duration::from_secs(2), 8, Duration::from_secs(60))
}

async fn body_of(c: &H1Client, url: &str) -> Result<Bytes, H1Error> {
    let id = HeaderValue::from_static("r1");
    let resp = c.post(&format!("{url}/v1/completions"), &[("x-request-id", &id)], Bytes::from_static(b"{\"a\":1}")).await?;
    Ok(resp.into_body().collect().await?.to_bytes())
}

#[tokio::test]
async fn answers_read_to_the_end_reuse_one_connection() {
    let w = worker(vec![Some(SSE), Some(JSON), Some(SSE)]).await;
    let c = client();
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "data: hello");
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "data: hello");
    assert_eq!(w.accepts.load(Ordering::SeqCst), 1);
    let first = w.requests.lock().unwrap()[0].clone();
    let authority = w.url.trim_start_matches("http://");
    assert_eq!(first, format!("POST /v1/completions HTTP/1.1\r\nhost: {authority}\r\ncontent-length: 7\r\nx-request-id: r1\r\n\r\n{{\"a\":1}}"));
}

async fn frames(c: &H1Client, url: &str) -> Vec<Result<Bytes, String>> {
    let id = HeaderValue::from_static("r1");
    let mut body = c.post(&format!("{url}/x"), &[("x-request-id", &id)], Bytes::new()).await.unwrap().into_body();
    let mut out = Vec::new();
    while let Some(f) = body.frame().await {
        out.push(f.map(|f| f.into_data().unwrap()).map_err(|e| e.to_string()));
    }
    out
}

#[tokio::test]
async fn chunks_read_together_are_one_frame_and_the_end_after_them_still_ends_the_body() {
    let w = worker(vec![Some(SSE), Some(JSON)]).await;
    let c = client();
    // One write of the whole answer: its two chunks are in the buffer together.
    assert_eq!(frames(&c, &w.url).await, vec![Ok(Bytes::from_static(b"data: hello"))]);
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(w.accepts.load(Ordering::SeqCst), 1, "the end found while gathering still pools the connection");
}

#[tokio::test]
async fn bad_framing_after_chunks_read_together_comes_after_their_data() {
    let w = worker(vec![Some("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"), Some(JSON)]).await;
    let c = client();
    let got = frames(&c, &w.url).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0], Ok(Bytes::from_static(b"hello")));
    assert!(got[1].is_err(), "{got:?}");
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(w.accepts.load(Ordering::SeqCst), 2, "a badly framed answer's connection is not reused");
}

/// A worker that answers with `first`, then sends `rest` only when the returned sender fires.
async fn answering_in_two_parts(first: &'static [u8], rest: &'static [u8]) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (go_on, next) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        read_request(&mut conn).await.unwrap();
        conn.write_all(first).await.unwrap();
        next.await.unwrap();
        conn.write_all(rest).await.unwrap();
    });
    (url, go_on)
}

#[tokio::test]
async fn a_chunk_not_yet_read_is_not_waited_for() {
    // The second chunk only once the client relayed the first: gathering must not wait.
    let (url, got_first) = answering_in_two_parts(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n", b"1\r\nb\r\n0\r\n\r\n").await;
    let c = client();
    let id = HeaderValue::from_static("r1");
    let mut body = c.post(&format!("{url}/x"), &[("x-request-id", &id)], Bytes::new()).await.unwrap().into_body();
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "a");
    got_first.send(()).unwrap();
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "b");
    assert!(body.frame().await.is_none());
}

/// A stream waits for its worker most of its life: waiting, its body holds no read buffer
/// (docs/performance.md, memory per stream), and what comes next is still read whole.
#[tokio::test]
async fn a_body_waiting_for_its_worker_holds_no_read_buffer() {
    let (url, go_on) = answering_in_two_parts(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n", b"2\r\nbc\r\n0\r\n\r\n").await;
    let c = client();
    let id = HeaderValue::from_static("r1");
    let mut body = c.post(&format!("{url}/x"), &[("x-request-id", &id)], Bytes::new()).await.unwrap().into_body();
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "a");
    let waiting = std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut body).poll_frame(cx).is_pending())).await;
    assert!(waiting, "nothing more was sent, so the body waits");
    assert_eq!(body.buf.capacity(), 0, "a waiting body keeps no buffer");
    go_on.send(()).unwrap();
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "bc");
    assert!(body.frame().await.is_none());
}

#[tokio::test]
async fn a_body_dropped_before_its_end_closes_its_connection() {
    let w = worker(vec![Some("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"), Some(JSON)]).await;
    let c = client();
    let id = HeaderValue::from_static("r1");
    let resp = c.post(&format!("{}/x", w.url), &[("x-request-id", &id)], Bytes::new()).await.unwrap();
    let mut body = resp.into_body();
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "hello");
    drop(body);
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(w.accepts.load(Ordering::SeqCst), 2, "the half-read connection was not reused");
}

#[tokio::test]
async fn a_connection_the_worker_closed_while_idle_is_not_used() {
    // The worker closes the connection after its answer, as an idle timer would.
    let w = worker(vec![Some("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}<close>"), Some(JSON)]).await;
    let c = client();
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(w.accepts.load(Ordering::SeqCst), 2);
    assert_eq!(w.requests.lock().unwrap().len(), 2, "nothing was sent on the closed connection");
}

#[tokio::test]
async fn a_request_that_met_the_workers_idle_close_is_sent_again_once() {
    // The worker reads the second request on the kept connection and closes it unanswered (its
    // idle timer fired as the request arrived): the client sends it once more, on a new one.
    let w = worker(vec![Some(JSON), None, Some(JSON)]).await;
    let c = client();
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    assert_eq!(w.accepts.load(Ordering::SeqCst), 2);
    assert_eq!(w.requests.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn a_new_connection_closed_unanswered_is_an_error_not_a_retry() {
    let w = worker(vec![None]).await;
    let err = body_of(&client(), &w.url).await.unwrap_err();
    assert!(matches!(err, H1Error::Closed), "{err:?}");
    assert_eq!(w.requests.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn connection_close_is_not_reused_and_a_body_cut_short_is_an_error() {
    let w = worker(vec![Some("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"), Some("HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}<close>")]).await;
    let c = client();
    assert_eq!(body_of(&c, &w.url).await.unwrap(), "{}");
    let err = body_of(&c, &w.url).await;
    // The second answer came on a new connection, which the worker then closed mid-body.
    assert_eq!(w.accepts.load(Ordering::SeqCst), 2);
    assert!(matches!(err, Err(H1Error::Closed)), "{err:?}");
}

#[tokio::test]
async fn a_refused_connect_says_the_request_was_not_sent() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = body_of(&client(), &format!("http://127.0.0.1:{port}")).await.unwrap_err();
    assert!(err.is_connect(), "{err:?}");
    let err = body_of(&client(), "https://127.0.0.1:1").await.unwrap_err();
    assert!(matches!(err, H1Error::BadUrl(_)), "{err:?}");
}

#[tokio::test]
async fn a_worker_that_is_not_speaking_http_is_refused() {
    let w = worker(vec![Some("hello there\r\n\r\n")]).await;
    let err = body_of(&client(), &w.url).await.unwrap_err();
    assert!(matches!(err, H1Error::Malformed(_)), "{err:?}");
}
