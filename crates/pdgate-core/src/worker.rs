//! Workers as plain data: what the gateway knows about one engine endpoint.

use std::collections::BTreeMap;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::pairing::KvLayout;

/// The port of an SGLang prefill's bootstrap server when none is given (the engines' default,
/// also the Mooncake bootstrap address's port). Declared once; docs/protocols.md §1, §3.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// How KV moves from prefill to decode for a pair of workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
pub enum KvConnector {
    /// SGLang: bootstrap rendezvous, both legs sent at once.
    #[default]
    Bootstrap,
    /// vLLM NixlConnector: prefill first, its `kv_transfer_params` relayed to decode (pull).
    Nixl,
    /// vLLM MooncakeConnector: shared `transfer_id`, prefill pushes to decode.
    Mooncake,
}

impl KvConnector {
    pub fn as_str(self) -> &'static str {
        match self {
            KvConnector::Bootstrap => "bootstrap",
            KvConnector::Nixl => "nixl",
            KvConnector::Mooncake => "mooncake",
        }
    }

    /// Our names, in the order every message lists them.
    pub const NAMES: [&'static str; 3] = ["bootstrap", "nixl", "mooncake"];

    /// [`KvConnector::from_name`] with the one error text every source of workers shows (flags,
    /// JSON config, `/workers`, Kubernetes annotations).
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::from_name(name).ok_or_else(|| format!("unknown kv_connector {name:?} (expected {})", Self::NAMES.join(", ")))
    }

    /// Accepts our names and the engines' connector class names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "bootstrap" | "sglang" => Some(KvConnector::Bootstrap),
            "nixl" | "nixlconnector" => Some(KvConnector::Nixl),
            "mooncake" | "mooncakeconnector" => Some(KvConnector::Mooncake),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    Regular,
    Prefill,
    Decode,
    /// EPD: runs the vision encoder for a request's images and ships the embeddings to the
    /// prefill (`--encode URL BOOTSTRAP_PORT`, docs/protocols.md §8).
    Encode,
}

impl WorkerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Regular => "regular",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Encode => "encode",
        }
    }

    /// Whether the worker runs a bootstrap server others connect to (a prefill for KV, an
    /// encode worker for embeddings).
    pub fn has_bootstrap_server(self) -> bool {
        matches!(self, WorkerRole::Prefill | WorkerRole::Encode)
    }
}

/// A worker's identity and static facts. Runtime state (health, load) lives in the snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// Base URL without a trailing slash, e.g. `http://10.0.0.5:30000` or `https://w0:8443`.
    pub url: String,
    pub role: WorkerRole,
    /// Host part of `url`, as sent in `bootstrap_host`.
    pub host: String,
    /// Prefill and encode only: port of the engine's bootstrap server (`None` = engine default).
    pub bootstrap_port: Option<u16>,
    /// Overrides the gateway-wide connector for this worker.
    pub kv_connector: Option<KvConnector>,
    pub labels: BTreeMap<String, String>,
    /// The engine, e.g. `sglang`, `vllm`, `pdgate-reference`; from registration or
    /// `/server_info`. Part of the pairing key.
    #[serde(default)]
    pub runtime: Option<String>,
    /// The engine's KV layout, as far as known. Part of the pairing key.
    #[serde(default)]
    pub kv_layout: KvLayout,
    /// The disaggregation role the engine reports about itself (gRPC `GetServerInfo`'s
    /// `kv_role`, `/server_info`'s `disaggregation_mode`); `None` while unknown or when the
    /// engine serves both. Part of the pairing key.
    #[serde(default)]
    pub reported_role: Option<WorkerRole>,
    /// Mooncake prefill: its engine id as registered (else learned from its bootstrap `/query`).
    #[serde(default)]
    pub kv_engine_id: Option<String>,
    /// The engine's KV event publisher (`tcp://host:port`), when it publishes one.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay socket; `None`: a sequence gap resets the worker's view.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
}

