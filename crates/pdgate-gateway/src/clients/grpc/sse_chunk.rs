//! A streamed OpenAI chunk (`text_completion` / `chat.completion.chunk`) written straight as
//! bytes. Building a `serde_json::Value` per token (maps, key strings, the tree dropped again)
//! was most of the gRPC stream's JSON cost; the chunk's envelope (`created`, `id`, `model`,
//! `object`) is the same for every event of an answer, so it is written once ([`ChunkFrame`])
//! and each event only writes its choice.
//!
//! The bytes equal what serializing the equivalent `Value` gives (serde_json's map writes keys
//! in sorted order; strings go through serde_json's own escaping): the tests check that.

use serde_json::Value;

const HEAD: &[u8] = b"data: {\"choices\":[";

/// The fixed end of every chunk of one answer: `],"created":..,"id":..,"model":..,"object":..}`
/// and the event's blank line.
pub struct ChunkFrame {
    tail: Vec<u8>,
}

/// What one choice of a chunk says. `text` is the completions `text` or the chat
/// `delta.content` (chat: `None` writes an empty delta).
pub struct ChoicePart<'a> {
    pub index: u32,
    pub text: Option<&'a str>,
    pub logprobs: &'a Value,
    pub finish_reason: Option<&'a str>,
    pub token_ids: Option<&'a [u32]>,
    /// The prompt's ids, on a completion choice's first chunk (where vLLM puts them).
    pub prompt_ids: Option<&'a [u32]>,
}

fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

fn json_value(out: &mut Vec<u8>, v: &Value) {
    let _ = serde_json::to_writer(&mut *out, v);
}

fn finish_reason(out: &mut Vec<u8>, reason: Option<&str>) {
    out.extend_from_slice(b"\"finish_reason\":");
    match reason {
        Some(r) => json_str(out, r),
        None => out.extend_from_slice(b"null"),
    }
}

fn index(out: &mut Vec<u8>, i: u32) {
    out.extend_from_slice(b",\"index\":");
    out.extend_from_slice(itoa::Buffer::new().format(i).as_bytes());
}

fn id_list(out: &mut Vec<u8>, ids: &[u32]) {
    out.push(b'[');
    let mut buf = itoa::Buffer::new();
    for (k, id) in ids.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(buf.format(*id).as_bytes());
    }
    out.push(b']');
}

fn logprobs_and_ids(out: &mut Vec<u8>, logprobs: &Value, ids: Option<&[u32]>, prompt_ids: Option<&[u32]>, text: Option<&str>) {
    out.extend_from_slice(b",\"logprobs\":");
    json_value(out, logprobs);
    if let Some(p) = prompt_ids {
        out.extend_from_slice(b",\"prompt_token_ids\":");
        id_list(out, p);
    }
    if let Some(t) = text {
        out.extend_from_slice(b",\"text\":");
        json_str(out, t);
    }
    if let Some(ids) = ids {
        out.extend_from_slice(b",\"token_ids\":");
        id_list(out, ids);
    }
}

impl ChunkFrame {
    pub fn new(id: &str, created: u64, model: &str, chat: bool) -> Self {
        let mut tail = Vec::with_capacity(96 + id.len() + model.len());
        tail.extend_from_slice(b"],\"created\":");
        tail.extend_from_slice(itoa::Buffer::new().format(created).as_bytes());
        tail.extend_from_slice(b",\"id\":");
        json_str(&mut tail, id);
        tail.extend_from_slice(b",\"model\":");
        json_str(&mut tail, model);
        tail.extend_from_slice(if chat { b",\"object\":\"chat.completion.chunk\"}\n\n".as_slice() } else { b",\"object\":\"text_completion\"}\n\n".as_slice() });
        ChunkFrame { tail }
    }

    /// A completions chunk: `{"finish_reason","index","logprobs","text"[,"token_ids"]}`.
    pub fn completion(&self, out: &mut Vec<u8>, c: &ChoicePart<'_>) {
        out.extend_from_slice(HEAD);
        out.push(b'{');
        finish_reason(out, c.finish_reason);
        index(out, c.index);
        logprobs_and_ids(out, c.logprobs, c.token_ids, c.prompt_ids, Some(c.text.unwrap_or_default()));
        out.push(b'}');
        out.extend_from_slice(&self.tail);
    }

    /// A chat chunk: `{"delta","finish_reason","index","logprobs"[,"token_ids"]}`.
    pub fn chat(&self, out: &mut Vec<u8>, c: &ChoicePart<'_>) {
        out.extend_from_slice(HEAD);
        out.extend_from_slice(b"{\"delta\":");
        match c.text {
            Some(t) => {
                out.extend_from_slice(b"{\"content\":");
                json_str(out, t);
                out.extend_from_slice(b"},");
            }
            None => out.extend_from_slice(b"{},"),
        }
        finish_reason(out, c.finish_reason);
        index(out, c.index);
        logprobs_and_ids(out, c.logprobs, c.token_ids, None, None);
        out.push(b'}');
        out.extend_from_slice(&self.tail);
    }

