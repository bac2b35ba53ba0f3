//! Possessive quantifiers in Split pre-tokenizer regexes (`++`, `*+`, `?+`, `{n,m}+`), against
//! the `tokenizers` crate.
//!
//! A possessive `X<q>+` means the atomic group `(?>X<q>)`: once it matched it never gives a
//! character back. Oniguruma (the regex engine of `tokenizers`) reads `++`, `*+` and `?+` so,
//! and each case here must tokenize exactly as `tokenizers` does on the same pattern and on its
//! atomic-group spelling. It reads `X{n,m}+` as `(?:X{n,m})+` instead; tf-tokenizer reads it as
//! possessive, so those cases must equal `tokenizers` on the atomic-group spelling and differ
//! from it on the pattern itself. Every case also differs from the greedy pattern (the `+`
//! removed), so a test that passed with possessive read as greedy would be no test.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;

use proptest::prelude::*;
use serde_json::{json, Value};
use tf_tokenizer::{Tokenizer, TokenizerError};

const BEHAVIORS: [&str; 5] = [
    "Removed",
    "Isolated",
    "MergedWithPrevious",
    "MergedWithNext",
    "Contiguous",
];

fn split(pattern: &str, behavior: &str, invert: bool) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": behavior, "invert": invert})
}

/// A tokenizer.json whose model is a WordLevel vocabulary of every substring of `texts`: each
/// pre-token is one id, so the tokens are exactly the pre-tokens.
fn word_level(pre_tokenizer: &Value, texts: &[&str]) -> Vec<u8> {
    let mut pieces = BTreeSet::new();
    for text in texts {
        let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        for (k, &from) in starts.iter().enumerate() {
            for &to in starts[k + 1..].iter().chain([&text.len()]) {
                pieces.insert(&text[from..to]);
            }
        }
    }
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for (id, piece) in pieces.into_iter().enumerate() {
        vocab.insert(piece.to_string(), json!(id + 1));
    }
    serde_json::to_vec(&json!({
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    }))
    .unwrap()
}

/// The pre-tokens tf-tokenizer makes of each of `texts`.
fn ours_all(pre_tokenizer: &Value, texts: &[&str]) -> Vec<Vec<String>> {
    let tok = Tokenizer::from_bytes(&word_level(pre_tokenizer, texts), "test").unwrap();
    texts
        .iter()
        .map(|text| {
            let ids = tok.encode(text).unwrap();
            ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect()
        })
        .collect()
}

/// The pre-tokens the `tokenizers` crate makes of each of `texts`.
fn reference_all(pre_tokenizer: &Value, texts: &[&str]) -> Vec<Vec<String>> {
    let tok = tokenizers::Tokenizer::from_bytes(word_level(pre_tokenizer, texts)).unwrap();
    texts
        .iter()
        .map(|text| tok.encode(*text, false).unwrap().get_tokens().to_vec())
        .collect()
}

fn ours(pre_tokenizer: &Value, text: &str) -> Vec<String> {
    ours_all(pre_tokenizer, &[text]).remove(0)
}

fn reference(pre_tokenizer: &Value, text: &str) -> Vec<String> {
    reference_all(pre_tokenizer, &[text]).remove(0)
}

struct Case {
    /// The pattern with a possessive quantifier.
    possessive: &'static str,
    /// The same with the possessive part as an atomic group.
    atomic: &'static str,
    /// The same with the possessive `+` removed, where it reads `text` otherwise (a case
    /// where it does not shows the ordinary use).
    greedy: Option<&'static str>,
    text: &'static str,
    /// Pre-tokens of `text` under `possessive`, behaviour `Isolated`.
    want: &'static [&'static str],
    /// How Oniguruma's default syntax (`tokenizers`) reads `possessive`, spelled out, where
    /// that is not possessive.
    onig_reading: Option<&'static str>,
}

