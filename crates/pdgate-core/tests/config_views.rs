//! The CLI and JSON views of `GatewayConfig` are one schema.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_core::{GatewayConfig, KvConnector, WorkerRole};

fn cli(args: &[&str]) -> GatewayConfig {
    let mut argv = vec!["pdgate-gateway"];
    argv.extend_from_slice(args);
    GatewayConfig::parse_cli(argv).unwrap()
}

#[test]
fn smg_style_prefill_flags_group_url_and_port() {
    let c = cli(&[
        "--pd-disaggregation",
        "--prefill",
        "http://p1:30000",
        "8998",
        "--prefill",
        "http://p2:30000",
        "--prefill",
        "http://p3:30000",
        "none",
        "kv_connector=nixl",
        "--decode",
        "http://d1:30001",
        "--decode",
        "http://d2:30001",
        "kv_connector=nixl",
    ]);
    c.validate().unwrap();
    let p = c.prefill_args().unwrap();
    assert_eq!(p.len(), 3);
    assert_eq!((p[0].url.as_str(), p[0].bootstrap_port), ("http://p1:30000", Some(8998)));
    assert_eq!(p[1].bootstrap_port, None);
    assert_eq!(p[2].kv_connector, Some(KvConnector::Nixl));
    let w = c.workers().unwrap();
    assert_eq!(w.iter().filter(|w| w.role == WorkerRole::Decode).count(), 2);
    assert_eq!(w[4].kv_connector, Some(KvConnector::Nixl));
}

#[test]
fn json_accepts_strings_pairs_and_objects() {
    let c = GatewayConfig::from_json(
        r#"{"pd_disaggregation": true,
            "prefill": ["http://p1:1", ["http://p2:1", 9000], {"url": "http://p3:1", "bootstrap_port": null, "kv_connector": "mooncake"}],
            "decode": ["http://d1:1", {"url": "http://d2:1", "kv_connector": "mooncake"}],
            "policy": "random", "request_timeout_secs": 5}"#,
    )
    .unwrap();
    let p = c.prefill_args().unwrap();
    assert_eq!(p[1].bootstrap_port, Some(9000));
    assert_eq!(p[2].kv_connector, Some(KvConnector::Mooncake));
    assert_eq!(c.request_timeout_secs, 5);
    assert_eq!(c.port, GatewayConfig::default().port, "missing keys take the CLI defaults");
}

#[test]
fn json_and_cli_produce_the_same_config() {
    let from_cli = cli(&["--pd-disaggregation", "--prefill", "http://p:1", "8998", "--decode", "http://d:1", "--policy", "random"]);
    let from_json = GatewayConfig::from_json(&from_cli.to_json()).unwrap();
    assert_eq!(from_cli, from_json);
}

#[test]
fn bad_configs_are_refused_with_a_reason() {
    for bad in [
        r#"{"unknown_option": 1}"#,
        r#"{"pd_disaggregation": true, "prefill": [["http://p:1", "notaport"]]}"#,
        r#"{"pd_disaggregation": true, "prefill": [{"url": "http://p:1", "kv_connector": "lmcache"}]}"#,
        r#"{"decode": ["http://d:1"]}"#,
        r#"{"worker_urls": ["ftp://a:1"]}"#,
        r#"{"worker_urls": ["http://a:1", "http://a:1/"]}"#,
        r#"{"worker_urls": ["label=zone=a", "http://a:1"]}"#,
        r#"{"worker_urls": ["http://a:1", "kv_events=tcp://*:5557"]}"#,
        r#"{"worker_urls": ["http://a:1", "kv_engine_id=e1"]}"#,
    ] {
        assert!(GatewayConfig::from_json(bad).is_err(), "{bad} should be refused");
    }
}

#[test]
fn log_level_takes_level_names_and_refuses_typos() {
    for ok in ["debug", "info", "warn", "warning", "ERROR", "off", "pdgate_gateway=debug,info", "hyper=warn"] {
        assert!(cli(&["--log-level", ok]).validate().is_ok(), "{ok} should be accepted");
    }
    for bad in ["warnn", "", "verbose", "pdgate_gateway=loud", "=debug", "info,"] {
        let err = cli(&["--log-level", bad]).validate().unwrap_err().to_string();
        assert!(err.contains("--log-level") && err.contains("warning"), "{bad}: {err}");
    }
}

#[test]
fn schema_lists_every_serde_field_once_with_its_flag() {
    let schema = GatewayConfig::schema();
    let names: Vec<String> = schema["options"].as_array().unwrap().iter().map(|o| o["name"].as_str().unwrap().to_string()).collect();
    let json = serde_json::to_value(GatewayConfig::default()).unwrap();
    let mut fields: Vec<String> = json.as_object().unwrap().keys().cloned().collect();
    let mut sorted = names.clone();
    sorted.sort();
    fields.sort();
    assert_eq!(sorted, fields, "clap args and serde fields must be the same set");
    for o in schema["options"].as_array().unwrap() {
        assert_eq!(o["flag"].as_str().unwrap(), format!("--{}", o["name"].as_str().unwrap().replace('_', "-")));
    }
}

