//! Decoding of engine KV events (vLLM's `--kv-events-config` wire format; SGLang publishes the
//! same). Pure: bytes in, events out; the ZMQ subscription lives in the gateway.
//!
//! The payload of one PUB message is a msgpack batch `[ts, events, data_parallel_rank]` (or the
//! same as a map `{ts, events, data_parallel_rank}`). vLLM has shipped two encodings of the
//! events themselves, and both are decoded here, by field name:
//! - positional arrays tagged by their first element:
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
//!   `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
//! - maps tagged by `type`: `{"type": "BlockStored", "block_hashes": [...], ...}`.
//!
//! Block hashes arrive as unsigned or signed 64-bit integers (older vLLM used Python's signed
//! `hash()`), or as raw digests (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), which are folded to
//! their low 8 bytes as vLLM folds them. An event that cannot be decoded is counted in
//! [`DecodedBatch::undecodable`], never dropped silently; a payload that is not a batch at all is
//! an error.

use rmpv::Value;

/// One KV cache event, whatever encoding it came in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks the worker now holds: `block_hashes[i]` holds
    /// `token_ids[i * block_size .. (i + 1) * block_size]`; the first block's parent is
    /// `parent_block_hash` (None: the start of a sequence).
    BlockStored { block_hashes: Vec<u64>, parent_block_hash: Option<u64>, token_ids: Vec<u32>, block_size: u32, medium: Option<String> },
    /// Blocks the worker evicted.
    BlockRemoved { block_hashes: Vec<u64>, medium: Option<String> },
    /// The worker emptied its cache.
    AllBlocksCleared,
}

/// A decoded batch: its events in order, and how many could not be decoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodedBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
    pub undecodable: usize,
}

/// Why a payload is not a batch at all.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BatchError {
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(String),
    #[error("payload is not a KV event batch: {0}")]
    NotABatch(&'static str),
}

/// Decode one PUB message payload.
pub fn decode_batch(mut payload: &[u8]) -> Result<DecodedBatch, BatchError> {
    let value = rmpv::decode::read_value(&mut payload).map_err(|e| BatchError::NotMsgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (field(&value, "ts"), field(&value, "events"), field(&value, "data_parallel_rank")),
        _ => return Err(BatchError::NotABatch("neither an array nor a map")),
    };
    let ts = ts.and_then(number).ok_or(BatchError::NotABatch("no timestamp"))?;
    let Some(Value::Array(events)) = events else {
        return Err(BatchError::NotABatch("no event list"));
    };
    let mut out = DecodedBatch { ts, data_parallel_rank: rank.and_then(Value::as_i64), ..DecodedBatch::default() };
    for ev in events {
        match decode_event(ev) {
            Some(e) => out.events.push(e),
            None => out.undecodable += 1,
        }
    }
    Ok(out)
}

/// One event in either encoding; None when it is neither (unknown type, missing or mistyped
/// field).
pub fn decode_event(ev: &Value) -> Option<KvEvent> {
    match ev {
        Value::Map(_) => {
            let get = |name: &str| field(ev, name);
            build(field(ev, "type")?.as_str()?, &get)
        }
        Value::Array(items) => {
            let tag = items.first()?.as_str()?;
            let order: &[&str] = match tag {
                "BlockStored" => &["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"],
                "BlockRemoved" => &["block_hashes", "medium"],
                _ => &[],
            };
            let get = |name: &str| order.iter().position(|n| *n == name).and_then(|i| items.get(i + 1));
            build(tag, &get)
        }
        _ => None,
    }
}

fn build<'a>(tag: &str, get: &dyn Fn(&str) -> Option<&'a Value>) -> Option<KvEvent> {
    let medium = || get("medium").and_then(Value::as_str).map(str::to_owned);
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(get("block_hashes")?)?;
            let parent_block_hash = match get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(v) => Some(hash(v)?),
            };
            let token_ids = get("token_ids")?.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect::<Option<Vec<u32>>>()?;
            let block_size = u32::try_from(get("block_size")?.as_u64()?).ok().filter(|b| *b > 0)?;
            if token_ids.len() != block_hashes.len() * block_size as usize {
                return None; // tokens must fill exactly the stored blocks
            }
            Some(KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium: medium() })
        }
        "BlockRemoved" => Some(KvEvent::BlockRemoved { block_hashes: hashes(get("block_hashes")?)?, medium: medium() }),
        "AllBlocksCleared" => Some(KvEvent::AllBlocksCleared),
        _ => None,
    }
}

/// A block hash as the u64 both encodings agree on: unsigned as is, signed by its two's
/// complement bits, raw digests by their low 8 bytes (big-endian), as vLLM folds them.
pub fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte)))
        }
        _ => None,
    }
}

fn hashes(v: &Value) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(hash).collect()
}

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()?.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}

fn number(v: &Value) -> Option<f64> {
    v.as_f64().or_else(|| v.as_i64().map(|i| i as f64)).or_else(|| v.as_u64().map(|u| u as f64))
}

#[cfg(test)]
#[path = "kv_events_tests.rs"]
mod tests;
