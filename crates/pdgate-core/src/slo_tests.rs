use std::collections::HashMap;
use std::time::Duration;

use super::*;

const DEFAULTS: SloTargets = SloTargets::reporting();

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn streamed(ttft: u64, e2e: u64, out: u64) -> RequestFigures {
    RequestFigures { e2e: ms(e2e), ttft: Some(ms(ttft)), streamed: true, output_tokens: Some(out), ..Default::default() }
}

#[test]
fn tpot_is_the_mean_gap_after_the_first_token() {
    // 11 tokens: 10 gaps over 500 ms.
    assert_eq!(tpot(ms(700), ms(200), 11), ms(50));
    // One token (or none): no gap to divide by, the whole tail is one step.
    assert_eq!(tpot(ms(700), ms(200), 1), ms(500));
    assert_eq!(tpot(ms(700), ms(200), 0), ms(500));
    // A TTFT after E2E (clock skew cannot happen here, but saturate rather than panic).
    assert_eq!(tpot(ms(100), ms(200), 5), Duration::ZERO);
    assert_eq!(streamed(200, 700, 11).tpot(), Some(ms(50)));
}

#[test]
fn non_streamed_and_failed_requests_have_no_tpot() {
    let whole = RequestFigures { e2e: ms(900), ttft: Some(ms(900)), output_tokens: Some(10), ..Default::default() };
    assert_eq!(whole.tpot(), None);
    let failed = RequestFigures { failed: true, ..streamed(10, 20, 3) };
    assert_eq!(failed.tpot(), None);
}

#[test]
fn streamed_requests_are_judged_on_ttft_then_tpot() {
    assert_eq!(classify(&streamed(999, 1499, 11), &DEFAULTS), SloResult::Met);
    assert_eq!(classify(&streamed(1001, 1100, 11), &DEFAULTS), SloResult::TtftMissed);
    // Late on both: the TTFT miss is the one named.
    assert_eq!(classify(&streamed(1500, 9000, 11), &DEFAULTS), SloResult::TtftMissed);
    assert_eq!(classify(&streamed(100, 100 + 10 * 51, 11), &DEFAULTS), SloResult::TpotMissed);
    assert_eq!(classify(&streamed(100, 100 + 10 * 50, 11), &DEFAULTS), SloResult::Met);
    // A stream that delivered no content is judged on its end.
    let empty = RequestFigures { ttft: None, ..streamed(0, 1200, 0) };
    assert_eq!(classify(&empty, &DEFAULTS), SloResult::TtftMissed);
}

#[test]
fn non_streamed_requests_are_judged_on_the_budget_of_their_length() {
    let whole = |e2e: u64, out: u64| RequestFigures { e2e: ms(e2e), ttft: Some(ms(e2e)), output_tokens: Some(out), ..Default::default() };
    // 11 tokens: 1000 + 10 × 50 = 1500 ms.
    assert_eq!(classify(&whole(1500, 11), &DEFAULTS), SloResult::Met);
    assert_eq!(classify(&whole(1501, 11), &DEFAULTS), SloResult::TtftMissed);
    assert_eq!(classify(&whole(1001, 1), &DEFAULTS), SloResult::TtftMissed);
}

#[test]
fn a_failure_is_failed_whatever_its_times() {
    let f = RequestFigures { failed: true, ..streamed(1, 2, 2) };
    assert_eq!(classify(&f, &DEFAULTS), SloResult::Failed);
    assert_eq!(SloResult::ALL.map(SloResult::as_str), ["met", "ttft_missed", "tpot_missed", "failed"]);
}

fn headers(pairs: &[(&'static str, &'static str)]) -> HashMap<&'static str, &'static [u8]> {
    pairs.iter().map(|(k, v)| (*k, v.as_bytes())).collect()
}

fn parse(pairs: &[(&'static str, &'static str)]) -> Result<SloTargets, BadSloHeader> {
    let h = headers(pairs);
    DEFAULTS.with_headers(|name| h.get(name).copied())
}

#[test]
fn headers_override_the_defaults_in_either_spelling() {
    assert_eq!(parse(&[]), Ok(DEFAULTS));
    assert_eq!(parse(&[("x-slo-ttft-ms", "250")]), Ok(SloTargets::set(250.0, 50.0)));
    assert_eq!(parse(&[("x-llm-d-slo-ttft-ms", "300"), ("x-llm-d-slo-tpot-ms", "12.5")]), Ok(SloTargets::set(300.0, 12.5)));
    // pdgate's own spelling wins over llm-d's when both are sent.
    assert_eq!(parse(&[("x-slo-tpot-ms", "20"), ("x-llm-d-slo-tpot-ms", "99")]), Ok(SloTargets { ttft_ms: 1000.0, tpot_ms: 20.0, ttft_set: false }));
    assert_eq!(parse(&[("x-slo-ttft-ms", " 40 ")]).map(|t| t.ttft_ms), Ok(40.0));
}

#[test]
fn only_a_chosen_ttft_objective_may_refuse() {
    // The reporting objective is not chosen; a TTFT header chooses one for its request, a
    // TPOT header alone does not (early rejection is judged on TTFT), and an operator's stays.
    assert!(!parse(&[]).unwrap().ttft_set);
    assert!(parse(&[("x-llm-d-slo-ttft-ms", "300")]).unwrap().ttft_set);
    assert!(!parse(&[("x-slo-tpot-ms", "20")]).unwrap().ttft_set);
    let operator = SloTargets::set(400.0, 30.0);
    assert_eq!(operator.with_headers(|_| None), Ok(operator));
}

#[test]
fn a_bad_header_is_refused_by_name() {
    for bad in ["", "abc", "-5", "0", "NaN", "inf", "1e12", "\u{e9}"] {
        let h: HashMap<&str, &[u8]> = [("x-llm-d-slo-tpot-ms", bad.as_bytes())].into_iter().collect();
        let err = DEFAULTS.with_headers(|name| h.get(name).copied()).unwrap_err();
        assert_eq!(err.header, "x-llm-d-slo-tpot-ms", "{bad:?}");
        assert!(err.message.contains("x-llm-d-slo-tpot-ms"), "{}", err.message);
    }
    let h: HashMap<&str, &[u8]> = [("x-slo-ttft-ms", &[0xff_u8, 0xfe][..])].into_iter().collect();
    assert_eq!(DEFAULTS.with_headers(|name| h.get(name).copied()).unwrap_err().header, "x-slo-ttft-ms");
}

#[test]
fn goodput_counts_the_last_window_only() {
    let mut w = GoodputWindow::new(10);
    assert_eq!(w.rate(0), 0.0);
    for _ in 0..5 {
        w.record(100);
    }
    w.record(105);
    w.record(109);
    assert_eq!(w.rate(109), 7.0 / 10.0);
    // Second 100 leaves the window at 110; 105 at 115.
    assert_eq!(w.rate(110), 2.0 / 10.0);
    assert_eq!(w.rate(115), 1.0 / 10.0);
    assert_eq!(w.rate(119), 0.0);
    // A slot reused by a later second starts from zero (100 and 120 share a slot).
    w.record(120);
    assert_eq!(w.rate(120), 1.0 / 10.0);
    // Seconds from the future (not possible with a monotonic clock) are not counted.
    assert_eq!(w.rate(50), 0.0);
}

#[test]
fn goodput_window_is_at_least_one_second() {
    let mut w = GoodputWindow::new(0);
    assert_eq!(w.secs(), 1);
    w.record(3);
    w.record(3);
    assert_eq!(w.rate(3), 2.0);
    assert_eq!(w.rate(4), 0.0);
}
