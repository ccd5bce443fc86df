//! A Messages request → the equivalent chat completions request (mapping table:
//! docs/protocols.md, "Messages API"). Everything a client can get wrong is checked here, so a
//! bad request is a 400 before any worker is asked.

use serde_json::{json, Map, Value};

use crate::request::{invalid, InvalidRequest};

/// A Messages request as the gateway runs it.
#[derive(Clone, Debug)]
pub struct Translated {
    /// The chat completions body.
    pub chat: Map<String, Value>,
    pub stream: bool,
    /// The client's `stop_sequences`: which one stopped the answer is its `stop_sequence`.
    pub stop_sequences: Vec<String>,
    /// The model the client named, echoed in the answer.
    pub model: String,
}

/// Which request: `/v1/messages` needs `max_tokens`; `/v1/messages/count_tokens` has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Create,
    CountTokens,
}

/// The body's fields the translation reads, found in one pass over it (a lookup each cost more).
#[derive(Default)]
struct Fields<'a> {
    model: Option<&'a Value>,
    system: Option<&'a Value>,
    messages: Option<&'a Value>,
    max_tokens: Option<&'a Value>,
    stop_sequences: Option<&'a Value>,
    temperature: Option<&'a Value>,
    top_p: Option<&'a Value>,
    top_k: Option<&'a Value>,
    metadata: Option<&'a Value>,
    tools: Option<&'a Value>,
    tool_choice: Option<&'a Value>,
    stream: Option<&'a Value>,
}

impl<'a> Fields<'a> {
    fn of(body: &'a Map<String, Value>) -> Self {
        let mut f = Fields::default();
        for (k, v) in body {
            let slot = match k.as_str() {
                "model" => &mut f.model,
                "system" => &mut f.system,
                "messages" => &mut f.messages,
                "max_tokens" => &mut f.max_tokens,
                "stop_sequences" => &mut f.stop_sequences,
                "temperature" => &mut f.temperature,
                "top_p" => &mut f.top_p,
                "top_k" => &mut f.top_k,
                "metadata" => &mut f.metadata,
                "tools" => &mut f.tools,
                "tool_choice" => &mut f.tool_choice,
                "stream" => &mut f.stream,
                _ => continue,
            };
            *slot = Some(v);
        }
        f
    }
}

/// Parses and translates a Messages body.
pub fn to_chat(raw: &[u8], kind: Kind) -> Result<Translated, InvalidRequest> {
    if let Some(t) = super::request_usual::usual(raw, kind) {
        return Ok(t);
    }
    parsed(raw, kind)
}

