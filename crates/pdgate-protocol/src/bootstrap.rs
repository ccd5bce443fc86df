//! SGLang bootstrap rendezvous fields (docs/protocols.md §1).
//!
//! Both legs get the same body with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`; for
//! a batch (or n>1) each field is a list with one entry and a distinct room per item. A streamed
//! request's prefill is asked for a whole answer ([`whole_prefill_body`]).

use serde_json::{Map, Value};

/// The reserved host that tells an SGLang engine to take its no-transfer health path.
pub const HEALTH_CHECK_HOST: &str = "2.2.2.2";

/// Largest room: rooms are uniform in [0, 2^63 - 1].
pub const MAX_ROOM: u64 = (1u64 << 63) - 1;

/// Rooms for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rooms {
    Single(u64),
    Batch(Vec<u64>),
}

impl Rooms {
    /// Every room, e.g. `123` or `[1,2,3]`, for the full record in the debug log (the header
    /// gives a batch as a count and a digest).
    pub fn describe(&self) -> String {
        match self {
            Rooms::Single(r) => r.to_string(),
            Rooms::Batch(rs) => format!("[{}]", rs.iter().map(u64::to_string).collect::<Vec<_>>().join(",")),
        }
    }
}

/// Adds the three fields, overwriting any the client sent (a client must not pick the room).
pub fn inject(body: &mut Map<String, Value>, host: &str, port: Option<u16>, rooms: &Rooms) {
    let port_value = port.map(Value::from).unwrap_or(Value::Null);
    match rooms {
        Rooms::Single(room) => {
            body.insert("bootstrap_host".into(), Value::from(host));
            body.insert("bootstrap_port".into(), port_value);
            body.insert("bootstrap_room".into(), Value::from(*room));
        }
        Rooms::Batch(list) => {
            let n = list.len();
            body.insert("bootstrap_host".into(), Value::Array(vec![Value::from(host); n]));
            body.insert("bootstrap_port".into(), Value::Array(vec![port_value; n]));
            body.insert("bootstrap_room".into(), Value::Array(list.iter().map(|r| Value::from(*r)).collect()));
        }
    }
}

/// The prefill's body for a streamed request: the decode's body (rendezvous fields and all)
/// asking for a whole answer, without `stream_options` (engines refuse it without `stream`) and
/// without `return_token_ids` (the answer is only drained: the ids are the decode's to send).
pub fn whole_prefill_body(decode: &Map<String, Value>) -> Map<String, Value> {
    let mut body = decode.clone();
    body.insert("stream".into(), Value::Bool(false));
    body.remove("stream_options");
    body.remove("return_token_ids");
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_streamed_requests_prefill_is_asked_for_a_whole_answer_without_ids() {
        let decode = json!({"prompt": "hi", "stream": true, "stream_options": {"include_usage": true}, "return_token_ids": true, "bootstrap_room": 7});
        let p = whole_prefill_body(decode.as_object().unwrap());
        assert_eq!(Value::Object(p), json!({"prompt": "hi", "stream": false, "bootstrap_room": 7}));
    }

    #[test]
    fn single_request_gets_scalars() {
        let mut body = json!({"text": "hi", "bootstrap_room": 5}).as_object().unwrap().clone();
        inject(&mut body, "10.0.0.1", Some(8998), &Rooms::Single(42));
        assert_eq!(body["bootstrap_host"], "10.0.0.1");
        assert_eq!(body["bootstrap_port"], 8998);
        assert_eq!(body["bootstrap_room"], 42, "client-sent room is replaced");
    }

    #[test]
    fn batch_gets_lists_and_null_port_stays_null() {
        let mut body = Map::new();
        inject(&mut body, "h", None, &Rooms::Batch(vec![1, 2, 3]));
        assert_eq!(
            Value::Object(body.clone()),
            json!({
                "bootstrap_host": ["h", "h", "h"], "bootstrap_port": [null, null, null], "bootstrap_room": [1, 2, 3]
            })
        );
    }
}
