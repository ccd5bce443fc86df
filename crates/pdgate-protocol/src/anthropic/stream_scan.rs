//! The usual chat chunk's text, read from its bytes: the stream translator's fast path. A chat
//! stream is mostly chunks of one choice whose delta is a piece of text; parsing each into a
//! `serde_json::Value` and writing the Anthropic event from it cost more than the rest of the
//! translation. The text is taken as the raw JSON string it is (escapes and all) and written
//! into the Anthropic event as it is, so it is neither decoded nor encoded. Anything else (the
//! first chunk, a finish reason, usage, tool calls, reasoning, an error, a repeated key) is
//! `None`: the caller parses.

use crate::json_scan::Scan;

/// For one event's data: `Some(Some(raw))`, a text delta (the raw contents of its JSON string);
/// `Some(None)`, a usual chunk with nothing for the client; `None`, not the usual shape.
pub(crate) fn text_delta(payload: &[u8]) -> Option<Option<&[u8]>> {
    if payload.first() != Some(&b'{') {
        return None;
    }
    let mut s = Scan { b: payload, i: 0 };
    let (mut text, mut seen) = (None, 0u8);
    s.object(|s, key, _, _| match key {
        b"choices" => {
            once(&mut seen, 1)?;
            let n = s.array(|s| {
                text = choice(s)?;
                Some(())
            })?;
            (n == 1).then_some(())
        }
        b"usage" => null(s),
        b"error" => None,
        _ => s.value().map(drop),
    })?;
    s.ws();
    (s.i == payload.len() && seen == 1).then_some(text)
}

fn once(seen: &mut u8, bit: u8) -> Option<()> {
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}

/// A member whose value must be `null` (else the chunk takes the parse path).
fn null(s: &mut Scan<'_>) -> Option<()> {
    let (a, z) = s.value()?;
    (&s.b[a..z] == b"null").then_some(())
}

fn choice<'a>(s: &mut Scan<'a>) -> Option<Option<&'a [u8]>> {
    let (mut text, mut seen) = (None, 0u8);
    s.object(|s, key, _, _| match key {
        b"finish_reason" => {
            once(&mut seen, 1)?;
            null(s)
        }
        b"delta" => {
            once(&mut seen, 2)?;
            s.object(|s, k, _, _| match k {
                b"content" => {
                    once(&mut seen, 4)?;
                    match s.peek_after_ws()? {
                        b'"' => {
                            text = Some(s.string()?);
                            Some(())
                        }
                        _ => null(s),
                    }
                }
                b"role" => {
                    once(&mut seen, 8)?;
                    s.value().map(drop)
                }
                _ => None,
            })
        }
        b"index" | b"logprobs" | b"stop_reason" | b"token_ids" => s.value().map(drop),
        _ => None,
    })?;
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::text_delta;

    #[test]
    fn reads_the_usual_chunk_and_refuses_the_rest() {
        let usual =
            br#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a\"b\\n"},"logprobs":null,"finish_reason":null}]}"#;
        assert_eq!(text_delta(usual), Some(Some(&br#"a\"b\\n"#[..])));
        let role = br#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#;
        assert_eq!(text_delta(role), Some(Some(&b""[..])));
        assert_eq!(text_delta(br#"{"choices":[{"index":0,"delta":{}}]}"#), Some(None));
        for other in [
            &br#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}"#[..],
            br#"{"choices":[],"usage":{"prompt_tokens":1}}"#,
            br#"{"choices":[{"delta":{"tool_calls":[]}}]}"#,
            br#"{"choices":[{"delta":{"reasoning_content":"r"}}]}"#,
            br#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            br#"{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}"#,
            br#"{"error":{"message":"x"}}"#,
            br#"{"id":"c"}"#,
            b"[DONE]",
        ] {
            assert_eq!(text_delta(other), None, "{}", String::from_utf8_lossy(other));
        }
    }
}
