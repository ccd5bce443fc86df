//! Images in a chat request, for EPD (docs/protocols.md §8): OpenAI `image_url` content parts
//! in prompt order, which is the order the engine numbers them (`item_index`), and what the
//! gateway sends the encode worker and the prefill about them.
//!
//! Only `data:` URLs are taken here: the gateway first fetches remote images from
//! `--allowed-media-domains` hosts into `data:` URLs, and refuses any other remote URL before any
//! leg is sent. The reference engine fetches nothing either.

use serde_json::{json, Map, Value};

/// Why an `image_url` part cannot go to an encode worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageUrlError {
    /// `image_url` (or its `url`) is not a non-empty string.
    NotAString { index: usize },
    /// An `http(s)://` or other non-`data:` URL.
    Remote { index: usize },
    /// A `data:` URL that is not `data:image/...;base64,...`.
    NotBase64Image { index: usize },
}

impl std::fmt::Display for ImageUrlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageUrlError::NotAString { index } => write!(f, "image {index}: image_url.url must be a non-empty string"),
            ImageUrlError::Remote { index } => {
                write!(f, "image {index}: only data: URLs are accepted for images (data:image/png;base64,...); the gateway fetches remote images only from the hosts in --allowed-media-domains")
            }
            ImageUrlError::NotBase64Image { index } => write!(f, "image {index}: an image data URL must be data:image/...;base64,..."),
        }
    }
}

/// The URL of every `image_url` part of the body's `messages`, in prompt order (`None` where a
/// part's URL is not a string). Both spellings: `{"image_url": {"url": U}}` and `{"image_url": U}`.
pub fn image_urls(body: &Map<String, Value>) -> Vec<Option<&str>> {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else { return Vec::new() };
    messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|p| p.get("type").and_then(Value::as_str) == Some("image_url"))
        .map(|p| match p.get("image_url") {
            Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
            Some(Value::String(s)) => Some(s.as_str()),
            _ => None,
        })
        .collect()
}

/// Puts `urls[i]` in place of the URL of image `i` (the numbering of [`image_urls`]), in either
/// spelling of the part; images not in `urls` are left as they are.
pub fn replace_image_urls(body: &mut Map<String, Value>, mut urls: std::collections::HashMap<usize, String>) {
    let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else { return };
    let parts =
        messages.iter_mut().filter_map(|m| m.get_mut("content").and_then(Value::as_array_mut)).flatten().filter(|p| p.get("type").and_then(Value::as_str) == Some("image_url"));
    for (i, part) in parts.enumerate() {
        let Some(url) = urls.remove(&i) else { continue };
        match part.get_mut("image_url") {
            Some(Value::Object(o)) => {
                o.insert("url".into(), Value::String(url));
            }
            Some(slot) => *slot = Value::String(url),
            None => {}
        }
    }
}

/// The base64 text of image `index`'s `data:image/...;base64,` URL.
pub fn data_url_base64(url: Option<&str>, index: usize) -> Result<&str, ImageUrlError> {
    let url = url.filter(|u| !u.is_empty()).ok_or(ImageUrlError::NotAString { index })?;
    let rest = url.strip_prefix("data:").ok_or(ImageUrlError::Remote { index })?;
    let (head, b64) = rest.split_once(',').ok_or(ImageUrlError::NotBase64Image { index })?;
    let mime = head.split(';').next().unwrap_or_default();
    if !head.split(';').skip(1).any(|p| p == "base64") || !(mime.is_empty() || mime.starts_with("image/")) {
        return Err(ImageUrlError::NotBase64Image { index });
    }
    Ok(b64)
}

/// Where one image's embedding waits: the encode worker's bootstrap server and the room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodeItem {
    pub item_index: usize,
    pub bootstrap_host: String,
    pub bootstrap_port: u16,
    pub bootstrap_room: u64,
}

/// The prefill's `encode_bootstrap_info` (TokenSpeed's `EncodeItemBootstrapInfo`, as JSON).
pub fn encode_bootstrap_info(items: &[EncodeItem]) -> Value {
    let items: Vec<Value> = items
        .iter()
        .map(|i| json!({"item_index": i.item_index, "bootstrap_host": i.bootstrap_host, "bootstrap_port": i.bootstrap_port, "bootstrap_room": i.bootstrap_room}))
        .collect();
    json!({ "items": items })
}

