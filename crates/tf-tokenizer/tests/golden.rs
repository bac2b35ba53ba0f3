//! Golden tests: tf-tokenizer against ids produced by Hugging Face tokenizers 0.22.1 (Python)
//! and tiktoken on the same BPE ranks (tests/tokenizer/make_fixtures.py).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{golden, hex, ids, qwen, qwen_with_normalizer};
use serde_json::Value;
use tf_tokenizer::templates::QwenImage21;
use tf_tokenizer::{Span, SpanKind, Tokenizer};

fn first_mismatch(what: &str, input: &str, got: &[u32], want: &[u32]) -> String {
    format!("{what} mismatch for {input:?}:\n got  {got:?}\n want {want:?}")
}

#[test]
fn fixture_tokenizer_matches_the_reference_metadata() {
    let lines = golden();
    let meta = lines.first().expect("meta line");
    assert_eq!(meta["kind"], "meta");
    let tok = qwen();
    assert_eq!(
        tok.vocab_size() as u64,
        meta["vocab_size"].as_u64().unwrap()
    );
    let added = meta["added"].as_object().unwrap();
    assert_eq!(tok.added_tokens().len(), added.len());
    for t in tok.added_tokens() {
        assert_eq!(
            added[&t.content].as_u64(),
            Some(u64::from(t.id)),
            "{}",
            t.content
        );
    }
    // Qwen2/3: 151643-151656 special, 151657-151668 not; H3 extras special.
    let non_special: Vec<u32> = tok
        .added_tokens()
        .iter()
        .filter(|t| !t.special)
        .map(|t| t.id)
        .collect();
    assert_eq!(non_special, (151_657..=151_668).collect::<Vec<_>>());
    let system = ids(&meta["qwen_image_system_ids"]);
    assert_eq!(tok.encode(QwenImage21::SYSTEM).unwrap(), system);
    assert_eq!(
        system.len(),
        14,
        "Qwen-Image 2.1 drops a 14-token system block"
    );
}

#[test]
fn text_corpus_matches_reference_ids() {
    let lines = golden();
    let tok = qwen();
    let nfkd = qwen_with_normalizer(serde_json::json!({"type": "NFKD"}));
    let mut cases = 0;
    let mut failures = Vec::new();
    for line in lines.iter().filter(|l| l["kind"] == "text") {
        cases += 1;
        let raw = hex(line["hex"].as_str().unwrap());
        let text = line["text"].as_str().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&raw),
            text,
            "lossy UTF-8 repair differs from Python's"
        );
        let checks: [(&str, Vec<u32>, &Value); 3] = [
            ("full", tok.encode_lossy(&raw).unwrap(), &line["full"]),
            ("plain", tok.encode_plain(text).unwrap(), &line["plain"]),
            (
                "nfkd plain",
                nfkd.encode_plain(text).unwrap(),
                &line["nfkd"],
            ),
        ];
        for (what, got, want) in checks {
            let want = ids(want);
            if got != want && failures.len() < 10 {
                failures.push(first_mismatch(what, text, &got, &want));
            }
        }
    }
    assert!(cases >= 5000, "only {cases} golden strings");
    assert!(
        failures.is_empty(),
        "{} mismatches, first ones:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("golden: {cases} strings x (full, plain, nfkd) equal to the reference");
}

fn spans_of(line: &Value) -> Vec<(SpanKind, String)> {
    line["spans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let kind = match s[0].as_str().unwrap() {
                "template" => SpanKind::Template,
                "user" => SpanKind::User,
                other => panic!("span kind {other}"),
            };
            (kind, s[1].as_str().unwrap().to_string())
        })
        .collect()
}

#[test]
fn masked_requests_match_reference_ids() {
    let lines = golden();
    let tok = qwen();
    let mut cases = 0;
    for line in lines.iter().filter(|l| l["kind"] == "masked") {
        cases += 1;
        let owned = spans_of(line);
        let spans: Vec<Span<'_>> = owned
            .iter()
            .map(|(k, t)| Span { kind: *k, text: t })
            .collect();
        let got = tok.encode_masked(&spans).unwrap();
        let want = ids(&line["ids"]);
        assert_eq!(got, want, "masked request {owned:?}");
    }
    assert!(cases >= 1000, "only {cases} masked requests");
    println!("golden: {cases} masked requests equal to the reference");
}

#[test]
fn memo_off_and_tiny_memo_give_the_golden_ids() {
    let lines = golden();
    let json = common::qwen_json();
    for capacity in [0usize, 8 * 1024] {
        let tok = Tokenizer::from_bytes(json, "qwen fixture")
            .unwrap()
            .with_memo_capacity(capacity);
        for line in lines.iter().filter(|l| l["kind"] == "text").take(1500) {
            let text = line["text"].as_str().unwrap();
            assert_eq!(
                tok.encode(text).unwrap(),
                ids(&line["full"]),
                "capacity {capacity}: {text:?}"
            );
        }
    }
}