/// The body parsed: every shape, and every error.
pub(crate) fn parsed(raw: &[u8], kind: Kind) -> Result<Translated, InvalidRequest> {
    let body: Value = serde_json::from_slice(raw).map_err(|e| InvalidRequest { param: None, message: format!("the request body is not valid JSON: {e}") })?;
    let Value::Object(body) = body else { return Err(InvalidRequest { param: None, message: "the request body must be a JSON object".into() }) };
    let f = Fields::of(&body);
    let model = match f.model {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => return Err(invalid("model", "model: Field required (a non-empty string)")),
    };
    let mut chat = Map::new();
    chat.insert("model".into(), Value::String(model.clone()));
    let mut messages = Vec::new();
    if let Some(system) = f.system {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    translate_messages(f.messages, &mut messages)?;
    let last_is_assistant = messages.last().and_then(|m| m.get("role")).and_then(Value::as_str) == Some("assistant");
    chat.insert("messages".into(), Value::Array(messages));
    if last_is_assistant {
        // Anthropic's prefill: the answer continues the last assistant turn.
        chat.insert("add_generation_prompt".into(), Value::Bool(false));
        chat.insert("continue_final_message".into(), Value::Bool(true));
    }
    match (f.max_tokens, kind) {
        (Some(v), _) => match v.as_u64() {
            Some(n) if n >= 1 => {
                chat.insert("max_tokens".into(), json!(n));
            }
            _ => return Err(invalid("max_tokens", "max_tokens must be an integer >= 1")),
        },
        (None, Kind::Create) => return Err(invalid("max_tokens", "max_tokens: Field required")),
        (None, Kind::CountTokens) => {}
    }
    let stop_sequences = stop_sequences(f.stop_sequences)?;
    if !stop_sequences.is_empty() {
        chat.insert("stop".into(), json!(stop_sequences));
    }
    for (key, v, lo, hi) in [("temperature", f.temperature, 0.0, 2.0), ("top_p", f.top_p, 0.0, 1.0)] {
        if let Some(v) = v.filter(|v| !v.is_null()) {
            match v.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => {
                    chat.insert(key.into(), v.clone());
                }
                _ => return Err(invalid(key, format!("{key} must be a number in [{lo}, {hi}]"))),
            }
        }
    }
    if let Some(v) = f.top_k.filter(|v| !v.is_null()) {
        match v.as_i64() {
            Some(k) if k >= 0 => {
                chat.insert("top_k".into(), v.clone());
            }
            _ => return Err(invalid("top_k", "top_k must be an integer >= 0")),
        }
    }
    if let Some(meta) = f.metadata.filter(|v| !v.is_null()) {
        let Some(meta) = meta.as_object() else { return Err(invalid("metadata", "metadata must be an object")) };
        match meta.get("user_id") {
            Some(Value::String(u)) => {
                chat.insert("user".into(), Value::String(u.clone()));
            }
            None | Some(Value::Null) => {}
            Some(_) => return Err(invalid("metadata.user_id", "metadata.user_id must be a string")),
        }
    }
    if let Some(tools) = f.tools.filter(|v| !v.is_null()) {
        chat.insert("tools".into(), Value::Array(translate_tools(tools)?));
    }
    if let Some(choice) = f.tool_choice.filter(|v| !v.is_null()) {
        let (choice, parallel) = translate_tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if parallel == Some(false) {
            chat.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
    }
    let stream = match f.stream {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("stream", "stream must be a boolean")),
    };
    if stream && kind == Kind::Create {
        chat.insert("stream".into(), Value::Bool(true));
        // The final counts of message_delta come from the worker's usage chunk.
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok(Translated { chat, stream: stream && kind == Kind::Create, stop_sequences, model })
}

fn stop_sequences(v: Option<&Value>) -> Result<Vec<String>, InvalidRequest> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => {
            items.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| invalid("stop_sequences", "stop_sequences must be a list of strings"))).collect()
        }
        Some(_) => Err(invalid("stop_sequences", "stop_sequences must be a list of strings")),
    }
}

/// The text of a string or of a list of text blocks (`system`, a `tool_result`'s content).
fn text_of(v: &Value, param: &str) -> Result<String, InvalidRequest> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                match block_type(b) {
                    Some("text") => parts.push(block_text(b, &format!("{param}[{i}]"))?),
                    Some("image") | Some("document") => return Err(unsupported_media(&format!("{param}[{i}]"))),
                    other => return Err(unknown_block(&format!("{param}[{i}]"), other)),
                }
            }
            Ok(parts.join("\n"))
        }
        Value::Null => Ok(String::new()),
        _ => Err(invalid(param, format!("{param} must be a string or a list of text blocks"))),
    }
}

fn block_type(b: &Value) -> Option<&str> {
    b.get("type").and_then(Value::as_str)
}

fn block_text(b: &Value, param: &str) -> Result<String, InvalidRequest> {
    b.get("text").and_then(Value::as_str).map(str::to_string).ok_or_else(|| invalid(param, format!("{param}.text: Field required (a string)")))
}

fn unknown_block(param: &str, t: Option<&str>) -> InvalidRequest {
    match t {
        Some(t) => invalid(param, format!("{param}: unknown content block type '{t}'")),
        None => invalid(param, format!("{param}: a content block must be an object with a string 'type'")),
    }
}

fn unsupported_media(param: &str) -> InvalidRequest {
    invalid(param, format!("{param}: document blocks, and image blocks outside a user message's own content, are not supported"))
}

/// The media types Anthropic takes in an image block's base64 source.
const IMAGE_TYPES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];