/// The encode worker's `POST /encode` body for one image: SGLang's names (`req_id`,
/// `mm_items`) plus TokenSpeed's room assignment (`items`), one item per call as SMG sends.
pub fn encode_body(req_id: &str, url: &str, room: u64) -> Map<String, Value> {
    let mut body = Map::new();
    body.insert("req_id".into(), Value::from(req_id));
    body.insert("mm_items".into(), json!([url]));
    body.insert("items".into(), json!([{ "bootstrap_room": room }]));
    body
}

/// vLLM's encoder call for one image: a chat completion of that image alone (no text), one
/// token, not streamed, under the request's model (vLLM's `disagg_epd_proxy.py`; the encoder
/// answers once the embedding is stored for the prefill's encoder-cache connector).
pub fn vllm_encode_body(model: Option<&Value>, url: &str) -> Map<String, Value> {
    let mut body = Map::new();
    if let Some(m) = model {
        body.insert("model".into(), m.clone());
    }
    body.insert("messages".into(), json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]));
    body.insert("max_tokens".into(), Value::from(1));
    body.insert("stream".into(), Value::Bool(false));
    body
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn images_in_prompt_order_across_messages_both_spellings() {
        let b = body(json!({"messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": "data:image/jpeg;base64,BB=="}, {"type": "image_url", "image_url": {"detail": "low"}}]},
        ]}));
        assert_eq!(image_urls(&b), vec![Some("data:image/png;base64,AA=="), Some("data:image/jpeg;base64,BB=="), None]);
        assert!(image_urls(&body(json!({"prompt": "x"}))).is_empty());
    }

    #[test]
    fn only_base64_image_data_urls() {
        assert_eq!(data_url_base64(Some("data:image/png;base64,AA=="), 0), Ok("AA=="));
        assert_eq!(data_url_base64(Some("https://example.com/cat.png"), 1), Err(ImageUrlError::Remote { index: 1 }));
        assert_eq!(data_url_base64(Some("data:text/plain;base64,aGk="), 0), Err(ImageUrlError::NotBase64Image { index: 0 }));
        assert_eq!(data_url_base64(Some("data:image/png,rawbytes"), 0), Err(ImageUrlError::NotBase64Image { index: 0 }));
        assert_eq!(data_url_base64(None, 2), Err(ImageUrlError::NotAString { index: 2 }));
        assert!(ImageUrlError::Remote { index: 0 }.to_string().contains("--allowed-media-domains"));
    }

    #[test]
    fn the_legs_fields() {
        let info = encode_bootstrap_info(&[EncodeItem { item_index: 0, bootstrap_host: "e".into(), bootstrap_port: 8990, bootstrap_room: 7 }]);
        assert_eq!(info, json!({"items": [{"item_index": 0, "bootstrap_host": "e", "bootstrap_port": 8990, "bootstrap_room": 7}]}));
        let b = encode_body("encode-r-0", "data:image/png;base64,AA==", 7);
        assert_eq!(Value::Object(b), json!({"req_id": "encode-r-0", "mm_items": ["data:image/png;base64,AA=="], "items": [{"bootstrap_room": 7}]}));
    }

    #[test]
    fn replaced_urls_keep_the_numbering_and_the_spelling() {
        let mut body = json!({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://a", "detail": "low"}}, {"type": "text", "text": "x"}]},
            {"role": "user", "content": "plain"},
            {"role": "user", "content": [{"type": "image_url", "image_url": "http://b"}, {"type": "image_url", "image_url": {"url": "http://c"}}]}
        ]})
        .as_object()
        .unwrap()
        .clone();
        replace_image_urls(&mut body, [(0, "data:a".to_string()), (1, "data:b".to_string())].into_iter().collect());
        assert_eq!(image_urls(&body), vec![Some("data:a"), Some("data:b"), Some("http://c")]);
        assert_eq!(body["messages"][0]["content"][0]["image_url"]["detail"], "low", "the part's other fields stay");
    }
}
