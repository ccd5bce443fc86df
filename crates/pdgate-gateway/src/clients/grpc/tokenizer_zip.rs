//! A `GetTokenizer` answer: the model directory's tokenizer files as one zip (SMG's contract:
//! the chunks' bytes concatenated, the last chunk's `sha256` the digest of the whole zip).
//!
//! Only what a tokenizer bundle needs is read: the central directory, stored (0) and deflated
//! (8) entries, no zip64, no encryption. Entries are found by file name wherever they sit in the
//! archive (a servicer may zip the directory with or without a folder prefix).

use pdgate_tokenizer::ModelTokenizer;

/// The largest bundle and the largest unpacked file taken (a real `tokenizer.json` is tens of MB).
pub const MAX_BUNDLE_BYTES: usize = 256 << 20;
const MAX_FILE_BYTES: usize = 256 << 20;

const EOCD_SIG: u32 = 0x0605_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;
const EOCD_LEN: usize = 22;

fn u16_at(b: &[u8], at: usize) -> Option<usize> {
    b.get(at..at + 2).map(|s| usize::from(u16::from_le_bytes([s[0], s[1]])))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Checks the bundle against the digest the worker sent (hex SHA-256). An empty digest (a
/// servicer that sends none) is accepted; a wrong one is an error.
pub fn verify_sha256(data: &[u8], expected_hex: &str) -> Result<(), String> {
    if expected_hex.is_empty() {
        return Ok(());
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, data);
    let got: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    if got.eq_ignore_ascii_case(expected_hex.trim()) {
        Ok(())
    } else {
        Err(format!("GetTokenizer bundle is corrupt: sha256 {got}, the worker announced {expected_hex}"))
    }
}

/// One entry of the central directory.
struct Entry<'a> {
    name: &'a str,
    method: usize,
    compressed: usize,
    size: usize,
    local_offset: usize,
}

fn entries(zip: &[u8]) -> Result<Vec<Entry<'_>>, String> {
    let bad = |what: &str| format!("GetTokenizer bundle is not a readable zip: {what}");
    // The end-of-central-directory record: the last signature within the comment's reach.
    let from = zip.len().saturating_sub(EOCD_LEN + 0xFFFF);
    let eocd = (from..=zip.len().saturating_sub(EOCD_LEN)).rev().find(|&i| u32_at(zip, i) == Some(EOCD_SIG)).ok_or_else(|| bad("no end of central directory"))?;
    let count = u16_at(zip, eocd + 10).ok_or_else(|| bad("truncated"))?;
    let mut at = u32_at(zip, eocd + 16).ok_or_else(|| bad("truncated"))? as usize;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        if u32_at(zip, at) != Some(CENTRAL_SIG) {
            return Err(bad("broken central directory"));
        }
        let field = |off: usize| u16_at(zip, at + off).ok_or_else(|| bad("truncated"));
        let word = |off: usize| u32_at(zip, at + off).map(|v| v as usize).ok_or_else(|| bad("truncated"));
        let (method, compressed, size) = (field(10)?, word(20)?, word(24)?);
        let (name_len, extra_len, comment_len) = (field(28)?, field(30)?, field(32)?);
        let local_offset = word(42)?;
        let name = zip.get(at + 46..at + 46 + name_len).ok_or_else(|| bad("truncated"))?;
        let name = std::str::from_utf8(name).map_err(|_| bad("a file name is not UTF-8"))?;
        out.push(Entry { name, method, compressed, size, local_offset });
        at += 46 + name_len + extra_len + comment_len;
    }
    Ok(out)
}

fn contents(zip: &[u8], e: &Entry<'_>) -> Result<Vec<u8>, String> {
    let bad = |what: &str| format!("GetTokenizer bundle: {}: {what}", e.name);
    if e.size > MAX_FILE_BYTES {
        return Err(bad("too large"));
    }
    let at = e.local_offset;
    if u32_at(zip, at) != Some(LOCAL_SIG) {
        return Err(bad("broken local header"));
    }
    let start = at + 30 + u16_at(zip, at + 26).ok_or_else(|| bad("truncated"))? + u16_at(zip, at + 28).ok_or_else(|| bad("truncated"))?;
    let raw = zip.get(start..start + e.compressed).ok_or_else(|| bad("truncated"))?;
    let data = match e.method {
        0 => raw.to_vec(),
        8 => miniz_oxide::inflate::decompress_to_vec_with_limit(raw, MAX_FILE_BYTES).map_err(|err| bad(&format!("cannot inflate: {err}")))?,
        m => return Err(bad(&format!("compression method {m} is not supported (stored or deflate only)"))),
    };
    if data.len() != e.size {
        return Err(bad("size does not match the directory"));
    }
    Ok(data)
}

