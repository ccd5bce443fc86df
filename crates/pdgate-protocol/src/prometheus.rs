//! A small reader of the Prometheus text exposition format (version 0.0.4), enough for the
//! gauges engines export about their load: `name{label="value",...} number [timestamp]`.
//!
//! Workers are not trusted: the parser never panics, skips lines it does not understand
//! (comments, malformed samples) and keeps only the series whose names the caller asks for, so
//! a huge `/metrics` page costs one pass and no allocation per unrelated line.

/// One sample: its labels (unescaped) and value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// The samples of `text` whose metric name is one of `wanted`, in page order.
pub fn samples(text: &str, wanted: &[&str]) -> Vec<Sample> {
    text.lines().filter_map(|line| parse_line(line, wanted)).collect()
}

/// One sample line, when its name is wanted and it parses.
fn parse_line(line: &str, wanted: &[&str]) -> Option<Sample> {
    let line = line.trim_start();
    if line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_ascii_whitespace())?;
    let name = &line[..name_end];
    if !wanted.contains(&name) {
        return None;
    }
    let rest = &line[name_end..];
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => parse_labels(inner)?,
        None => (Vec::new(), rest),
    };
    let value = parse_value(rest.split_ascii_whitespace().next()?)?;
    Some(Sample { name: name.to_string(), labels, value })
}

/// `key="value",...}` and what follows the closing brace.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_string();
        let (value, rest) = quoted(s[eq + 1..].trim_start())?;
        labels.push((key, value));
        s = rest;
    }
}

/// A double-quoted label value with `\\`, `\"` and `\n` escapes, and what follows it.
fn quoted(s: &str) -> Option<(String, &str)> {
    let body = s.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &body[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// A sample value: a float, or `NaN`, `+Inf`, `-Inf` as the format spells them.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        s => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_with_and_without_labels() {
        let text = "# HELP a x\n# TYPE a gauge\na 3\nb{x=\"1\"} 2.5 1700000000\nc{k=\"v\"} 1\n  a{q=\"a,b\",r=\"say \\\"hi\\\"\\n\"} -Inf\n";
        let got = samples(text, &["a", "b"]);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], Sample { name: "a".into(), labels: vec![], value: 3.0 });
        assert_eq!(got[1].label("x"), Some("1"));
        assert_eq!(got[1].value, 2.5);
        assert_eq!(got[2].label("q"), Some("a,b"));
        assert_eq!(got[2].label("r"), Some("say \"hi\"\n"));
        assert_eq!(got[2].value, f64::NEG_INFINITY);
    }

    #[test]
    fn malformed_lines_are_skipped() {
        let text = "a{x=\"1\" 2\na{x=1} 2\na{x=\"1\"}\na not_a_number\na{x=\"unterminated} 1\na 7\n";
        let got = samples(text, &["a"]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].value, 7.0);
    }

    #[test]
    fn a_trailing_comma_in_labels_is_accepted() {
        let got = samples("vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",} 1.0\n", &["vllm:cache_config_info"]);
        assert_eq!(got[0].label("block_size"), Some("16"));
        assert_eq!(got[0].label("cache_dtype"), Some("auto"));
    }
}
