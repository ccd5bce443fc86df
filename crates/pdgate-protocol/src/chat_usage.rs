//! A chat `usage` object's counts, for the stream translators' last events (Messages,
//! Responses): read from its bytes by the structural scanner when it is the usual object of
//! plain counts, else from the parsed value, with the same meaning either way (a count that is
//! not an unsigned integer is absent, as `Value::as_u64` reads it). Parsing it into a value and
//! building the translated usage as another cost more than the rest of the stream's last events.

use serde_json::Value;

use crate::json_scan::Scan;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct UsageCounts {
    pub prompt: Option<u64>,
    pub completion: Option<u64>,
    pub total: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached: Option<u64>,
    /// `completion_tokens_details.reasoning_tokens`.
    pub reasoning: Option<u64>,
}

impl UsageCounts {
    /// The counts of a chat `usage` object's JSON; `None` when it is not an object (or not JSON).
    pub(crate) fn read(raw: &[u8]) -> Option<Self> {
        scan(raw).or_else(|| Self::of_value(&serde_json::from_slice(raw).ok()?))
    }

    /// The counts of a parsed `usage`; `None` when it is not an object.
    pub(crate) fn of_value(u: &Value) -> Option<Self> {
        let obj = u.as_object()?;
        let n = |k: &str| obj.get(k).and_then(Value::as_u64);
        let inner = |k: &str, j: &str| obj.get(k).and_then(|d| d.get(j)).and_then(Value::as_u64);
        Some(UsageCounts {
            prompt: n("prompt_tokens"),
            completion: n("completion_tokens"),
            total: n("total_tokens"),
            cached: inner("prompt_tokens_details", "cached_tokens"),
            reasoning: inner("completion_tokens_details", "reasoning_tokens"),
        })
    }
}

/// The fast read: an object whose counts (and their details' counts) are digits or `null`,
/// each key once; anything else is `None` (the caller parses).
fn scan(raw: &[u8]) -> Option<UsageCounts> {
    if raw.first() != Some(&b'{') {
        return None;
    }
    let mut s = Scan { b: raw, i: 0 };
    let mut c = UsageCounts::default();
    let mut seen = 0u8;
    s.object(|s, key, _, _| {
        let (bit, slot) = match key {
            b"prompt_tokens" => (1, &mut c.prompt),
            b"completion_tokens" => (2, &mut c.completion),
            b"total_tokens" => (4, &mut c.total),
            b"prompt_tokens_details" => {
                once(&mut seen, 8)?;
                return details(s, b"cached_tokens", &mut c.cached);
            }
            b"completion_tokens_details" => {
                once(&mut seen, 16)?;
                return details(s, b"reasoning_tokens", &mut c.reasoning);
            }
            _ => return s.value().map(drop),
        };
        once(&mut seen, bit)?;
        *slot = count(s)?;
        Some(())
    })?;
    s.ws();
    (s.i == raw.len()).then_some(c)
}

/// A details object (or `null`) with one count of interest.
fn details(s: &mut Scan<'_>, want: &[u8], slot: &mut Option<u64>) -> Option<()> {
    if s.peek_after_ws()? != b'{' {
        return count(s)?.is_none().then_some(());
    }
    let mut seen = false;
    s.object(|s, key, _, _| {
        if key != want {
            return s.value().map(drop);
        }
        if std::mem::replace(&mut seen, true) {
            return None;
        }
        *slot = count(s)?;
        Some(())
    })
}

/// A count: `Some(n)` for digits that fit, `None` inside for `null`; anything else refused.
fn count(s: &mut Scan<'_>) -> Option<Option<u64>> {
    // Digits only, within u64 (a bigger number is a float to the parse: the slow path).
    let at = s.i;
    if let Some(n) = s.plain_u64() {
        return Some(Some(n));
    }
    s.i = at;
    let (a, z) = s.value()?;
    (&s.b[a..z] == b"null").then_some(None)
}

fn once(seen: &mut u8, bit: u8) -> Option<()> {
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}

#[cfg(test)]
mod tests {
    use super::{scan, UsageCounts};

    /// The scan reads what the parsed value says, and leaves to the parse what it cannot tell.
    #[test]
    fn the_scan_agrees_with_the_value_or_declines() {
        let agree = [
            &br#"{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}"#[..],
            br#"{ "prompt_tokens" : 10 , "total_tokens":null,"completion_tokens":0,"x":[1,{"a":"}"}]}"#,
            br#"{"prompt_tokens":7,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":4,"other":1},"completion_tokens_details":{"reasoning_tokens":9}}"#,
            br#"{"prompt_tokens":7,"prompt_tokens_details":null,"completion_tokens_details":{}}"#,
            br#"{}"#,
        ];
        for raw in agree {
            let want = serde_json::from_slice(raw).ok().as_ref().and_then(UsageCounts::of_value);
            assert!(want.is_some());
            assert_eq!(scan(raw), want, "{}", String::from_utf8_lossy(raw));
            assert_eq!(UsageCounts::read(raw), want);
        }
        let declined = [
            &br#"{"prompt_tokens":3.0}"#[..],
            br#"{"prompt_tokens":-1}"#,
            br#"{"prompt_tokens":"3"}"#,
            br#"{"prompt_tokens":1,"prompt_tokens":2}"#,
            br#"{"prompt_tokens":99999999999999999999}"#,
            br#"{"prompt_tokens":01}"#,
            br#"{"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":2}}"#,
            br#"{"prompt_tokens_details":5}"#,
            br#"[1]"#,
        ];
        for raw in declined {
            assert_eq!(scan(raw), None, "{}", String::from_utf8_lossy(raw));
            // What the value says (here: counts that are not unsigned integers are absent).
            let want = serde_json::from_slice(raw).ok().as_ref().and_then(UsageCounts::of_value);
            assert_eq!(UsageCounts::read(raw), want, "{}", String::from_utf8_lossy(raw));
        }
        assert_eq!(UsageCounts::read(br#"{"prompt_tokens":1,"prompt_tokens":2}"#).and_then(|c| c.prompt), Some(2), "the parse takes the last");
        assert_eq!(UsageCounts::read(b"[1]"), None);
    }
}
