//! Split pre-tokenizer regexes, compiled here: possessive intervals, errors naming the pattern.
//!
//! `tokenizers` compiles a Split pattern (`{"type": "Split", "pattern": {"Regex": ...}}`) with
//! Oniguruma's default syntax. That syntax reads `X++`, `X*+` and `X?+` as possessive, but reads
//! the possessive interval `X{n,m}+` (also `X{n}+`, `X{n,}+`, `X{,m}+`) as a repeat of a repeat,
//! `(?:X{n,m})+`: `\p{N}{1,3}+` then matches a whole run of digits instead of three at most.
//! This crate reads `X{n,m}+` as possessive, `(?>X{n,m})`, as Perl, PCRE and Java do: it compiles
//! every Split regex itself, with Oniguruma's default syntax plus its possessive-interval
//! operator, which changes nothing else. The Split itself runs as `tokenizers`' does (same
//! search loop, same delimiter behaviours); every other pre-tokenizer is `tokenizers`' own.
//!
//! Two more differences, both where `tokenizers` would fail less clearly:
//! - A Split regex that does not compile fails the load with an error naming the pattern.
//! - A search Oniguruma gives up on (its retry limit, catastrophic backtracking) is an encoding
//!   error naming the pattern; `tokenizers`' search panics there.
//!
//! One Oniguruma spelling cannot be combined with the possessive-interval operator: its reversed
//! interval `X{m,n}` (m > n, Oniguruma's own possessive `{n,m}`) is an error under it. A pattern
//! that uses it is compiled with the default syntax alone, as `tokenizers` does, so its
//! `{n,m}+` keep `tokenizers`' reading.

use std::sync::OnceLock;

use onig::{MatchParam, Regex, RegexOptions, Region, SearchOptions, Syntax, SyntaxOperator};
use serde::Deserialize;
use serde_json::Value;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::tokenizer::pattern::{Invert, Pattern};
use tokenizers::{Offsets, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior};

/// Oniguruma's default syntax (what `tokenizers` compiles with) with `{n,m}+` possessive.
fn possessive_syntax() -> &'static Syntax {
    // Oniguruma keeps a pointer to the syntax in each regex: it must outlive them.
    static SYNTAX: OnceLock<Syntax> = OnceLock::new();
    SYNTAX.get_or_init(|| {
        let mut syntax = *Syntax::default();
        syntax.enable_operators(SyntaxOperator::SYNTAX_OPERATOR_PLUS_POSSESSIVE_INTERVAL);
        syntax
    })
}

/// Compile a Split regex: possessive intervals on, or, for a pattern that spells Oniguruma's
/// reversed interval, the default syntax alone. The error names the pattern.
fn compile(pattern: &str) -> Result<Regex, String> {
    Regex::with_options(
        pattern,
        RegexOptions::REGEX_OPTION_NONE,
        possessive_syntax(),
    )
    .or_else(|_| Regex::new(pattern))
    .map_err(|e| {
        format!(
            "its pre-tokenizer Split pattern {pattern:?} is not a valid Oniguruma regex ({})",
            e.description()
        )
    })
}

/// A Split regex and its source, as a `tokenizers` pattern.
pub(crate) struct SplitRegex {
    regex: Regex,
    pattern: String,
}

impl Pattern for &SplitRegex {
    /// As `tokenizers`' pattern over an Oniguruma regex (its `find_iter`, which skips an empty
    /// match right after the previous match), with search errors returned instead of panicking.
    fn find_matches(&self, inside: &str) -> tokenizers::Result<Vec<(Offsets, bool)>> {
        if inside.is_empty() {
            return Ok(vec![((0, 0), false)]);
        }
        let mut splits = Vec::new();
        let mut prev = 0;
        let mut from = 0;
        let mut last_match_end = None;
        let mut region = Region::new();
        while from <= inside.len() {
            region.clear();
            let found = self
                .regex
                .search_with_param(
                    inside,
                    from,
                    inside.len(),
                    SearchOptions::SEARCH_OPTION_NONE,
                    Some(&mut region),
                    MatchParam::default(),
                )
                .map_err(|e| {
                    format!(
                        "Split pattern {:?} failed on the text ({}); simplify the pattern",
                        self.pattern,
                        e.description()
                    )
                })?;
            let Some((start, end)) = found.and(region.pos(0)) else {
                break;
            };
            if start == end && last_match_end == Some(end) {
                from += inside
                    .get(from..)
                    .and_then(|rest| rest.chars().next())
                    .map_or(1, char::len_utf8);
                continue;
            }
            from = end;
            last_match_end = Some(end);
            if prev != start {
                splits.push(((prev, start), false));
            }
            splits.push(((start, end), true));
            prev = end;
        }
        if prev != inside.len() {
            splits.push(((prev, inside.len()), false));
        }
        Ok(splits)
    }
}