/// A user message's image block as a chat `image_url` part (what `--epd-disaggregation` and
/// the multimodal workers read): a `base64` source as a data URL, a `url` source as its
/// `http(s)://` URL, which a chat `image_url` part with that URL meets next (under EPD the
/// gateway fetches it from a host in `--allowed-media-domains`, else refuses it; elsewhere the
/// engine fetches it, as vLLM does, or refuses it).
fn image_part(b: &Value, param: &str) -> Result<Value, InvalidRequest> {
    let source = b.get("source").and_then(Value::as_object).ok_or_else(|| invalid(param, format!("{param}.source: Field required (an object)")))?;
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => {}
        Some("url") => {
            return match source.get("url").and_then(Value::as_str) {
                Some(u) if u.starts_with("http://") || u.starts_with("https://") => Ok(json!({"type": "image_url", "image_url": {"url": u}})),
                _ => Err(invalid(param, format!("{param}.source.url: Field required (an http:// or https:// URL)"))),
            };
        }
        Some(t) => return Err(invalid(param, format!("{param}.source.type: '{t}' is not supported (only 'base64' and 'url')"))),
        None => return Err(invalid(param, format!("{param}.source.type: Field required"))),
    }
    let media_type = source.get("media_type").and_then(Value::as_str).ok_or_else(|| invalid(param, format!("{param}.source.media_type: Field required")))?;
    if !IMAGE_TYPES.contains(&media_type) {
        return Err(invalid(param, format!("{param}.source.media_type: '{media_type}' is not one of {}", IMAGE_TYPES.join(", "))));
    }
    let data = source.get("data").and_then(Value::as_str).ok_or_else(|| invalid(param, format!("{param}.source.data: Field required (base64 text)")))?;
    Ok(json!({"type": "image_url", "image_url": {"url": format!("data:{media_type};base64,{data}")}}))
}

/// `messages` → chat messages, appended to `out` (after the system message).
fn translate_messages(v: Option<&Value>, out: &mut Vec<Value>) -> Result<(), InvalidRequest> {
    let Some(Value::Array(messages)) = v else { return Err(invalid("messages", "messages: Field required (a list)")) };
    if messages.is_empty() {
        return Err(invalid("messages", "messages: at least one message is required"));
    }
    // The tool_use ids of the previous assistant turn: what this user turn's tool_results answer.
    let mut open_tool_uses: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        // The usual message, a role and a string: valid as it is (but an assistant first), and
        // no `param` to write for an error.
        if let Some(m) = m.as_object() {
            if let (Some(role @ ("user" | "assistant")), Some(Value::String(text))) = (m.get("role").and_then(Value::as_str), m.get("content")) {
                if i > 0 || role == "user" {
                    out.push(json!({"role": role, "content": text}));
                    open_tool_uses.clear();
                    continue;
                }
            }
        }
        let param = format!("messages[{i}]");
        let Some(m) = m.as_object() else { return Err(invalid(&param, format!("{param} must be an object"))) };
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").ok_or_else(|| invalid(&param, format!("{param}.content: Field required")))?;
        match role {
            Some("user") => {
                user_turn(content, &param, &open_tool_uses, out)?;
                open_tool_uses.clear();
            }
            Some("assistant") => {
                if i == 0 {
                    return Err(invalid(&param, "messages: the first message must use the 'user' role"));
                }
                open_tool_uses = assistant_turn(content, &param, out)?;
            }
            Some(r) => return Err(invalid(&param, format!("{param}.role: '{r}' is not a message role ('user' or 'assistant'; the system prompt is the top-level 'system')"))),
            None => return Err(invalid(&param, format!("{param}.role: Field required"))),
        }
    }
    Ok(())
}

fn user_turn(content: &Value, param: &str, open_tool_uses: &[String], out: &mut Vec<Value>) -> Result<(), InvalidRequest> {
    let blocks = match content {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => return Err(invalid(param, format!("{param}.content must be a string or a list of content blocks"))),
    };
    let mut texts = Vec::new();
    // The turn's text and image blocks in order, as chat parts (used when it has an image).
    let mut parts = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}.content[{j}]");
        match block_type(b) {
            Some("text") => {
                let text = block_text(b, &bp)?;
                parts.push(json!({"type": "text", "text": text}));
                texts.push(text);
            }
            Some("image") => parts.push(image_part(b, &bp)?),
            Some("tool_result") => {
                let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| invalid(&bp, format!("{bp}.tool_use_id: Field required")))?;
                if !open_tool_uses.iter().any(|u| u == id) {
                    return Err(invalid(&bp, format!("{bp}: tool_result block for tool_use_id '{id}' has no matching tool_use block in the previous assistant message")));
                }
                let text = match b.get("content") {
                    None => String::new(),
                    Some(c) => text_of(c, &format!("{bp}.content"))?,
                };
                // A tool's error is told to the model as text, as Anthropic's templates do.
                let text = if b.get("is_error").and_then(Value::as_bool) == Some(true) { format!("Error: {text}") } else { text };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            }
            Some("document") => return Err(unsupported_media(&bp)),
            Some("tool_use") => return Err(invalid(&bp, format!("{bp}: tool_use blocks belong to assistant messages"))),
            other => return Err(unknown_block(&bp, other)),
        }
    }
    if parts.len() > texts.len() {
        out.push(json!({"role": "user", "content": parts}));
    } else if !texts.is_empty() || blocks.is_empty() {
        out.push(json!({"role": "user", "content": joined(texts)}));
    }
    Ok(())
}

