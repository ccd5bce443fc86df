//! A structural walk over JSON bytes without building values: keys and value ranges, strings
//! found by `memchr`, nothing allocated. The relay's fast paths (`resume_scan.rs`,
//! `content.rs`) read stream events with it; anything it does not recognise is `None`, and
//! the caller parses instead.

/// The JSON object of an SSE event that is one `data:` line holding an object (`raw` without
/// its separator); `None` for any other event (those take the callers' parse paths).
pub(crate) fn event_object(raw: &[u8]) -> Option<&[u8]> {
    let rest = raw.strip_prefix(b"data:")?;
    let payload = rest.strip_prefix(b" ").unwrap_or(rest);
    (payload.first() == Some(&b'{') && memchr::memchr2(b'\n', b'\r', payload).is_none()).then_some(payload)
}

pub(crate) struct Scan<'a> {
    pub(crate) b: &'a [u8],
    pub(crate) i: usize,
}

impl<'a> Scan<'a> {
    pub(crate) fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    pub(crate) fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    pub(crate) fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// A string at the cursor: its raw content (escapes left as they are).
    pub(crate) fn string(&mut self) -> Option<&'a [u8]> {
        self.ws();
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.i + 1;
        let mut j = start;
        // Most strings of a stream event are short (keys, ids, a token's text): a plain loop
        // over their first bytes costs less than setting up memchr for each.
        let short = (start + 24).min(self.b.len());
        while j < short {
            match self.b[j] {
                b'"' => {
                    self.i = j + 1;
                    return Some(&self.b[start..j]);
                }
                b'\\' => j += 2,
                _ => j += 1,
            }
        }
        while let Some(k) = memchr::memchr2(b'\\', b'"', self.b.get(j..)?) {
            j += k;
            if self.b[j] == b'"' {
                self.i = j + 1;
                return Some(&self.b[start..j]);
            }
            j += 2; // an escape: the next byte is never the string's end
        }
        None
    }

    /// Skips one value; returns its range.
    pub(crate) fn value(&mut self) -> Option<(usize, usize)> {
        self.ws();
        let start = self.i;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'{' | b'[' => {
                let mut depth = 0usize;
                while self.i < self.b.len() {
                    match self.b[self.i] {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some((start, self.i));
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
                return None;
            }
            _ => {
                while self.i < self.b.len() && !matches!(self.b[self.i], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    self.i += 1;
                }
                if self.i == start {
                    return None;
                }
            }
        }
        Some((start, self.i))
    }

    /// Skips one value and reads it as an unsigned integer in plain digits (no sign, fraction,
    /// exponent or leading zero) within u64: what `Value::as_u64` of the parsed value gives,
    /// for the values written that way; `None` for any other value.
    pub(crate) fn plain_u64(&mut self) -> Option<u64> {
        let (a, z) = self.value()?;
        let raw = &self.b[a..z];
        if raw.len() > 1 && raw[0] == b'0' {
            return None;
        }
        raw.iter().try_fold(0u64, |n, &d| if d.is_ascii_digit() { n.checked_mul(10)?.checked_add(u64::from(d - b'0')) } else { None })
    }

    /// Walks the object at the cursor: `f(scan, key, key_start, before)` is called with the
    /// cursor at the member's value and must consume it; `before` is the comma that precedes
    /// the member, if any. Keys with escapes are refused.
    pub(crate) fn object(&mut self, mut f: impl FnMut(&mut Self, &'a [u8], usize, Option<usize>) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        let mut before = None;
        loop {
            self.ws();
            let key_start = self.i;
            let key = self.string()?;
            if key.contains(&b'\\') {
                return None;
            }
            self.eat(b':')?;
            f(self, key, key_start, before)?;
            self.ws();
            match self.peek()? {
                b',' => {
                    before = Some(self.i);
                    self.i += 1;
                }
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// Walks the array at the cursor: `f(scan)` is called with the cursor at each element and
    /// must consume it. Returns how many elements there were.
    pub(crate) fn array(&mut self, mut f: impl FnMut(&mut Self) -> Option<()>) -> Option<usize> {
        self.eat(b'[')?;
        let mut n = 0;
        loop {
            match self.peek_after_ws()? {
                b']' => {
                    self.i += 1;
                    return Some(n);
                }
                b',' if n > 0 => self.i += 1,
                _ if n > 0 => return None,
                _ => {}
            }
            f(self)?;
            n += 1;
        }
    }

    /// A string with no escape and no control character (what serde_json would refuse or
    /// decode), as text: the usual request readers take only these.
    pub(crate) fn plain_str(&mut self) -> Option<&'a str> {
        let b = self.string()?;
        if b.iter().any(|&c| c == b'\\' || c < 0x20) {
            return None;
        }
        std::str::from_utf8(b).ok()
    }

    /// `true` or `false`; `None` for any other value.
    pub(crate) fn boolean(&mut self) -> Option<bool> {
        let (a, z) = self.value()?;
        match &self.b[a..z] {
            b"true" => Some(true),
            b"false" => Some(false),
            _ => None,
        }
    }

    /// Nothing but whitespace is left: the whole input was one value.
    pub(crate) fn end(&mut self) -> Option<()> {
        self.ws();
        (self.i == self.b.len()).then_some(())
    }

    pub(crate) fn peek_after_ws(&mut self) -> Option<u8> {
        self.ws();
        self.peek()
    }

    pub(crate) fn i_after_ws(&mut self) -> usize {
        self.ws();
        self.i
    }
}

#[cfg(test)]
mod tests {
    use super::Scan;

    /// Strings of every length around the short loop's end, with an escape at each place (an
    /// escaped quote or backslash is never the end), read as serde_json reads them.
    #[test]
    fn strings_end_at_their_closing_quote_at_any_length() {
        for len in 0..40 {
            for esc_at in 0..=len {
                for esc in [&br#"\""#[..], br"\\", br"\n", br"\u00e9"] {
                    let mut raw = vec![b'a'; len];
                    if esc_at < len {
                        raw.splice(esc_at..esc_at, esc.iter().copied());
                    }
                    let mut json = b"\"".to_vec();
                    json.extend_from_slice(&raw);
                    json.extend_from_slice(b"\",1");
                    let mut s = Scan { b: &json, i: 0 };
                    assert_eq!(s.string(), Some(&raw[..]), "{}", String::from_utf8_lossy(&json));
                    assert_eq!(&json[s.i..], b",1");
                    let unterminated = &json[..raw.len() + 1];
                    assert_eq!(Scan { b: unterminated, i: 0 }.string(), None, "{}", String::from_utf8_lossy(unterminated));
                }
            }
        }
    }
}
