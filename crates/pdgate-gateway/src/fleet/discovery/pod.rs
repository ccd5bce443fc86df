//! What one pod means to the gateway: a pure function from a Pod object and the discovery
//! settings to a verdict (a worker, not a worker, or refused with a reason). No IO here.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use pdgate_core::{WorkerRegistration, WorkerRole, WorkerSpec};

/// Worker HTTP port; wins over `--service-discovery-port`.
pub const PORT_ANNOTATION: &str = "pdgate.ai/port";
/// `http` (default), `https` or `grpc`: how the gateway reaches this worker. An https worker's
/// certificate must name the pod IP (discovery addresses pods by IP), signed by a CA the gateway
/// trusts (`--worker-ca-cert`).
pub const SCHEME_ANNOTATION: &str = "pdgate.ai/scheme";
/// Bootstrap port of a prefill (SGLang) or an encode worker (EPD), as SMG reads it.
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "sglang.ai/bootstrap-port";
/// KV connector of this worker (`bootstrap`, `nixl`, `mooncake`), as SMG reads it.
pub const KV_CONNECTOR_ANNOTATION: &str = "smg.ai/kv-connector";
/// Engine id of a (Mooncake) prefill, as SMG reads it.
pub const KV_ENGINE_ID_ANNOTATION: &str = "smg.ai/kv-engine-id";
/// The engine's KV event publisher: a port (on the pod IP), `tcp://*:PORT` (as the engine's
/// `--kv-events-config` binds it; read as the pod IP) or `tcp://host:port`.
pub const KV_EVENTS_ANNOTATION: &str = "pdgate.ai/kv-events-endpoint";
/// Its replay socket, in the same forms.
pub const KV_EVENTS_REPLAY_ANNOTATION: &str = "pdgate.ai/kv-events-replay-endpoint";

/// Labels put on every worker that discovery adds, naming the pod it came from.
pub const NAMESPACE_LABEL: &str = "k8s.namespace";
pub const POD_LABEL: &str = "k8s.pod";
pub const UID_LABEL: &str = "k8s.uid";

/// An equality-based label selector (`k=v,k2=v2`): every pair must match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector(pub BTreeMap<String, String>);

impl Selector {
    /// From `k=v` items; the config has already checked their shape.
    pub fn parse<'a>(items: impl IntoIterator<Item = &'a String>) -> Self {
        Selector(items.into_iter().filter_map(|kv| pdgate_core::config::parse_label(kv)).map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    /// Both selectors at once (the common `--selector` plus a role's selector).
    pub fn and(&self, other: &Selector) -> Selector {
        let mut all = self.0.clone();
        all.extend(other.0.iter().map(|(k, v)| (k.clone(), v.clone())));
        Selector(all)
    }

    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.0.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    }

    /// The `labelSelector` query parameter.
    pub fn to_query(&self) -> String {
        self.0.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }
}

/// One role to discover: its selector, and the other roles' selectors with their flags (a pod
/// must match only one role).
#[derive(Clone, Debug)]
pub struct RoleSelector {
    pub role: WorkerRole,
    pub selector: Selector,
    /// The flag that gave `selector` (named when a pod matches two roles).
    pub flag: &'static str,
    pub conflicting: Vec<(&'static str, Selector)>,
}

/// What the gateway should register for a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Boxed: a spec is far larger than the other verdicts.
    pub spec: Box<WorkerSpec>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Worker(Candidate),
    /// Not (or no longer) a worker: not running, not ready, terminating, no IP yet.
    NotServing(&'static str),
    /// Can never be a worker as it is: the reason goes to the log.
    Refused(String),
}

/// `namespace/name`, how pods are keyed and named in logs.
pub fn pod_key(pod: &Pod) -> String {
    format!("{}/{}", pod.metadata.namespace.as_deref().unwrap_or(""), pod.metadata.name.as_deref().unwrap_or(""))
}

fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref()?.get(key).map(|v| v.trim()).filter(|v| !v.is_empty())
}

/// A KV event annotation as an address on this pod: a bare port or a `*` host means the pod IP.
fn on_pod(value: &str, host: &str) -> String {
    if value.parse::<u16>().is_ok() {
        return format!("tcp://{host}:{value}");
    }
    match value.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://{host}:{port}"),
        None => value.to_string(),
    }
}

