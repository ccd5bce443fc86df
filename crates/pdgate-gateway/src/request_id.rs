//! Request ids. The gateway mints the id the legs rendezvous on (`X-Request-Id` to the workers,
//! which vLLM/NIXL and the reference engine use as their request id and response id): unique per
//! attempt, derived from but never equal to the client's `X-Request-Id`. A client id is used only
//! after validation (bounded length, a safe charset); anything else is dropped and the minted id
//! is fully random. The client's id stays in the logs and is echoed as `x-client-request-id`.

use axum::http::HeaderMap;

/// Longest client id that is kept.
pub const MAX_CLIENT_ID_LEN: usize = 128;
/// The response header that echoes the (validated) client id.
pub const CLIENT_ID_HEADER: &str = "x-client-request-id";

/// The client's id from the first of `names` (`--request-id-headers`) that the request has,
/// when it is 1..=128 bytes of `[A-Za-z0-9._:-]`, else `None`.
pub fn client_id(headers: &HeaderMap, names: &[String]) -> Option<String> {
    let v = names.iter().find_map(|n| headers.get(n.as_str()))?.as_bytes();
    valid(v).then(|| String::from_utf8_lossy(v).into_owned())
}

fn valid(id: &[u8]) -> bool {
    !id.is_empty() && id.len() <= MAX_CLIENT_ID_LEN && id.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// A fresh id for one attempt: `<client id>-<16 hex>`, or `pdgate-<32 hex>` without one.
/// From the thread-local rng: uuid's v4 would cost a getrandom syscall per request.
pub fn mint(client: Option<&str>) -> String {
    match client {
        Some(c) => format!("{c}-{:016x}", rand::random::<u64>()),
        None => format!("pdgate-{:032x}", rand::random::<u128>()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", axum::http::HeaderValue::from_bytes(v).unwrap());
        h
    }

    fn client_id(h: &HeaderMap) -> Option<String> {
        super::client_id(h, &["x-request-id".to_string()])
    }

    #[test]
    fn the_first_configured_header_present_wins() {
        let mut h = HeaderMap::new();
        h.insert("x-trace-id", "trace-1".parse().unwrap());
        h.insert("x-correlation-id", "corr-1".parse().unwrap());
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(super::client_id(&h, &names(&["x-request-id", "x-correlation-id", "x-trace-id"])).as_deref(), Some("corr-1"));
        assert_eq!(super::client_id(&h, &names(&["x-trace-id"])).as_deref(), Some("trace-1"));
        assert_eq!(super::client_id(&h, &names(&["x-request-id"])), None);
    }

    #[test]
    fn only_safe_bounded_client_ids_are_kept() {
        assert_eq!(client_id(&headers(b"req-1.a_b:c")).as_deref(), Some("req-1.a_b:c"));
        for bad in [&b"cmpl-../../etc;room=1"[..], b"a b", b"x/y", b"\xff\xfe", b"a\"b", &[b'a'; 129]] {
            assert_eq!(client_id(&headers(bad)), None, "{}", String::from_utf8_lossy(bad));
        }
        assert!(client_id(&headers(&[b'a'; 128])).is_some());
        assert_eq!(client_id(&HeaderMap::new()), None);
    }

    #[test]
    fn minted_ids_are_derived_unique_and_never_the_client_id() {
        let a = mint(Some("same"));
        let b = mint(Some("same"));
        assert!(a.starts_with("same-") && a != "same" && a != b);
        assert_eq!(a.len(), "same-".len() + 16);
        let r = mint(None);
        assert!(r.starts_with("pdgate-") && r.len() == 39 && valid(r.as_bytes()));
    }
}
