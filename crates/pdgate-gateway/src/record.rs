//! The decision record: which workers, which protocol, which rendezvous, how many attempts.
//! Sent to the client as the `x-pdgate-route` header and written to the debug log.

use std::fmt::Write;

pub const ROUTE_HEADER: &str = "x-pdgate-route";

#[derive(Clone, Debug, Default)]
pub struct Record {
    pub protocol: &'static str,
    pub worker: Option<String>,
    pub prefill: Option<String>,
    pub decode: Option<String>,
    /// `room=...` or `transfer_id=...` or `request_id=...`.
    pub rendezvous: Option<String>,
    pub attempts: u32,
    /// The policies' reasons, e.g. `cache_hit=0.82` or `prefill:cache_miss decode:power_of_two`.
    pub policy: Option<String>,
}

impl Record {
    pub fn header_value(&self) -> String {
        let mut s = String::with_capacity(160);
        let _ = write!(s, "protocol={}", self.protocol);
        for (k, v) in [("worker", &self.worker), ("prefill", &self.prefill), ("decode", &self.decode)] {
            if let Some(v) = v {
                let _ = write!(s, "; {k}={v}");
            }
        }
        if let Some(r) = &self.rendezvous {
            let _ = write!(s, "; {r}");
        }
        if let Some(p) = &self.policy {
            let _ = write!(s, "; policy={p}");
        }
        let _ = write!(s, "; attempts={}", self.attempts);
        s
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
            rendezvous: Some("room=42".into()),
            attempts: 2,
            policy: Some("round_robin".into()),
            ..Default::default()
        };
        assert_eq!(r.header_value(), "protocol=bootstrap; prefill=http://p:1; decode=http://d:2; room=42; policy=round_robin; attempts=2");
    }
}
