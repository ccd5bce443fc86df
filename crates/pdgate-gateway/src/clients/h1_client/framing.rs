//! How an HTTP/1.1 answer's body is delimited, and the chunked decoder: pure functions over the
//! bytes read so far, so any split of the wire bytes decodes the same (tested in `tests.rs`).

use bytes::{Bytes, BytesMut};

/// Longest chunk-size or trailer line accepted: a worker that sends more is not speaking HTTP.
const LINE_LIMIT: usize = 4096;

/// How the body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length`: this many bytes are left.
    Length(u64),
    /// `Transfer-Encoding: chunked`, at this point of the chunk grammar.
    Chunked(Chunk),
    /// Neither: the body ends when the worker closes the connection (never reused).
    UntilClose,
}

/// Where the chunked decoder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunk {
    /// Expecting a chunk-size line (`1a;ext=1\r\n`).
    Size,
    /// Inside a chunk's data: this many bytes are left.
    Data(u64),
    /// After a chunk's data: expecting its CRLF.
    DataEnd,
    /// After the last (zero-size) chunk: trailer lines until an empty one.
    Trailers,
}

/// What one decoding step found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Body bytes (split off the buffer, no copy).
    Data(Bytes),
    /// The body is complete; what is left in the buffer belongs to no answer.
    End,
    /// More bytes are needed from the connection.
    More,
}

/// A body that breaks HTTP/1.1's framing.
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

impl Framing {
    /// One step over `buf`: decodes what it can and consumes it.
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Step, Malformed> {
        match self {
            Framing::Length(0) => Ok(Step::End),
            Framing::Length(left) => take(buf, left).map_or(Ok(Step::More), |b| Ok(Step::Data(b))),
            Framing::UntilClose => Ok(if buf.is_empty() { Step::More } else { Step::Data(buf.split().freeze()) }),
            Framing::Chunked(state) => chunked(state, buf),
        }
    }
}

/// Up to `left` bytes off the front of `buf`, or `None` when it is empty.
fn take(buf: &mut BytesMut, left: &mut u64) -> Option<Bytes> {
    if buf.is_empty() {
        return None;
    }
    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
    *left -= n as u64;
    Some(buf.split_to(n).freeze())
}

fn chunked(state: &mut Chunk, buf: &mut BytesMut) -> Result<Step, Malformed> {
    loop {
        match state {
            Chunk::Size => {
                let Some(line) = line(buf)? else { return Ok(Step::More) };
                let size = chunk_size(&line)?;
                *state = if size == 0 { Chunk::Trailers } else { Chunk::Data(size) };
            }
            Chunk::Data(left) => {
                let Some(data) = take(buf, left) else { return Ok(Step::More) };
                if *left == 0 {
                    *state = Chunk::DataEnd;
                }
                return Ok(Step::Data(data));
            }
            Chunk::DataEnd => {
                let Some(line) = line(buf)? else { return Ok(Step::More) };
                if !line.is_empty() {
                    return Err(Malformed("chunk data longer than its size"));
                }
                *state = Chunk::Size;
            }
            Chunk::Trailers => {
                // Trailers carry nothing the gateway relays: read past them.
                let Some(line) = line(buf)? else { return Ok(Step::More) };
                if line.is_empty() {
                    return Ok(Step::End);
                }
            }
        }
    }
}

/// The next line without its line ending (CRLF, or a bare LF as lenient parsers accept), or
/// `None` if it is not complete yet.
fn line(buf: &mut BytesMut) -> Result<Option<BytesMut>, Malformed> {
    let Some(end) = memchr::memchr(b'\n', buf) else {
        return if buf.len() > LINE_LIMIT { Err(Malformed("chunk line too long")) } else { Ok(None) };
    };
    if end > LINE_LIMIT {
        return Err(Malformed("chunk line too long"));
    }
    let mut line = buf.split_to(end + 1);
    line.truncate(end);
    if line.last() == Some(&b'\r') {
        line.truncate(end - 1);
    }
    Ok(Some(line))
}

/// A chunk-size line's size: hex digits, then optional whitespace and `;extensions`.
fn chunk_size(line: &[u8]) -> Result<u64, Malformed> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let rest = &line[digits..];
    let rest_ok = rest.iter().all(|b| *b == b' ' || *b == b'\t') || rest.iter().find(|b| **b != b' ' && **b != b'\t') == Some(&b';');
    if digits == 0 || digits > 15 || !rest_ok {
        return Err(Malformed("bad chunk size"));
    }
    let text = std::str::from_utf8(&line[..digits]).map_err(|_| Malformed("bad chunk size"))?;
    u64::from_str_radix(text, 16).map_err(|_| Malformed("bad chunk size"))
}
