//! Hop marking: every request pdgate forwards carries a `via` entry with this gateway
//! instance's token, appended to the client's own `via`. A request that comes back with this
//! token, or that has crossed too many pdgate gateways, is a loop and is answered 508.

use axum::http::{HeaderMap, HeaderValue};
use pdgate_core::GatewayError;

/// Most pdgate gateways one request may cross (a chain deeper than this is a loop through
/// instances that do not know each other's tokens, e.g. restarted ones).
pub const MAX_PDGATE_HOPS: usize = 8;
/// Longest incoming `via` taken into account; longer is refused as a loop (it cannot be a
/// legitimate chain of proxies).
const MAX_VIA_LEN: usize = 2048;
const PREFIX: &str = "pdgate-";

pub struct Hops {
    /// `pdgate-<64-bit hex>`, random per gateway instance.
    token: String,
    /// `1.1 <token>`: the via entry this gateway adds.
    entry: HeaderValue,
}

impl Hops {
    pub fn new() -> Self {
        Self::with_token(format!("{PREFIX}{:016x}", rand::random::<u64>()))
    }

    pub fn with_token(token: String) -> Self {
        let entry = HeaderValue::from_str(&format!("1.1 {token}")).unwrap_or_else(|_| HeaderValue::from_static("1.1 pdgate"));
        Hops { token, entry }
    }

    /// The `via` value to send upstream for a request with these headers, or a 508 when the
    /// request is looping. Without an incoming `via` this is a clone of a shared value.
    pub fn outgoing(&self, headers: &HeaderMap) -> Result<HeaderValue, (GatewayError, &'static str)> {
        let mut incoming = headers.get_all(axum::http::header::VIA).iter().peekable();
        if incoming.peek().is_none() {
            return Ok(self.entry.clone());
        }
        let mut joined = String::new();
        for v in incoming {
            let Ok(text) = v.to_str() else { continue };
            if !joined.is_empty() {
                joined.push_str(", ");
            }
            joined.push_str(text);
            if joined.len() > MAX_VIA_LEN {
                return Err((GatewayError::loop_detected(format!("the request's via header is longer than {MAX_VIA_LEN} bytes: refused as a loop")), "hops"));
            }
        }
        let mut hops = 0;
        for entry in joined.split(',') {
            // An entry is `protocol received-by [comment]`; ours is `1.1 pdgate-<hex>`.
            let Some(by) = entry.split_whitespace().nth(1) else { continue };
            if by == self.token {
                return Err((GatewayError::loop_detected("this request already passed through this gateway: it loops (a worker URL points back at a gateway)"), "via"));
            }
            hops += usize::from(by.starts_with(PREFIX));
        }
        if hops >= MAX_PDGATE_HOPS {
            return Err((GatewayError::loop_detected(format!("this request already crossed {hops} pdgate gateways: refused as a loop")), "hops"));
        }
        joined.push_str(", ");
        joined.push_str(self.entry.to_str().unwrap_or_default());
        HeaderValue::from_str(&joined).map_err(|_| (GatewayError::invalid(Some("via"), "the via header is not valid"), "hops"))
    }
}

impl Default for Hops {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(via: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in via {
            h.append(axum::http::header::VIA, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn appends_its_entry_to_the_incoming_via() {
        let hops = Hops::with_token("pdgate-aa".into());
        assert_eq!(hops.outgoing(&headers(&[])).unwrap(), "1.1 pdgate-aa");
        assert_eq!(hops.outgoing(&headers(&["1.1 proxy", "1.0 fred"])).unwrap(), "1.1 proxy, 1.0 fred, 1.1 pdgate-aa");
    }

    #[test]
    fn its_own_token_or_too_many_gateways_is_a_loop() {
        let hops = Hops::with_token("pdgate-aa".into());
        let (e, kind) = hops.outgoing(&headers(&["1.1 pdgate-bb, 1.1 pdgate-aa, 1.1 pdgate-cc"])).unwrap_err();
        assert_eq!((e.status(), e.code().as_str(), kind), (508, "loop_detected", "via"));
        // Similar tokens are not ours.
        assert!(hops.outgoing(&headers(&["1.1 pdgate-aaa"])).is_ok());
        let chain: Vec<String> = (0..MAX_PDGATE_HOPS).map(|i| format!("1.1 pdgate-{i:02}")).collect();
        let (_, kind) = hops.outgoing(&headers(&[&chain.join(", ")])).unwrap_err();
        assert_eq!(kind, "hops");
        let shorter = chain[1..].join(", ");
        assert!(hops.outgoing(&headers(&[&shorter])).is_ok());
        assert_eq!(hops.outgoing(&headers(&[&"1.1 x, ".repeat(500)])).unwrap_err().1, "hops");
    }
}
