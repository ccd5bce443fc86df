//! Property tests of request parsing, the gateway's first contact with a client's bytes: it
//! never panics, every error points at something real, and what it accepts keeps the facts the
//! gateway relies on. A stand-in for a cargo-fuzz target that runs in every `cargo test`:
//! 256 cases by default (a few seconds); `PROPTEST_CASES=100000 cargo test -p pdgate-protocol
//! --test fuzz_request` searches longer.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_protocol::rendezvous::{has_gateway_fields, strip_gateway_fields};
use pdgate_protocol::{parse_request, Endpoint, InvalidRequest, Limits, ParsedRequest};
use proptest::prelude::*;
use serde_json::{Map, Value};

const ENDPOINTS: [Endpoint; 3] = [Endpoint::Completions, Endpoint::ChatCompletions, Endpoint::Generate];

/// The one call under test, with the gateway's default bounds.
fn parse(ep: Endpoint, bytes: &[u8]) -> Result<ParsedRequest, InvalidRequest> {
    parse_request(ep, bytes, &Limits::default())
}

/// Field names the parser reads, and some it does not, so that generated bodies hit its paths.
const KEYS: &[&str] = &[
    "prompt",
    "messages",
    "text",
    "input_ids",
    "n",
    "stream",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "stream_options",
    "sampling_params",
    "return_logprob",
    "role",
    "content",
    "best_of",
    "stop",
    "logit_bias",
    "tools",
    "user",
    "x",
    "bootstrap_room",
    "kv_transfer_params",
    "rid",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::from),
        (0u64..5).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("JSON has no NaN/inf", |f| f.is_finite()).prop_map(Value::from),
        "[a-z \\u{e9}\\u{1F600}]{0,8}".prop_map(Value::String),
        Just(Value::String("user".into())),
    ]
}

fn json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// A top-level body: an object whose fields are the parser's (sometimes right, often wrong).
fn body() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::vec((prop::sample::select(KEYS), json()), 0..8).prop_map(|kv| kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// The field a `param` names: `messages[2]` → `messages`, `sampling_params.n` → `sampling_params`.
fn root(param: &str) -> &str {
    param.split(['[', '.']).next().unwrap_or(param)
}

/// Fields an error may name although the body lacks them: the required ones.
const REQUIRED: &[&str] = &["prompt", "messages", "text", "input_ids"];

fn n_of(ep: Endpoint, body: &Map<String, Value>) -> Option<u64> {
    match ep {
        Endpoint::Generate => body.get("sampling_params")?.get("n")?.as_u64(),
        _ => body.get("n")?.as_u64(),
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), ep in prop::sample::select(&ENDPOINTS[..])) {
        let _ = parse(ep, &bytes);
    }

    #[test]
    fn cut_and_mangled_json_never_panics(b in body(), cut in any::<prop::sample::Index>(), flip in any::<(prop::sample::Index, u8)>(), ep in prop::sample::select(&ENDPOINTS[..])) {
        let mut bytes = serde_json::to_vec(&b).unwrap();
        let _ = parse(ep, &bytes[..cut.index(bytes.len() + 1)]);
        if !bytes.is_empty() {
            let i = flip.0.index(bytes.len());
            bytes[i] = flip.1;
            let _ = parse(ep, &bytes);
        }
    }

    #[test]
    fn errors_name_a_real_field_and_accepted_requests_keep_their_facts(b in body(), ep in prop::sample::select(&ENDPOINTS[..])) {
        let bytes = serde_json::to_vec(&b).unwrap();
        match parse(ep, &bytes) {
            Err(e) => {
                prop_assert!(!e.message.is_empty());
                if let Some(p) = &e.param {
                    let r = root(p);
                    prop_assert!(b.contains_key(r) || REQUIRED.contains(&r), "param {p:?} names nothing in {b:?}: {}", e.message);
                }
            }
            Ok(req) => {
                prop_assert_eq!(req.endpoint, ep);
                // The body is kept as the client sent it (compared with serde_json's own reading of
                // the bytes; with float_roundtrip that reading is exact).
                // Only the gateway-owned rendezvous fields are removed, and then it says so.
                let mut sent: Map<String, Value> = serde_json::from_slice(&bytes).unwrap();
                prop_assert_eq!(req.rewritten, has_gateway_fields(&sent));
                strip_gateway_fields(&mut sent);
                prop_assert_eq!(&req.body, &sent);
                prop_assert!(!has_gateway_fields(&req.body));
                // Fields the gateway adds reach the worker as the body says, whether appended to
                // the bytes or encoded (a client that sent the field has it changed, not twice).
                let mut asked = req.clone();
                asked.add_field("return_token_ids", Value::Bool(true));
                asked.add_field("stream_options", serde_json::json!({"include_usage": true}));
                let forwarded = asked.forward_bytes(&bytes).unwrap().unwrap();
                prop_assert_eq!(&serde_json::from_slice::<Map<String, Value>>(&forwarded).unwrap(), &asked.body);
                prop_assert_eq!(req.stream, b.get("stream") == Some(&Value::Bool(true)));
                prop_assert_eq!(req.model.as_deref(), b.get("model").and_then(Value::as_str));
                if let Some(items) = req.batch_items {
                    prop_assert!(items >= 1);
                    // Nothing downstream may allocate per item beyond the bound.
                    prop_assert!(items as u64 <= Limits::default().max_batch_size, "{items} items accepted");
                    if let Some(n) = n_of(ep, &b) {
                        prop_assert!(n >= 1 && (items as u64).is_multiple_of(n), "{items} items for n = {n}");
                    }
                }
                let single = match ep {
                    Endpoint::Completions => b.get("prompt").is_some_and(Value::is_string),
                    Endpoint::Generate => b.get("text").is_some_and(Value::is_string),
                    Endpoint::ChatCompletions => true,
                };
                if single && n_of(ep, &b).unwrap_or(1) == 1 {
                    prop_assert_eq!(req.batch_items, None);
                }
                prop_assert!(!req.wants_input_logprobs || ep == Endpoint::Generate);
            }
        }
    }

    #[test]
    fn small_bounds_hold_for_whatever_is_accepted(b in body(), ep in prop::sample::select(&ENDPOINTS[..])) {
        // Bounds small enough that generated bodies cross them often.
        let limits = Limits { max_n: 3, max_batch_size: 4, max_prompt_bytes: 16, ..Limits::default() };
        let bytes = serde_json::to_vec(&b).unwrap();
        if let Ok(req) = parse_request(ep, &bytes, &limits) {
            prop_assert!(req.batch_items.unwrap_or(1) as u64 <= limits.max_batch_size, "{:?} items accepted", req.batch_items);
            if let Some(n) = n_of(ep, &b) {
                prop_assert!(n <= limits.max_n, "n = {n} accepted");
            }
        }
    }
}

/// The case CI found: a body re-encoded because it carried a gateway-owned field must keep a
/// long float to the last bit (serde_json's `float_roundtrip` parser; the default one read this
/// number one ULP off, so the worker got a different value than the client sent).
#[test]
fn a_reencoded_body_keeps_every_float_bit() {
    let sent = br#"{"bootstrap_room":null,"input_ids":[0],"role":[[-4.766762783809616e+71]]}"#;
    let req = parse(Endpoint::Generate, sent).unwrap();
    assert!(req.rewritten, "the gateway-owned field forces the re-encoding path");
    let forwarded = req.forward_bytes(sent).unwrap().unwrap();
    let value: Value = serde_json::from_slice(&forwarded).unwrap();
    assert_eq!(value["role"][0][0].as_f64(), Some(-4.766762783809616e71));
}