    /// The chat stream's first chunk of a choice: the assistant role, empty content, and the
    /// prompt's ids at the chunk's top level when asked for (vLLM's place for them in chat).
    pub fn chat_role(&self, out: &mut Vec<u8>, i: u32, prompt_ids: Option<&[u32]>) {
        out.extend_from_slice(HEAD);
        out.extend_from_slice(b"{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},");
        finish_reason(out, None);
        index(out, i);
        out.extend_from_slice(b",\"logprobs\":null}");
        match prompt_ids {
            // The tail ends `}\n\n`: the ids go in before that brace (keys stay sorted).
            Some(p) => {
                out.extend_from_slice(&self.tail[..self.tail.len() - 3]);
                out.extend_from_slice(b",\"prompt_token_ids\":");
                id_list(out, p);
                out.extend_from_slice(b"}\n\n");
            }
            None => out.extend_from_slice(&self.tail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map};

    /// The `Value` path this replaces (response.rs before): the reference bytes.
    fn reference(id: &str, created: u64, model: &str, chat: bool, c: Value) -> Vec<u8> {
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [c]});
        let mut out = b"data: ".to_vec();
        serde_json::to_writer(&mut out, &v).unwrap();
        out.extend_from_slice(b"\n\n");
        out
    }

    fn reference_choice(chat: bool, c: &ChoicePart<'_>) -> Value {
        let mut o = Map::new();
        o.insert("index".into(), json!(c.index));
        if chat {
            o.insert("delta".into(), c.text.map_or_else(|| json!({}), |t| json!({"content": t})));
        } else {
            o.insert("text".into(), json!(c.text.unwrap_or_default()));
        }
        o.insert("logprobs".into(), c.logprobs.clone());
        o.insert("finish_reason".into(), json!(c.finish_reason));
        if let Some(p) = c.prompt_ids {
            o.insert("prompt_token_ids".into(), json!(p));
        }
        if let Some(ids) = c.token_ids {
            o.insert("token_ids".into(), json!(ids));
        }
        Value::Object(o)
    }

    #[test]
    fn chunks_are_byte_equal_to_the_value_path() {
        let lp = json!({"tokens": ["a"], "token_logprobs": [-0.5]});
        let texts = [Some(" The"), Some(""), None, Some("quote \" back\\slash \n tab\t ctl\u{1} é 東京 🙂")];
        for (id, model) in [("cmpl-1", "m"), ("chatcmpl-\"x\"", "org/model\u{7f}-ü")] {
            for chat in [false, true] {
                let frame = ChunkFrame::new(id, 1_796_230_031, model, chat);
                for text in texts {
                    for reason in [None, Some("length"), Some("stop")] {
                        for ids in [None, Some(&[][..]), Some(&[7u32, 300, 4_000_000_000][..])] {
                            for logprobs in [&Value::Null, &lp] {
                                // Prompt ids ride on completion choices only (chat: the role chunk).
                                let prompt_ids = (!chat).then_some(ids).flatten();
                                let c = ChoicePart { index: 3, text, logprobs, finish_reason: reason, token_ids: ids, prompt_ids };
                                let mut out = Vec::new();
                                if chat {
                                    frame.chat(&mut out, &c);
                                } else {
                                    frame.completion(&mut out, &c);
                                }
                                let want = reference(id, 1_796_230_031, model, chat, reference_choice(chat, &c));
                                assert_eq!(String::from_utf8(out).unwrap(), String::from_utf8(want).unwrap());
                            }
                        }
                    }
                }
                if chat {
                    let mut out = Vec::new();
                    frame.chat_role(&mut out, 2, None);
                    let role = json!({"index": 2, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                    assert_eq!(out, reference(id, 1_796_230_031, model, true, role.clone()));
                    let mut out = Vec::new();
                    frame.chat_role(&mut out, 2, Some(&[1, 2, 30_000]));
                    let mut want: Value = serde_json::from_slice(&reference(id, 1_796_230_031, model, true, role)[6..]).unwrap();
                    want["prompt_token_ids"] = json!([1, 2, 30_000]);
                    let mut want_bytes = b"data: ".to_vec();
                    serde_json::to_writer(&mut want_bytes, &want).unwrap();
                    want_bytes.extend_from_slice(b"\n\n");
                    assert_eq!(String::from_utf8(out).unwrap(), String::from_utf8(want_bytes).unwrap());
                }
            }
        }
    }
}
