//! Which refusals a configuration arms, in words: what `pdgate launch` logs at start, so an
//! operator sees every reason the gateway may turn a request away without reading the help.
//! Pure: the gateway logs the lines; tests read them.

use crate::config::GatewayConfig;
use crate::slo::{REPORTING_TPOT_MS, REPORTING_TTFT_MS};

/// One line per kind of refusal, armed or not (an "off" line says why it cannot happen).
pub fn armed_refusals(c: &GatewayConfig) -> Vec<String> {
    let mut lines = Vec::with_capacity(4);
    lines.push(match c.concurrency_limit() {
        Some(n) => format!(
            "admission: ARMED, {n} requests at once (--max-concurrent-requests), {} more wait up to {} s (--queue-size, --queue-timeout-secs); beyond: 429 queue_full, 408 queue_timeout",
            c.queue_size, c.queue_timeout_secs
        ),
        None => "admission: off (no --max-concurrent-requests); --max-connections bounds connections".to_string(),
    });
    lines.push(early_rejection(c));
    if c.pd_disaggregation {
        lines.push(format!(
            "decode KV room: ARMED, a PD request waits up to {} s (--queue-timeout-secs) for a decode that reports room for prompt + max_tokens, then 408 no_kv_room; decodes that report no free KV never hold a request",
            c.queue_timeout_secs
        ));
    }
    lines
}

fn early_rejection(c: &GatewayConfig) -> String {
    if !c.pd_disaggregation {
        return "early rejection: off (PD mode only)".to_string();
    }
    if c.admission_slack == 0.0 {
        return "early rejection: off (--admission-slack 0)".to_string();
    }
    match c.slo_ttft_ms {
        Some(ttft) => format!(
            "early rejection: ARMED, 429 overloaded when a request's predicted TTFT exceeds {ttft:.0} ms (--slo-ttft-ms, or its own x-slo-ttft-ms) x {} (--admission-slack), placement {}",
            c.admission_slack,
            c.pd_placement.as_str()
        ),
        None => format!(
            "early rejection: only for requests that send x-slo-ttft-ms (x {} --admission-slack); no --slo-ttft-ms, so goodput is reported against {REPORTING_TTFT_MS:.0} ms TTFT / {REPORTING_TPOT_MS:.0} ms TPOT and nothing else is refused for time",
            c.admission_slack
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> GatewayConfig {
        use clap::Parser;
        GatewayConfig::try_parse_from(std::iter::once("pdgate").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn the_defaults_arm_no_refusal_for_time() {
        let lines = armed_refusals(&config(&["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]));
        assert!(lines[0].starts_with("admission: off"), "{lines:?}");
        assert!(lines[1].starts_with("early rejection: only for requests that send x-slo-ttft-ms"), "{lines:?}");
        assert!(lines[2].starts_with("decode KV room: ARMED"), "{lines:?}");
    }

    #[test]
    fn set_objectives_and_limits_are_named_with_their_values() {
        let c = config(&["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--slo-ttft-ms", "750", "--max-concurrent-requests", "8"]);
        let lines = armed_refusals(&c);
        assert!(lines[0].contains("ARMED, 8 requests at once"), "{lines:?}");
        assert!(lines[1].contains("ARMED") && lines[1].contains("750 ms") && lines[1].contains("x 2"), "{lines:?}");
        let off = config(&["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--slo-ttft-ms", "750", "--admission-slack", "0"]);
        assert_eq!(armed_refusals(&off)[1], "early rejection: off (--admission-slack 0)");
        assert_eq!(armed_refusals(&config(&["--worker-urls", "http://w:1"])).len(), 2, "no KV-room wait outside PD mode");
    }
}