#[test]
fn version_and_help_name_the_program_they_were_called_as() {
    let err = GatewayConfig::parse_cli(["pdgate launch", "--version"]).err().map(|e| (e.kind(), e.to_string()));
    let (kind, text) = err.unwrap_or_else(|| panic!("--version must stop parsing"));
    assert_eq!(kind, clap::error::ErrorKind::DisplayVersion);
    assert_eq!(text.trim(), format!("pdgate launch {}", env!("CARGO_PKG_VERSION")));
    let help = GatewayConfig::parse_cli(["pdgate-gateway", "--help"]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(help.contains("Usage: pdgate-gateway"), "{help}");
}

#[test]
fn request_bounds_default_to_the_parsers_defaults_and_are_flags() {
    assert_eq!(GatewayConfig::default().limits(), pdgate_protocol::Limits::default());
    let c = cli(&["--max-n", "4", "--max-batch-size", "8", "--max-tools", "1"]);
    let l = c.limits();
    assert_eq!((l.max_n, l.max_batch_size, l.max_tools), (4, 8, 1));
    assert!(cli(&["--max-n", "0"]).validate().is_err());
}

/// The core reads no environment: a key in PDGATE_API_KEY reaches neither the defaults, nor the
/// schema, nor the JSON view. Only the command-line layers apply it, through `fill_from_env`.
#[test]
fn the_core_reads_no_environment() {
    // Safe in edition 2021; nothing in this crate reads the variable, which is the point.
    std::env::set_var("PDGATE_API_KEY", "leaked-from-env");
    std::env::set_var("PDGATE_ADMIN_API_KEY", "leaked-admin");
    assert_eq!(GatewayConfig::default().api_key, None);
    assert_eq!(cli(&[]).admin_api_key, None);
    assert_eq!(GatewayConfig::from_json("{}").unwrap().api_key, None);
    let schema = GatewayConfig::schema().to_string();
    assert!(!schema.contains("leaked"), "{schema}");
    std::env::remove_var("PDGATE_API_KEY");
    std::env::remove_var("PDGATE_ADMIN_API_KEY");
}

#[test]
fn env_fallbacks_fill_only_unset_options_through_the_given_lookup() {
    let env = |var: &str| match var {
        "PDGATE_API_KEY" => Some("from-env".to_string()),
        "PDGATE_ADMIN_API_KEY" => Some(String::new()),
        _ => None,
    };
    let mut c = cli(&[]);
    c.fill_from_env(env);
    assert_eq!((c.api_key.as_deref(), c.admin_api_key.as_deref()), (Some("from-env"), None), "an empty variable is unset");
    let mut c = cli(&["--api-key", "from-flag"]);
    c.fill_from_env(env);
    assert_eq!(c.api_key.as_deref(), Some("from-flag"), "the flag wins");
    let names: Vec<&str> = pdgate_core::config::ENV_FALLBACKS.iter().map(|(_, v)| *v).collect();
    assert_eq!(names, ["PDGATE_API_KEY", "PDGATE_ADMIN_API_KEY"]);
}

/// Issue 28: `--worker-urls` takes the tokens `--decode` takes after each URL (the JSON view is
/// the same token list), so a regular worker's registration has every field from every source.
#[test]
fn worker_urls_take_a_workers_fields_after_its_url() {
    let config = cli(&["--worker-urls", "http://a:1", "kv_events=tcp://a:5557", "kv_events_replay=tcp://a:5558", "label=zone=x", "http://b:1", "--worker-urls", "http://c:1"]);
    let workers = config.workers().unwrap();
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    assert_eq!(urls, ["http://a:1", "http://b:1", "http://c:1"]);
    assert_eq!((workers[0].kv_events.as_deref(), workers[0].kv_events_replay.as_deref()), (Some("tcp://a:5557"), Some("tcp://a:5558")));
    assert_eq!(workers[0].labels.get("zone").map(String::as_str), Some("x"));
    assert!(workers[1].kv_events.is_none() && workers[1].labels.is_empty());
    let from_json = GatewayConfig::from_json(&config.to_json()).unwrap();
    assert_eq!(from_json.workers().unwrap(), workers);
}

/// Issue 28: the colocated pool is accepted in every --pd-placement mode; under
/// `disaggregated` it is unused and the start-up log says so.
#[test]
fn worker_urls_are_accepted_in_every_pd_placement() {
    for mode in ["disaggregated", "colocated", "conditional"] {
        let config =
            cli(&["--pd-disaggregation", "--pd-placement", mode, "--prefill", "http://p:1", "--decode", "http://d:1", "--worker-urls", "http://c:1", "label=pool=colocated"]);
        config.validate().unwrap();
        assert_eq!(config.workers().unwrap().len(), 3, "{mode}");
        let warnings = config.warnings();
        assert_eq!(warnings.len(), usize::from(mode == "disaggregated"), "{mode}: {warnings:?}");
    }
    let warned = cli(&["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--worker-urls", "http://c:1"]).warnings();
    assert!(warned[0].contains("1 worker(s)") && warned[0].contains("never uses"), "{warned:?}");
    assert!(cli(&["--worker-urls", "http://c:1"]).warnings().is_empty(), "regular mode uses its workers");
    assert!(GatewayConfig::from_json(r#"{"worker_urls": ["http://a:1"], "pd_disaggregation": true}"#).is_ok());
}
