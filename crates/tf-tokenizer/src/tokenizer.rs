//! The tokenizer: loading, plain / masked / default encoding, decoding.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use tokenizers::tokenizer::normalizer::Range;
use tokenizers::{
    AddedToken, AddedVocabulary, Model, NormalizedString, Normalizer, NormalizerWrapper,
    OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Split, Token,
};

use crate::bytes::TokenBytesRule;
use crate::error::{Result, TokenizerError};
use crate::memo::{MemoStats, SegmentKind, SegmentMemo};
use crate::pretok::{self, PreTok};

/// Default byte budget of the segment memo (32 MiB).
pub const DEFAULT_MEMO_BYTES: usize = 32 << 20;

/// Who wrote a span of a masked request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// Text from the engine's prompt template: may form added tokens.
    Template,
    /// Text from the user: never forms an added token.
    User,
}

/// One span of a masked request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span<'a> {
    /// Who wrote it.
    pub kind: SpanKind,
    /// Its text.
    pub text: &'a str,
}

impl<'a> Span<'a> {
    /// A template span.
    pub fn template(text: &'a str) -> Self {
        Self {
            kind: SpanKind::Template,
            text,
        }
    }

    /// A user span.
    pub fn user(text: &'a str) -> Self {
        Self {
            kind: SpanKind::User,
            text,
        }
    }
}

/// An added token of the loaded tokenizer (tokenizer.json `added_tokens`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddedTokenInfo {
    /// Its id.
    pub id: u32,
    /// Its text.
    pub content: String,
    /// Whether it is special (skipped by `decode(.., skip_special_tokens = true)`).
    pub special: bool,
    /// Whether it is matched on normalized text rather than on the raw input.
    pub normalized: bool,
}

/// A part of the input after added-token matching.
enum Piece {
    Token(u32),
    Text {
        start: usize,
        end: usize,
        holds_user_text: bool,
    },
}

/// Added tokens of one matching kind, in their own vocabulary, with the map from that
/// vocabulary's ids to the loaded tokenizer's ids (the two may number new tokens differently).
struct Matcher {
    vocab: AddedVocabulary,
    to_real_id: HashMap<u32, u32>,
}

impl Matcher {
    fn new(
        tokens: &[&AddedTokenInfo],
        model: &impl Model,
        normalizer: Option<&NormalizerWrapper>,
        raw: &HashMap<u32, AddedToken>,
    ) -> Option<Self> {
        if tokens.is_empty() {
            return None;
        }
        let mut vocab = AddedVocabulary::new();
        let specs: Vec<AddedToken> = tokens
            .iter()
            .filter_map(|t| raw.get(&t.id).cloned())
            .collect();
        vocab.add_tokens(&specs, model, normalizer);
        let to_real_id = tokens
            .iter()
            .filter_map(|t| vocab.token_to_id(&t.content, model).map(|aux| (aux, t.id)))
            .collect();
        Some(Self { vocab, to_real_id })
    }

    /// Byte ranges of `text` that form added tokens, with their ids, in order.
    fn find(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let extracted = self
            .vocab
            .extract_and_normalize(None::<&NormalizerWrapper>, text);
        extracted
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter_map(|(_, (start, end), tokens)| {
                let token = tokens.as_ref()?.first()?;
                let id = self.to_real_id.get(&token.id).copied().unwrap_or(token.id);
                Some((start, end, id))
            })
            .collect()
    }
}

/// A loaded tokenizer.json with the encoding modes of this crate. Cheap to share behind an
/// `Arc`; every method takes `&self`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    raw_tokens: Option<Matcher>,
    normalized_tokens: Option<Matcher>,
    added: Vec<AddedTokenInfo>,
    added_ids: HashSet<u32>,
    bytes_rule: TokenBytesRule,
    memo: SegmentMemo,
    // Replaces `inner`'s pre-tokenizer when that holds a Split regex, compiled here so that
    // `{n,m}+` is possessive and a failed search is an error (src/pretok.rs).
    own_pre_tokenizer: Option<PreTok>,
    // `tokenizers` rebuilds the whole vocabulary map to count it: count once.
    vocab_size: usize,
}