impl WorkerSpec {
    /// Validates the URL (http, https or grpc, host required) and normalises it.
    pub fn new(url: &str, role: WorkerRole) -> Result<Self, String> {
        let mut parsed = url::Url::parse(url).map_err(|e| format!("invalid worker URL {url:?}: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https" | "grpc") {
            return Err(format!("worker URL {url:?} must use http://, https:// or grpc://"));
        }
        if parsed.scheme() == "grpc" {
            // `grpc` is not a special scheme to the URL standard: its host is kept as written
            // (lower-cased here, so one worker has one URL) and it has no default port.
            if parsed.port().is_none() {
                return Err(format!("worker URL {url:?} needs a port (grpc://HOST:PORT)"));
            }
            let host = parsed.host_str().unwrap_or_default().to_ascii_lowercase();
            parsed.set_host(Some(&host)).map_err(|e| format!("invalid worker URL {url:?}: {e}"))?;
        }
        let host = match parsed.host() {
            Some(url::Host::Ipv6(addr)) => addr.to_string(),
            Some(h) => h.to_string(),
            None => return Err(format!("worker URL {url:?} has no host")),
        };
        if parsed.path() != "/" && !parsed.path().is_empty() {
            return Err(format!("worker URL {url:?} must not have a path"));
        }
        // The parsed form: scheme and host lower-cased, so one worker has one URL.
        let url = parsed.as_str().trim_end_matches('/').to_string();
        Ok(WorkerSpec {
            url,
            role,
            host,
            bootstrap_port: None,
            kv_connector: None,
            labels: BTreeMap::new(),
            runtime: None,
            kv_layout: KvLayout::default(),
            reported_role: None,
            kv_engine_id: None,
            kv_events: None,
            kv_events_replay: None,
        })
    }

    /// Whether the gateway reaches this worker over TLS (an `https://` URL).
    pub fn is_tls(&self) -> bool {
        self.url.starts_with("https://")
    }

    /// Whether the worker speaks the SMG gRPC contract (a `grpc://` URL).
    pub fn is_grpc(&self) -> bool {
        is_grpc_url(&self.url)
    }

    /// The connector this worker speaks, given the gateway-wide default.
    pub fn connector(&self, default: KvConnector) -> KvConnector {
        self.kv_connector.unwrap_or(default)
    }
}

/// Whether a worker URL is a gRPC worker's (`grpc://HOST:PORT`).
pub fn is_grpc_url(url: &str) -> bool {
    url.starts_with("grpc://")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_urls_are_accepted_with_a_port() {
        let w = WorkerSpec::new("grpc://Node-A:30000/", WorkerRole::Decode).unwrap();
        assert_eq!(w.url, "grpc://node-a:30000");
        assert_eq!(w.host, "node-a");
        assert!(w.is_grpc() && !w.is_tls());
        assert_eq!(WorkerSpec::new("grpc://127.0.0.1:5", WorkerRole::Prefill).unwrap().host, "127.0.0.1");
        assert!(WorkerSpec::new("grpc://w", WorkerRole::Decode).unwrap_err().contains("needs a port"));
        assert!(WorkerSpec::new("ftp://w:1", WorkerRole::Decode).unwrap_err().contains("grpc://"));
    }

    #[test]
    fn url_is_normalised_and_host_extracted() {
        let w = WorkerSpec::new("http://10.1.2.3:30000/", WorkerRole::Prefill).unwrap();
        assert_eq!(w.url, "http://10.1.2.3:30000");
        assert_eq!(WorkerSpec::new("HTTP://Node-A:30000", WorkerRole::Prefill).unwrap().url, "http://node-a:30000");
        assert_eq!(w.host, "10.1.2.3");
        let v6 = WorkerSpec::new("http://[::1]:8000", WorkerRole::Decode).unwrap();
        assert_eq!(v6.host, "::1");
    }

    #[test]
    fn https_urls_are_accepted_and_known_as_tls() {
        let w = WorkerSpec::new("HTTPS://Worker-0.ml.svc:8443/", WorkerRole::Decode).unwrap();
        assert_eq!(w.url, "https://worker-0.ml.svc:8443");
        assert_eq!(w.host, "worker-0.ml.svc");
        assert!(w.is_tls());
        assert!(!WorkerSpec::new("http://w:1", WorkerRole::Decode).unwrap().is_tls());
        // The default port is implied, as for http.
        assert_eq!(WorkerSpec::new("https://w:443", WorkerRole::Regular).unwrap().url, "https://w");
    }

    #[test]
    fn bad_urls_are_refused() {
        for bad in ["localhost:3000", "ftp://x:1", "grpc://x", "grpc://x:1/v1", "https://x:1/v1", "http://x:1/v1", "not a url"] {
            assert!(WorkerSpec::new(bad, WorkerRole::Regular).is_err(), "{bad}");
        }
    }

    #[test]
    fn old_json_without_pairing_fields_still_reads() {
        let json = r#"{"url":"http://a:1","role":"decode","host":"a","bootstrap_port":null,"kv_connector":null,"labels":{}}"#;
        let w: WorkerSpec = serde_json::from_str(json).unwrap();
        assert_eq!((w.runtime, w.kv_layout), (None, KvLayout::default()));
    }

    #[test]
    fn connector_names_parse_with_one_error_text() {
        for name in KvConnector::NAMES {
            assert_eq!(KvConnector::parse(name).unwrap().as_str(), name);
        }
        assert_eq!(KvConnector::parse("lmcache").unwrap_err(), "unknown kv_connector \"lmcache\" (expected bootstrap, nixl, mooncake)");
    }

    #[test]
    fn connector_names() {
        assert_eq!(KvConnector::from_name("NixlConnector"), Some(KvConnector::Nixl));
        assert_eq!(KvConnector::from_name("mooncake"), Some(KvConnector::Mooncake));
        assert_eq!(KvConnector::from_name("lmcache"), None);
    }
}
