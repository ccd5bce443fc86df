//! A Responses request, validated, and its Chat Completions equivalent.
//!
//! | Responses | Chat Completions |
//! | --- | --- |
//! | `instructions` | a first `system` message (not carried to the next turn, as OpenAI) |
//! | `input` string | one `user` message |
//! | `message` item (`user`/`assistant`/`system`/`developer`) | a message of that role (`developer` → `system`); `input_text`/`output_text` parts joined |
//! | `function_call` item | an `assistant` message's `tool_calls` entry (`call_id` → `id`) |
//! | `function_call_output` item | a `tool` message (`tool_call_id`) |
//! | `max_output_tokens` | `max_tokens` |
//! | `temperature`, `top_p`, `user`, `parallel_tool_calls` | the same |
//! | `tools` (`function`) | `tools` (`{"type":"function","function":{...}}`) |
//! | `tool_choice` | `tool_choice` (`{"type":"function","name"}` → `{"type":"function","function":{"name"}}`) |
//! | `text.format` | `response_format` |
//! | `stream` | `stream` with `stream_options.include_usage` (the usage is real) |

use serde_json::{json, Map, Value};

use crate::request::InvalidRequest;

fn invalid(param: &str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest { param: Some(param.to_string()), message: message.into() }
}

/// A validated Responses request.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponsesRequest {
    pub stream: bool,
    /// Keep the response for `GET` and `previous_response_id` (OpenAI's default: true).
    pub store: bool,
    pub previous_response_id: Option<String>,
    pub instructions: Option<String>,
    /// This turn's input items (a string input as one `user` message item).
    pub input: Vec<Value>,
    /// The request's fields the Response object echoes (`model`, `max_output_tokens`, `tools`, ...).
    pub echo: Map<String, Value>,
    /// Chat fields other than `messages`, already mapped.
    pub(super) chat: Map<String, Value>,
}

/// Fields refused with a clear 400 rather than silently ignored: they would change the answer.
const UNSUPPORTED: [(&str, &str); 3] = [
    ("background", "background mode is not supported by pdgate (responses run in the foreground)"),
    ("conversation", "the Conversations API is not supported by pdgate; use previous_response_id"),
    ("prompt", "prompt templates are not supported by pdgate"),
];

/// The Responses API's own fields: mapped above, echoed, or with no chat equivalent; never
/// passed to the chat body as they are.
const RESPONSES_FIELDS: [&str; 28] = [
    "background",
    "conversation",
    "include",
    "input",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "messages",
    "metadata",
    "model",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
];

/// The body's members read here, found in one pass over it (a lookup each cost more).
#[derive(Default)]
struct Fields<'a> {
    background: Option<&'a Value>,
    conversation: Option<&'a Value>,
    prompt: Option<&'a Value>,
    stream: Option<&'a Value>,
    store: Option<&'a Value>,
    previous_response_id: Option<&'a Value>,
    instructions: Option<&'a Value>,
    input: Option<&'a Value>,
    model: Option<&'a Value>,
    max_output_tokens: Option<&'a Value>,
    temperature: Option<&'a Value>,
    top_p: Option<&'a Value>,
    user: Option<&'a Value>,
    parallel_tool_calls: Option<&'a Value>,
    metadata: Option<&'a Value>,
    tools: Option<&'a Value>,
    tool_choice: Option<&'a Value>,
    text: Option<&'a Value>,
    reasoning: Option<&'a Value>,
    truncation: Option<&'a Value>,
    service_tier: Option<&'a Value>,
}