/// The pre-tokenizer used in place of `tokenizers`' own when it holds a Split regex.
pub(crate) enum PreTok {
    /// A pre-tokenizer of `tokenizers`, as loaded by it.
    Native(PreTokenizerWrapper),
    /// A Split on a regex compiled here.
    Split {
        regex: SplitRegex,
        behavior: SplitDelimiterBehavior,
        invert: bool,
    },
    /// Each in turn.
    Sequence(Vec<PreTok>),
}

impl PreTokenizer for PreTok {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        match self {
            Self::Native(p) => p.pre_tokenize(pretokenized),
            // As `tokenizers`' Split does with its own regex.
            Self::Split {
                regex,
                behavior,
                invert: true,
            } => pretokenized.split(|_, s| s.split(Invert(regex), *behavior)),
            Self::Split {
                regex,
                behavior,
                invert: false,
            } => pretokenized.split(|_, s| s.split(regex, *behavior)),
            Self::Sequence(steps) => steps.iter().try_for_each(|p| p.pre_tokenize(pretokenized)),
        }
    }
}

/// The `pre_tokenizer` of a tokenizer.json, nothing else parsed.
#[derive(Deserialize)]
struct Doc {
    #[serde(default)]
    pre_tokenizer: Option<Value>,
}

/// The `pre_tokenizer` of `json`, or `None` if it has none or `json` is not JSON of that shape
/// (then `tokenizers` reports the problem).
pub(crate) fn pre_tokenizer_json(json: &[u8]) -> Option<Value> {
    serde_json::from_slice::<Doc>(json).ok()?.pre_tokenizer
}

/// The regex of a Split node, if `node` is one with a `Regex` pattern.
fn split_regex(node: &Value) -> Option<&str> {
    if node.get("type")?.as_str()? != "Split" {
        return None;
    }
    node.get("pattern")?.get("Regex")?.as_str()
}

/// The sub-pre-tokenizers of a Sequence node.
fn sequence_steps(node: &Value) -> Option<&Vec<Value>> {
    if node.get("type")?.as_str()? != "Sequence" {
        return None;
    }
    node.get("pretokenizers")?.as_array()
}

/// Compile every Split regex under `node`; the first that does not compile is an error naming
/// it. Run before `tokenizers` loads the file, whose own error would not name it.
pub(crate) fn check_patterns(node: &Value) -> Result<(), String> {
    if let Some(pattern) = split_regex(node) {
        compile(pattern)?;
    }
    sequence_steps(node)
        .into_iter()
        .flatten()
        .try_for_each(check_patterns)
}

fn holds_split_regex(node: &Value) -> bool {
    split_regex(node).is_some()
        || sequence_steps(node)
            .into_iter()
            .flatten()
            .any(holds_split_regex)
}

/// The pre-tokenizer to use in place of `tokenizers`' own, if a Split regex is under `node`.
/// `node` must be one `tokenizers` has loaded.
pub(crate) fn own_pre_tokenizer(node: &Value) -> Result<Option<PreTok>, String> {
    if holds_split_regex(node) {
        build(node).map(Some)
    } else {
        Ok(None)
    }
}

fn build(node: &Value) -> Result<PreTok, String> {
    if let Some(steps) = sequence_steps(node) {
        return steps
            .iter()
            .map(build)
            .collect::<Result<_, _>>()
            .map(PreTok::Sequence);
    }
    if let Some(pattern) = split_regex(node) {
        let field = |name: &str| node.get(name).cloned().unwrap_or(Value::Null);
        let behavior = serde_json::from_value(field("behavior"))
            .map_err(|e| format!("its Split pre-tokenizer has no valid behavior: {e}"))?;
        let invert = serde_json::from_value(field("invert"))
            .map_err(|e| format!("its Split pre-tokenizer has no valid invert flag: {e}"))?;
        return Ok(PreTok::Split {
            regex: SplitRegex {
                regex: compile(pattern)?,
                pattern: pattern.to_string(),
            },
            behavior,
            invert,
        });
    }
    serde_json::from_value(node.clone())
        .map(PreTok::Native)
        .map_err(|e| format!("its pre-tokenizer cannot be loaded: {e}"))
}
