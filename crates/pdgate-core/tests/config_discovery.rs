//! The Kubernetes discovery options (`--service-discovery` and its selectors) and their checks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_core::GatewayConfig;

fn cli(args: &[&str]) -> Result<GatewayConfig, String> {
    let mut argv = vec!["pdgate-gateway"];
    argv.extend_from_slice(args);
    let c = GatewayConfig::parse_cli(argv).map_err(|e| e.to_string())?;
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

#[test]
fn smg_style_discovery_flags_parse() {
    let c = cli(&[
        "--pd-disaggregation",
        "--service-discovery",
        "--prefill-selector",
        "app=sglang",
        "role=prefill",
        "--decode-selector",
        "app=sglang",
        "role=decode",
        "--service-discovery-namespace",
        "ml",
        "--service-discovery-port",
        "30000",
        "--kubeconfig",
        "/k/config",
    ])
    .unwrap();
    assert_eq!(c.prefill_selector, ["app=sglang", "role=prefill"]);
    assert_eq!(c.decode_selector.len(), 2);
    assert_eq!(c.service_discovery_namespace.as_deref(), Some("ml"));
    assert_eq!(c.service_discovery_port, 30000);
    assert_eq!(GatewayConfig::from_json(&c.to_json()).unwrap(), c, "JSON and CLI views agree");
    let regular = cli(&["--service-discovery", "--selector", "app=worker", "--selector", "tier=gpu"]).unwrap();
    assert_eq!(regular.selector, ["app=worker", "tier=gpu"], "repeated flags accumulate");
    assert_eq!(GatewayConfig::default().service_discovery_port, 80, "SMG's default");
    assert_eq!(GatewayConfig::default().service_discovery_namespace, None, "all namespaces by default");
}

#[test]
fn discovery_options_are_checked() {
    for (args, why) in [
        (&["--selector", "app=w"][..], "selectors need --service-discovery"),
        (&["--service-discovery", "--prefill-selector", "app=p"][..], "PD selectors need --pd-disaggregation"),
        (&["--service-discovery"][..], "an empty selector would take every pod"),
        (&["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=p"][..], "PD mode needs both selectors"),
        (&["--service-discovery", "--selector", "app"][..], "KEY=VALUE"),
        (&["--service-discovery", "--selector", "=x"][..], "empty key"),
        (&["--service-discovery", "--selector", "a=w", "--service-discovery-port", "0"][..], "port 0"),
    ] {
        assert!(cli(args).is_err(), "{args:?} should be refused: {why}");
    }
    assert!(cli(&["--pd-disaggregation", "--service-discovery", "--selector", "team=ml", "--prefill-selector", "app=p", "--decode-selector", "app=d"]).is_ok());
    assert!(GatewayConfig::from_json(r#"{"service_discovery": true, "selector": ["app=w"], "kubeconfig": "/k"}"#).is_ok());
    assert!(GatewayConfig::from_json(r#"{"selector": ["app=w"]}"#).is_err());
}
