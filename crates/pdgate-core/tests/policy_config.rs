//! The routing, pairing and breaker options in both views of the config.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_core::{BreakerConfig, GatewayConfig, PairingMode, PolicyName, PolicyOptions};

fn cli(args: &[&str]) -> Result<GatewayConfig, clap::Error> {
    let mut argv = vec!["pdgate-gateway"];
    argv.extend_from_slice(args);
    GatewayConfig::parse_cli(argv)
}

#[test]
fn defaults_follow_smg() {
    let c = GatewayConfig::default();
    assert_eq!((c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold), (0.3, 64, 1.5));
    assert_eq!(c.max_tree_size, 67_108_864);
    assert_eq!(c.pd_pairing_mode, PairingMode::Lenient);
    let b = BreakerConfig::from_config(&c);
    assert_eq!((b.enabled, b.failure_threshold, b.success_threshold, b.cooldown.as_secs()), (true, 5, 2, 30));
    assert_eq!(PolicyOptions::from_config(&c), PolicyOptions::default());
}

#[test]
fn policy_names_are_snake_case_on_the_cli_and_in_json() {
    let c = cli(&["--policy", "cache_aware", "--prefill-policy", "power_of_two", "--decode-policy", "consistent_hash", "--pd-pairing-mode", "strict"]).unwrap();
    assert_eq!(c.policy, PolicyName::CacheAware);
    assert_eq!(c.effective_prefill_policy(), PolicyName::PowerOfTwo);
    assert_eq!(c.effective_decode_policy(), PolicyName::ConsistentHash);
    assert_eq!(c.pd_pairing_mode, PairingMode::Strict);
    assert!(cli(&["--policy", "round_robin"]).is_ok());
    let j = GatewayConfig::from_json(r#"{"policy": "power_of_two", "pd_pairing_mode": "off", "disable_circuit_breaker": true}"#).unwrap();
    assert_eq!((j.policy, j.pd_pairing_mode), (PolicyName::PowerOfTwo, PairingMode::Off));
    assert!(!BreakerConfig::from_config(&j).enabled);
    assert_eq!(GatewayConfig::from_json(&c.to_json()).unwrap(), c);
    let schema = GatewayConfig::schema();
    let policy = schema["options"].as_array().unwrap().iter().find(|o| o["name"] == "policy").unwrap();
    let choices: Vec<&str> = policy["choices"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(choices, ["random", "round_robin", "power_of_two", "cache_aware", "consistent_hash", "least_tokens", "most_free_kv"]);
    let c = cli(&["--prefill-policy", "least_tokens", "--decode-policy", "most_free_kv"]).unwrap();
    assert_eq!((c.effective_prefill_policy(), c.effective_decode_policy()), (PolicyName::LeastTokens, PolicyName::MostFreeKv));
}

#[test]
fn out_of_range_thresholds_are_refused() {
    for bad in [
        r#"{"cache_threshold": 1.5}"#,
        r#"{"cache_threshold": -0.1}"#,
        r#"{"balance_rel_threshold": 0.5}"#,
        r#"{"breaker_failure_threshold": 0}"#,
        r#"{"pd_pairing_mode": "sometimes"}"#,
    ] {
        assert!(GatewayConfig::from_json(bad).is_err(), "{bad} should be refused");
    }
}
