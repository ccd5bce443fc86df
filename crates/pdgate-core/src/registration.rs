//! One worker registration, declared once.
//!
//! Every source of workers gives the same facts: the static flags (`--prefill URL [PORT]
//! [kv_connector=NAME] [kv_engine_id=ID] [label=K=V]...`), the JSON config, the `/workers` API
//! (and so the Python `add_worker` keywords and `quickstart`) and Kubernetes pod annotations.
//! Each parses into a [`WorkerRegistration`], and [`WorkerRegistration::into_spec`] is the one
//! place that checks it and builds the [`WorkerSpec`], with one error text per mistake.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::worker::{KvConnector, WorkerRole, WorkerSpec};

/// What a source says about one worker: the SMG `/workers` body, field for field.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRegistration {
    pub url: String,
    /// `regular`, `prefill`, `decode` or `encode` (EPD); required in PD mode, `regular` otherwise.
    #[serde(default)]
    pub worker_type: Option<String>,
    /// Prefill and encode only: its bootstrap server's port (`None`: the engine's default).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Overrides the gateway-wide connector (our names or the engines' class names).
    #[serde(default)]
    pub kv_connector: Option<String>,
    /// Mooncake prefill: its engine id, known in advance (else asked from its `/query`).
    #[serde(default)]
    pub kv_engine_id: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The engine's KV event publisher (`tcp://host:port`, a ZMQ PUB), e.g. vLLM's
    /// `--kv-events-config` `endpoint` as seen from the gateway.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay socket (ROUTER, `replay_endpoint`); without one a sequence gap resets the
    /// worker's view instead of being replayed.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
}

/// A registration that cannot be a worker: which field, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistrationError {
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for RegistrationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn bad(param: &'static str, message: impl Into<String>) -> RegistrationError {
    RegistrationError { param, message: message.into() }
}

impl WorkerRegistration {
    /// A registration with a known role (static flags and discovery know it from where the
    /// worker was given).
    pub fn new(url: impl Into<String>, role: WorkerRole) -> Self {
        WorkerRegistration { url: url.into(), worker_type: Some(role.as_str().to_string()), ..Default::default() }
    }

    /// The role asked for, checked against the gateway's mode (`pd`).
    pub fn role(&self, pd: bool) -> Result<WorkerRole, RegistrationError> {
        let role = match self.worker_type.as_deref().unwrap_or(if pd { "" } else { "regular" }) {
            "regular" => WorkerRole::Regular,
            "prefill" => WorkerRole::Prefill,
            "decode" => WorkerRole::Decode,
            "encode" => WorkerRole::Encode,
            "" => return Err(bad("worker_type", "worker_type is required in PD mode: prefill or decode")),
            other => return Err(bad("worker_type", format!("unknown worker_type {other:?}: regular, prefill, decode or encode"))),
        };
        match (pd, role) {
            (true, WorkerRole::Regular) => Err(bad("worker_type", "this gateway runs in PD mode: add prefill or decode workers")),
            (false, WorkerRole::Prefill | WorkerRole::Decode | WorkerRole::Encode) => Err(bad("worker_type", "this gateway runs in regular mode: add regular workers")),
            _ => Ok(role),
        }
    }

    /// Checks the registration and builds the worker's spec.
    pub fn into_spec(self, pd: bool) -> Result<WorkerSpec, RegistrationError> {
        let role = self.role(pd)?;
        let mut spec = WorkerSpec::new(&self.url, role).map_err(|m| bad("url", m))?;
        if role == WorkerRole::Encode && spec.is_grpc() {
            return Err(bad(
                "url",
                format!("encode worker {}: gRPC encode workers (TokenSpeedEncoder.Encode) are not built yet; give an http:// encode worker that serves POST /encode", spec.url),
            ));
        }
        if role == WorkerRole::Encode {
            if let Some(param) = [("kv_connector", self.kv_connector.is_some()), ("kv_events", self.kv_events.is_some())].into_iter().find_map(|(p, given)| given.then_some(p)) {
                return Err(bad(param, format!("encode workers hold no KV: {param} is for prefill, decode and regular workers")));
            }
        }
        if self.bootstrap_port.is_some() && !role.has_bootstrap_server() {
            return Err(bad("bootstrap_port", "bootstrap_port is for prefill and encode workers"));
        }
        if self.bootstrap_port == Some(0) {
            return Err(bad("bootstrap_port", "bootstrap_port must be 1-65535"));
        }
        if self.kv_engine_id.is_some() && role != WorkerRole::Prefill {
            return Err(bad("kv_engine_id", "kv_engine_id is for prefill workers (the engine a decode pulls from)"));
        }
        if self.kv_engine_id.as_deref().is_some_and(str::is_empty) {
            return Err(bad("kv_engine_id", "kv_engine_id must not be empty"));
        }
        if let Some(key) = self.labels.keys().find(|k| k.trim().is_empty()) {
            return Err(bad("labels", format!("label key {key:?} is empty")));
        }
        if self.kv_events_replay.is_some() && self.kv_events.is_none() {
            return Err(bad("kv_events_replay", "kv_events_replay needs kv_events (the publisher it replays)"));
        }
        spec.kv_events = self.kv_events.as_deref().map(kv_events_endpoint).transpose().map_err(|m| bad("kv_events", m))?;
        spec.kv_events_replay = self.kv_events_replay.as_deref().map(kv_events_endpoint).transpose().map_err(|m| bad("kv_events_replay", m))?;
        spec.bootstrap_port = self.bootstrap_port;
        spec.kv_connector = self.kv_connector.as_deref().map(KvConnector::parse).transpose().map_err(|m| bad("kv_connector", m))?;
        spec.kv_engine_id = self.kv_engine_id;
        spec.labels = self.labels;
        Ok(spec)
    }
}

