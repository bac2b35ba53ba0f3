//! The crate's error type.

use std::path::PathBuf;

/// Everything tf-tokenizer can fail at. Each message says what failed, why, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}; check that the file exists and is readable")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// tokenizer.json was read but the `tokenizers` crate refused it.
    #[error(
        "{origin} is not a usable tokenizer.json: {reason}; pass a Hugging Face tokenizer.json \
         (format of tokenizers 0.22)"
    )]
    Parse { origin: String, reason: String },
    /// A JSON side file (config.json, tokenizer_config.json, generation_config.json) is malformed.
    #[error("{file}: {field} {reason}")]
    Config {
        file: String,
        field: String,
        reason: String,
    },
    /// The tokenizer pipeline (normalizer, pre-tokenizer or model) failed on some input.
    #[error("encoding failed in the {stage}: {reason}")]
    Encode { stage: &'static str, reason: String },
    /// Decoding failed.
    #[error("decoding failed: {reason}")]
    Decode { reason: String },
    /// A user span produced an added-token id. Masked encoding refuses the request rather
    /// than hand a control token spelled by the user to the model.
    #[error(
        "user text produced added-token id {id} ({content:?}); masked encoding never lets a user \
         span form an added token, so this tokenizer's model vocabulary itself contains that \
         token: remove it from the user text or use a tokenizer whose vocabulary does not"
    )]
    AddedTokenFromUserSpan { id: u32, content: String },
    /// An id outside the vocabulary.
    #[error("token id {id} is not in the vocabulary (size {vocab_size}); ids come from this tokenizer's encode")]
    UnknownId { id: u32, vocab_size: usize },
    /// `token_bytes` asked of a decoder that joins tokens with context.
    #[error(
        "the tokenizer's decoder ({decoder}) depends on neighbouring tokens, so one token's bytes are \
         not defined; decode whole sequences with `decode` instead"
    )]
    DecoderNotTokenLocal { decoder: String },
    /// A prompt template's requirement on the tokenizer does not hold.
    #[error("{template} template: {reason}")]
    Template {
        template: &'static str,
        reason: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, TokenizerError>;
