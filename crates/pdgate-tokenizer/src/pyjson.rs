//! JSON text as Python's `json.dumps(obj, ensure_ascii=False)` writes it, which is what Hugging
//! Face's `tojson` filter produces: `", "` and `": "` separators, or `indent` with `","` + newline.

use std::io;

use serde_json::ser::Formatter;

/// The formatter for `json.dumps(..., indent=None)` / `indent=N`.
pub(crate) struct PyFormatter {
    indent: Option<Vec<u8>>,
    depth: usize,
    has_value: bool,
}

impl PyFormatter {
    pub(crate) fn new(indent: Option<usize>) -> Self {
        Self { indent: indent.map(|n| vec![b' '; n]), depth: 0, has_value: false }
    }

    fn newline_indent<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(unit) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth {
                w.write_all(unit)?;
            }
        }
        Ok(())
    }

    fn separator<W: ?Sized + io::Write>(&self, w: &mut W, first: bool) -> io::Result<()> {
        match (&self.indent, first) {
            (None, true) => Ok(()),
            (None, false) => w.write_all(b", "),
            (Some(_), first) => {
                if !first {
                    w.write_all(b",")?;
                }
                self.newline_indent(w)
            }
        }
    }

    fn open<W: ?Sized + io::Write>(&mut self, w: &mut W, b: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(b)
    }

    fn close<W: ?Sized + io::Write>(&mut self, w: &mut W, b: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline_indent(w)?;
        }
        self.has_value = true;
        w.write_all(b)
    }
}

impl Formatter for PyFormatter {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.separator(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.separator(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub(crate) fn dumps(value: &serde_json::Value, indent: Option<usize>) -> String {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter::new(indent));
    // Serializing a serde_json::Value into a Vec cannot fail.
    let _ = serde::Serialize::serialize(value, &mut ser);
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::dumps;
    use serde_json::json;

    #[test]
    fn compact_form_uses_python_separators() {
        let v = json!({"a": [1, 2, {"b": "é"}], "c": {}, "d": []});
        assert_eq!(dumps(&v, None), r#"{"a": [1, 2, {"b": "é"}], "c": {}, "d": []}"#);
    }

    #[test]
    fn indented_form_matches_python() {
        let v = json!({"a": [1, {"b": null}], "e": []});
        assert_eq!(dumps(&v, Some(2)), "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"e\": []\n}");
    }
}
