//! Token bytes for streaming, and a streaming UTF-8 decoder.

use serde_json::Value;

use crate::error::{Result, TokenizerError};
use crate::tokenizer::Tokenizer;

/// One decoder step that acts on each token alone.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    /// Literal replacement inside the token string.
    Replace { pattern: String, content: String },
    /// GPT-2 byte-level characters to bytes.
    ByteLevel,
    /// `<0xHH>` tokens to one byte.
    ByteFallback,
    /// Joins tokens; no effect on each token's bytes.
    Fuse,
}

/// How a token string becomes bytes, derived from the tokenizer's decoder.
#[derive(Clone, Debug)]
pub(crate) enum TokenBytesRule {
    Local(Vec<Step>),
    NotLocal(String),
}

/// GPT-2's byte-level table inverted: character -> byte.
fn byte_level_char_to_byte(c: char) -> Option<u8> {
    let code = c as u32;
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if code < 256 && printable(code) {
        return u8::try_from(code).ok();
    }
    // The other 68 bytes map, in increasing order, to U+0100.. .
    let index = code.checked_sub(256)?;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(usize::try_from(index).ok()?)
        .and_then(|b| u8::try_from(b).ok())
}

fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl TokenBytesRule {
    pub(crate) fn from_decoder_json(decoder: &Value) -> Self {
        let mut steps = Vec::new();
        match Self::collect(decoder, &mut steps) {
            Ok(()) => {
                // Byte conversion happens at most once, and literal replacement only before it.
                let conversions = steps
                    .iter()
                    .filter(|s| matches!(s, Step::ByteLevel | Step::ByteFallback))
                    .count();
                let first_join = steps
                    .iter()
                    .position(|s| !matches!(s, Step::Replace { .. }))
                    .unwrap_or(steps.len());
                let replace_after_join = steps
                    .iter()
                    .skip(first_join)
                    .any(|s| matches!(s, Step::Replace { .. }));
                if conversions > 1 || replace_after_join {
                    Self::NotLocal("a sequence that rewrites text after joining tokens".into())
                } else {
                    Self::Local(steps)
                }
            }
            Err(name) => Self::NotLocal(name),
        }
    }

    fn collect(decoder: &Value, steps: &mut Vec<Step>) -> std::result::Result<(), String> {
        if decoder.is_null() {
            return Err("none: tokens are joined with spaces".into());
        }
        let kind = decoder
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("unknown");
        match kind {
            "ByteLevel" => steps.push(Step::ByteLevel),
            "ByteFallback" => steps.push(Step::ByteFallback),
            "Fuse" => steps.push(Step::Fuse),
            "Replace" => {
                let pattern = decoder
                    .get("pattern")
                    .and_then(|p| p.get("String"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| "Replace with a regex pattern".to_string())?;
                let content = decoder.get("content").and_then(Value::as_str).unwrap_or("");
                steps.push(Step::Replace {
                    pattern: pattern.to_string(),
                    content: content.to_string(),
                });
            }
            "Sequence" => {
                let list = decoder
                    .get("decoders")
                    .and_then(Value::as_array)
                    .ok_or_else(|| "Sequence without decoders".to_string())?;
                for d in list {
                    Self::collect(d, steps)?;
                }
            }
            other => return Err(other.to_string()),
        }
        Ok(())
    }

    pub(crate) fn apply(&self, token: &str) -> Result<Vec<u8>> {
        let steps = match self {
            Self::Local(steps) => steps,
            Self::NotLocal(name) => {
                return Err(TokenizerError::DecoderNotTokenLocal {
                    decoder: name.clone(),
                })
            }
        };
        let mut text = token.to_string();
        for step in steps {
            match step {
                Step::Replace { pattern, content } => {
                    text = text.replace(pattern.as_str(), content)
                }
                Step::ByteLevel => {
                    // Tokens with characters outside the table (added tokens) keep their bytes.
                    let mapped: Option<Vec<u8>> =
                        text.chars().map(byte_level_char_to_byte).collect();
                    return Ok(mapped.unwrap_or_else(|| text.into_bytes()));
                }
                Step::ByteFallback => {
                    if let Some(b) = byte_fallback(&text) {
                        return Ok(vec![b]);
                    }
                }
                Step::Fuse => {}
            }
        }
        Ok(text.into_bytes())
    }
}

/// Turns a stream of token ids into complete UTF-8 text: bytes of a character split across
/// tokens are held until the character is complete; bytes that can never form a character
/// become U+FFFD, as in `decode`.
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    pending: Vec<u8>,
}

impl<'t> StreamDecoder<'t> {
    pub(crate) fn new(tokenizer: &'t Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Add one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        let bytes = self.tokenizer.token_bytes(id)?;
        self.pending.extend_from_slice(&bytes);
        Ok(self.drain(false))
    }

    /// End of stream: whatever is held, repaired.
    pub fn finish(mut self) -> String {
        self.drain(true)
    }

    /// Bytes held for an incomplete character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = after.get(n..).unwrap_or(&[]);
                        }
                        None if at_end => {
                            out.push('\u{FFFD}');
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_over_256_bytes() {
        let mut seen = [false; 256];
        for code in 0x21u32..0x200 {
            if let Some(b) = char::from_u32(code).and_then(byte_level_char_to_byte) {
                assert!(!seen[usize::from(b)], "byte {b} mapped twice");
                seen[usize::from(b)] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(byte_level_char_to_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_char_to_byte('A'), Some(b'A'));
    }

    #[test]
    fn decoder_shapes_are_classified() {
        let bl = serde_json::json!({"type": "ByteLevel"});
        assert!(matches!(
            TokenBytesRule::from_decoder_json(&bl),
            TokenBytesRule::Local(_)
        ));
        let llama = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
        assert!(matches!(
            TokenBytesRule::from_decoder_json(&llama),
            TokenBytesRule::NotLocal(_)
        ));
        let sp = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]});
        let rule = TokenBytesRule::from_decoder_json(&sp);
        assert_eq!(rule.apply("▁hi").unwrap(), b" hi");
        assert_eq!(rule.apply("<0xC3>").unwrap(), vec![0xC3]);
        assert!(matches!(
            TokenBytesRule::from_decoder_json(&Value::Null).apply("x"),
            Err(TokenizerError::DecoderNotTokenLocal { .. })
        ));
    }
}
