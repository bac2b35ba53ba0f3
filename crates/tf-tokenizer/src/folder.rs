//! A model folder (tokenizer.json and its JSON side files) and the EOS resolver.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Result, TokenizerError};
use crate::tokenizer::Tokenizer;

/// A model folder: tokenizer.json plus the optional tokenizer_config.json, config.json and
/// generation_config.json.
pub struct ModelFolder {
    /// The folder.
    pub path: PathBuf,
    /// tokenizer.json, loaded.
    pub tokenizer: Tokenizer,
    /// tokenizer_config.json, if present.
    pub tokenizer_config: Option<Value>,
    /// config.json, if present.
    pub config: Option<Value>,
    /// generation_config.json, if present.
    pub generation_config: Option<Value>,
    /// The resolved end-of-sequence ids (see [`resolve_eos_ids`]).
    pub eos_ids: Vec<u32>,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(path).map_err(|source| TokenizerError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| TokenizerError::Config {
            file: path.display().to_string(),
            field: "(whole file)".into(),
            reason: format!("is not valid JSON: {e}"),
        })
}

impl ModelFolder {
    /// Load the folder; only tokenizer.json is required.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let tokenizer = Tokenizer::from_file(path.join("tokenizer.json"))?;
        let tokenizer_config = read_json(&path.join("tokenizer_config.json"))?;
        let config = read_json(&path.join("config.json"))?;
        let generation_config = read_json(&path.join("generation_config.json"))?;
        let eos_ids = resolve_eos_ids(
            &tokenizer,
            config.as_ref(),
            generation_config.as_ref(),
            tokenizer_config.as_ref(),
        )?;
        Ok(Self {
            path,
            tokenizer,
            tokenizer_config,
            config,
            generation_config,
            eos_ids,
        })
    }
}

/// `eos_token_id` as an int or a list of ints; absent or null gives nothing.
fn ids_field(doc: &Value, file: &str, field: &str) -> Result<Vec<u32>> {
    let bad = |reason: &str| TokenizerError::Config {
        file: file.to_string(),
        field: field.to_string(),
        reason: reason.to_string(),
    };
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad("must be a non-negative integer id or a list of them"))
    };
    match doc.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// End-of-sequence ids, de-duplicated, in this order: config.json `eos_token_id` (top level,
/// then `text_config`), generation_config.json `eos_token_id`, then tokenizer_config.json
/// `eos_token` (a string or `{content}`) looked up in the tokenizer. A chat end that differs
/// from the model's EOS is kept, never hidden by it.
pub fn resolve_eos_ids(
    tokenizer: &Tokenizer,
    config: Option<&Value>,
    generation_config: Option<&Value>,
    tokenizer_config: Option<&Value>,
) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = Vec::new();
    let mut add = |new: Vec<u32>| {
        for id in new {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    };
    if let Some(config) = config {
        add(ids_field(config, "config.json", "eos_token_id")?);
        if let Some(text) = config.get("text_config") {
            add(ids_field(text, "config.json", "text_config.eos_token_id")?);
        }
    }
    if let Some(generation) = generation_config {
        add(ids_field(
            generation,
            "generation_config.json",
            "eos_token_id",
        )?);
    }
    if let Some(tc) = tokenizer_config {
        let token = match tc.get("eos_token") {
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str),
            _ => None,
        };
        if let Some(token) = token {
            let id = tokenizer
                .token_to_id(token)
                .ok_or_else(|| TokenizerError::Config {
                    file: "tokenizer_config.json".into(),
                    field: "eos_token".into(),
                    reason: format!(
                        "names {token:?}, which is not in tokenizer.json; fix the name or remove it"
                    ),
                })?;
            add(vec![id]);
        }
    }
    Ok(ids)
}