impl<'a> Fields<'a> {
    fn of(body: &'a Map<String, Value>) -> Self {
        let mut f = Fields::default();
        for (k, v) in body {
            let slot = match k.as_str() {
                "background" => &mut f.background,
                "conversation" => &mut f.conversation,
                "prompt" => &mut f.prompt,
                "stream" => &mut f.stream,
                "store" => &mut f.store,
                "previous_response_id" => &mut f.previous_response_id,
                "instructions" => &mut f.instructions,
                "input" => &mut f.input,
                "model" => &mut f.model,
                "max_output_tokens" => &mut f.max_output_tokens,
                "temperature" => &mut f.temperature,
                "top_p" => &mut f.top_p,
                "user" => &mut f.user,
                "parallel_tool_calls" => &mut f.parallel_tool_calls,
                "metadata" => &mut f.metadata,
                "tools" => &mut f.tools,
                "tool_choice" => &mut f.tool_choice,
                "text" => &mut f.text,
                "reasoning" => &mut f.reasoning,
                "truncation" => &mut f.truncation,
                "service_tier" => &mut f.service_tier,
                _ => continue,
            };
            *slot = Some(v);
        }
        f
    }
}

/// Parses and validates a `/v1/responses` body.
pub fn parse_responses(bytes: &[u8]) -> Result<ResponsesRequest, InvalidRequest> {
    if let Some(r) = super::request_usual::usual(bytes) {
        return Ok(r);
    }
    parsed(bytes)
}

/// The body parsed: every shape, and every error.
pub(crate) fn parsed(bytes: &[u8]) -> Result<ResponsesRequest, InvalidRequest> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| InvalidRequest { param: None, message: format!("request body is not valid JSON: {e}") })?;
    let Value::Object(body) = value else {
        return Err(InvalidRequest { param: None, message: "request body must be a JSON object".into() });
    };
    let f = Fields::of(&body);
    for ((field, why), v) in UNSUPPORTED.into_iter().zip([f.background, f.conversation, f.prompt]) {
        if v.is_some_and(|v| !v.is_null() && *v != Value::Bool(false)) {
            return Err(invalid(field, why));
        }
    }
    let stream = opt_bool(f.stream, "stream")?.unwrap_or(false);
    let store = opt_bool(f.store, "store")?.unwrap_or(true);
    let previous_response_id = opt_str(f.previous_response_id, "previous_response_id")?.map(str::to_string);
    let instructions = opt_str(f.instructions, "instructions")?.map(str::to_string);
    let input = match f.input {
        None | Some(Value::Null) => return Err(invalid("input", "input is required")),
        // One user message: valid as it is made.
        Some(Value::String(s)) => vec![json!({"type": "message", "role": "user", "content": s})],
        Some(Value::Array(items)) => {
            // Validate the items on their own (the conversation is checked again with its history).
            for (i, item) in items.iter().enumerate() {
                item_message(item, i)?;
            }
            items.clone()
        }
        Some(_) => return Err(invalid("input", "input must be a string or a list of items")),
    };
    let mut chat = Map::new();
    let mut echo = Map::new();
    if let Some(model) = opt_str(f.model, "model")? {
        chat.insert("model".into(), model.into());
        echo.insert("model".into(), model.into());
    }
    if let Some(n) = f.max_output_tokens.filter(|v| !v.is_null()) {
        if n.as_u64().is_none_or(|n| n < 1) {
            return Err(invalid("max_output_tokens", "max_output_tokens must be a positive integer"));
        }
        chat.insert("max_tokens".into(), n.clone());
        echo.insert("max_output_tokens".into(), n.clone());
    }
    for (field, v) in [("temperature", f.temperature), ("top_p", f.top_p)] {
        if let Some(v) = v.filter(|v| !v.is_null()) {
            if !v.is_number() {
                return Err(invalid(field, format!("{field} must be a number")));
            }
            chat.insert(field.into(), v.clone());
            echo.insert(field.into(), v.clone());
        }
    }
    if let Some(user) = opt_str(f.user, "user")? {
        chat.insert("user".into(), user.into());
        echo.insert("user".into(), user.into());
    }
    if let Some(p) = opt_bool(f.parallel_tool_calls, "parallel_tool_calls")? {
        chat.insert("parallel_tool_calls".into(), p.into());
        echo.insert("parallel_tool_calls".into(), p.into());
    }
    if let Some(m) = f.metadata.filter(|v| !v.is_null()) {
        if !m.as_object().is_some_and(|m| m.values().all(Value::is_string)) {
            return Err(invalid("metadata", "metadata must be an object of strings"));
        }
        echo.insert("metadata".into(), m.clone());
    }
    if let Some(tools) = f.tools.filter(|v| !v.is_null()) {
        chat.insert("tools".into(), map_tools(tools)?);
        echo.insert("tools".into(), tools.clone());
    }
    if let Some(choice) = f.tool_choice.filter(|v| !v.is_null()) {
        chat.insert("tool_choice".into(), map_tool_choice(choice)?);
        echo.insert("tool_choice".into(), choice.clone());
    }
    if let Some(text) = f.text.filter(|v| !v.is_null()) {
        if let Some(format) = map_text_format(text)? {
            chat.insert("response_format".into(), format);
        }
        echo.insert("text".into(), text.clone());
    }
    for (field, v) in [("reasoning", f.reasoning), ("truncation", f.truncation), ("service_tier", f.service_tier)] {
        if let Some(v) = v.filter(|v| !v.is_null()) {
            echo.insert(field.into(), v.clone());
        }
    }
    if let Some(i) = &instructions {
        echo.insert("instructions".into(), i.clone().into());
    }
    if let Some(p) = &previous_response_id {
        echo.insert("previous_response_id".into(), p.clone().into());
    }
    echo.insert("store".into(), store.into());
    // Engine extensions (`ignore_eos`, `top_k`, `seed`, ...: the SDK's `extra_body`) go to the
    // chat body as they came, as on the chat route; the chat parser validates them.
    for (k, v) in &body {
        if !RESPONSES_FIELDS.contains(&k.as_str()) && !chat.contains_key(k) {
            chat.insert(k.clone(), v.clone());
        }
    }
    chat.insert("stream".into(), stream.into());
    if stream {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok(ResponsesRequest { stream, store, previous_response_id, instructions, input, echo, chat })
}

