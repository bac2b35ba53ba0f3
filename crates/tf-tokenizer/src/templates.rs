//! The engines' prompt templates, as data.
//!
//! * Qwen-Image 2.1: the prompt goes into a fixed chat wrapper; the system block's tokens are
//!   encoded and then dropped, so the text encoder's kept rows start at `<|im_start|>user`.
//!   An empty prompt becomes a single space.
//! * MiniMax H3: the prompt is encoded raw (no template, no BOS/EOS); `\(` and `\)` become
//!   `(` and `)`; the text is cut before every `embedding:` that follows whitespace and each
//!   piece is encoded alone; an empty result is the pad id 151643. The tokenizer must carry
//!   H3's seven extra special tokens at 151669-151675.

use crate::error::{Result, TokenizerError};
use crate::tokenizer::{Span, Tokenizer};

/// Qwen-Image 2.1's text-to-image prompt template.
pub struct QwenImage21;

/// A Qwen-Image prompt, encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QwenImagePrompt {
    /// Every id of the filled template.
    pub ids: Vec<u32>,
    /// How many leading ids (the system block) the text encoder output drops.
    pub drop: usize,
}

impl QwenImagePrompt {
    /// The ids whose hidden states the DiT sees.
    pub fn kept(&self) -> &[u32] {
        self.ids.get(self.drop..).unwrap_or(&[])
    }
}

impl QwenImage21 {
    /// The system block, encoded and then dropped.
    pub const SYSTEM: &'static str =
        "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n";
    /// Opens the user turn.
    pub const USER_OPEN: &'static str = "<|im_start|>user\n";
    /// Closes the user turn and opens the assistant's.
    pub const CLOSE: &'static str = "<|im_end|>\n<|im_start|>assistant\n";
    /// What an empty prompt is replaced by.
    pub const EMPTY_PROMPT: &'static str = " ";

    /// The request as spans: the prompt is a user span, so it never forms an added token.
    pub fn spans(prompt: &str) -> [Span<'_>; 3] {
        let prompt = if prompt.is_empty() {
            Self::EMPTY_PROMPT
        } else {
            prompt
        };
        // The system block and the user opening are one template span: the newline between
        // them is ordinary text between two added tokens either way.
        [
            Span::template(concat!(
                "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n",
                "<|im_start|>user\n"
            )),
            Span::user(prompt),
            Span::template(Self::CLOSE),
        ]
    }

    /// Encode `prompt` in the template and count the system block's ids.
    pub fn encode(tokenizer: &Tokenizer, prompt: &str) -> Result<QwenImagePrompt> {
        let ids = tokenizer.encode_masked(&Self::spans(prompt))?;
        let system = tokenizer.encode(Self::SYSTEM)?;
        if !ids.starts_with(&system) {
            return Err(TokenizerError::Template {
                template: "Qwen-Image 2.1",
                reason: "the system block does not encode to a prefix of the filled template; \
                         the tokenizer is not a Qwen chat tokenizer (needs <|im_start|> and <|im_end|>)"
                    .into(),
            });
        }
        Ok(QwenImagePrompt {
            drop: system.len(),
            ids,
        })
    }
}

/// Whether a MiniMax H3 prompt may spell added tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptMarkup {
    /// As the reference pipeline: spelled added tokens (`<d>`, the lyrics markers...) count.
    Allowed,
    /// The prompt is untrusted text: nothing in it forms an added token.
    Forbidden,
}

/// MiniMax H3's prompt handling.
pub struct MiniMaxH3;

impl MiniMaxH3 {
    /// The first of H3's extra special tokens.
    pub const FIRST_EXTRA_ID: u32 = 151_669;
    /// The last of them.
    pub const LAST_EXTRA_ID: u32 = 151_675;
    /// The extra tokens whose spelling is fixed.
    pub const KNOWN_EXTRAS: [(u32, &'static str); 3] =
        [(151_669, "<d>"), (151_670, "</d>"), (151_671, "<|cutoff|>")];
    /// What an empty encoding becomes (`<|endoftext|>`).
    pub const PAD_ID: u32 = 151_643;
    /// The marker that starts a separately encoded piece when it follows whitespace.
    pub const EMBEDDING_MARKER: &'static str = "embedding:";

    /// Check the tokenizer has H3's extra special tokens at 151669-151675.
    pub fn check(tokenizer: &Tokenizer) -> Result<()> {
        for id in Self::FIRST_EXTRA_ID..=Self::LAST_EXTRA_ID {
            let info = tokenizer.added_tokens().iter().find(|t| t.id == id);
            let ok = match (info, Self::KNOWN_EXTRAS.iter().find(|(k, _)| *k == id)) {
                (Some(t), Some((_, name))) => t.special && t.content == *name,
                (Some(t), None) => t.special && !t.content.is_empty(),
                (None, _) => false,
            };
            if !ok {
                return Err(TokenizerError::Template {
                    template: "MiniMax H3",
                    reason: format!(
                        "token id {id} is not H3's extra special token; load the tokenizer.json \
                         shipped with the H3 text encoder"
                    ),
                });
            }
        }
        Ok(())
    }

    /// `\(` -> `(`, `\)` -> `)`, then cut before each `embedding:` that follows whitespace.
    pub fn pieces(prompt: &str) -> Vec<String> {
        let text = prompt.replace("\\(", "(").replace("\\)", ")");
        let mut pieces = Vec::new();
        let mut start = 0usize;
        let mut search = 0usize;
        while let Some(found) = text
            .get(search..)
            .and_then(|t| t.find(Self::EMBEDDING_MARKER))
        {
            let at = search + found;
            let after_space = text
                .get(..at)
                .and_then(|before| before.chars().next_back())
                .is_some_and(char::is_whitespace);
            if after_space && at > start {
                pieces.push(text.get(start..at).unwrap_or_default().to_string());
                start = at;
            }
            search = at + Self::EMBEDDING_MARKER.len();
        }
        pieces.push(text.get(start..).unwrap_or_default().to_string());
        pieces.retain(|p| !p.is_empty());
        pieces
    }

    /// Encode a prompt as H3's text encoder expects it.
    pub fn encode(tokenizer: &Tokenizer, prompt: &str, markup: PromptMarkup) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for piece in Self::pieces(prompt) {
            ids.extend(match markup {
                PromptMarkup::Allowed => tokenizer.encode(&piece)?,
                PromptMarkup::Forbidden => tokenizer.encode_plain(&piece)?,
            });
        }
        if ids.is_empty() {
            ids.push(Self::PAD_ID);
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h3_pieces_unescape_and_cut_after_whitespace_only() {
        assert_eq!(MiniMaxH3::pieces(r"a \(b\) c"), vec!["a (b) c"]);
        assert_eq!(
            MiniMaxH3::pieces("x embedding:foo y\nembedding:bar"),
            vec!["x ", "embedding:foo y\n", "embedding:bar"]
        );
        assert_eq!(MiniMaxH3::pieces("xembedding:foo"), vec!["xembedding:foo"]);
        assert_eq!(MiniMaxH3::pieces("embedding:foo"), vec!["embedding:foo"]);
        assert!(MiniMaxH3::pieces("").is_empty());
    }

    #[test]
    fn qwen_image_empty_prompt_becomes_a_space() {
        let spans = QwenImage21::spans("");
        assert_eq!(spans[1].text, " ");
        assert_eq!(
            format!("{}{}", QwenImage21::SYSTEM, QwenImage21::USER_OPEN),
            spans[0].text
        );
    }
}
