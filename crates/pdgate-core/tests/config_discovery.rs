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
}

#[test]
fn the_encode_selector_is_for_epd_mode_only() {
    let epd = ["--epd-disaggregation", "--service-discovery", "--prefill-selector", "app=p", "--decode-selector", "app=d"];
    let c = cli(&[&epd[..], &["--encode-selector", "app=sglang", "role=encode"]].concat()).unwrap();
    assert_eq!(c.encode_selector, ["app=sglang", "role=encode"]);
    assert_eq!(GatewayConfig::from_json(&c.to_json()).unwrap(), c, "JSON and CLI views agree");
    assert!(cli(&epd).is_ok(), "optional: encode workers may come from --encode or the API");
    for (args, why) in [
        (
            &["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=p", "--decode-selector", "app=d", "--encode-selector", "app=e"][..],
            "PD mode has no encode workers",
        ),
        (&["--service-discovery", "--selector", "app=w", "--encode-selector", "app=e"][..], "regular mode has no encode workers"),
        (&["--epd-disaggregation", "--encode-selector", "app=e"][..], "selectors need --service-discovery"),
        (&[&epd[..], &["--encode-selector", "app"]].concat()[..], "KEY=VALUE"),
    ] {
        assert!(cli(args).is_err(), "{args:?} should be refused: {why}");
    }
    let err = cli(&["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=p", "--decode-selector", "app=d", "--encode-selector", "app=e"]).unwrap_err();
    assert!(err.contains("--encode-selector needs --epd-disaggregation"), "{err}");
    let json = r#"{"epd_disaggregation": true, "service_discovery": true, "prefill_selector": ["app=p"], "decode_selector": ["app=d"], "encode_selector": ["app=e"]}"#;
    assert_eq!(GatewayConfig::from_json(json).unwrap().encode_selector, ["app=e"]);
    assert!(GatewayConfig::from_json(
        r#"{"pd_disaggregation": true, "service_discovery": true, "prefill_selector": ["app=p"], "decode_selector": ["app=d"], "encode_selector": ["app=e"]}"#
    )
    .is_err());
    assert!(GatewayConfig::from_json(r#"{"selector": ["app=w"]}"#).is_err());
}
