//! The decision record: which workers, which protocol, which rendezvous, how many attempts.
//! Sent to the client as the `x-pdgate-route` header and written to the debug log.
//!
//! The header has a fixed maximum size, whatever the request: a batch gives the count and a
//! digest of its rooms (`rooms=3,digest=ab12cd34`), not every room (10,000 rooms made a header
//! no client accepts), and every other value is cut to a bound. The debug log gets the full
//! record ([`Record::full`]), every room included, on one line.

use std::fmt::{self, Write};

use pdgate_protocol::bootstrap::Rooms;

pub const ROUTE_HEADER: &str = "x-pdgate-route";

/// Longest worker URL or rendezvous id shown in the header.
const MAX_VALUE: usize = 200;
/// Longest policy reason shown in the header.
const MAX_POLICY: usize = 120;
/// Upper bound of the whole header value: three values, a policy and the fixed parts.
#[cfg(test)]
const MAX_HEADER_LEN: usize = 4 * MAX_VALUE + MAX_ENCODE + MAX_POLICY + 300;
/// Longest list of encode workers shown in the header (EPD).
const MAX_ENCODE: usize = 2 * MAX_VALUE;

pub use pdgate_core::plan::Rendezvous;

#[derive(Clone, Debug, Default)]
pub struct Record {
    pub protocol: &'static str,
    /// How the request ran (`colocated`, `disaggregated`): the latency metrics' label.
    pub placed_as: &'static str,
    pub worker: Option<String>,
    pub prefill: Option<String>,
    pub decode: Option<String>,
    pub rendezvous: Option<Rendezvous>,
    pub attempts: u32,
    /// The policies' reasons, e.g. `cache_hit=0.82` or `prefill:cache_miss decode:power_of_two`.
    pub policy: Option<String>,
    /// PD mode with placement engaged: where the request ran and why (`--pd-placement`).
    pub placement: Option<(&'static str, &'static str)>,
    /// A failure before commit and the recovery chosen for it, with its reason.
    pub recovery: Option<(&'static str, &'static str)>,
    /// A whole answer sent again on a new pair after its decode died (resume). A stream's
    /// resumes come after its head: the request log and the resume log line say them.
    pub resumes: u32,
    /// EPD: the encode workers the request's images went to (each once, in image order).
    pub encode: Vec<String>,
    /// EPD: how many images the request sent to encode workers.
    pub images: usize,
}

/// Appends `v` cut to `max` bytes (at a char boundary), with anything that is not a visible
/// ASCII character or a space replaced, so the header value is always valid.
fn push_bounded(out: &mut String, v: &str, max: usize) {
    let mut used = 0;
    for c in v.chars() {
        if used + c.len_utf8() > max {
            out.push_str("...");
            return;
        }
        used += c.len_utf8();
        out.push(if c == ' ' || c.is_ascii_graphic() { c } else { '?' });
    }
}

/// FNV-1a over the rooms: a short, stable fingerprint to match a header with the log line.
fn digest(rooms: &[u64]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for r in rooms {
        for b in r.to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    }
    h
}

impl Record {
    /// The bounded header value.
    pub fn header_value(&self) -> String {
        let mut s = String::with_capacity(160);
        let _ = write!(s, "protocol={}", self.protocol);
        for (k, v) in [("worker", &self.worker), ("prefill", &self.prefill), ("decode", &self.decode)] {
            if let Some(v) = v {
                let _ = write!(s, "; {k}=");
                push_bounded(&mut s, v, MAX_VALUE);
            }
        }
        if !self.encode.is_empty() {
            s.push_str("; encode=");
            push_bounded(&mut s, &self.encode.join(","), MAX_ENCODE);
            let _ = write!(s, "; images={}", self.images);
        }
        match &self.rendezvous {
            None => {}
            Some(Rendezvous::Rooms(Rooms::Single(r))) => {
                let _ = write!(s, "; room={r}");
            }
            Some(Rendezvous::Rooms(Rooms::Batch(rs))) => {
                let _ = write!(s, "; rooms={},digest={:08x}", rs.len(), digest(rs));
            }
            Some(Rendezvous::TransferId(id)) => {
                s.push_str("; transfer_id=");
                push_bounded(&mut s, id, MAX_VALUE);
            }
            Some(Rendezvous::RequestId(id)) => {
                s.push_str("; request_id=");
                push_bounded(&mut s, id, MAX_VALUE);
            }
        }
        if let Some(p) = &self.policy {
            s.push_str("; policy=");
            push_bounded(&mut s, p, MAX_POLICY);
        }
        if let Some((placement, reason)) = self.placement {
            let _ = write!(s, "; placement={placement}; reason={reason}");
        }
        if let Some((choice, reason)) = self.recovery {
            let _ = write!(s, "; recovery={choice}:{reason}");
        }
        let _ = write!(s, "; attempts={}", self.attempts);
        if self.resumes > 0 {
            let _ = write!(s, "; resumes={}", self.resumes);
        }
        s
    }