/// The file called `base` (by its last path component), if the bundle has one.
fn file(zip: &[u8], all: &[Entry<'_>], base: &str) -> Result<Option<Vec<u8>>, String> {
    match all.iter().find(|e| e.name.rsplit('/').next() == Some(base)) {
        Some(e) => contents(zip, e).map(Some),
        None => Ok(None),
    }
}

/// Loads the tokenizer from a bundle with the same loader as `--model-path` (tokenizer.json,
/// tokenizer_config.json's chat template and special tokens, else `chat_template.jinja`).
pub fn load_bundle(zip: &[u8]) -> Result<ModelTokenizer, String> {
    let all = entries(zip)?;
    let tokenizer = file(zip, &all, "tokenizer.json")?.ok_or("GetTokenizer bundle has no tokenizer.json")?;
    let config = file(zip, &all, "tokenizer_config.json")?;
    let template = file(zip, &all, "chat_template.jinja")?.map(|t| String::from_utf8_lossy(&t).into_owned());
    ModelTokenizer::from_parts(&tokenizer, config.as_deref(), template.as_deref()).map_err(|e| format!("GetTokenizer bundle: {e}"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A zip of `files`, stored (method 0) or deflated (8), as Python's zipfile writes them.
    pub(crate) fn zip_of(files: &[(&str, &[u8])], deflate: bool) -> Vec<u8> {
        let (mut out, mut central) = (Vec::new(), Vec::new());
        for (name, data) in files {
            let body = if deflate { miniz_oxide::deflate::compress_to_vec(data, 6) } else { data.to_vec() };
            let method: u16 = if deflate { 8 } else { 0 };
            let offset = out.len() as u32;
            let head = |sig: u32, buf: &mut Vec<u8>, central: bool| {
                buf.extend_from_slice(&sig.to_le_bytes());
                if central {
                    buf.extend_from_slice(&20u16.to_le_bytes());
                }
                buf.extend_from_slice(&[20, 0, 0, 0]);
                buf.extend_from_slice(&method.to_le_bytes());
                buf.extend_from_slice(&[0; 8]); // time, date, crc (not checked: the sha256 covers it)
                buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
                buf.extend_from_slice(&(data.len() as u32).to_le_bytes());
                buf.extend_from_slice(&(name.len() as u16).to_le_bytes());
                buf.extend_from_slice(&0u16.to_le_bytes());
                if central {
                    buf.extend_from_slice(&[0; 10]); // comment length, disk, attributes
                    buf.extend_from_slice(&offset.to_le_bytes());
                }
                buf.extend_from_slice(name.as_bytes());
            };
            head(LOCAL_SIG, &mut out, false);
            out.extend_from_slice(&body);
            head(CENTRAL_SIG, &mut central, true);
        }
        let (cd_offset, cd_len, n) = (out.len() as u32, central.len() as u32, files.len() as u16);
        out.extend_from_slice(&central);
        out.extend_from_slice(&EOCD_SIG.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&cd_len.to_le_bytes());
        out.extend_from_slice(&cd_offset.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    pub(crate) fn fixture_files() -> Vec<(String, Vec<u8>)> {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ["tokenizer.json", "tokenizer_config.json"].iter().map(|f| (format!("model/{f}"), std::fs::read(format!("{dir}/{f}")).unwrap())).collect()
    }

    pub(crate) fn fixture_zip(deflate: bool) -> Vec<u8> {
        let files = fixture_files();
        let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
        zip_of(&refs, deflate)
    }

    #[test]
    fn a_bundle_loads_like_the_model_directory_stored_or_deflated() {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        let from_dir = ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap();
        for deflate in [false, true] {
            let tok = load_bundle(&fixture_zip(deflate)).unwrap();
            assert_eq!(tok.encode("hello world", true).unwrap(), from_dir.encode("hello world", true).unwrap());
            assert_eq!(tok.eos_token_id(), from_dir.eos_token_id());
            assert_eq!(tok.has_chat_template(), from_dir.has_chat_template());
        }
    }

    #[test]
    fn broken_or_incomplete_bundles_are_errors() {
        assert!(load_bundle(b"not a zip").unwrap_err().contains("not a readable zip"));
        let cfg_only = zip_of(&[("tokenizer_config.json", b"{}")], false);
        assert!(load_bundle(&cfg_only).unwrap_err().contains("no tokenizer.json"));
        let mut cut = fixture_zip(true);
        cut.truncate(cut.len() / 2);
        assert!(load_bundle(&cut).is_err());
    }

    #[test]
    fn the_digest_is_checked_when_sent() {
        let data = b"abc";
        // SHA-256("abc"), the FIPS 180-2 example.
        let good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(verify_sha256(data, good).is_ok());
        assert!(verify_sha256(data, &good.to_uppercase()).is_ok());
        assert!(verify_sha256(data, "").is_ok());
        assert!(verify_sha256(b"abd", good).unwrap_err().contains("corrupt"));
    }
}