/// The command-line form of one `--prefill` / `--decode` / `--encode`: `URL [PORT]
/// [kv_connector=NAME] [kv_engine_id=ID] [label=K=V]...` (a port only for a prefill or an
/// encode worker, right after the URL; `none` for the engine default).
pub fn from_tokens(tokens: &[String], role: WorkerRole) -> Result<WorkerRegistration, String> {
    let flag = if role == WorkerRole::Regular { "worker-urls" } else { role.as_str() };
    let (url, rest) = tokens.split_first().ok_or_else(|| format!("--{flag} needs a URL"))?;
    let mut reg = WorkerRegistration::new(url.clone(), role);
    for (i, token) in rest.iter().enumerate() {
        if let Some(name) = token.strip_prefix("kv_connector=") {
            reg.kv_connector = Some(KvConnector::parse(name)?.as_str().to_string());
        } else if let Some(id) = token.strip_prefix("kv_engine_id=") {
            reg.kv_engine_id = Some(id.to_string());
        } else if let Some(ep) = token.strip_prefix("kv_events=") {
            reg.kv_events = Some(ep.to_string());
        } else if let Some(ep) = token.strip_prefix("kv_events_replay=") {
            reg.kv_events_replay = Some(ep.to_string());
        } else if let Some(kv) = token.strip_prefix("label=") {
            let (k, v) = parse_label(kv).ok_or_else(|| format!("label {kv:?} after {flag} {url}: expected label=KEY=VALUE"))?;
            reg.labels.insert(k.to_string(), v.to_string());
        } else if i == 0 && role.has_bootstrap_server() {
            reg.bootstrap_port = parse_port(token)?;
        } else {
            return Err(format!("unexpected token {token:?} after {flag} {url}"));
        }
    }
    Ok(reg)
}

/// `--worker-urls` as workers: each URL with the tokens after it that are a worker's fields
/// (`kv_connector=`, `kv_engine_id=`, `kv_events=`, `kv_events_replay=`, `label=`), as a
/// `--decode` takes them. Any other token starts the next worker, so `--worker-urls A B` is two.
pub fn worker_url_groups(tokens: &[String]) -> Result<Vec<&[String]>, String> {
    const FIELDS: [&str; 5] = ["kv_connector=", "kv_engine_id=", "kv_events=", "kv_events_replay=", "label="];
    let mut groups: Vec<&[String]> = Vec::new();
    let mut start = None;
    for (i, token) in tokens.iter().enumerate() {
        if FIELDS.iter().any(|f| token.starts_with(f)) {
            if start.is_none() {
                return Err(format!("--worker-urls: {token:?} comes before any worker URL"));
            }
            continue;
        }
        if let Some(s) = start {
            groups.push(&tokens[s..i]);
        }
        start = Some(i);
    }
    if let Some(s) = start {
        groups.push(&tokens[s..]);
    }
    Ok(groups)
}

/// One `KEY=VALUE` label (a worker's `label=K=V`, a discovery selector); `None` when
/// malformed (no `=` or an empty key).
pub fn parse_label(kv: &str) -> Option<(&str, &str)> {
    let (k, v) = kv.split_once('=')?;
    let k = k.trim();
    (!k.is_empty() && !v.contains('=')).then_some((k, v.trim()))
}

