//! SMG's (and vLLM router's) spellings resolve to pdgate's options with SMG's meaning.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_core::breaker::BreakerConfig;
use pdgate_core::config::parse_control_plane_key;
use pdgate_core::{GatewayConfig, KvConnector, PolicyName};
use std::time::Duration;

fn cli(args: &[&str]) -> Result<GatewayConfig, String> {
    let c = GatewayConfig::parse_cli(std::iter::once("pdgate").chain(args.iter().copied())).map_err(|e| e.to_string())?;
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

#[test]
fn circuit_breaker_flags_in_smgs_spelling() {
    let c = cli(&["--cb-failure-threshold", "7", "--cb-success-threshold", "4", "--cb-timeout-duration-secs", "45", "--cb-window-duration-secs", "90"]).unwrap();
    assert_eq!((c.breaker_failure_threshold, c.breaker_success_threshold, c.breaker_cooldown_secs, c.breaker_window_secs), (7, 4, 45, 90));
    let b = BreakerConfig::from_config(&c);
    assert_eq!((b.cooldown, b.window), (Duration::from_secs(45), Duration::from_secs(90)));
    assert_eq!(cli(&["--breaker-failure-threshold", "7"]).unwrap().breaker_failure_threshold, 7, "pdgate's name still works");
}

#[test]
fn retries_count_attempts_as_smg() {
    assert_eq!(cli(&["--retry-max-retries", "3"]).unwrap().max_attempts(), 3);
    assert_eq!(cli(&["--retry-max-retries", "0"]).unwrap().max_attempts(), 1);
    assert_eq!(cli(&["--retry-max-retries", "4", "--disable-retries"]).unwrap().max_attempts(), 1);
    assert!(cli(&["--retry-backoff-multiplier", "0.9"]).unwrap_err().contains("--retry-backoff-multiplier"));
    assert!(cli(&["--retry-jitter-factor", "-0.1"]).is_err());
}

#[test]
fn policy_spelling_consistent_hashing() {
    let c = cli(&["--policy", "consistent_hashing", "--decode-policy", "consistent_hashing"]).unwrap();
    assert_eq!((c.policy, c.decode_policy), (PolicyName::ConsistentHash, Some(PolicyName::ConsistentHash)));
    let j = GatewayConfig::from_json(r#"{"policy": "consistent_hashing"}"#).unwrap();
    assert_eq!(j.policy, PolicyName::ConsistentHash);
}

#[test]
fn vllm_router_pd_flag_means_pd_with_nixl_unless_told_otherwise() {
    let args = ["--vllm-pd-disaggregation", "--prefill", "http://p:8000", "--decode", "http://d:8000"];
    let c = cli(&args).unwrap();
    assert!(c.pd_disaggregation && c.vllm_pd_disaggregation);
    assert_eq!(c.kv_connector, KvConnector::Nixl);
    let mut with = args.to_vec();
    with.extend(["--kv-connector", "mooncake"]);
    assert_eq!(cli(&with).unwrap().kv_connector, KvConnector::Mooncake);
    // The JSON view: the same rule, and a round trip keeps the resolved connector.
    let j = GatewayConfig::from_json(r#"{"vllm_pd_disaggregation": true}"#).unwrap();
    assert!(j.pd_disaggregation && j.kv_connector == KvConnector::Nixl);
    let explicit = GatewayConfig::from_json(r#"{"vllm_pd_disaggregation": true, "kv_connector": "bootstrap"}"#).unwrap();
    assert_eq!(explicit.kv_connector, KvConnector::Bootstrap);
    assert_eq!(GatewayConfig::from_json(&c.to_json()).unwrap(), c);
}

#[test]
fn control_plane_keys_are_admin_keys() {
    let c = cli(&["--admin-api-key", "a1", "--control-plane-api-keys", "k1:Service Account:admin:s:e:c", "k2:Ops:ADMIN:t"]).unwrap();
    assert_eq!(c.admin_keys(), ["a1", "s:e:c", "t"]);
    let k = parse_control_plane_key("id:Name With Spaces:admin:key").unwrap();
    assert_eq!((k.id.as_str(), k.name.as_str(), k.key.as_str()), ("id", "Name With Spaces", "key"));
    for bad in ["k:n:user:s", "k:n:root:s", "k:n:admin:", ":n:admin:s", "nocolons"] {
        let err = cli(&["--control-plane-api-keys", bad]).unwrap_err();
        assert!(err.contains("--control-plane-api-keys"), "{bad}: {err}");
        assert!(!err.contains(":s\""), "the key is not echoed: {err}");
    }
}

#[test]
fn admission_and_request_id_options() {
    let c = cli(&["--max-concurrent-requests", "-1"]).unwrap();
    assert_eq!(c.concurrency_limit(), None);
    assert_eq!(cli(&["--max-concurrent-requests", "0"]).unwrap().concurrency_limit(), None);
    let c = cli(&["--max-concurrent-requests", "8", "--queue-size", "0", "--queue-timeout-secs", "5"]).unwrap();
    assert_eq!((c.concurrency_limit(), c.queue_size, c.queue_timeout_secs), (Some(8), 0, 5));
    assert!(cli(&["--max-concurrent-requests", "-5"]).is_err());
    assert!(cli(&["--max-concurrent-requests", "8", "--queue-timeout-secs", "0"]).is_err());
    let c = cli(&["--request-id-headers", "x-trace-id", "x-request-id"]).unwrap();
    assert_eq!(c.request_id_headers, ["x-trace-id", "x-request-id"]);
    assert!(cli(&["--request-id-headers", "bad header"]).is_err());
    assert_eq!(GatewayConfig::default().request_id_headers, ["x-request-id", "x-correlation-id", "x-trace-id", "request-id"]);
}

#[test]
fn metrics_listener_and_log_options() {
    let c = cli(&["--prometheus-port", "29000", "--prometheus-host", "0.0.0.0", "--log-json", "--log-dir", "/tmp/x", "--disable-health-check"]).unwrap();
    assert_eq!((c.prometheus_port, c.prometheus_host.as_str()), (Some(29000), "0.0.0.0"));
    assert!(c.log_json && c.disable_health_check);
    assert_eq!(c.log_dir.as_deref(), Some("/tmp/x"));
    let d = GatewayConfig::default();
    assert_eq!((d.prometheus_port, d.prometheus_host.as_str()), (None, "127.0.0.1"));
    assert!(cli(&["--log-dir", ""]).is_err());
}

#[test]
fn trace_flags_as_smg_names_and_defaults_them() {
    let d = cli(&[]).unwrap();
    assert!(!d.enable_trace);
    assert_eq!(d.otlp_traces_endpoint, "localhost:4317", "SMG's default collector");
    let c = cli(&["--enable-trace", "--otlp-traces-endpoint", "otel-collector:4317"]).unwrap();
    assert!(c.enable_trace);
    assert_eq!(pdgate_core::config::otlp_endpoint_url(&c.otlp_traces_endpoint).unwrap(), "http://otel-collector:4317", "host:port means http://, as SMG");
    assert_eq!(pdgate_core::config::otlp_endpoint_url("https://collector.example:4317").unwrap(), "https://collector.example:4317");
    for bad in ["ftp://collector:4317", "http://:4317", "not a url at all"] {
        let err = cli(&["--enable-trace", "--otlp-traces-endpoint", bad]).unwrap_err();
        assert!(err.contains("--otlp-traces-endpoint"), "{bad}: {err}");
    }
    // Without --enable-trace the endpoint is not used, so it is not checked either (as SMG).
    assert!(cli(&["--otlp-traces-endpoint", "ftp://x"]).is_ok());
}
