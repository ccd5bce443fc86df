//! Which prefill may hand its KV to which decode.
//!
//! Every worker has a [`PairingKey`]: its runtime (sglang, vllm, pdgate-reference), its KV
//! transport (the connector) and its KV layout, each part `None` while unknown. The transport
//! must always match, in every mode: the PD protocol the gateway speaks is chosen by it, so a
//! bootstrap prefill and a NIXL decode cannot be driven as one request. Beyond that:
//!
//! - `off`: the transport only.
//! - `lenient` (default): a *known* difference in runtime or KV layout refuses the pair; an
//!   unknown part (not yet read from `/server_info`) is given the benefit of the doubt. So does
//!   an engine that reports the opposite role (a prefill whose engine says it is a KV consumer).
//! - `strict`: an unknown runtime, page size or KV dtype refuses too. The attention backend
//!   is compared only when both sides report one: vLLM's HTTP surface never does, and an
//!   engine that picks it automatically reports none.
//!
//! Compatibility is decided per class of equal keys, once per snapshot build, so a fleet of
//! thousands of workers with a handful of distinct keys costs a handful of comparisons.

use std::collections::HashMap;
use std::fmt;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::worker::{KvConnector, WorkerRole, WorkerSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PairingMode {
    Off,
    #[default]
    Lenient,
    Strict,
}

/// How a worker lays out its KV cache, as far as it is known.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct KvLayout {
    /// Tokens per KV page (SGLang `page_size`, vLLM `block_size`).
    pub page_size: Option<u32>,
    /// KV cache dtype, e.g. `bfloat16`, `fp8_e4m3`.
    pub kv_dtype: Option<String>,
    /// Tensor-parallel size. Shown, not compared: the engines' transfer backends map between
    /// different TP sizes themselves.
    pub tp_size: Option<u32>,
    /// The attention backend (vLLM gRPC `GetServerInfo.attention_backend`, SGLang's
    /// `attention_backend`): part of vLLM's NIXL compatibility hash.
    pub attention_backend: Option<String>,
}

/// The part of a worker that decides whom it can pair with; shown in `GET /workers`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct PairingKey {
    /// Lower-cased runtime name, e.g. `sglang`, `vllm`, `pdgate-reference`.
    pub runtime: Option<String>,
    pub transport: KvConnector,
    pub kv_layout: KvLayout,
    /// The role the engine itself reports (vLLM's `kv_role`, SGLang's `disaggregation_mode`),
    /// which may contradict the role the worker was registered with.
    pub reported_role: Option<WorkerRole>,
}

impl PairingKey {
    pub fn of(spec: &WorkerSpec, default_connector: KvConnector) -> Self {
        let mut kv_layout = spec.kv_layout.clone();
        kv_layout.kv_dtype = kv_layout.kv_dtype.map(|d| d.to_ascii_lowercase());
        PairingKey { runtime: spec.runtime.as_ref().map(|r| r.to_ascii_lowercase()), transport: spec.connector(default_connector), kv_layout, reported_role: spec.reported_role }
    }

    /// What stops prefill `self` from pairing with decode `decode` under `mode` (empty: none).
    pub fn mismatches(&self, decode: &PairingKey, mode: PairingMode) -> Vec<Mismatch> {
        let mut out = Vec::new();
        if self.transport != decode.transport {
            out.push(Mismatch::new("transport", Some(self.transport.as_str()), Some(decode.transport.as_str())));
        }
        if mode == PairingMode::Off {
            return out;
        }
        // An engine that says it is the other side of the handoff cannot take this one's.
        let (pr, dr) = (self.reported_role, decode.reported_role);
        if pr == Some(WorkerRole::Decode) || dr == Some(WorkerRole::Prefill) {
            out.push(Mismatch::new("reported role", pr.map(WorkerRole::as_str), dr.map(WorkerRole::as_str)));
        }
        let (p, d) = (&self.kv_layout, &decode.kv_layout);
        if let (Some(a), Some(b)) = (&p.attention_backend, &d.attention_backend) {
            if a != b {
                out.push(Mismatch::new("attention backend", Some(a), Some(b)));
            }
        }
        let page = |l: &KvLayout| l.page_size.map(|v| v.to_string());
        let parts =
            [("runtime", self.runtime.clone(), decode.runtime.clone()), ("KV layout page_size", page(p), page(d)), ("KV layout kv_dtype", p.kv_dtype.clone(), d.kv_dtype.clone())];
        for (what, a, b) in parts {
            let refuses = match (&a, &b) {
                (Some(a), Some(b)) => a != b,
                _ => mode == PairingMode::Strict,
            };
            if refuses {
                out.push(Mismatch { what, prefill: a, decode: b });
            }
        }
        out
    }

    pub fn compatible(&self, decode: &PairingKey, mode: PairingMode) -> bool {
        self.mismatches(decode, mode).is_empty()
    }
}

