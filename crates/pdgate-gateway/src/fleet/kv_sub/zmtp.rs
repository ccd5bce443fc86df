//! The smallest ZMQ client the KV event subscription needs: ZMTP 3.0 over TCP with the NULL
//! mechanism, as a SUB (the engine's PUB) or a DEALER (its replay ROUTER). Written here rather
//! than taken from a crate so the gateway links no libzmq and pulls no ZMQ runtime: the two
//! socket types are a greeting, one READY command each way, and length-prefixed frames.
//!
//! We announce ZMTP 3.0, so a libzmq 4.x peer speaks 3.0 back: subscriptions are messages whose
//! first byte is 1, and no heartbeat commands are sent unless the peer configured them (any
//! command after the handshake is ignored). Every read here has a caller-given deadline or
//! none where silence is normal (a quiet publisher); see `subscriber.rs`.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A frame larger than this ends the connection (a batch of events is kilobytes; a bad peer must
/// not make us allocate gigabytes).
pub const MAX_FRAME: u64 = 64 << 20;
/// At most this many frames in one message (ours have 3 or 4).
const MAX_FRAMES: usize = 16;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// A connected, handshaken ZMTP peer.
pub struct Peer {
    stream: BufReader<TcpStream>,
}

/// What the peer said it is, checked against what we expect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }
    /// The socket types that may answer us (an XPUB is a PUB that also reports subscriptions).
    fn peer_names(self) -> &'static [&'static [u8]] {
        match self {
            SocketType::Sub => &[b"PUB", b"XPUB"],
            SocketType::Dealer => &[b"ROUTER"],
        }
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// `tcp://host:port` -> `host:port` for `TcpStream::connect` (brackets kept for IPv6).
pub fn tcp_addr(endpoint: &str) -> io::Result<&str> {
    endpoint.strip_prefix("tcp://").ok_or_else(|| bad(format!("{endpoint:?} is not tcp://")))
}

impl Peer {
    /// Connect and handshake as `kind`, all within `deadline`.
    pub async fn connect(endpoint: &str, kind: SocketType, deadline: Duration) -> io::Result<Peer> {
        let addr = tcp_addr(endpoint)?.to_string();
        let handshake = async move {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut peer = Peer { stream: BufReader::new(stream) };
            peer.handshake(kind).await?;
            Ok::<_, io::Error>(peer)
        };
        tokio::time::timeout(deadline, handshake).await.map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "ZMTP connect/handshake timed out"))?
    }

    async fn handshake(&mut self, kind: SocketType) -> io::Result<()> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xFF;
        greeting[9] = 0x7F;
        greeting[10] = 3; // major
        greeting[11] = 0; // minor: 3.0
        greeting[12..16].copy_from_slice(b"NULL");
        self.stream.get_mut().write_all(&greeting).await?;
        let mut theirs = [0u8; 64];
        self.stream.read_exact(&mut theirs).await?;
        if theirs[0] != 0xFF || theirs[9] & 1 != 1 || theirs[10] < 3 {
            return Err(bad("peer is not a ZMTP 3 peer"));
        }
        if &theirs[12..16] != b"NULL" || theirs[16] != 0 {
            return Err(bad("peer wants a security mechanism other than NULL"));
        }
        self.send_frame(FLAG_COMMAND, &ready(kind.name())).await?;
        let (flags, body) = self.read_frame().await?;
        if flags & FLAG_COMMAND == 0 || !body.starts_with(b"\x05READY") {
            return Err(bad("peer did not send READY"));
        }
        match property(&body[6..], b"Socket-Type") {
            Some(t) if kind.peer_names().iter().any(|n| t.eq_ignore_ascii_case(n)) => Ok(()),
            other => Err(bad(format!("peer socket type {:?} cannot answer a {:?}", other.map(String::from_utf8_lossy), kind))),
        }
    }

    async fn send_frame(&mut self, flags: u8, body: &[u8]) -> io::Result<()> {
        let mut out = Vec::with_capacity(body.len() + 9);
        if body.len() > 255 {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            out.push(flags);
            out.push(body.len() as u8);
        }
        out.extend_from_slice(body);
        self.stream.get_mut().write_all(&out).await
    }

    /// Send one message (its frames in order).
    pub async fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        for (i, f) in frames.iter().enumerate() {
            self.send_frame(if i + 1 < frames.len() { FLAG_MORE } else { 0 }, f).await?;
        }
        self.stream.get_mut().flush().await
    }

    /// SUB: subscribe to messages whose first frame starts with `prefix` (empty: all).
    pub async fn subscribe(&mut self, prefix: &[u8]) -> io::Result<()> {
        let mut body = Vec::with_capacity(prefix.len() + 1);
        body.push(1);
        body.extend_from_slice(prefix);
        self.send(&[&body]).await
    }

    async fn read_frame(&mut self) -> io::Result<(u8, Vec<u8>)> {
        let flags = self.stream.read_u8().await?;
        let len = if flags & FLAG_LONG != 0 { self.stream.read_u64().await? } else { u64::from(self.stream.read_u8().await?) };
        if len > MAX_FRAME {
            return Err(bad(format!("frame of {len} bytes is over the {MAX_FRAME}-byte limit")));
        }
        let mut body = vec![0u8; len as usize];
        self.stream.read_exact(&mut body).await?;
        Ok((flags, body))
    }

    /// The next message (commands skipped). No deadline: wrap it in one where silence is wrong.
    pub async fn recv(&mut self) -> io::Result<Vec<Vec<u8>>> {
        let mut frames = Vec::new();
        loop {
            let (flags, body) = self.read_frame().await?;
            if flags & FLAG_COMMAND != 0 {
                continue;
            }
            if frames.len() == MAX_FRAMES {
                return Err(bad("message has too many frames"));
            }
            frames.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(frames);
            }
        }
    }
}

/// The READY command body with one property, `Socket-Type`.
fn ready(socket_type: &[u8]) -> Vec<u8> {
    let mut body = b"\x05READY".to_vec();
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type);
    body
}

/// One property's value from a READY command's property list.
fn property<'a>(mut props: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    while let Some((&nlen, rest)) = props.split_first() {
        let (n, rest) = rest.split_at_checked(nlen as usize)?;
        let (vlen, rest) = rest.split_at_checked(4)?;
        let vlen = u32::from_be_bytes(vlen.try_into().ok()?) as usize;
        let (v, rest) = rest.split_at_checked(vlen)?;
        if n.eq_ignore_ascii_case(name) {
            return Some(v);
        }
        props = rest;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_properties_round_trip_and_truncation_is_not_a_panic() {
        let body = ready(b"SUB");
        assert_eq!(property(&body[6..], b"socket-type"), Some(&b"SUB"[..]));
        assert_eq!(property(&body[6..], b"Identity"), None);
        for cut in 0..body.len() - 6 {
            let _ = property(&body[6..6 + cut], b"Socket-Type");
        }
        assert_eq!(property(&body[6..body.len() - 1], b"Socket-Type"), None);
    }
}