const CASES: &[Case] = &[
    // `++`: `a++` takes every `a`, so `a++a` never matches.
    Case {
        possessive: r"a++a",
        atomic: r"(?>a+)a",
        greedy: Some(r"a+a"),
        text: "aaa baa",
        want: &["aaa baa"],
        onig_reading: None,
    },
    Case {
        possessive: r"\p{L}++\p{L}",
        atomic: r"(?>\p{L}+)\p{L}",
        greedy: Some(r"\p{L}+\p{L}"),
        text: "héllo wörld 42 x",
        want: &["héllo wörld 42 x"],
        onig_reading: None,
    },
    // `*+`: `[^\s]*+` takes the `!` too, so nothing is left for the `!` after it.
    Case {
        possessive: r"[^\s]*+!",
        atomic: r"(?>[^\s]*)!",
        greedy: Some(r"[^\s]*!"),
        text: "hi! yo!",
        want: &["hi! yo!"],
        onig_reading: None,
    },
    Case {
        possessive: r"[^\s!]*+!",
        atomic: r"(?>[^\s!]*)!",
        greedy: None,
        text: "hi! yo!",
        want: &["hi!", " ", "yo!"],
        onig_reading: None,
    },
    // `?+`: a lone `a` is taken by `a?+` and never matches `a?+a`.
    Case {
        possessive: r"a?+a",
        atomic: r"(?>a?)a",
        greedy: Some(r"a?a"),
        text: "a aa",
        want: &["a ", "aa"],
        onig_reading: None,
    },
    // `{n,m}+`: three digits at most per match.
    Case {
        possessive: r"\d{1,3}+",
        atomic: r"(?>\d{1,3})",
        greedy: None,
        text: "12345678 9",
        want: &["123", "456", "78", " ", "9"],
        onig_reading: Some(r"(?:\d{1,3})+"),
    },
    Case {
        possessive: r"\d{1,3}+\d",
        atomic: r"(?>\d{1,3})\d",
        greedy: Some(r"\d{1,3}\d"),
        text: "123 1234",
        want: &["123 ", "1234"],
        onig_reading: Some(r"(?:\d{1,3})+\d"),
    },
    // `{n}+`: the first way of matching twice is kept (`aa`), so `aabc` never matches.
    Case {
        possessive: r"(?:a|ab){2}+c",
        atomic: r"(?>(?:a|ab){2})c",
        greedy: Some(r"(?:a|ab){2}c"),
        text: "aabc aac",
        want: &["aabc ", "aac"],
        onig_reading: Some(r"(?:(?:a|ab){2})+c"),
    },
    // `{n,}+`: takes every digit, so `\d{2,}+\d` never matches.
    Case {
        possessive: r"\d{2,}+\d",
        atomic: r"(?>\d{2,})\d",
        greedy: Some(r"\d{2,}\d"),
        text: "1 12345 x",
        want: &["1 12345 x"],
        onig_reading: Some(r"(?:\d{2,})+\d"),
    },
    // `{,m}+`: `aa` is taken whole, so only three `a`s match `a{,2}+a`.
    Case {
        possessive: r"a{,2}+a",
        atomic: r"(?>a{,2})a",
        greedy: Some(r"a{,2}a"),
        text: "aa aaa",
        want: &["aa ", "aaa"],
        onig_reading: Some(r"(?:a{,2})+a"),
    },
];

#[test]
fn possessive_quantifiers_tokenize_as_atomic_groups() {
    for case in CASES {
        let at = |pattern: &str| split(pattern, "Isolated", false);
        let got = ours(&at(case.possessive), case.text);
        assert_eq!(got, case.want, "{} on {:?}", case.possessive, case.text);
        assert_eq!(
            got,
            reference(&at(case.atomic), case.text),
            "{} against tokenizers on {}",
            case.possessive,
            case.atomic
        );
        if let Some(greedy) = case.greedy {
            assert_ne!(
                got,
                reference(&at(greedy), case.text),
                "{}: the text does not tell possessive from greedy",
                case.possessive
            );
        }
        let tokenizers_own = reference(&at(case.possessive), case.text);
        match case.onig_reading {
            None => assert_eq!(
                got, tokenizers_own,
                "{} against tokenizers",
                case.possessive
            ),
            Some(reading) => {
                assert_eq!(tokenizers_own, reference(&at(reading), case.text));
                assert_ne!(got, tokenizers_own, "{}", case.possessive);
            }
        }
    }
}

