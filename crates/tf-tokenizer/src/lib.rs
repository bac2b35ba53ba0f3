//! tf-tokenizer: text to token ids for the engines, on Hugging Face `tokenizers` (pinned
//! `=0.22.1`), with the guarantees an inference server needs on top of it.
//!
//! # What it does
//!
//! * Loads a `tokenizer.json` ([`Tokenizer::from_file`]) or a model folder with its
//!   `tokenizer_config.json`, `config.json` and `generation_config.json` ([`ModelFolder`]).
//! * Three encodings:
//!   - [`Tokenizer::encode`]: as `tokenizers`' `encode(text, add_special_tokens = false)`;
//!     spelled added tokens (`<|im_end|>`...) become their ids.
//!   - [`Tokenizer::encode_plain`]: no added token is matched; text that spells one is
//!     ordinary text.
//!   - [`Tokenizer::encode_masked`]: a request made of [`Span`]s. Template spans may form added
//!     tokens, user spans never do, special or not (`tokenizers`' own
//!     `encode_special_tokens` switch only covers special ones).
//! * [`Tokenizer::decode`], and [`Tokenizer::token_bytes`] / [`StreamDecoder`] for streaming:
//!   the exact bytes each id contributes, so a client emits only complete UTF-8.
//! * [`resolve_eos_ids`]: model config EOS ids, then the tokenizer's EOS, de-duplicated.
//! * The engines' prompt templates as data: [`templates::QwenImage21`], [`templates::MiniMaxH3`].
//! * A bounded segment memo: text between added tokens that was encoded before is not
//!   encoded again.
//! * Possessive quantifiers in pre-tokenizer Split regexes: `X++`, `X*+`, `X?+` and the
//!   possessive interval `X{n,m}+` (`{n}+`, `{n,}+`, `{,m}+`) match as the atomic group
//!   `(?>X...)`. `tokenizers` reads `X{n,m}+` as `(?:X{n,m})+` (Oniguruma's default syntax), so
//!   this crate compiles Split regexes itself; a regex that does not compile fails the load
//!   with an error naming it, and a search Oniguruma gives up on (its retry limit) is an
//!   encoding error naming it, where `tokenizers` panics.
//!
//! # Invariants
//!
//! 1. `encode(x)` equals `tokenizers`' `encode(x, false)` ids, truncation and padding off
//!    (checked against the Python binding of the same version and against tiktoken on a
//!    5,600-string corpus, `tests/golden.rs`). One exception: a Split regex with a possessive
//!    interval `X{n,m}+` gives the ids of `tokenizers` on the same regex with `(?>X{n,m})` in
//!    its place (`tests/possessive.rs`).
//! 2. `encode_masked` never returns an added-token id that came from user text: tokens are
//!    searched for only inside template spans, user text goes through the model alone, and
//!    the result is checked; a violation is an error, never a silent id.
//! 3. A request whose user spans spell no added token encodes exactly like `encode` of the
//!    concatenated text; the ordinary text between two added tokens is always one segment,
//!    whoever wrote its parts.
//! 4. The memo never changes a result: it is keyed by everything a segment's ids depend on
//!    (the text, whether it starts the input, and whether it may form normalized added tokens).
//! 5. `decode(encode(x)) == normalize(x)` for valid UTF-8 `x` with byte-level tokenizers, and
//!    the concatenated [`Tokenizer::token_bytes`] of the ids are the UTF-8 bytes of that text.
//! 6. Normalizers are `tokenizers`' own (NFC, NFKD, ...): whatever tokenizer.json asks for.
//!
//! Limits: in masked mode a template span's `lstrip`/`rstrip`/`single_word` added tokens see
//! only their own span, and normalized added tokens (`normalized: true`) form only in
//! segments with no user text.
//!
//! # Command line
//!
//! `tf tokenize --tokenizer FILE [--masked] TEXT` prints the ids as a JSON array. FILE is a
//! tokenizer.json or a folder holding one. Without `--masked`, TEXT is encoded as
//! [`Tokenizer::encode`] (spelled added tokens match); with `--masked`, TEXT is a user span,
//! so it never forms an added token (the ids of [`Tokenizer::encode_plain`]).
//!
//! # Example
//!
//! ```
//! use tf_tokenizer::{Span, Tokenizer};
//!
//! // A tiny byte-level BPE with one special token; real ones come from `Tokenizer::from_file`.
//! let json = r#"{
//!   "added_tokens": [{"id": 11, "content": "<|end|>", "single_word": false, "lstrip": false,
//!                     "rstrip": false, "normalized": false, "special": true}],
//!   "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
//!                     "use_regex": true},
//!   "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
//!               "use_regex": true},
//!   "model": {"type": "BPE", "vocab": {"h": 0, "i": 1, "hi": 2, "Ġ": 3, "Ġhi": 4, "<": 5,
//!             "|": 6, "e": 7, "n": 8, "d": 9, ">": 10}, "merges": [["h", "i"], ["Ġ", "hi"]]}
//! }"#;
//! let tok = Tokenizer::from_bytes(json.as_bytes(), "example")?;
//!
//! assert_eq!(tok.encode("hi hi<|end|>")?, vec![2, 4, 11]);
//! // Plain: the spelling is text, not the token.
//! assert_eq!(tok.encode_plain("hi<|end|>")?, vec![2, 5, 6, 7, 8, 9, 6, 10]);
//! // Masked: the template's token counts, the user's spelling does not.
//! let ids = tok.encode_masked(&[Span::user("hi<|end|>"), Span::template("<|end|>")])?;
//! assert_eq!(ids, vec![2, 5, 6, 7, 8, 9, 6, 10, 11]);
//! assert_eq!(tok.decode(&[2, 4], false)?, "hi hi");
//! assert_eq!(tok.token_bytes(4)?, b" hi");
//! # Ok::<(), tf_tokenizer::TokenizerError>(())
//! ```

mod bytes;
mod error;
mod folder;
mod memo;
mod pretok;
pub mod templates;
mod tokenizer;

pub use bytes::StreamDecoder;
pub use error::{Result, TokenizerError};
pub use folder::{resolve_eos_ids, ModelFolder};
pub use memo::MemoStats;
pub use tokenizer::{
    AddedTokenInfo, SharedTokenizer, Span, SpanKind, Tokenizer, DEFAULT_MEMO_BYTES,
};

/// The `tokenizers` crate this one is built on, for callers that need its types.
pub use tokenizers;