/// One text block is a plain string (what every chat template takes); several are text parts.
fn joined(mut texts: Vec<String>) -> Value {
    if texts.len() == 1 {
        return Value::String(texts.remove(0));
    }
    if texts.is_empty() {
        return Value::String(String::new());
    }
    Value::Array(texts.into_iter().map(|t| json!({"type": "text", "text": t})).collect())
}

/// An assistant turn; returns its tool_use ids.
fn assistant_turn(content: &Value, param: &str, out: &mut Vec<Value>) -> Result<Vec<String>, InvalidRequest> {
    let blocks = match content {
        Value::String(s) => {
            out.push(json!({"role": "assistant", "content": s}));
            return Ok(Vec::new());
        }
        Value::Array(blocks) => blocks,
        _ => return Err(invalid(param, format!("{param}.content must be a string or a list of content blocks"))),
    };
    let (mut texts, mut calls, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}.content[{j}]");
        match block_type(b) {
            Some("text") => texts.push(block_text(b, &bp)?),
            Some("tool_use") => {
                let id = b.get("id").and_then(Value::as_str).ok_or_else(|| invalid(&bp, format!("{bp}.id: Field required")))?;
                let name = b.get("name").and_then(Value::as_str).ok_or_else(|| invalid(&bp, format!("{bp}.name: Field required")))?;
                let input = b.get("input").filter(|v| v.is_object()).ok_or_else(|| invalid(&bp, format!("{bp}.input must be an object")))?;
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                ids.push(id.to_string());
            }
            // Earlier turns' reasoning is not sent back to the model (chat templates drop it too).
            Some("thinking") | Some("redacted_thinking") => {}
            Some("tool_result") => return Err(invalid(&bp, format!("{bp}: tool_result blocks belong to user messages"))),
            Some("image") | Some("document") => return Err(unsupported_media(&bp)),
            other => return Err(unknown_block(&bp, other)),
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    let text = texts.concat();
    msg.insert("content".into(), if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text) });
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    out.push(Value::Object(msg));
    Ok(ids)
}

/// Anthropic tools → OpenAI function tools.
fn translate_tools(v: &Value) -> Result<Vec<Value>, InvalidRequest> {
    let Some(tools) = v.as_array() else { return Err(invalid("tools", "tools must be a list")) };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
            return Err(invalid(&p, format!("{p}: tool type '{kind}' is not supported (only client tools with an input_schema)")));
        }
        let name = t.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| invalid(&p, format!("{p}.name: Field required")))?;
        let schema = t.get("input_schema").filter(|s| s.is_object()).ok_or_else(|| invalid(&p, format!("{p}.input_schema: Field required (an object)")))?;
        let mut f = Map::new();
        f.insert("name".into(), json!(name));
        if let Some(d) = t.get("description").and_then(Value::as_str) {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), schema.clone());
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(out)
}

/// Anthropic `tool_choice` → OpenAI `tool_choice`, and `disable_parallel_tool_use` inverted.
fn translate_tool_choice(v: &Value) -> Result<(Value, Option<bool>), InvalidRequest> {
    let parallel = v.get("disable_parallel_tool_use").and_then(Value::as_bool).map(|d| !d);
    let choice = match v.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = v.get("name").and_then(Value::as_str).ok_or_else(|| invalid("tool_choice.name", "tool_choice.name: Field required for type 'tool'"))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => return Err(invalid("tool_choice", "tool_choice.type must be one of 'auto', 'any', 'tool', 'none'")),
    };
    Ok((choice, parallel))
}