/// One reason a prefill and a decode cannot pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// `transport`, `reported role`, `attention backend`, `runtime`, `KV layout page_size`,
    /// `KV layout kv_dtype`.
    pub what: &'static str,
    pub prefill: Option<String>,
    pub decode: Option<String>,
}

impl Mismatch {
    fn new(what: &'static str, prefill: Option<&str>, decode: Option<&str>) -> Self {
        Mismatch { what, prefill: prefill.map(str::to_string), decode: decode.map(str::to_string) }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".into());
        if self.what == "reported role" {
            return write!(f, "an engine reports the other role: the prefill's engine says {}, the decode's {}", show(&self.prefill), show(&self.decode));
        }
        let verb = if self.prefill.is_some() && self.decode.is_some() { "differs" } else { "unknown (strict pairing)" };
        write!(f, "{} {verb}: prefill {}, decode {}", self.what, show(&self.prefill), show(&self.decode))
    }
}

/// The prefill → compatible decodes index of one snapshot.
#[derive(Clone, Debug, Default)]
pub(crate) struct PairingIndex {
    /// Per worker index: its prefill class, or `NONE` for workers that are not eligible prefills.
    prefill_class: Vec<u32>,
    /// Per prefill class: the compatible eligible decodes, ascending.
    class_decodes: Vec<Vec<usize>>,
    /// Eligible prefills that have at least one compatible eligible decode, ascending.
    pub(crate) pairable_prefill: Vec<usize>,
}

const NONE: u32 = u32::MAX;

impl PairingIndex {
    /// `keys` holds every worker's key; `prefills`/`decodes` the eligible ones, ascending.
    pub(crate) fn build(keys: &[PairingKey], prefills: &[usize], decodes: &[usize], mode: PairingMode) -> Self {
        let mut decode_classes: Vec<(&PairingKey, Vec<usize>)> = Vec::new();
        let mut decode_class_of: HashMap<&PairingKey, usize> = HashMap::new();
        for &d in decodes {
            let c = *decode_class_of.entry(&keys[d]).or_insert_with(|| {
                decode_classes.push((&keys[d], Vec::new()));
                decode_classes.len() - 1
            });
            decode_classes[c].1.push(d);
        }
        let mut index = PairingIndex { prefill_class: vec![NONE; keys.len()], ..Default::default() };
        let mut prefill_class_of: HashMap<&PairingKey, u32> = HashMap::new();
        for &p in prefills {
            let class = *prefill_class_of.entry(&keys[p]).or_insert_with(|| {
                let mut compatible: Vec<usize> = decode_classes.iter().filter(|(dk, _)| keys[p].compatible(dk, mode)).flat_map(|(_, members)| members.iter().copied()).collect();
                compatible.sort_unstable();
                index.class_decodes.push(compatible);
                (index.class_decodes.len() - 1) as u32
            });
            index.prefill_class[p] = class;
            if !index.class_decodes[class as usize].is_empty() {
                index.pairable_prefill.push(p);
            }
        }
        index
    }

    pub(crate) fn compatible_decodes(&self, prefill: usize) -> &[usize] {
        match self.prefill_class.get(prefill) {
            Some(&c) if c != NONE => self.class_decodes.get(c as usize).map(Vec::as_slice).unwrap_or(&[]),
            _ => &[],
        }
    }
}