impl ResponsesRequest {
    /// The chat body of this turn after `history` (the previous response's conversation items),
    /// or the error that names the offending item (e.g. a `function_call_output` whose
    /// `function_call` is in neither the history nor this input). Takes the request's chat
    /// fields (moved, not copied): call it once.
    pub fn chat_body(&mut self, history: &[Value]) -> Result<Map<String, Value>, InvalidRequest> {
        let mut messages = Vec::new();
        if let Some(i) = &self.instructions {
            messages.push(json!({"role": "system", "content": i}));
        }
        let items: Vec<&Value> = history.iter().chain(&self.input).collect();
        messages.extend(items_to_messages(items.iter().copied(), history.len())?);
        let mut chat = std::mem::take(&mut self.chat);
        chat.insert("messages".into(), Value::Array(messages));
        Ok(chat)
    }
}

/// Chat messages of a conversation's items, in order. `first_input` is the index of the first
/// item of this request's `input` (earlier ones come from the stored history), for the `param`
/// of an error.
pub fn items_to_messages<'a>(items: impl IntoIterator<Item = &'a Value>, first_input: usize) -> Result<Vec<Value>, InvalidRequest> {
    let mut messages: Vec<Value> = Vec::new();
    let mut calls: Vec<String> = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        let at = i.saturating_sub(first_input);
        match item_message(item, at)? {
            Piece::Message(m) => messages.push(m),
            Piece::Call(call_id, call) => {
                calls.push(call_id);
                // Consecutive calls (and a call right after the assistant's text) are one turn.
                match messages.last_mut().and_then(Value::as_object_mut).filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant")) {
                    Some(last) => match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(list) => list.push(call),
                        None => {
                            last.insert("tool_calls".into(), json!([call]));
                        }
                    },
                    None => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            Piece::Output(call_id, output) => {
                if !calls.contains(&call_id) {
                    return Err(invalid(&format!("input[{at}].call_id"), format!("no function_call with call_id {call_id:?} precedes this function_call_output")));
                }
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
        }
    }
    Ok(messages)
}

enum Piece {
    Message(Value),
    Call(String, Value),
    Output(String, String),
}

