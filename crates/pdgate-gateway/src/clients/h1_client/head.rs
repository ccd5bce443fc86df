//! The request head the client writes and the response head it parses (httparse), with what
//! the head says about the body: its framing and whether the connection may be reused.

use bytes::{BufMut, BytesMut};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, StatusCode};

use super::framing::{Chunk, Framing};

/// Largest response head accepted (status line and headers).
pub const HEAD_LIMIT: usize = 64 * 1024;
/// Most response headers accepted.
const MAX_HEADERS: usize = 64;

/// Writes a POST head for a body of `len` bytes into `out`. Header values are `HeaderValue`s,
/// so no CR or LF can reach the wire.
pub fn write_post(out: &mut BytesMut, authority: &str, path: &str, headers: &[(&'static str, &HeaderValue)], len: usize) {
    out.put_slice(b"POST ");
    out.put_slice(path.as_bytes());
    out.put_slice(b" HTTP/1.1\r\nhost: ");
    out.put_slice(authority.as_bytes());
    out.put_slice(b"\r\ncontent-length: ");
    out.put_slice(itoa::Buffer::new().format(len).as_bytes());
    out.put_slice(b"\r\n");
    for (name, value) in headers {
        out.put_slice(name.as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    out.put_slice(b"\r\n");
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// The worker keeps the connection open after this answer.
    pub keep_alive: bool,
}

/// Parses a response head off the front of `buf`: `Ok(None)` while it is incomplete, an
/// informational (1xx) head is consumed and skipped.
pub fn parse(buf: &mut BytesMut) -> Result<Option<Head>, String> {
    loop {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut slots);
        let len = match resp.parse(buf) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > HEAD_LIMIT => return Err(format!("response head over {HEAD_LIMIT} bytes")),
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(format!("malformed response head: {e}")),
        };
        let code = resp.code.unwrap_or(0);
        let status = StatusCode::from_u16(code).map_err(|_| format!("bad status code {code}"))?;
        if status.is_informational() {
            let _ = buf.split_to(len);
            continue;
        }
        let http10 = resp.version == Some(0);
        let mut headers = HeaderMap::with_capacity(resp.headers.len());
        for h in resp.headers.iter() {
            let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| format!("bad header name {:?}", h.name))?;
            let value = HeaderValue::from_bytes(h.value).map_err(|_| format!("bad value of header {name}"))?;
            headers.append(name, value);
        }
        let _ = buf.split_to(len);
        let framing = framing(status, &headers)?;
        let keep_alive = keep_alive(&headers, http10) && framing != Framing::UntilClose;
        return Ok(Some(Head { status, headers, framing, keep_alive }));
    }
}

/// How the body is delimited (RFC 9112 §6.3): chunked wins over a length; a length must be
/// one number (repeated copies agree); else the body runs to the connection's close.
fn framing(status: StatusCode, headers: &HeaderMap) -> Result<Framing, String> {
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Framing::Length(0));
    }
    if let Some(te) = headers.get_all(hyper::header::TRANSFER_ENCODING).iter().next_back() {
        let last = te.to_str().ok().and_then(|t| t.rsplit(',').next()).map(str::trim);
        return match last {
            Some(c) if c.eq_ignore_ascii_case("chunked") => Ok(Framing::Chunked(Chunk::Size)),
            // Another coding last: the body ends at the close (the encoding check refuses it).
            _ => Ok(Framing::UntilClose),
        };
    }
    let mut length = None;
    for v in headers.get_all(hyper::header::CONTENT_LENGTH) {
        for part in v.to_str().map_err(|_| "bad content-length".to_string())?.split(',') {
            let n: u64 = part.trim().parse().map_err(|_| format!("bad content-length {part:?}"))?;
            if length.is_some_and(|l| l != n) {
                return Err("conflicting content-length headers".into());
            }
            length = Some(n);
        }
    }
    Ok(length.map_or(Framing::UntilClose, Framing::Length))
}

fn keep_alive(headers: &HeaderMap, http10: bool) -> bool {
    let has = |token: &str| headers.get_all(hyper::header::CONNECTION).iter().any(|v| v.to_str().is_ok_and(|t| t.split(',').any(|p| p.trim().eq_ignore_ascii_case(token))));
    if http10 {
        has("keep-alive")
    } else {
        !has("close")
    }
}