fn encode_error(stage: &'static str) -> impl Fn(tokenizers::Error) -> TokenizerError {
    move |e| TokenizerError::Encode {
        stage,
        reason: e.to_string(),
    }
}

impl Tokenizer {
    /// Load `path`: a tokenizer.json, or a folder holding one.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let bytes = std::fs::read(&file).map_err(|source| TokenizerError::Read {
            path: file.clone(),
            source,
        })?;
        Self::from_bytes(&bytes, &file.display().to_string())
    }

    /// Load a tokenizer.json held in memory; `origin` names it in errors.
    ///
    /// Truncation and padding configured in the file are switched off: callers get every id
    /// and cap lengths themselves.
    ///
    /// A pre-tokenizer Split regex that does not compile is an error naming the pattern.
    /// Possessive quantifiers (`++`, `*+`, `?+`, `{n,m}+`) in Split regexes are possessive; for
    /// `{n,m}+` (also `{n}+`, `{n,}+`, `{,m}+`) this differs from `tokenizers`, which reads it
    /// as a repeat of a repeat, `(?:X{n,m})+`.
    pub fn from_bytes(json: &[u8], origin: &str) -> Result<Self> {
        let parse_error = |reason: String| TokenizerError::Parse {
            origin: origin.to_string(),
            reason,
        };
        let pre_tokenizer_json = pretok::pre_tokenizer_json(json);
        if let Some(node) = &pre_tokenizer_json {
            pretok::check_patterns(node).map_err(parse_error)?;
        }
        let mut inner =
            tokenizers::Tokenizer::from_bytes(json).map_err(|e| parse_error(e.to_string()))?;
        inner
            .with_truncation(None)
            .map_err(|e| parse_error(e.to_string()))?;
        inner.with_padding(None);

        let raw_specs: HashMap<u32, AddedToken> =
            inner.get_added_tokens_decoder().into_iter().collect();
        let mut added: Vec<AddedTokenInfo> = raw_specs
            .iter()
            .map(|(&id, t)| AddedTokenInfo {
                id,
                content: t.content.clone(),
                special: t.special,
                normalized: t.normalized,
            })
            .collect();
        added.sort_by_key(|t| t.id);
        let raw: Vec<&AddedTokenInfo> = added.iter().filter(|t| !t.normalized).collect();
        let normalized: Vec<&AddedTokenInfo> = added.iter().filter(|t| t.normalized).collect();
        let raw_tokens = Matcher::new(&raw, inner.get_model(), None, &raw_specs);
        let normalized_tokens = Matcher::new(
            &normalized,
            inner.get_model(),
            inner.get_normalizer(),
            &raw_specs,
        );
        let decoder_json = serde_json::to_value(inner.get_decoder())
            .map_err(|e| parse_error(format!("its decoder cannot be inspected: {e}")))?;
        let bytes_rule = TokenBytesRule::from_decoder_json(&decoder_json);
        let added_ids = added.iter().map(|t| t.id).collect();
        let vocab_size = inner.get_vocab_size(true);
        let own_pre_tokenizer = match &pre_tokenizer_json {
            Some(node) if inner.get_pre_tokenizer().is_some() => {
                pretok::own_pre_tokenizer(node).map_err(parse_error)?
            }
            _ => None,
        };
        Ok(Self {
            own_pre_tokenizer,
            vocab_size,
            inner,
            raw_tokens,
            normalized_tokens,
            added,
            added_ids,
            bytes_rule,
            memo: SegmentMemo::new(DEFAULT_MEMO_BYTES),
        })
    }

    /// Replace the segment memo by an empty one of `capacity_bytes` (0 turns it off).
    pub fn with_memo_capacity(mut self, capacity_bytes: usize) -> Self {
        self.memo = SegmentMemo::new(capacity_bytes);
        self
    }

    /// Empty the segment memo (its counters stay).
    pub fn clear_memo(&self) {
        self.memo.clear();
    }

    /// Hits, misses and size of the segment memo.
    pub fn memo_stats(&self) -> MemoStats {
        self.memo.stats()
    }

    /// The underlying `tokenizers` tokenizer (same configuration, truncation and padding off).
    /// Its own encoding reads a possessive interval `{n,m}+` in a Split pattern as
    /// `tokenizers` does (`(?:X{n,m})+`), not as this crate's encodings do.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The added tokens, by id.
    pub fn added_tokens(&self) -> &[AddedTokenInfo] {
        &self.added
    }

    /// Whether `id` is an added token's id (special or not).
    pub fn is_added_token(&self, id: u32) -> bool {
        self.added_ids.contains(&id)
    }

    /// The id of a whole token string (model vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of `id`, as stored in the vocabulary (byte-level spelling for BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encode like `tokenizers`' `encode(text, add_special_tokens = false)`: added tokens
    /// spelled in `text` become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_masked(&[Span::template(text)])
    }

    /// Encode with no added token matched: text that spells one is ordinary text.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_masked(&[Span::user(text)])
    }

    /// Encode a request made of spans. Added tokens are matched inside each template span
    /// alone; user spans never form one. The ordinary text between added tokens, user text
    /// included, is encoded as one segment, so a request whose user text spells no added token
    /// gives the same ids as `encode` of the concatenated text.
    ///
    /// Fails with [`TokenizerError::AddedTokenFromUserSpan`] if a segment holding user text
    /// still yields an added-token id (possible only when the model vocabulary itself holds
    /// an added token's spelling).
    pub fn encode_masked(&self, spans: &[Span<'_>]) -> Result<Vec<u32>> {
        let mut text = String::with_capacity(spans.iter().map(|s| s.text.len()).sum());
        let mut pieces = Vec::new();
        let mut pending_start = 0usize;
        let mut pending_user = false;
        for span in spans {
            let base = text.len();
            text.push_str(span.text);
            match span.kind {
                SpanKind::User => pending_user |= !span.text.is_empty(),
                SpanKind::Template => {
                    let found = match &self.raw_tokens {
                        Some(m) => m.find(span.text),
                        None => Vec::new(),
                    };
                    for (start, end, id) in found {
                        let (start, end) = (base + start, base + end);
                        if pending_start < start {
                            pieces.push(Piece::Text {
                                start: pending_start,
                                end: start,
                                holds_user_text: pending_user,
                            });
                        }
                        pieces.push(Piece::Token(id));
                        pending_start = end;
                        pending_user = false;
                    }
                }
            }
        }
        if pending_start < text.len() {
            pieces.push(Piece::Text {
                start: pending_start,
                end: text.len(),
                holds_user_text: pending_user,
            });
        }

        let mut ids = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Token(id) => ids.push(id),
                Piece::Text {
                    start,
                    end,
                    holds_user_text,
                } => {
                    let segment = text.get(start..end).ok_or_else(|| TokenizerError::Encode {
                        stage: "added-token split",
                        reason: "a match did not fall on character boundaries".into(),
                    })?;
                    let kind = if holds_user_text {
                        SegmentKind::Plain
                    } else {
                        SegmentKind::Template
                    };
                    let at_start = start == 0;
                    let seg_ids = self.memo.get_or_encode(kind, at_start, segment, |s| {
                        self.encode_segment(s, at_start, kind)
                    })?;
                    if kind == SegmentKind::Plain {
                        if let Some(&id) = seg_ids.iter().find(|id| self.added_ids.contains(id)) {
                            return Err(TokenizerError::AddedTokenFromUserSpan {
                                id,
                                content: self.id_to_token(id).unwrap_or_default(),
                            });
                        }
                    }
                    ids.extend_from_slice(&seg_ids);
                }
            }
        }
        Ok(ids)
    }

    /// Run normalizer, (normalized added tokens for template text), pre-tokenizer and model on
    /// one segment, as `tokenizers` does for the text between two raw added tokens.
    fn encode_segment(&self, segment: &str, at_start: bool, kind: SegmentKind) -> Result<Vec<u32>> {
        // Pre-tokenizers may look at whether a segment starts the input (Metaspace's
        // `prepend_scheme: first`); a shifted slice keeps that fact.
        let normalized = if at_start {
            NormalizedString::from(segment)
        } else {
            let mut shifted = String::with_capacity(segment.len() + 1);
            shifted.push(' ');
            shifted.push_str(segment);
            NormalizedString::from(shifted.as_str())
                .slice(Range::Original(1..))
                .ok_or_else(|| TokenizerError::Encode {
                    stage: "segment slicing",
                    reason: "a segment could not be sliced".into(),
                })?
        };
        let mut pretok = PreTokenizedString::from(normalized);
        if let Some(n) = self.inner.get_normalizer() {
            pretok
                .normalize(|s| n.normalize(s))
                .map_err(encode_error("normalizer"))?;
        }
        if let (SegmentKind::Template, Some(m)) = (kind, &self.normalized_tokens) {
            pretok
                .split(|_, s| {
                    let mut splits: Vec<Split> = Vec::new();
                    let mut cursor = 0usize;
                    for (start, end, id) in m.find(s.get()) {
                        if cursor < start {
                            if let Some(part) = s.slice(Range::Normalized(cursor..start)) {
                                splits.push(part.into());
                            }
                        }
                        if let Some(part) = s.slice(Range::Normalized(start..end)) {
                            let value = part.get().to_string();
                            let token = Token::new(id, value, (0, end - start));
                            splits.push((part, Some(vec![token])).into());
                        }
                        cursor = end;
                    }
                    if cursor < s.len() {
                        if let Some(part) = s.slice(Range::Normalized(cursor..)) {
                            splits.push(part.into());
                        }
                    }
                    Ok(splits)
                })
                .map_err(encode_error("normalized added-token split"))?;
        }
        if let Some(p) = &self.own_pre_tokenizer {
            p.pre_tokenize(&mut pretok)
                .map_err(encode_error("pre-tokenizer"))?;
        } else if let Some(p) = self.inner.get_pre_tokenizer() {
            p.pre_tokenize(&mut pretok)
                .map_err(encode_error("pre-tokenizer"))?;
        }
        let model = self.inner.get_model();
        pretok
            .tokenize(|s| model.tokenize(s.get()))
            .map_err(encode_error("model"))?;
        let encoding = pretok
            .into_encoding(None, 0, OffsetType::None)
            .map_err(encode_error("model"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encode bytes that may not be valid UTF-8: each maximal invalid sequence becomes U+FFFD
    /// (as `String::from_utf8_lossy`), then as [`Tokenizer::encode`].
    pub fn encode_lossy(&self, bytes: &[u8]) -> Result<Vec<u32>> {
        self.encode(&String::from_utf8_lossy(bytes))
    }

    /// The text the model part sees: `text` after the tokenizer's normalizer (unchanged if
    /// it has none).
    pub fn normalize(&self, text: &str) -> Result<String> {
        let mut n = NormalizedString::from(text);
        if let Some(normalizer) = self.inner.get_normalizer() {
            normalizer
                .normalize(&mut n)
                .map_err(encode_error("normalizer"))?;
        }
        Ok(n.get().to_string())
    }

    /// Decode ids to text (invalid UTF-8 from byte-level tokens becomes U+FFFD).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode {
                reason: e.to_string(),
            })
    }

    /// The exact bytes one token contributes to decoded output, possibly an incomplete UTF-8
    /// sequence (byte-level BPE splits characters across tokens). Concatenating the bytes of
    /// a sequence's tokens gives its decoding before lossy repair. Defined for decoders that
    /// treat each token alone (ByteLevel; ByteFallback, Fuse and literal Replace steps).
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let token = self
            .inner
            .id_to_token(id)
            .ok_or(TokenizerError::UnknownId {
                id,
                vocab_size: self.vocab_size,
            })?;
        self.bytes_rule.apply(&token)
    }

    /// A streaming decoder over this tokenizer: push ids, get complete UTF-8 text.
    pub fn stream(&self) -> crate::bytes::StreamDecoder<'_> {
        crate::bytes::StreamDecoder::new(self)
    }
}

/// Shared handle, for engines that hold one tokenizer across threads.
pub type SharedTokenizer = Arc<Tokenizer>;