/// A KV event endpoint the gateway connects to: `tcp://host:port`, a concrete host (the
/// engine binds `tcp://*:port`; the gateway needs an address it can reach).
pub fn kv_events_endpoint(ep: &str) -> Result<String, String> {
    let rest = ep.strip_prefix("tcp://").ok_or_else(|| format!("KV events endpoint {ep:?} must be tcp://host:port"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("KV events endpoint {ep:?} has no port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host == "*" || host.contains('/') {
        return Err(format!("KV events endpoint {ep:?} needs the host the gateway connects to (not * or empty)"));
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("KV events endpoint {ep:?}: port must be 1-65535")),
        Ok(_) => Ok(ep.to_string()),
    }
}

fn parse_port(token: &str) -> Result<Option<u16>, String> {
    if token.eq_ignore_ascii_case("none") || token.eq_ignore_ascii_case("null") {
        return Ok(None);
    }
    match token.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("invalid bootstrap port {token:?} (expected 1-65535 or none)")),
        Ok(p) => Ok(Some(p)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tokens(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    /// Issue 28: `--worker-urls` takes a worker's fields after its URL, as `--decode` does.
    #[test]
    fn worker_urls_group_each_url_with_its_fields() {
        let t = tokens(&["http://a:1", "kv_events=tcp://a:5557", "label=zone=x", "label=gpu=h100", "http://b:1", "http://c:1", "kv_connector=nixl"]);
        let groups = worker_url_groups(&t).unwrap();
        assert_eq!(groups, vec![&t[0..4], &t[4..5], &t[5..7]]);
        let a = from_tokens(groups[0], WorkerRole::Regular).unwrap().into_spec(false).unwrap();
        assert_eq!(a.kv_events.as_deref(), Some("tcp://a:5557"));
        assert_eq!((a.labels.get("zone").map(String::as_str), a.labels.get("gpu").map(String::as_str)), (Some("x"), Some("h100")));
        assert_eq!(from_tokens(groups[2], WorkerRole::Regular).unwrap().into_spec(false).unwrap().kv_connector, Some(KvConnector::Nixl));
        // Plain URLs stay one worker each; a field before any URL is refused.
        assert_eq!(worker_url_groups(&tokens(&["http://a:1", "http://b:1"])).unwrap().len(), 2);
        assert!(worker_url_groups(&tokens(&["label=zone=x", "http://a:1"])).unwrap_err().contains("before any worker URL"));
        assert!(worker_url_groups(&[]).unwrap().is_empty());
    }

    #[test]
    fn every_fact_of_a_worker_from_the_command_line() {
        let reg = from_tokens(&tokens(&["http://p:1", "9000", "kv_connector=MooncakeConnector", "kv_engine_id=e1", "label=zone=a"]), WorkerRole::Prefill).unwrap();
        let spec = reg.into_spec(true).unwrap();
        assert_eq!((spec.bootstrap_port, spec.kv_connector), (Some(9000), Some(KvConnector::Mooncake)));
        assert_eq!(spec.kv_engine_id.as_deref(), Some("e1"));
        assert_eq!(spec.labels.get("zone").map(String::as_str), Some("a"));
        let d = from_tokens(&tokens(&["http://d:1", "label=zone=b", "kv_connector=nixl"]), WorkerRole::Decode).unwrap().into_spec(true).unwrap();
        assert_eq!((d.role, d.kv_connector), (WorkerRole::Decode, Some(KvConnector::Nixl)));
        assert!(from_tokens(&tokens(&["http://d:1", "9000"]), WorkerRole::Decode).is_err(), "a decode has no bootstrap port");
        assert!(from_tokens(&tokens(&["http://d:1", "label=novalue"]), WorkerRole::Decode).is_err());
    }

    /// EPD: `--encode URL BOOTSTRAP_PORT`, as SMG's command line gives it.
    #[test]
    fn an_encode_worker_from_flags_and_json() {
        let flags = from_tokens(&tokens(&["http://e:30010", "8990", "label=zone=a"]), WorkerRole::Encode).unwrap();
        let spec = flags.clone().into_spec(true).unwrap();
        assert_eq!((spec.role, spec.bootstrap_port, spec.host.as_str()), (WorkerRole::Encode, Some(8990), "e"));
        let json: WorkerRegistration = serde_json::from_str(r#"{"url": "http://e:30010", "worker_type": "encode", "bootstrap_port": 8990, "labels": {"zone": "a"}}"#).unwrap();
        assert_eq!(json.into_spec(true).unwrap(), spec);
        assert!(from_tokens(&tokens(&["http://e:1", "none"]), WorkerRole::Encode).unwrap().bootstrap_port.is_none());
    }

    #[test]
    fn the_api_body_and_the_flags_agree() {
        let json: WorkerRegistration = serde_json::from_str(
            r#"{"url": "http://p:1", "worker_type": "prefill", "bootstrap_port": 9000, "kv_connector": "mooncake", "kv_engine_id": "e1", "labels": {"zone": "a"}}"#,
        )
        .unwrap();
        let flags = from_tokens(&tokens(&["http://p:1", "9000", "kv_connector=mooncake", "kv_engine_id=e1", "label=zone=a"]), WorkerRole::Prefill).unwrap();
        assert_eq!(json.into_spec(true).unwrap(), flags.into_spec(true).unwrap());
    }

    #[test]
    fn kv_events_endpoints_from_flags_and_json() {
        let flags = from_tokens(&tokens(&["http://p:1", "kv_events=tcp://p:5557", "kv_events_replay=tcp://p:5558"]), WorkerRole::Prefill).unwrap();
        assert_eq!(flags.bootstrap_port, None, "kv_events= is not taken for a port");
        let json: WorkerRegistration =
            serde_json::from_str(r#"{"url": "http://p:1", "worker_type": "prefill", "kv_events": "tcp://p:5557", "kv_events_replay": "tcp://p:5558"}"#).unwrap();
        let spec = flags.into_spec(true).unwrap();
        assert_eq!((spec.kv_events.as_deref(), spec.kv_events_replay.as_deref()), (Some("tcp://p:5557"), Some("tcp://p:5558")));
        assert_eq!(json.into_spec(true).unwrap(), spec);
        assert_eq!(kv_events_endpoint("tcp://[::1]:5557").unwrap(), "tcp://[::1]:5557");
    }

    #[test]
    fn mistakes_name_their_field() {
        let reg = |json: &str| serde_json::from_str::<WorkerRegistration>(json).unwrap();
        let cases = [
            (r#"{"url": "http://w:1"}"#, true, "worker_type"),
            (r#"{"url": "http://w:1", "worker_type": "regular"}"#, true, "worker_type"),
            (r#"{"url": "http://w:1", "worker_type": "prefill"}"#, false, "worker_type"),
            (r#"{"url": "ftp://w:1", "worker_type": "decode"}"#, true, "url"),
            (r#"{"url": "http://w:1", "worker_type": "decode", "bootstrap_port": 9000}"#, true, "bootstrap_port"),
            (r#"{"url": "http://w:1", "worker_type": "decode", "kv_engine_id": "e"}"#, true, "kv_engine_id"),
            (r#"{"url": "http://w:1", "worker_type": "prefill", "kv_connector": "lmcache"}"#, true, "kv_connector"),
            (r#"{"url": "http://w:1", "worker_type": "prefill", "kv_events": "tcp://*:5557"}"#, true, "kv_events"),
            (r#"{"url": "http://w:1", "worker_type": "prefill", "kv_events": "http://w:5557"}"#, true, "kv_events"),
            (r#"{"url": "http://w:1", "kv_events": "tcp://w:0"}"#, false, "kv_events"),
            (r#"{"url": "http://w:1", "kv_events_replay": "tcp://w:5558"}"#, false, "kv_events_replay"),
            (r#"{"url": "http://w:1", "kv_events": "tcp://w:5557", "kv_events_replay": "tcp://w"}"#, false, "kv_events_replay"),
        ];
        for (json, pd, param) in cases {
            assert_eq!(reg(json).into_spec(pd).unwrap_err().param, param, "{json}");
        }
        assert!(serde_json::from_str::<WorkerRegistration>(r#"{"url": "http://w:1", "zone": "a"}"#).is_err(), "unknown fields are refused");
        let encode = [
            (r#"{"url": "grpc://e:50060", "worker_type": "encode"}"#, "url"),
            (r#"{"url": "http://e:1", "worker_type": "encode", "kv_connector": "nixl"}"#, "kv_connector"),
            (r#"{"url": "http://e:1", "worker_type": "encode", "kv_events": "tcp://e:5557"}"#, "kv_events"),
            (r#"{"url": "http://e:1", "worker_type": "encode", "kv_engine_id": "x"}"#, "kv_engine_id"),
        ];
        for (json, param) in encode {
            assert_eq!(reg(json).into_spec(true).unwrap_err().param, param, "{json}");
        }
        assert!(reg(r#"{"url": "grpc://e:50060", "worker_type": "encode"}"#).into_spec(true).unwrap_err().message.contains("not built"));
        assert_eq!(reg(r#"{"url": "http://e:1", "worker_type": "encode"}"#).into_spec(false).unwrap_err().param, "worker_type");
        assert_eq!(reg(r#"{"url": "http://w:1"}"#).into_spec(false).unwrap().role, WorkerRole::Regular);
    }
}