/// Why none of `prefills` pairs with any of `decodes`: every distinct mismatch, named.
pub(crate) fn gap_message(keys: &[PairingKey], prefills: &[usize], decodes: &[usize], mode: PairingMode) -> String {
    let distinct = |idx: &[usize]| {
        let mut v: Vec<&PairingKey> = Vec::new();
        for &i in idx {
            if !v.contains(&&keys[i]) {
                v.push(&keys[i]);
            }
        }
        v
    };
    let (ps, ds) = (distinct(prefills), distinct(decodes));
    let mut reasons: Vec<String> = Vec::new();
    for p in &ps {
        for d in &ds {
            for m in p.mismatches(d, mode) {
                let s = m.to_string();
                if !reasons.contains(&s) {
                    reasons.push(s);
                }
            }
        }
    }
    let names = |v: &[&PairingKey]| {
        let mut t: Vec<&str> = v.iter().map(|k| k.transport.as_str()).collect();
        t.sort_unstable();
        t.dedup();
        t.join(",")
    };
    format!(
        "no decode worker is compatible with any healthy prefill (pairing mode {}; prefill transports: [{}], decode transports: [{}]): {}",
        mode.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default(),
        names(&ps),
        names(&ds),
        if reasons.is_empty() { "no eligible workers".to_string() } else { reasons.join("; ") }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(runtime: Option<&str>, transport: KvConnector, page: Option<u32>, dtype: Option<&str>) -> PairingKey {
        PairingKey {
            runtime: runtime.map(str::to_string),
            transport,
            kv_layout: KvLayout { page_size: page, kv_dtype: dtype.map(str::to_string), ..KvLayout::default() },
            reported_role: None,
        }
    }

    /// GetServerInfo's pairing keys beyond the transport: the engine's own role and its
    /// attention backend refuse a pair when known and wrong; unknown ones never do.
    #[test]
    fn reported_role_and_attention_backend() {
        let base = key(Some("vllm"), KvConnector::Nixl, Some(16), Some("float32"));
        let with = |role: Option<WorkerRole>, backend: Option<&str>| {
            let mut k = base.clone();
            k.reported_role = role;
            k.kv_layout.attention_backend = backend.map(str::to_string);
            k
        };
        let (p, d) = (Some(WorkerRole::Prefill), Some(WorkerRole::Decode));
        for mode in [PairingMode::Lenient, PairingMode::Strict] {
            assert!(with(p, Some("flash")).compatible(&with(d, Some("flash")), mode));
            assert!(with(None, None).compatible(&with(None, Some("flash")), mode), "an unknown backend never refuses");
            assert!(!with(p, Some("flash")).compatible(&with(d, Some("flashinfer")), mode));
            assert!(!with(d, None).compatible(&with(d, None), mode), "a prefill whose engine is a KV consumer");
            assert!(!with(p, None).compatible(&with(p, None), mode), "a decode whose engine is a KV producer");
        }
        assert!(with(d, Some("a")).compatible(&with(p, Some("b")), PairingMode::Off));
        let m = with(p, Some("flash")).mismatches(&with(p, Some("xformers")), PairingMode::Lenient);
        let text: Vec<String> = m.iter().map(|m| m.to_string()).collect();
        assert_eq!(
            text,
            ["an engine reports the other role: the prefill's engine says prefill, the decode's prefill", "attention backend differs: prefill flash, decode xformers"]
        );
    }

    /// The pairing modes on a table of keys: (prefill, decode, off, lenient, strict).
    #[test]
    fn modes_on_a_table_of_keys() {
        use KvConnector::*;
        let full = key(Some("sglang"), Bootstrap, Some(16), Some("bf16"));
        let table = [
            (full.clone(), full.clone(), true, true, true),
            (full.clone(), key(Some("sglang"), Nixl, Some(16), Some("bf16")), false, false, false),
            (full.clone(), key(Some("vllm"), Bootstrap, Some(16), Some("bf16")), true, false, false),
            (full.clone(), key(None, Bootstrap, Some(16), Some("bf16")), true, true, false),
            (full.clone(), key(Some("sglang"), Bootstrap, Some(64), Some("bf16")), true, false, false),
            (full.clone(), key(Some("sglang"), Bootstrap, None, None), true, true, false),
            (full.clone(), key(Some("sglang"), Bootstrap, Some(16), Some("fp8")), true, false, false),
            (key(None, Nixl, None, None), key(None, Nixl, None, None), true, true, false),
        ];
        for (i, (p, d, off, lenient, strict)) in table.iter().enumerate() {
            assert_eq!(p.compatible(d, PairingMode::Off), *off, "row {i} off");
            assert_eq!(p.compatible(d, PairingMode::Lenient), *lenient, "row {i} lenient");
            assert_eq!(p.compatible(d, PairingMode::Strict), *strict, "row {i} strict");
        }
    }

    #[test]
    fn mismatch_messages_name_the_part() {
        let p = key(Some("sglang"), KvConnector::Bootstrap, Some(16), None);
        let d = key(Some("vllm"), KvConnector::Nixl, Some(64), None);
        let text: Vec<String> = p.mismatches(&d, PairingMode::Strict).iter().map(|m| m.to_string()).collect();
        assert_eq!(text[0], "transport differs: prefill bootstrap, decode nixl");
        assert_eq!(text[1], "runtime differs: prefill sglang, decode vllm");
        assert_eq!(text[2], "KV layout page_size differs: prefill 16, decode 64");
        assert_eq!(text[3], "KV layout kv_dtype unknown (strict pairing): prefill unknown, decode unknown");
    }

    #[test]
    fn index_groups_by_class() {
        use KvConnector::*;
        let keys = vec![
            key(Some("sglang"), Bootstrap, Some(16), None), // 0 prefill
            key(Some("vllm"), Bootstrap, None, None),       // 1 prefill
            key(Some("sglang"), Bootstrap, None, None),     // 2 decode
            key(Some("sglang"), Bootstrap, Some(16), None), // 3 decode
            key(Some("sglang"), Bootstrap, Some(32), None), // 4 decode
        ];
        let idx = PairingIndex::build(&keys, &[0, 1], &[2, 3, 4], PairingMode::Lenient);
        assert_eq!(idx.compatible_decodes(0), &[2, 3]);
        assert_eq!(idx.compatible_decodes(1), &[] as &[usize]);
        assert_eq!(idx.compatible_decodes(2), &[] as &[usize], "a decode is no prefill");
        assert_eq!(idx.pairable_prefill, vec![0]);
        let gap = gap_message(&keys, &[1], &[2, 3, 4], PairingMode::Lenient);
        assert!(gap.contains("runtime differs: prefill vllm, decode sglang"), "{gap}");
    }
}