    /// The whole record for the log: the header plus, for a batch, every room. Formats lazily,
    /// so a disabled log level costs nothing.
    pub fn full(&self) -> impl fmt::Display + '_ {
        Full(self)
    }
}

struct Full<'a>(&'a Record);

impl fmt::Display for Full<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.header_value())?;
        if let Some(Rendezvous::Rooms(rooms @ Rooms::Batch(_))) = &self.0.rendezvous {
            write!(f, "; room={}", rooms.describe())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_names_pair_protocol_room_and_attempts() {
        let r = Record {
            protocol: "bootstrap",
            prefill: Some("http://p:1".into()),
            decode: Some("http://d:2".into()),
            rendezvous: Some(Rendezvous::Rooms(Rooms::Single(42))),
            attempts: 2,
            policy: Some("round_robin".into()),
            ..Default::default()
        };
        assert_eq!(r.header_value(), "protocol=bootstrap; prefill=http://p:1; decode=http://d:2; room=42; policy=round_robin; attempts=2");
    }

    #[test]
    fn an_epd_request_names_its_encode_workers_and_images() {
        let r = Record {
            protocol: "bootstrap",
            prefill: Some("http://p:1".into()),
            decode: Some("http://d:2".into()),
            encode: vec!["http://e0:3".into(), "http://e1:3".into()],
            images: 3,
            rendezvous: Some(Rendezvous::Rooms(Rooms::Single(42))),
            attempts: 1,
            ..Default::default()
        };
        assert_eq!(r.header_value(), "protocol=bootstrap; prefill=http://p:1; decode=http://d:2; encode=http://e0:3,http://e1:3; images=3; room=42; attempts=1");
    }

    #[test]
    fn a_resumed_whole_answer_says_so() {
        let r = Record { protocol: "nixl", decode: Some("http://d:2".into()), attempts: 2, resumes: 1, ..Default::default() };
        assert_eq!(r.header_value(), "protocol=nixl; decode=http://d:2; attempts=2; resumes=1");
    }

    #[test]
    fn placement_and_recovery_follow_the_route() {
        let r = Record {
            protocol: "regular",
            worker: Some("http://r:1".into()),
            attempts: 2,
            placement: Some(("colocated", "colocated_cheaper")),
            recovery: Some(("recompute_colocated", "colocated_cheaper")),
            ..Default::default()
        };
        assert_eq!(
            r.header_value(),
            "protocol=regular; worker=http://r:1; placement=colocated; reason=colocated_cheaper; recovery=recompute_colocated:colocated_cheaper; attempts=2"
        );
    }

    #[test]
    fn a_batch_gives_a_count_and_digest_and_the_log_every_room() {
        let rooms: Vec<u64> = (0..20_000).map(|i| (1 << 62) + i).collect();
        let r = Record { protocol: "bootstrap", rendezvous: Some(Rendezvous::Rooms(Rooms::Batch(rooms.clone()))), attempts: 1, ..Default::default() };
        let h = r.header_value();
        assert!(h.contains(&format!("rooms=20000,digest={:08x}", digest(&rooms))), "{h}");
        assert!(h.len() < 100, "{h}");
        let full = r.full().to_string();
        assert!(full.contains(&format!("room=[{},", 1u64 << 62)) && full.len() > 20_000 * 19, "the log has every room");
        let other: Vec<u64> = (1..=20_000).map(|i| (1 << 62) + i).collect();
        assert_ne!(digest(&rooms), digest(&other));
    }

    #[test]
    fn every_field_is_bounded_and_header_safe() {
        let long = format!("http://{}\u{e9}\r\n:1", "h".repeat(5000));
        let r = Record {
            protocol: "mooncake",
            worker: Some(long.clone()),
            prefill: Some(long.clone()),
            decode: Some(long.clone()),
            encode: vec![long.clone(), long.clone()],
            images: usize::MAX,
            rendezvous: Some(Rendezvous::TransferId(long)),
            policy: Some("x".repeat(5000)),
            attempts: u32::MAX,
            placement: Some(("disaggregated", "slo_missed_remote_lower")),
            recovery: Some(("recompute_colocated", "only_colocated_fits_deadline")),
            placed_as: "disaggregated",
            resumes: u32::MAX,
        };
        let h = r.header_value();
        assert!(h.len() <= MAX_HEADER_LEN, "{} > {MAX_HEADER_LEN}", h.len());
        assert!(axum::http::HeaderValue::from_str(&h).is_ok());
        let odd = Record { protocol: "regular", worker: Some("http://a\u{e9}\r\n:1".into()), ..Default::default() };
        assert_eq!(odd.header_value(), "protocol=regular; worker=http://a???:1; attempts=0");
    }
}