#[test]
fn every_split_behaviour_and_inversion_matches_tokenizers() {
    for case in CASES {
        let texts = [
            case.text,
            "aaa baa 12345678 héllo, wörld!! a aa",
            "",
            "   ",
            "9",
        ];
        for behavior in BEHAVIORS {
            for invert in [false, true] {
                assert_eq!(
                    ours_all(&split(case.possessive, behavior, invert), &texts),
                    reference_all(&split(case.atomic, behavior, invert), &texts),
                    "{} {behavior} invert {invert}",
                    case.possessive
                );
            }
        }
    }
}

#[test]
fn possessive_split_inside_a_sequence_matches_tokenizers() {
    let text = "call 5551234567 now,  or 12 later";
    let sequence = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            split(pattern, "Isolated", false),
            {"type": "Digits", "individual_digits": false},
        ]})
    };
    let got = ours(&sequence(r"\p{N}{1,3}+"), text);
    assert_eq!(
        got,
        ["call", "555", "123", "456", "7", "now,", "or", "12", "later"]
    );
    assert_eq!(got, reference(&sequence(r"(?>\p{N}{1,3})"), text));
}

/// tiktoken's cl100k pattern in its possessive spelling, in the Qwen fixture's Split, with
/// merges for two- and three-digit tokens added so that digit grouping shows in the ids: equal
/// to `tokenizers` with its one possessive interval spelled as an atomic group, on the golden
/// corpus.
#[test]
fn a_possessive_byte_level_pattern_matches_tokenizers_on_the_corpus() {
    let possessive = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s";
    let atomic = possessive.replace(r"\p{N}{1,3}+", r"(?>\p{N}{1,3})");
    let with_pattern = |pattern: &str| {
        let mut doc: Value = serde_json::from_slice(common::qwen_json()).unwrap();
        let pre = &mut doc["pre_tokenizer"]["pretokenizers"][0];
        assert_eq!(pre["type"], "Split");
        pre["pattern"]["Regex"] = json!(pattern);
        let mut next_id = 200_000;
        let digits: Vec<String> = (0..10).map(|d| d.to_string()).collect();
        for a in &digits {
            for b in &digits {
                for (left, right) in [(a.clone(), b.clone())].into_iter().chain(
                    digits
                        .iter()
                        .map(|c| (format!("{a}{b}"), c.clone()))
                        .collect::<Vec<_>>(),
                ) {
                    doc["model"]["vocab"][format!("{left}{right}")] = json!(next_id);
                    next_id += 1;
                    doc["model"]["merges"]
                        .as_array_mut()
                        .unwrap()
                        .push(json!([left, right]));
                }
            }
        }
        serde_json::to_vec(&doc).unwrap()
    };
    let tok = Tokenizer::from_bytes(&with_pattern(possessive), "possessive").unwrap();
    let reference = tokenizers::Tokenizer::from_bytes(with_pattern(&atomic)).unwrap();
    let nested = tokenizers::Tokenizer::from_bytes(with_pattern(possessive)).unwrap();

    let digits = "year 2024: 1234567 items";
    let want = reference.encode(digits, false).unwrap().get_ids().to_vec();
    assert_eq!(tok.encode(digits).unwrap(), want);
    let pieces: Vec<String> = want
        .iter()
        .map(|&id| tok.id_to_token(id).unwrap())
        .collect();
    for piece in ["123", "456", "7"] {
        assert!(pieces.contains(&piece.to_string()), "{pieces:?}");
    }
    assert_ne!(
        nested.encode(digits, false).unwrap().get_ids(),
        &want[..],
        "tokenizers reads \\p{{N}}{{1,3}}+ as a repeat of a repeat"
    );

    let mut cases = 0;
    for line in common::golden().iter().filter(|l| l["kind"] == "text") {
        let text = line["text"].as_str().unwrap();
        let want = reference.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
        cases += 1;
    }
    assert!(cases >= 5000, "only {cases} golden strings");
}

