//! `GET /v1/responses/{id}/input_items`: the items used to generate a kept response (the
//! earlier turns' items when it continued a `previous_response_id`, then its own input), in
//! OpenAI's list shape (`object: "list"`, `data`, `first_id`, `last_id`, `has_more`), paged by
//! `limit` (1-100, default 20), `order` (`asc` or `desc`, default `desc`: newest first, as
//! OpenAI) and the cursors `after` / `before` (an item id).
//!
//! Every kept item has an id: input items the client sent without one get one when the
//! response is kept ([`with_ids`]), so the cursors work.

use serde::Deserialize;
use serde_json::{json, Value};

use super::store::StoredResponse;

/// The query string.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    pub limit: Option<String>,
    pub order: Option<String>,
    pub after: Option<String>,
    pub before: Option<String>,
}

/// A query the API refuses: the parameter and why (a 400 `invalid_request_error`).
#[derive(Debug, PartialEq)]
pub struct BadQuery {
    pub param: &'static str,
    pub message: String,
}

/// The input items of `kept`: its conversation without its own output.
pub fn input_items(kept: &StoredResponse) -> &[Value] {
    &kept.input
}

/// This turn's input items as kept: each without an id gets `msg_<suffix>_in<i>` (a message) or
/// `item_<suffix>_in<i>`, `suffix` being the response id's. Takes the items (they are kept, not
/// copied).
pub fn with_ids(input: Vec<Value>, response_id: &str) -> Vec<Value> {
    let suffix = response_id.strip_prefix("resp_").unwrap_or(response_id);
    let mut input = input;
    for (i, item) in input.iter_mut().enumerate() {
        if let Some(obj) = item.as_object_mut().filter(|o| !o.contains_key("id")) {
            let is_message = obj.get("type").and_then(Value::as_str).is_none_or(|t| t == "message");
            let mut id = String::with_capacity(suffix.len() + 12);
            id.push_str(if is_message { "msg_" } else { "item_" });
            id.push_str(suffix);
            id.push_str("_in");
            let mut digits = Vec::with_capacity(4);
            pdgate_protocol::push_u64(&mut digits, i as u64);
            id.push_str(std::str::from_utf8(&digits).unwrap_or_default());
            obj.insert("id".into(), id.into());
        }
    }
    input
}

/// One page of `items` (oldest first) in OpenAI's list shape.
pub fn page(items: &[Value], q: &ListQuery) -> Result<Value, BadQuery> {
    let limit = match q.limit.as_deref() {
        None => 20,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=100).contains(&n) => n,
            _ => return Err(BadQuery { param: "limit", message: format!("Invalid 'limit': {s:?}. Expected an integer from 1 to 100.") }),
        },
    };
    let desc = match q.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(other) => return Err(BadQuery { param: "order", message: format!("Invalid 'order': {other:?}. Expected 'asc' or 'desc'.") }),
    };
    let mut ordered: Vec<&Value> = items.iter().collect();
    if desc {
        ordered.reverse();
    }
    let id_of = |v: &Value| v.get("id").and_then(Value::as_str).map(str::to_string);
    let position = |cursor: &str, param: &'static str| {
        ordered.iter().position(|v| id_of(v).as_deref() == Some(cursor)).ok_or_else(|| BadQuery { param, message: format!("No input item with id '{cursor}' in this response.") })
    };
    let start = match q.after.as_deref() {
        Some(a) => position(a, "after")? + 1,
        None => 0,
    };
    let end = match q.before.as_deref() {
        Some(b) => position(b, "before")?,
        None => ordered.len(),
    };
    let window = ordered.get(start..end.max(start)).unwrap_or(&[]);
    let data: Vec<Value> = window.iter().take(limit).map(|v| listed(v)).collect();
    let has_more = window.len() > data.len();
    let first_id = data.first().and_then(id_of);
    let last_id = data.last().and_then(id_of);
    Ok(json!({"object": "list", "data": data, "first_id": first_id, "last_id": last_id, "has_more": has_more}))
}