/// One input item as a chat piece, validated.
fn item_message(item: &Value, at: usize) -> Result<Piece, InvalidRequest> {
    let p = |field: &str| format!("input[{at}].{field}");
    let Some(obj) = item.as_object() else {
        return Err(invalid(&format!("input[{at}]"), "each input item must be an object"));
    };
    let kind = match obj.get("type") {
        None | Some(Value::Null) if obj.contains_key("role") => "message",
        Some(Value::String(t)) => t.as_str(),
        _ => return Err(invalid(&p("type"), "the item has no type")),
    };
    let str_field =
        |field: &str| -> Result<&str, InvalidRequest> { obj.get(field).and_then(Value::as_str).ok_or_else(|| invalid(&p(field), format!("a {kind} item needs a string {field}"))) };
    match kind {
        "message" => {
            let role = match str_field("role")? {
                "user" => "user",
                "assistant" => "assistant",
                "system" | "developer" => "system",
                other => return Err(invalid(&p("role"), format!("unknown role {other:?} (expected user, assistant, system or developer)"))),
            };
            let content = content_text(obj.get("content"), &p("content"))?;
            Ok(Piece::Message(json!({"role": role, "content": content})))
        }
        "function_call" => {
            let call_id = str_field("call_id")?;
            let name = str_field("name")?;
            let arguments = str_field("arguments")?;
            Ok(Piece::Call(call_id.to_string(), json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})))
        }
        "function_call_output" => {
            let call_id = str_field("call_id")?;
            let output = content_text(obj.get("output"), &p("output"))?;
            Ok(Piece::Output(call_id.to_string(), output))
        }
        other => Err(invalid(&p("type"), format!("unsupported input item type {other:?} (pdgate takes message, function_call and function_call_output items)"))),
    }
}

/// A content value as text: a string, or a list of `input_text`/`output_text` parts joined.
fn content_text(content: Option<&Value>, param: &str) -> Result<String, InvalidRequest> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
                    ("input_text" | "output_text" | "text", None) => return Err(invalid(&format!("{param}[{j}].text"), "a text part needs a string text")),
                    ("refusal", _) => {}
                    (other, _) => return Err(invalid(&format!("{param}[{j}].type"), format!("unsupported content part type {other:?} (pdgate takes input_text and output_text)"))),
                }
            }
            Ok(text)
        }
        _ => Err(invalid(param, "content must be a string or a list of parts")),
    }
}

fn map_tools(tools: &Value) -> Result<Value, InvalidRequest> {
    let Some(list) = tools.as_array() else {
        return Err(invalid("tools", "tools must be a list"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(&format!("tools[{i}].type"), "only function tools are supported by pdgate"));
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(invalid(&format!("tools[{i}].name"), "a function tool needs a string name"));
        };
        let mut function = Map::new();
        function.insert("name".into(), name.into());
        for field in ["description", "parameters", "strict"] {
            if let Some(v) = tool.get(field).filter(|v| !v.is_null()) {
                function.insert(field.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

fn map_tool_choice(choice: &Value) -> Result<Value, InvalidRequest> {
    match choice {
        Value::String(s) if matches!(s.as_str(), "none" | "auto" | "required") => Ok(choice.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => match o.get("name").and_then(Value::as_str) {
            Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
            None => Err(invalid("tool_choice.name", "a function tool_choice needs a name")),
        },
        _ => Err(invalid("tool_choice", "tool_choice must be none, auto, required or {\"type\":\"function\",\"name\":...}")),
    }
}

fn map_text_format(text: &Value) -> Result<Option<Value>, InvalidRequest> {
    let Some(format) = text.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for field in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(field).filter(|v| !v.is_null()) {
                    schema.insert(field.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(invalid("text.format.type", "text.format.type must be text, json_object or json_schema")),
    }
}

fn opt_bool(v: Option<&Value>, field: &str) -> Result<Option<bool>, InvalidRequest> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(field, format!("{field} must be a boolean"))),
    }
}

fn opt_str<'a>(v: Option<&'a Value>, field: &str) -> Result<Option<&'a str>, InvalidRequest> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(field, format!("{field} must be a string"))),
    }
}