/// Oniguruma's own possessive spelling, the reversed interval `{3,1}`, still reads as
/// `tokenizers` reads it.
#[test]
fn reversed_intervals_read_as_tokenizers_reads_them() {
    let text = "12345 6";
    let pre = split(r"\d{3,1}", "Isolated", false);
    let got = ours(&pre, text);
    assert_eq!(got, ["123", "45", " ", "6"]);
    assert_eq!(got, reference(&pre, text));
}

fn load_error(pre_tokenizer: &Value) -> String {
    match Tokenizer::from_bytes(&word_level(pre_tokenizer, &["x"]), "bad.json") {
        Err(e @ TokenizerError::Parse { .. }) => e.to_string(),
        Err(e) => panic!("not a parse error: {e}"),
        Ok(_) => panic!("{pre_tokenizer} loaded"),
    }
}

#[test]
fn a_bad_pattern_is_an_error_naming_it() {
    for pattern in [
        r"(",
        r"a)",
        r"\p{Foo}",
        r"[z-a]",
        r"[a",
        r"(?<n>a)\k<m>",
        r"*+",
        r"(?P<x>a)",
    ] {
        for pre in [
            split(pattern, "Isolated", false),
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "WhitespaceSplit"},
                split(pattern, "Removed", true),
            ]}),
        ] {
            let message = load_error(&pre);
            assert!(
                message.contains(&format!("{pattern:?}")) && message.contains("bad.json"),
                "{pattern}: {message}"
            );
        }
    }
}

#[test]
fn a_search_the_regex_engine_gives_up_on_is_an_error_naming_the_pattern() {
    let pattern = r"(\w|\w)*\d";
    let text = format!("{}!", "a".repeat(30));
    let json = word_level(&split(pattern, "Isolated", false), &["x"]);
    let tok = Tokenizer::from_bytes(&json, "test").unwrap();
    match tok.encode(&text) {
        Err(e @ TokenizerError::Encode { .. }) => {
            assert!(e.to_string().contains(&format!("{pattern:?}")), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // The tokenizer still works on text the pattern handles.
    assert_eq!(tok.encode("x").unwrap(), [1]);
}

fn pattern_strategy() -> impl Strategy<Value = String> {
    let atoms = prop::sample::select(vec![
        "a", "b", "\\d", "\\p{L}", "\\s", ".", "[ab]", "[^\\s]", "(", ")", "(?:", "(?>", "(?=",
        "(?<=", "|", "+", "*", "?", "{", "}", "{2}", "{1,3}", "{,2}", "{2,}", "{3,1}", ",", "1",
        "^", "$", "\\", "]", "[",
    ]);
    prop::collection::vec(atoms, 0..10).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any pattern: the load succeeds or fails naming it, and encoding succeeds or fails, never
    /// panics.
    #[test]
    fn no_pattern_panics(pattern in pattern_strategy(), behavior in prop::sample::select(BEHAVIORS.to_vec()), invert in any::<bool>()) {
        let texts = ["ab 12 aab", "", "a1b2 ", "ää"];
        let json = word_level(&split(&pattern, behavior, invert), &texts);
        match Tokenizer::from_bytes(&json, "random") {
            Ok(tok) => {
                for text in texts {
                    let _ = tok.encode(text);
                }
            }
            Err(e) => prop_assert!(e.to_string().contains(&format!("{pattern:?}")), "{e}"),
        }
    }
}
