//! What a worker's answer must look like before the gateway relays it.
//!
//! Workers are not trusted: a broken one may answer an HTML error page under 200, half a JSON
//! document, or plain JSON to a streaming request. These checks are cheap (the shape only, not
//! every field) and follow what the engines send (docs/protocols.md; SGLang's and vLLM's OpenAI
//! servers, the reference engine's `api_openai.py` and `api_native.py`).

use serde_json::Value;

use crate::request::Endpoint;

/// Why an answer was refused, in words for the client and a short label for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadAnswer {
    pub reason: &'static str,
    pub message: String,
}

fn bad(reason: &'static str, message: impl Into<String>) -> BadAnswer {
    BadAnswer { reason, message: message.into() }
}

/// Reasons, for metrics labels that exist from the start.
pub const REASONS: &[&str] = &["not_json", "bad_shape", "not_sse", "content_encoding", "too_large", "sse_event_too_long"];

/// Parses a non-streamed answer and checks its shape for `endpoint`: OpenAI routes answer an
/// object with a `choices` list; SGLang's `/generate` answers an object with `text`,
/// `output_ids` or `meta_info`, or (for a batch or `n` > 1) a non-empty list of such objects.
pub fn check_json(endpoint: Endpoint, bytes: &[u8]) -> Result<Value, BadAnswer> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| bad("not_json", format!("answer is not JSON ({e})")))?;
    let ok = match endpoint {
        Endpoint::Completions | Endpoint::ChatCompletions => v.get("choices").is_some_and(Value::is_array),
        Endpoint::Generate => match &v {
            Value::Array(items) => !items.is_empty() && items.iter().all(is_generate_item),
            item => is_generate_item(item),
        },
    };
    if ok {
        Ok(v)
    } else {
        let want = match endpoint {
            Endpoint::Generate => "an object with text/output_ids/meta_info, or a list of them",
            _ => "an object with a 'choices' list",
        };
        Err(bad("bad_shape", format!("answer is JSON but not {want}")))
    }
}

fn is_generate_item(v: &Value) -> bool {
    v.as_object().is_some_and(|o| ["text", "output_ids", "meta_info"].iter().any(|k| o.contains_key(*k)))
}

/// Checks the head of a streamed answer: a content type, when given, must be
/// `text/event-stream`, and the first bytes must be able to start an SSE stream.
pub fn check_sse_start(content_type: Option<&str>, first: &[u8]) -> Result<(), BadAnswer> {
    if let Some(ct) = content_type {
        let media = ct.split(';').next().unwrap_or("").trim();
        if !media.eq_ignore_ascii_case("text/event-stream") {
            return Err(bad("not_sse", format!("answer to a streaming request has content-type {ct:?}, not text/event-stream")));
        }
    }
    if !crate::sse::looks_like_sse(first) {
        return Err(bad("not_sse", "answer to a streaming request does not start with an SSE event"));
    }
    Ok(())
}

/// The gateway asks for `identity`; anything else would reach the client as bytes it cannot
/// read (the encoding header is not relayed), so it is refused rather than half-forwarded.
pub fn check_encoding(content_encoding: Option<&str>) -> Result<(), BadAnswer> {
    match content_encoding.map(str::trim) {
        None | Some("") => Ok(()),
        Some(e) if e.eq_ignore_ascii_case("identity") => Ok(()),
        Some(e) => Err(bad("content_encoding", format!("answer has content-encoding {e:?}; the gateway asked for identity"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_answers_need_choices() {
        assert!(check_json(Endpoint::Completions, br#"{"id":"x","choices":[]}"#).is_ok());
        assert!(check_json(Endpoint::ChatCompletions, br#"{"choices":[{"message":{}}]}"#).is_ok());
        assert_eq!(check_json(Endpoint::Completions, br#"{"error":"x"}"#).unwrap_err().reason, "bad_shape");
        assert_eq!(check_json(Endpoint::Completions, b"<html>oops</html>").unwrap_err().reason, "not_json");
        assert_eq!(check_json(Endpoint::Completions, br#"{"choices":[1"#).unwrap_err().reason, "not_json");
    }

    #[test]
    fn generate_answers_are_items_or_lists_of_items() {
        assert!(check_json(Endpoint::Generate, br#"{"text":"a","meta_info":{}}"#).is_ok());
        assert!(check_json(Endpoint::Generate, br#"{"output_ids":[1],"meta_info":{}}"#).is_ok());
        assert!(check_json(Endpoint::Generate, br#"[{"text":"a"},{"text":"b"}]"#).is_ok());
        for b in [&br#"[]"#[..], br#"[{"text":"a"},3]"#, br#"{"choices":[]}"#, b"42"] {
            assert_eq!(check_json(Endpoint::Generate, b).unwrap_err().reason, "bad_shape", "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn streams_must_look_like_sse() {
        assert!(check_sse_start(Some("text/event-stream; charset=utf-8"), b"data: {}\n\n").is_ok());
        assert!(check_sse_start(None, b": ping\n\n").is_ok());
        assert!(check_sse_start(Some("text/event-stream"), b"da").is_ok(), "too short to tell");
        assert_eq!(check_sse_start(Some("application/json"), b"data: {}").unwrap_err().reason, "not_sse");
        assert_eq!(check_sse_start(Some("text/event-stream"), b"<!DOCTYPE html>").unwrap_err().reason, "not_sse");
        assert_eq!(check_sse_start(None, br#"{"choices":[]}"#).unwrap_err().reason, "not_sse");
    }

    #[test]
    fn only_identity_encoding_passes() {
        assert!(check_encoding(None).is_ok());
        assert!(check_encoding(Some("identity")).is_ok());
        assert_eq!(check_encoding(Some("gzip")).unwrap_err().reason, "content_encoding");
        assert!(check_encoding(Some("br")).is_err());
    }
}