fn port_annotation(pod: &Pod, key: &str) -> Result<Option<u16>, String> {
    match annotation(pod, key) {
        None => Ok(None),
        Some(v) => v.parse::<u16>().ok().filter(|p| *p > 0).map(Some).ok_or_else(|| format!("annotation {key}={v:?} is not a port")),
    }
}

/// The verdict for a pod that the watch for `role` returned (so it matches `role.selector`).
pub fn verdict(pod: &Pod, role: &RoleSelector, default_port: u16) -> Verdict {
    let labels = pod.metadata.labels.as_ref();
    if !role.selector.matches(labels) {
        // The server filters by selector; a pod can still arrive here through a relabel race.
        return Verdict::NotServing("labels do not match the selector");
    }
    if let Some((other, _)) = role.conflicting.iter().find(|(_, s)| s.matches(labels)) {
        return Verdict::Refused(format!("matches both {} and {other}", role.flag));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Verdict::NotServing("terminating");
    }
    let status = pod.status.as_ref();
    if status.and_then(|s| s.phase.as_deref()) != Some("Running") {
        return Verdict::NotServing("not running");
    }
    if !is_ready(pod) {
        return Verdict::NotServing("not ready");
    }
    let Some(ip) = status.and_then(|s| s.pod_ip.as_deref()).filter(|ip| !ip.is_empty()) else {
        return Verdict::NotServing("no pod IP");
    };
    match candidate(pod, role.role, ip, default_port) {
        Ok(c) => Verdict::Worker(c),
        Err(reason) => Verdict::Refused(reason),
    }
}

