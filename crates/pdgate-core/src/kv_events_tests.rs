#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use super::*;

fn s(x: &str) -> Value {
    Value::from(x)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn ints(xs: &[u64]) -> Value {
    Value::Array(xs.iter().map(|x| Value::from(*x)).collect())
}

fn stored_map(hashes: &[u64], parent: Value, tokens: &[u64]) -> Value {
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(hashes)),
        ("parent_block_hash", parent),
        ("token_ids", ints(tokens)),
        ("block_size", Value::from(2)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
    ])
}

fn stored_array(hashes: &[u64], parent: Value, tokens: &[u64]) -> Value {
    Value::Array(vec![s("BlockStored"), ints(hashes), parent, ints(tokens), Value::from(2), Value::Nil, s("GPU")])
}

fn want_stored() -> KvEvent {
    KvEvent::BlockStored { block_hashes: vec![7, u64::MAX - 1], parent_block_hash: Some(3), token_ids: vec![1, 2, 3, 4], block_size: 2, medium: Some("GPU".into()) }
}

#[test]
fn both_event_encodings_decode_to_the_same_events() {
    let tagged = Value::Array(vec![
        Value::from(1.5),
        Value::Array(vec![
            stored_map(&[7, u64::MAX - 1], Value::from(3), &[1, 2, 3, 4]),
            map(vec![("type", s("BlockRemoved")), ("block_hashes", ints(&[7])), ("medium", s("GPU"))]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]),
        Value::from(0),
    ]);
    let positional = Value::Array(vec![
        Value::from(1.5),
        Value::Array(vec![
            stored_array(&[7, u64::MAX - 1], Value::from(3), &[1, 2, 3, 4]),
            Value::Array(vec![s("BlockRemoved"), ints(&[7]), s("GPU")]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
        Value::from(0),
    ]);
    let a = decode_batch(&encode(&tagged)).unwrap();
    let b = decode_batch(&encode(&positional)).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.undecodable, 0);
    assert_eq!(a.ts, 1.5);
    assert_eq!(a.data_parallel_rank, Some(0));
    assert_eq!(a.events, vec![want_stored(), KvEvent::BlockRemoved { block_hashes: vec![7], medium: Some("GPU".into()) }, KvEvent::AllBlocksCleared]);
}

#[test]
fn a_batch_encoded_as_a_map_decodes_too() {
    let batch = map(vec![("ts", Value::from(2)), ("events", Value::Array(vec![map(vec![("type", s("AllBlocksCleared"))])]))]);
    let d = decode_batch(&encode(&batch)).unwrap();
    assert_eq!((d.ts, d.events, d.data_parallel_rank), (2.0, vec![KvEvent::AllBlocksCleared], None));
}

#[test]
fn signed_unsigned_and_digest_hashes_agree_on_the_bits() {
    assert_eq!(hash(&Value::from(-2i64)), Some(u64::MAX - 1));
    assert_eq!(hash(&Value::from(u64::MAX - 1)), Some(u64::MAX - 1));
    let digest: Vec<u8> = (0..32).collect();
    assert_eq!(hash(&Value::Binary(digest)), Some(u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])));
    assert_eq!(hash(&s("7")), None);
    let signed = stored_map(&[7], Value::from(-1i64), &[1, 2]);
    let Some(KvEvent::BlockStored { parent_block_hash, .. }) = decode_event(&signed) else { panic!("not decoded") };
    assert_eq!(parent_block_hash, Some(u64::MAX));
}

#[test]
fn undecodable_events_are_counted_not_dropped_silently() {
    let events = vec![
        map(vec![("type", s("BlockMoved"))]),                             // unknown type
        stored_map(&[7], Value::Nil, &[1, 2, 3]),                         // tokens do not fill the block
        map(vec![("type", s("BlockRemoved")), ("block_hashes", s("x"))]), // mistyped field
        Value::from(5),                                                   // not an event
        stored_map(&[7], Value::Nil, &[1, 2]),                            // fine
    ];
    let d = decode_batch(&encode(&Value::Array(vec![Value::from(0.0), Value::Array(events)]))).unwrap();
    assert_eq!(d.undecodable, 4);
    assert_eq!(d.events.len(), 1);
}

#[test]
fn a_payload_that_is_no_batch_is_an_error() {
    assert!(matches!(decode_batch(&[]), Err(BatchError::NotMsgpack(_))));
    assert!(matches!(decode_batch(&[0x92, 0xcb]), Err(BatchError::NotMsgpack(_)))); // truncated
    assert_eq!(decode_batch(&encode(&Value::from(3))), Err(BatchError::NotABatch("neither an array nor a map")));
    assert_eq!(decode_batch(&encode(&Value::Array(vec![Value::from(1.0)]))), Err(BatchError::NotABatch("no event list")));
    assert_eq!(decode_batch(&encode(&Value::Array(vec![s("x"), Value::Array(vec![])]))), Err(BatchError::NotABatch("no timestamp")));
}