/// An item as OpenAI lists it: a message with `type`, `status` and its content as parts (a
/// string content as one `input_text` part, `output_text` for the assistant's).
fn listed(item: &Value) -> Value {
    let mut item = item.clone();
    let Some(obj) = item.as_object_mut() else { return item };
    let is_message = obj.get("type").and_then(Value::as_str).is_none_or(|t| t == "message") && obj.contains_key("role");
    if is_message {
        obj.insert("type".into(), "message".into());
        obj.entry("status").or_insert_with(|| "completed".into());
        let part = if obj.get("role").and_then(Value::as_str) == Some("assistant") { "output_text" } else { "input_text" };
        if let Some(Value::String(text)) = obj.get("content") {
            let parts = json!([{"type": part, "text": text}]);
            obj.insert("content".into(), parts);
        }
    }
    item
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items() -> Vec<Value> {
        with_ids(
            vec![
                json!({"type": "message", "role": "user", "content": "a"}),
                json!({"role": "user", "content": [{"type": "input_text", "text": "b"}]}),
                json!({"type": "function_call_output", "call_id": "c", "output": "o"}),
                json!({"type": "message", "role": "assistant", "content": "d", "id": "msg_kept"}),
            ],
            "resp_x",
        )
    }

    fn q(limit: Option<&str>, order: Option<&str>, after: Option<&str>, before: Option<&str>) -> ListQuery {
        let s = |v: Option<&str>| v.map(str::to_string);
        ListQuery { limit: s(limit), order: s(order), after: s(after), before: s(before) }
    }

    fn ids(page: &Value) -> Vec<&str> {
        page["data"].as_array().map(|d| d.iter().filter_map(|v| v["id"].as_str()).collect()).unwrap_or_default()
    }

    #[test]
    fn ids_are_minted_once_and_kept_ones_stay() {
        let items = items();
        assert_eq!(items.iter().map(|v| v["id"].as_str().unwrap_or("")).collect::<Vec<_>>(), ["msg_x_in0", "msg_x_in1", "item_x_in2", "msg_kept"]);
    }

    #[test]
    fn pages_newest_first_by_default_and_follow_the_cursors() {
        let items = items();
        let all = page(&items, &ListQuery::default()).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(ids(&all), ["msg_kept", "item_x_in2", "msg_x_in1", "msg_x_in0"]);
        assert_eq!(
            (all["object"].as_str(), all["first_id"].as_str(), all["last_id"].as_str(), all["has_more"].as_bool()),
            (Some("list"), Some("msg_kept"), Some("msg_x_in0"), Some(false))
        );
        let first = page(&items, &q(Some("2"), Some("asc"), None, None)).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((ids(&first), first["has_more"].as_bool()), (vec!["msg_x_in0", "msg_x_in1"], Some(true)));
        let next = page(&items, &q(Some("2"), Some("asc"), Some("msg_x_in1"), None)).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((ids(&next), next["has_more"].as_bool()), (vec!["item_x_in2", "msg_kept"], Some(false)));
        let before = page(&items, &q(None, Some("asc"), None, Some("item_x_in2"))).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(ids(&before), ["msg_x_in0", "msg_x_in1"]);
        let empty = page(&items, &q(None, Some("asc"), Some("msg_kept"), None)).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((empty["data"].as_array().map(Vec::len), empty["first_id"].is_null()), (Some(0), true));
    }

    #[test]
    fn messages_are_listed_with_content_parts() {
        let items = items();
        let all = page(&items, &q(None, Some("asc"), None, None)).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(all["data"][0], json!({"type": "message", "id": "msg_x_in0", "role": "user", "status": "completed", "content": [{"type": "input_text", "text": "a"}]}));
        assert_eq!(all["data"][3]["content"], json!([{"type": "output_text", "text": "d"}]));
        assert_eq!(all["data"][2], json!({"type": "function_call_output", "call_id": "c", "output": "o", "id": "item_x_in2"}));
    }

    #[test]
    fn a_bad_query_names_its_parameter() {
        let items = items();
        for (query, param) in [
            (q(Some("0"), None, None, None), "limit"),
            (q(Some("101"), None, None, None), "limit"),
            (q(None, Some("up"), None, None), "order"),
            (q(None, None, Some("nope"), None), "after"),
        ] {
            assert_eq!(page(&items, &query).err().map(|e| e.param), Some(param));
        }
    }

    #[test]
    fn the_input_items_are_the_conversation_without_the_output() {
        let response = br#"{"id":"r","output":[{"id":"out"}]}"#;
        let kept = StoredResponse { response: response[..].into(), output: 20..32, input: vec![json!({"id": "a"}), json!({"id": "b"})] };
        assert_eq!(input_items(&kept), &[json!({"id": "a"}), json!({"id": "b"})]);
        assert_eq!(kept.items(), vec![json!({"id": "a"}), json!({"id": "b"}), json!({"id": "out"})], "the next turn's conversation ends with the output");
    }
}
