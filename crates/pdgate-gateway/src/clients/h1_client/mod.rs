//! The gateway's own HTTP/1.1 client for plain-`http://` workers' POSTs (every leg and abort).
//!
//! Why not hyper-util's pooled client (which still serves `https://` workers and GETs): it
//! drives each connection in a task of its own and hands every body frame to the request's
//! task over a channel, so each relayed chunk of a stream costs two task wake-ups, often on two
//! threads. Here the answer's body is read by whoever polls it: the relay, inside the client
//! connection's task, reads the worker's socket and returns the bytes to the client in the same
//! poll. Connections are pooled per worker address ([`pool`]) and reused only after a body was
//! read to its end; a body dropped early closes its connection, which is how a vLLM-style leg
//! is aborted.

mod framing;
mod head;
pub mod pool;
#[cfg(test)]
mod tests;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::HeaderValue;
use hyper::Response;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use framing::{Framing, Step};
use pool::Pool;

/// Read buffer per answer (hyper's default too).
const READ_BUF: usize = 8 * 1024;
/// A body above this size is written after the head rather than copied next to it.
const COPY_BODY_LIMIT: usize = 16 * 1024;

/// Why a request got no (complete) answer.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// No connection: the worker never saw the request.
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("connect: timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("{0}")]
    Io(std::io::Error),
    #[error("connection closed before the answer was complete")]
    Closed,
    #[error("{0}")]
    Malformed(String),
    #[error("{0} is not an http:// URL this client can reach")]
    BadUrl(String),
}

impl H1Error {
    /// The request cannot have reached the worker.
    pub fn is_connect(&self) -> bool {
        matches!(self, H1Error::Connect(_) | H1Error::ConnectTimeout(_) | H1Error::BadUrl(_))
    }
}

#[derive(Clone)]
pub struct H1Client {
    pool: Arc<Pool>,
    connect_timeout: Duration,
}

impl H1Client {
    pub fn new(connect_timeout: Duration, max_idle_per_host: usize, idle_timeout: Duration) -> Self {
        H1Client { pool: Arc::new(Pool::new(max_idle_per_host, idle_timeout)), connect_timeout }
    }

