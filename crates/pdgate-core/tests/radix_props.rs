//! The radix tree against a naive oracle: a list of every (text, worker) inserted.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_core::RadixTree;
use proptest::prelude::*;

/// Common prefix of two strings in bytes, at a character boundary.
fn lcp(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).map(|(c, _)| c.len_utf8()).sum()
}

/// Longest match over everything inserted, and the workers that have it.
fn oracle(entries: &[(String, String)], q: &str) -> (usize, Vec<String>) {
    let best = entries.iter().map(|(t, _)| lcp(q, t)).max().unwrap_or(0);
    if best == 0 {
        return (0, vec![]);
    }
    let mut who: Vec<String> = entries.iter().filter(|(t, _)| lcp(q, t) == best).map(|(_, w)| w.clone()).collect();
    who.sort();
    who.dedup();
    (best, who)
}

fn text() -> impl Strategy<Value = String> {
    // A small alphabet (with a two-byte character) so that prefixes are shared often.
    proptest::collection::vec(prop_oneof![Just('a'), Just('b'), Just('c'), Just('é')], 0..24).prop_map(|v| v.into_iter().collect())
}

fn worker() -> impl Strategy<Value = String> {
    (0..4u8).prop_map(|i| format!("http://w{i}:1"))
}

fn sorted(v: Vec<&str>) -> Vec<String> {
    let mut v: Vec<String> = v.into_iter().map(str::to_string).collect();
    v.sort();
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn matches_agree_with_the_oracle(inserts in proptest::collection::vec((text(), worker()), 0..40), queries in proptest::collection::vec(text(), 1..20)) {
        let mut tree = RadixTree::new();
        for (i, (t, w)) in inserts.iter().enumerate() {
            tree.insert(t, w, i as u64);
            prop_assert_eq!(tree.check_invariants(), Ok(()));
        }
        let all: Vec<String> = inserts.iter().map(|(t, _)| t.clone()).chain(queries).collect();
        for q in &all {
            let (m, who) = tree.best_match(q);
            prop_assert_eq!((m, sorted(who)), oracle(&inserts, q), "query {:?}", q);
        }
        let total: usize = inserts.iter().map(|(t, _)| t.len()).sum();
        prop_assert!(tree.size() <= total);
        for w in 0..4 {
            let key = format!("http://w{w}:1");
            let mine: Vec<usize> = inserts.iter().filter(|(_, x)| *x == key).map(|(t, _)| t.len()).collect();
            let size = tree.tenant_size(&key);
            prop_assert!(size <= mine.iter().sum::<usize>() && size >= mine.iter().copied().max().unwrap_or(0));
        }
    }

    #[test]
    fn eviction_bounds_size_keeps_the_latest_and_stays_sound(
        inserts in proptest::collection::vec((text(), worker()), 1..60),
        max in 8usize..64,
    ) {
        let mut tree = RadixTree::new();
        for (i, (t, w)) in inserts.iter().enumerate() {
            tree.insert(t, w, i as u64);
            tree.evict(max);
            prop_assert_eq!(tree.check_invariants(), Ok(()));
            prop_assert!(tree.size() <= max);
            // The most recent text survives whole when it fits under the eviction target.
            if t.len() <= max - max / 16 {
                let (m, who) = tree.best_match(t);
                prop_assert_eq!(m, t.len());
                prop_assert!(t.is_empty() || who.contains(&w.as_str()));
            }
        }
        // Whatever is left is sound: a reported worker really was sent that prefix.
        for (q, _) in &inserts {
            let (m, who) = tree.best_match(q);
            for w in who {
                prop_assert!(inserts.iter().any(|(t, x)| x == w && lcp(q, t) >= m), "{} never had {} bytes of {:?}", w, m, q);
            }
        }
    }

    #[test]
    fn removing_a_worker_is_like_never_inserting_it(inserts in proptest::collection::vec((text(), worker()), 0..40), gone in worker()) {
        let mut tree = RadixTree::new();
        for (i, (t, w)) in inserts.iter().enumerate() {
            tree.insert(t, w, i as u64);
        }
        tree.remove_tenant(&gone);
        prop_assert_eq!(tree.check_invariants(), Ok(()));
        let rest: Vec<(String, String)> = inserts.iter().filter(|(_, w)| *w != gone).cloned().collect();
        for (q, _) in &inserts {
            let (m, who) = tree.best_match(q);
            prop_assert_eq!((m, sorted(who)), oracle(&rest, q));
        }
        prop_assert_eq!(tree.tenant_size(&gone), 0);
    }
}
