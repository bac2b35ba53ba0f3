//! Fixture loading shared by the integration tests and the benchmark.
#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::Value;
use tf_tokenizer::Tokenizer;

/// tests/tokenizer/fixtures at the workspace root.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/tokenizer/fixtures")
}

pub fn gunzip(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join(name);
    let file = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "open {}: {e} (regenerate with tests/tokenizer/make_fixtures.py)",
            path.display()
        )
    });
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("gunzip {}: {e}", path.display()));
    out
}

/// The Qwen2/3 + H3 tokenizer.json fixture, as bytes.
pub fn qwen_json() -> &'static [u8] {
    static JSON: OnceLock<Vec<u8>> = OnceLock::new();
    JSON.get_or_init(|| gunzip("qwen-tokenizer.json.gz"))
}

/// The fixture tokenizer, loaded once per test binary (memo on, default size).
pub fn qwen() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_bytes(qwen_json(), "qwen fixture").expect("fixture loads"))
}

/// The same tokenizer.json with its normalizer replaced.
pub fn qwen_with_normalizer(normalizer: Value) -> Tokenizer {
    let mut doc: Value = serde_json::from_slice(qwen_json()).expect("fixture is JSON");
    doc["normalizer"] = normalizer;
    let bytes = serde_json::to_vec(&doc).expect("serialize");
    Tokenizer::from_bytes(&bytes, "qwen fixture, normalizer replaced").expect("loads")
}

/// golden.jsonl.gz, one JSON value per line.
pub fn golden() -> Vec<Value> {
    let text = String::from_utf8(gunzip("golden.jsonl.gz")).expect("golden is UTF-8");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("golden line is JSON"))
        .collect()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id"))
        .collect()
}

pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}