    /// POSTs `body` to `url` (`http://host:port/path`) with `headers` (plus host and
    /// content-length); resolves at the answer's head. A pooled connection the worker closed
    /// while the request went out (its keep-alive timer against ours) is replaced by a new one
    /// once, when nothing of an answer came back on it.
    pub async fn post(&self, url: &str, headers: &[(&'static str, &HeaderValue)], body: Bytes) -> Result<Response<H1Body>, H1Error> {
        let (authority, path) = split_url(url)?;
        let mut out = BytesMut::with_capacity(256 + if body.len() <= COPY_BODY_LIMIT { body.len() } else { 0 });
        head::write_post(&mut out, authority, path, headers, body.len());
        let body = if body.len() <= COPY_BODY_LIMIT {
            out.extend_from_slice(&body);
            Bytes::new()
        } else {
            body
        };
        let out = out.freeze();
        if let Some(conn) = self.pool.take(authority) {
            match self.exchange(conn, authority, &out, &body).await {
                Err(Exchange::Stale) => {}
                other => return other.map_err(Exchange::into_error),
            }
        }
        let conn = self.connect(authority).await?;
        self.exchange(conn, authority, &out, &body).await.map_err(Exchange::into_error)
    }

    async fn connect(&self, authority: &str) -> Result<TcpStream, H1Error> {
        let (host, port) = host_port(authority).ok_or_else(|| H1Error::BadUrl(authority.to_string()))?;
        let conn = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| H1Error::ConnectTimeout(self.connect_timeout))?
            .map_err(H1Error::Connect)?;
        // Events are small and latency-bound: no Nagle delay on the request.
        conn.set_nodelay(true).map_err(H1Error::Connect)?;
        Ok(conn)
    }

    /// Writes the request and reads the answer's head.
    async fn exchange(&self, mut conn: TcpStream, authority: &str, head: &Bytes, body: &Bytes) -> Result<Response<H1Body>, Exchange> {
        let written = async {
            conn.write_all(head).await?;
            if !body.is_empty() {
                conn.write_all(body).await?;
            }
            Ok::<_, std::io::Error>(())
        };
        if let Err(e) = written.await {
            return Err(Exchange::Stale.or(e));
        }
        let mut buf = BytesMut::new();
        let head = loop {
            match head::parse(&mut buf) {
                Ok(Some(head)) => break head,
                Ok(None) => {}
                Err(e) => return Err(Exchange::Failed(H1Error::Malformed(e))),
            }
            let got_nothing = buf.is_empty();
            match read_more(&mut conn, &mut buf).await {
                Ok(0) if got_nothing => return Err(Exchange::Stale),
                Ok(0) => return Err(Exchange::Failed(H1Error::Closed)),
                Ok(_) => {}
                Err(e) if got_nothing => return Err(Exchange::Stale.or(e)),
                Err(e) => return Err(Exchange::Failed(H1Error::Io(e))),
            }
        };
        let body = H1Body { conn: Some(conn), buf, framing: head.framing, keep_alive: head.keep_alive, pool: self.pool.clone(), authority: authority.to_string(), deferred: None };
        let mut resp = Response::new(body);
        *resp.status_mut() = head.status;
        *resp.headers_mut() = head.headers;
        Ok(resp)
    }
}

/// How an exchange on one connection failed.
enum Exchange {
    /// Nothing came back: on a pooled connection, one the worker had closed (try a new one).
    Stale,
    /// The worker answered badly, or a new connection broke.
    Failed(H1Error),
    /// Nothing came back, for this reason.
    StaleIo(std::io::Error),
}

impl Exchange {
    fn or(self, e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::UnexpectedEof => self,
            _ => Exchange::StaleIo(e),
        }
    }

    fn into_error(self) -> H1Error {
        match self {
            Exchange::Stale => H1Error::Closed,
            Exchange::Failed(e) => e,
            Exchange::StaleIo(e) => H1Error::Io(e),
        }
    }
}

async fn read_more(conn: &mut TcpStream, buf: &mut BytesMut) -> std::io::Result<usize> {
    std::future::poll_fn(|cx| poll_read_lean(conn, buf, cx)).await
}

/// [`poll_read_buf`], but a buffer that holds nothing is given back before waiting. A leg spends
/// most of its life waiting: between a worker's chunks, or until the whole answer when not
/// streamed; it held `READ_BUF` all that time, a quarter of a slow stream's memory
/// (docs/performance.md). A buffer is taken again when the socket is readable, from the
/// allocator's thread-local free list. (Reading into a per-thread scratch buffer and copying
/// out allocations the size of each read measured no better, docs/performance.md.)
fn poll_read_lean(conn: &mut TcpStream, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
    if buf.is_empty() && conn.poll_read_ready(cx)?.is_pending() {
        *buf = BytesMut::new();
        return Poll::Pending;
    }
    poll_read_buf(conn, buf, cx)
}

/// Reads what the socket has into `buf`, registering for readiness when it has nothing. Through
/// `AsyncRead`, which takes a short read as the socket drained: the next poll waits for
/// readiness instead of spending a `recv` to learn that nothing came (one syscall per chunk).
fn poll_read_buf(conn: &mut TcpStream, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(READ_BUF);
    }
    tokio_util::io::poll_read_buf(Pin::new(conn), cx, buf)
}

/// An answer's body, read from the worker's socket by whoever polls it.
pub struct H1Body {
    /// `None` once the body ended (the connection went back to the pool or was closed).
    conn: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    keep_alive: bool,
    pool: Arc<Pool>,
    authority: String,
    /// The body's end (`Ok`) or bad framing met while gathering the chunks already read
    /// ([`H1Body::with_ready`]): reported on the next poll, after the data before it.
    deferred: Option<Result<(), framing::Malformed>>,
}