fn candidate(pod: &Pod, role: WorkerRole, ip: &str, default_port: u16) -> Result<Candidate, String> {
    let port = port_annotation(pod, PORT_ANNOTATION)?.unwrap_or(default_port);
    let host = if ip.contains(':') { format!("[{ip}]") } else { ip.to_string() };
    let scheme = match annotation(pod, SCHEME_ANNOTATION) {
        None | Some("http") => "http",
        Some("https") => "https",
        Some("grpc") => "grpc",
        Some(other) => return Err(format!("annotation {SCHEME_ANNOTATION}={other:?}: expected http, https or grpc")),
    };
    // The annotations are one more spelling of a worker registration (pdgate-core).
    let mut reg = WorkerRegistration::new(format!("{scheme}://{host}:{port}"), role);
    if role.has_bootstrap_server() {
        reg.bootstrap_port = port_annotation(pod, BOOTSTRAP_PORT_ANNOTATION)?;
    }
    if role == WorkerRole::Prefill {
        reg.kv_engine_id = annotation(pod, KV_ENGINE_ID_ANNOTATION).map(str::to_string);
    }
    // An encode worker holds no KV: its KV annotations are refused below, as at registration.
    reg.kv_connector = annotation(pod, KV_CONNECTOR_ANNOTATION).map(str::to_string);
    reg.kv_events = annotation(pod, KV_EVENTS_ANNOTATION).map(|v| on_pod(v, &host));
    reg.kv_events_replay = annotation(pod, KV_EVENTS_REPLAY_ANNOTATION).map(|v| on_pod(v, &host));
    let mut spec = reg.into_spec(role != WorkerRole::Regular).map_err(|e| match e.param {
        "kv_connector" => format!("annotation {KV_CONNECTOR_ANNOTATION}: {}", e.message),
        "kv_engine_id" => format!("annotation {KV_ENGINE_ID_ANNOTATION}: {}", e.message),
        "kv_events" => format!("annotation {KV_EVENTS_ANNOTATION}: {}", e.message),
        "kv_events_replay" => format!("annotation {KV_EVENTS_REPLAY_ANNOTATION}: {}", e.message),
        _ => e.message,
    })?;
    let meta = &pod.metadata;
    for (key, value) in [(NAMESPACE_LABEL, &meta.namespace), (POD_LABEL, &meta.name), (UID_LABEL, &meta.uid)] {
        if let Some(v) = value {
            spec.labels.insert(key.to_string(), v.clone());
        }
    }
    Ok(Candidate { spec: Box::new(spec) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdgate_core::KvConnector;
    use serde_json::json;

    fn pod(labels: serde_json::Value, annotations: serde_json::Value, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p-0", "namespace": "ml", "uid": "u-1", "labels": labels, "annotations": annotations},
            "status": status,
        }))
        .unwrap()
    }

    fn ready(ip: &str) -> serde_json::Value {
        json!({"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]})
    }

    fn prefill() -> RoleSelector {
        let sel = |k: &str, v: &str| Selector([(k.to_string(), v.to_string())].into());
        RoleSelector { role: WorkerRole::Prefill, selector: sel("app", "p"), flag: "--prefill-selector", conflicting: vec![("--decode-selector", sel("tier", "d"))] }
    }

    #[test]
    fn a_ready_running_pod_with_an_ip_is_a_worker_with_its_annotations() {
        let p = pod(
            json!({"app": "p"}),
            json!({"pdgate.ai/port": "30001", "sglang.ai/bootstrap-port": "9001", "smg.ai/kv-connector": "mooncake", "smg.ai/kv-engine-id": "e1"}),
            ready("10.0.0.7"),
        );
        let Verdict::Worker(c) = verdict(&p, &prefill(), 8000) else { panic!("not a worker") };
        assert_eq!(c.spec.url, "http://10.0.0.7:30001");
        assert_eq!(c.spec.bootstrap_port, Some(9001));
        assert_eq!(c.spec.kv_connector, Some(KvConnector::Mooncake));
        assert_eq!(c.spec.kv_engine_id.as_deref(), Some("e1"));
        assert_eq!(c.spec.labels.get(UID_LABEL).map(String::as_str), Some("u-1"));
        assert_eq!(c.spec.labels.get(POD_LABEL).map(String::as_str), Some("p-0"));
    }

    #[test]
    fn kv_event_annotations_address_the_pod() {
        let ann = json!({"pdgate.ai/kv-events-endpoint": "tcp://*:5557", "pdgate.ai/kv-events-replay-endpoint": "5558"});
        let Verdict::Worker(c) = verdict(&pod(json!({"app": "p"}), ann, ready("10.0.0.7")), &prefill(), 8000) else { panic!("not a worker") };
        assert_eq!((c.spec.kv_events.as_deref(), c.spec.kv_events_replay.as_deref()), (Some("tcp://10.0.0.7:5557"), Some("tcp://10.0.0.7:5558")));
        let bad = pod(json!({"app": "p"}), json!({"pdgate.ai/kv-events-endpoint": "udp://x:1"}), ready("10.0.0.7"));
        let Verdict::Refused(reason) = verdict(&bad, &prefill(), 8000) else { panic!("a bad endpoint is refused") };
        assert!(reason.contains(KV_EVENTS_ANNOTATION), "{reason}");
    }

    #[test]
    fn default_port_and_ipv6() {
        let p = pod(json!({"app": "p"}), json!({}), ready("fd00::5"));
        let Verdict::Worker(c) = verdict(&p, &prefill(), 8000) else { panic!("not a worker") };
        assert_eq!(c.spec.url, "http://[fd00::5]:8000");
        assert_eq!(c.spec.bootstrap_port, None);
    }

    #[test]
    fn the_scheme_annotation_makes_an_https_worker() {
        let p = pod(json!({"app": "p"}), json!({"pdgate.ai/scheme": "https", "pdgate.ai/port": "8443"}), ready("10.0.0.7"));
        let Verdict::Worker(c) = verdict(&p, &prefill(), 8000) else { panic!("not a worker") };
        assert_eq!(c.spec.url, "https://10.0.0.7:8443");
        let plain = pod(json!({"app": "p"}), json!({"pdgate.ai/scheme": "http"}), ready("10.0.0.7"));
        let Verdict::Worker(c) = verdict(&plain, &prefill(), 8000) else { panic!("not a worker") };
        assert_eq!(c.spec.url, "http://10.0.0.7:8000");
        let grpc = pod(json!({"app": "p"}), json!({"pdgate.ai/scheme": "grpc", "pdgate.ai/port": "30000"}), ready("10.0.0.7"));
        let Verdict::Worker(c) = verdict(&grpc, &prefill(), 8000) else { panic!("not a worker") };
        assert_eq!(c.spec.url, "grpc://10.0.0.7:30000");
    }

    #[test]
    fn pods_that_do_not_serve_are_not_workers() {
        let cases = [
            json!({"phase": "Pending", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}),
            json!({"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "False"}]}),
            json!({"phase": "Running", "podIP": "10.0.0.1"}),
            json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}),
            json!({"phase": "Succeeded", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}),
        ];
        for status in cases {
            let p = pod(json!({"app": "p"}), json!({}), status.clone());
            assert!(matches!(verdict(&p, &prefill(), 8000), Verdict::NotServing(_)), "{status}");
        }
        let mut terminating = pod(json!({"app": "p"}), json!({}), ready("10.0.0.1"));
        terminating.metadata.deletion_timestamp = serde_json::from_value(json!("2025-01-01T00:00:00Z")).unwrap();
        assert_eq!(verdict(&terminating, &prefill(), 8000), Verdict::NotServing("terminating"));
        let relabeled = pod(json!({"app": "x"}), json!({}), ready("10.0.0.1"));
        assert!(matches!(verdict(&relabeled, &prefill(), 8000), Verdict::NotServing(_)));
    }

    #[test]
    fn both_selectors_or_bad_annotations_refuse_the_pod() {
        let both = pod(json!({"app": "p", "tier": "d"}), json!({}), ready("10.0.0.1"));
        assert!(matches!(verdict(&both, &prefill(), 8000), Verdict::Refused(_)));
        for (k, v) in [("pdgate.ai/port", "http"), ("sglang.ai/bootstrap-port", "0"), ("smg.ai/kv-connector", "lmcache"), ("pdgate.ai/scheme", "h2c")] {
            let p = pod(json!({"app": "p"}), json!({k: v}), ready("10.0.0.1"));
            assert!(matches!(verdict(&p, &prefill(), 8000), Verdict::Refused(_)), "{k}={v}");
        }
    }

    fn encode() -> RoleSelector {
        let sel = |k: &str, v: &str| Selector([(k.to_string(), v.to_string())].into());
        RoleSelector {
            role: WorkerRole::Encode,
            selector: sel("app", "e"),
            flag: "--encode-selector",
            conflicting: vec![("--prefill-selector", sel("app", "p")), ("--decode-selector", sel("tier", "d"))],
        }
    }

    #[test]
    fn an_encode_pod_is_an_encode_worker_with_its_bootstrap_port() {
        let p = pod(json!({"app": "e"}), json!({"pdgate.ai/port": "30002", "sglang.ai/bootstrap-port": "9002"}), ready("10.0.0.9"));
        let Verdict::Worker(c) = verdict(&p, &encode(), 8000) else { panic!("not a worker") };
        assert_eq!(c.spec.role, WorkerRole::Encode);
        assert_eq!(c.spec.url, "http://10.0.0.9:30002");
        assert_eq!(c.spec.bootstrap_port, Some(9002));
        assert_eq!(c.spec.labels.get(POD_LABEL).map(String::as_str), Some("p-0"));
        let default_port = pod(json!({"app": "e"}), json!({}), ready("10.0.0.9"));
        let Verdict::Worker(c) = verdict(&default_port, &encode(), 8000) else { panic!("not a worker") };
        assert_eq!((c.spec.url.as_str(), c.spec.bootstrap_port), ("http://10.0.0.9:8000", None), "absent: the engine default");
    }

    #[test]
    fn an_encode_pod_is_refused_for_kv_annotations_grpc_or_a_second_role() {
        for (k, v) in [("smg.ai/kv-connector", "bootstrap"), ("pdgate.ai/kv-events-endpoint", "5557"), ("pdgate.ai/scheme", "grpc"), ("sglang.ai/bootstrap-port", "x")] {
            let p = pod(json!({"app": "e"}), json!({k: v}), ready("10.0.0.9"));
            let Verdict::Refused(reason) = verdict(&p, &encode(), 8000) else { panic!("{k}={v} should refuse an encode pod") };
            assert!(!reason.is_empty());
        }
        // The kv-engine-id annotation is a prefill's: ignored on an encode pod, as on a decode.
        let p = pod(json!({"app": "e"}), json!({"smg.ai/kv-engine-id": "e1"}), ready("10.0.0.9"));
        assert!(matches!(verdict(&p, &encode(), 8000), Verdict::Worker(_)));
        let both = pod(json!({"app": "e", "tier": "d"}), json!({}), ready("10.0.0.9"));
        assert_eq!(verdict(&both, &encode(), 8000), Verdict::Refused("matches both --encode-selector and --decode-selector".into()));
    }

    #[test]
    fn selectors_match_all_pairs_and_render_as_a_query() {
        let s = Selector::parse(&["app=p".to_string(), "model=llama".to_string()]);
        let labels: BTreeMap<String, String> = [("app".into(), "p".into()), ("model".into(), "llama".into()), ("x".into(), "y".into())].into();
        assert!(s.matches(Some(&labels)));
        assert!(!Selector::parse(&["app=d".to_string()]).matches(Some(&labels)));
        assert!(!s.matches(None));
        assert_eq!(s.to_query(), "app=p,model=llama");
    }
}
