//! Property tests of the crate's invariants on the Qwen fixture tokenizer.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::OnceLock;

use common::qwen;
use proptest::prelude::*;
use tf_tokenizer::{Span, SpanKind, Tokenizer};

/// Text drawn from pieces that stress the tokenizer: spelled added tokens (whole, cut,
/// doubled), ASCII, CJK, emoji with ZWJ, combining marks, whitespace runs, digits.
fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("<|im_end|>".to_string()),
        Just("<|im_start|>".to_string()),
        Just("<|endoftext|>".to_string()),
        Just("<think>".to_string()),
        Just("</tool_call>".to_string()),
        Just("<d>".to_string()),
        Just("<|im_".to_string()),
        Just("end|>".to_string()),
        Just("👩‍💻".to_string()),
        Just("e\u{301}".to_string()),
        Just("中文".to_string()),
        Just("ﬁ".to_string()),
        "[ \t\r\n]{1,6}",
        "[a-zA-Z']{1,8}",
        "[0-9]{1,6}",
        any::<String>(),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|v| v.concat())
}

fn spans_strategy() -> impl Strategy<Value = Vec<(bool, String)>> {
    prop::collection::vec((any::<bool>(), text_strategy()), 0..6)
}

fn as_spans(v: &[(bool, String)]) -> Vec<Span<'_>> {
    v.iter()
        .map(|(user, t)| {
            if *user {
                Span::user(t)
            } else {
                Span::template(t)
            }
        })
        .collect()
}

/// The fixture tokenizer with a 2 KiB memo, so that entries are evicted all the time.
fn tiny_memo() -> &'static Tokenizer {
    static TINY: OnceLock<Tokenizer> = OnceLock::new();
    TINY.get_or_init(|| {
        Tokenizer::from_bytes(common::qwen_json(), "qwen fixture")
            .unwrap()
            .with_memo_capacity(2048)
    })
}

fn added_ids_in(tok: &Tokenizer, ids: &[u32]) -> Vec<u32> {
    ids.iter()
        .copied()
        .filter(|&id| tok.is_added_token(id))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn decode_inverts_encode_up_to_the_normalizer(x in text_strategy()) {
        let tok = qwen();
        let normalized = tok.normalize(&x).unwrap();
        prop_assert_eq!(tok.decode(&tok.encode(&x).unwrap(), false).unwrap(), normalized.clone());
        prop_assert_eq!(tok.decode(&tok.encode_plain(&x).unwrap(), false).unwrap(), normalized);
    }

    #[test]
    fn token_bytes_concatenate_to_the_text(x in text_strategy()) {
        let tok = qwen();
        let ids = tok.encode(&x).unwrap();
        let mut bytes = Vec::new();
        let mut stream = tok.stream();
        let mut streamed = String::new();
        for &id in &ids {
            bytes.extend(tok.token_bytes(id).unwrap());
            streamed.push_str(&stream.push(id).unwrap());
        }
        streamed.push_str(&stream.finish());
        let normalized = tok.normalize(&x).unwrap();
        prop_assert_eq!(&bytes, normalized.as_bytes());
        prop_assert_eq!(streamed, normalized);
    }

    #[test]
    fn plain_encoding_never_yields_an_added_token(x in text_strategy()) {
        let tok = qwen();
        let ids = tok.encode_plain(&x).unwrap();
        prop_assert!(added_ids_in(tok, &ids).is_empty(), "{:?} -> {:?}", x, ids);
    }

    /// The added tokens of a masked request are exactly those its template spans form on their
    /// own, in order: none comes from a user span.
    #[test]
    fn masked_added_tokens_come_from_template_spans_only(v in spans_strategy()) {
        let tok = qwen();
        let ids = tok.encode_masked(&as_spans(&v)).unwrap();
        let mut expected = Vec::new();
        for (user, t) in &v {
            if !*user {
                expected.extend(added_ids_in(tok, &tok.encode(t).unwrap()));
            }
        }
        prop_assert_eq!(added_ids_in(tok, &ids), expected);
    }

    /// User text that spells no added token: masked equals encoding the concatenation.
    #[test]
    fn masked_equals_whole_encoding_when_users_spell_no_token(v in spans_strategy()) {
        let tok = qwen();
        let spells = |t: &str| tok.added_tokens().iter().any(|a| t.contains(a.content.as_str()));
        prop_assume!(v.iter().all(|(user, t)| !*user || !spells(t)));
        // A user span may still complete a token begun in a template span (`<|im_` + `end|>`):
        // masked mode must not join them, so only compare when no joined spelling appears.
        let whole: String = v.iter().map(|(_, t)| t.as_str()).collect();
        let templates_alone: usize = v.iter().filter(|(u, _)| !*u)
            .map(|(_, t)| added_ids_in(tok, &tok.encode(t).unwrap()).len()).sum();
        prop_assume!(added_ids_in(tok, &tok.encode(&whole).unwrap()).len() == templates_alone);
        prop_assert_eq!(tok.encode_masked(&as_spans(&v)).unwrap(), tok.encode(&whole).unwrap());
    }

    #[test]
    fn memo_never_changes_a_result(texts in prop::collection::vec(text_strategy(), 1..12), repeat in 1usize..4) {
        let with_memo = qwen();
        let tiny = tiny_memo();
        for _ in 0..repeat {
            for t in &texts {
                let want = with_memo.inner().encode_fast(t.as_str(), false).unwrap().get_ids().to_vec();
                prop_assert_eq!(with_memo.encode(t).unwrap(), want.clone());
                prop_assert_eq!(tiny.encode(t).unwrap(), want);
                let spans = [Span::template("<|im_start|>user\n"), Span::user(t), Span::template("<|im_end|>")];
                prop_assert_eq!(with_memo.encode_masked(&spans).unwrap(), tiny.encode_masked(&spans).unwrap());
            }
        }
    }
}

#[test]
fn span_kind_is_visible_in_the_public_api() {
    assert_eq!(Span::user("x").kind, SpanKind::User);
    assert_eq!(Span::template("x").kind, SpanKind::Template);
}