/// How many bytes of chunks already read go out as one frame at most.
const GATHER_LIMIT: usize = 64 * 1024;

impl H1Body {
    /// `first` and the chunks after it that are already in the buffer, as one frame: events a
    /// worker wrote one chunk each but that were read together are relayed together (one pass
    /// of the relay and one chunk to the client instead of one per event). Nothing is waited
    /// for: a chunk not complete in the buffer ends the frame.
    fn with_ready(&mut self, first: Bytes) -> Bytes {
        if self.buf.is_empty() || !matches!(self.framing, Framing::Chunked(_)) {
            return first;
        }
        let mut joined: Option<BytesMut> = None;
        while joined.as_ref().map_or(first.len(), BytesMut::len) < GATHER_LIMIT {
            match self.framing.step(&mut self.buf) {
                Ok(Step::Data(more)) => joined
                    .get_or_insert_with(|| {
                        let mut j = BytesMut::with_capacity(first.len() + self.buf.len() + more.len());
                        j.extend_from_slice(&first);
                        j
                    })
                    .extend_from_slice(&more),
                Ok(Step::More) => break,
                Ok(Step::End) => {
                    self.deferred = Some(Ok(()));
                    break;
                }
                Err(e) => {
                    self.deferred = Some(Err(e));
                    break;
                }
            }
        }
        joined.map_or(first, BytesMut::freeze)
    }

    /// The body is complete: a connection with nothing left over is kept for the next request.
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.keep_alive && self.buf.is_empty() {
                self.pool.put(&self.authority, conn);
            }
        }
    }
}

impl Body for H1Body {
    type Data = Bytes;
    type Error = H1Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, H1Error>>> {
        let this = self.get_mut();
        match this.deferred.take() {
            Some(Ok(())) => {
                this.finish();
                return Poll::Ready(None);
            }
            Some(Err(e)) => {
                this.conn = None;
                return Poll::Ready(Some(Err(H1Error::Malformed(e.0.to_string()))));
            }
            None => {}
        }
        loop {
            if this.conn.is_none() {
                return Poll::Ready(None);
            }
            match this.framing.step(&mut this.buf) {
                Ok(Step::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(this.with_ready(data))))),
                Ok(Step::End) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(Step::More) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(H1Error::Malformed(e.0.to_string()))));
                }
            }
            let Some(conn) = this.conn.as_mut() else { return Poll::Ready(None) };
            match ready!(poll_read_lean(conn, &mut this.buf, cx)) {
                Ok(0) if this.framing == Framing::UntilClose => {
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(H1Error::Closed)));
                }
                Ok(_) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(H1Error::Io(e))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || self.framing == Framing::Length(0)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

/// `http://authority/path` → (authority, path); the path defaults to `/`.
fn split_url(url: &str) -> Result<(&str, &str), H1Error> {
    let rest = url.strip_prefix("http://").ok_or_else(|| H1Error::BadUrl(url.to_string()))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    // Userinfo, a query-less fragment or whitespace have no place in a worker's address.
    if authority.is_empty() || authority.contains(['@', '#', '?', ' ']) || path.contains(['#', ' ', '\r', '\n']) {
        return Err(H1Error::BadUrl(url.to_string()));
    }
    Ok((authority, path))
}

/// `host:port`, `[v6]:port` or `host` (port 80) → what `TcpStream::connect` takes.
fn host_port(authority: &str) -> Option<(&str, u16)> {
    if let Some(v6) = authority.strip_prefix('[') {
        let (host, rest) = v6.split_once(']')?;
        let port = match rest.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None if rest.is_empty() => 80,
            None => return None,
        };
        return Some((host, port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Some((host, port.parse().ok()?)),
        None => Some((authority, 80)),
    }
}
