//! Typed parsing of model config files (`config.json`, `scheduler_config.json`, `model_index.json`) that names
//! the offending key.
//!
//! Every config struct derives `Deserialize` with `#[serde(default)]` for each key (required keys are `Option`
//! and checked by the struct's `validate()`), so a one-key object always parses unless that key is bad. When the
//! whole object fails, [`parse_object`] re-parses it key by key and reports the first key that fails on its own,
//! with serde's reason ("invalid type: string \"two\", expected usize").
//!
//! Bounds live in each `validate()`; [`at_most`] and [`checked_product`] are the shared helpers.
//!
//! ```
//! use serde::Deserialize;
//! use tf_engines::nn::config::parse_object;
//!
//! #[derive(Debug, Deserialize, Default)]
//! #[serde(default)]
//! struct Tiny {
//!     layers: usize,
//! }
//! let err = parse_object::<Tiny>(&serde_json::json!({"layers": "two", "other": 1})).unwrap_err();
//! assert!(err.contains("`layers`"), "{err}");
//! assert_eq!(parse_object::<Tiny>(&serde_json::json!({"layers": 2})).unwrap().layers, 2);
//! ```

use serde::de::DeserializeOwned;
use serde_json::Value;

/// Parses `value` (a JSON object) as `T`. The error names the first key that fails, or says what else is
/// wrong; the caller adds the file name.
pub fn parse_object<T: DeserializeOwned>(value: &Value) -> Result<T, String> {
    let Value::Object(map) = value else {
        return Err(format!("expected a JSON object, found {}", kind_of(value)));
    };
    match serde_json::from_value::<T>(value.clone()) {
        Ok(t) => Ok(t),
        Err(whole) => {
            for (key, v) in map {
                let mut one = serde_json::Map::new();
                one.insert(key.clone(), v.clone());
                if let Err(e) = serde_json::from_value::<T>(Value::Object(one)) {
                    return Err(format!("`{key}`: {e}"));
                }
            }
            Err(whole.to_string())
        }
    }
}

/// `Ok` when `value <= max`, else an error naming `key` and the limit.
pub fn at_most(key: &str, value: usize, max: usize) -> Result<(), String> {
    if value <= max {
        Ok(())
    } else {
        Err(format!(
            "`{key}` = {value} is above the supported limit of {max}"
        ))
    }
}

/// `Ok` when `1 <= value <= max`, else an error naming `key`.
pub fn in_range(key: &str, value: usize, max: usize) -> Result<(), String> {
    if value == 0 {
        return Err(format!("`{key}` must be positive, found 0"));
    }
    at_most(key, value, max)
}

/// The product of `factors` (named `what` in the error), or an error when it overflows `usize`.
pub fn checked_product(what: &str, factors: &[usize]) -> Result<usize, String> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| format!("{what} ({factors:?}) overflows"))
}

/// What kind of JSON value `value` is, for error messages ("a string", "an object").
pub(crate) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, Default)]
    #[serde(default)]
    struct Two {
        a: usize,
        b: Option<Vec<bool>>,
    }

    #[test]
    fn the_failing_key_is_named() {
        let e = parse_object::<Two>(&serde_json::json!({"a": 1, "b": [true, 3]})).unwrap_err();
        assert!(e.starts_with("`b`"), "{e}");
        let e = parse_object::<Two>(&serde_json::json!({"a": -1})).unwrap_err();
        assert!(e.starts_with("`a`"), "{e}");
        let e = parse_object::<Two>(&serde_json::json!([1])).unwrap_err();
        assert!(e.contains("JSON object"), "{e}");
        let ok = parse_object::<Two>(&serde_json::json!({"a": 3, "z": "ignored"})).unwrap();
        assert_eq!((ok.a, ok.b), (3, None));
    }

    #[test]
    fn bounds_and_products() {
        assert!(at_most("k", 3, 3).is_ok());
        assert!(at_most("k", 4, 3).unwrap_err().contains("`k` = 4"));
        assert!(in_range("k", 0, 3).is_err());
        assert_eq!(checked_product("p", &[2, 3, 4]), Ok(24));
        assert!(checked_product("p", &[usize::MAX, 2]).is_err());
    }
}
