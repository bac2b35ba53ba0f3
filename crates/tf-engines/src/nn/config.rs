//! Typed parsing of model config files (`config.json`, `scheduler_config.json`, `model_index.json`) that names
//! the offending key.
//!
//! Every config struct derives `Deserialize` with `#[serde(default)]` for each key (required keys are `Option`
//! and checked by the struct's `validate()`), so a one-key object always parses unless that key is bad. When the
//! whole object fails, [`parse_object`] re-parses it key by key and reports the first key that fails on its own,
//! with serde's reason ("invalid type: string \"two\", expected usize").
//!
//! Bounds live in each `validate()`; [`at_most`], [`in_range`], [`checked_product`], [`check_class_name`] and
//! [`check_per_channel`] are the shared helpers, and [`parse_validated`] parses and validates in one call.
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

use std::path::Path;

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

/// Parses `value` as `T` with [`parse_object`] and checks it with `validate`. The error is `(file, why)`: the
/// `file` the value was read from, for the caller's error type, and the reason (a parse error ends with how to
/// fix it).
pub fn parse_validated<T: DeserializeOwned>(
    value: &Value,
    file: &Path,
    validate: impl FnOnce(&T) -> Result<(), String>,
) -> Result<T, (String, String)> {
    let file = file.display().to_string();
    let config: T = match parse_object(value) {
        Ok(config) => config,
        Err(why) => {
            return Err((
                file,
                format!("{why} (fix the key or remove it to take the diffusers default)"),
            ))
        }
    };
    match validate(&config) {
        Ok(()) => Ok(config),
        Err(why) => Err((file, why)),
    }
}

/// Whether a parsed `config.json` names `class` (`_class_name`).
pub fn names_class(config_json: &Value, class: &str) -> bool {
    config_json.get("_class_name").and_then(|v| v.as_str()) == Some(class)
}

/// `Ok` unless a `_class_name` is given and differs from `expected`; the error says what the loader reads
/// (`folder`, e.g. "the vae/ folder of a MiniMax H3 model").
pub fn check_class_name(found: Option<&str>, expected: &str, folder: &str) -> Result<(), String> {
    match found {
        Some(name) if name != expected => Err(format!(
            "`_class_name` is {name:?}; this loader is for {expected} ({folder})"
        )),
        _ => Ok(()),
    }
}

/// `Ok` when `values` holds one value per channel (`channels`), each finite with magnitude at most 1e30 and,
/// when `nonzero`, not zero (per-channel latent statistics); the error names `key`.
pub fn check_per_channel(
    key: &str,
    values: &[f64],
    channels: usize,
    nonzero: bool,
) -> Result<(), String> {
    if values.len() != channels {
        return Err(format!(
            "`{key}` has {} values; it needs one per latent channel ({channels})",
            values.len()
        ));
    }
    if let Some(bad) = values
        .iter()
        .find(|x| !(x.is_finite() && x.abs() <= 1e30) || (nonzero && **x == 0.0))
    {
        return Err(format!(
            "`{key}` holds {bad}; every value must be finite{}",
            if nonzero { " and non-zero" } else { "" }
        ));
    }
    Ok(())
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

/// Assertions the config parsers' unit tests share.
#[cfg(test)]
pub(crate) mod test_support {
    use std::fmt::{Debug, Display};

    use serde_json::Value;

    /// Each `(config, key)` case is refused by `parse` with an error that starts with `config.json: ` and names
    /// `key`.
    pub(crate) fn assert_refused_naming_key<T: Debug, E: Display>(
        parse: impl Fn(Value) -> Result<T, E>,
        cases: &[(Value, &str)],
    ) {
        for (bad, key) in cases {
            let err = parse(bad.clone()).unwrap_err().to_string();
            assert!(err.contains(key), "{bad}: {err}");
            assert!(err.starts_with("config.json: "), "{err}");
        }
    }

    /// Every key of `keys`, alone in a config under each of a set of hostile values (zero, negative, huge,
    /// tiny, null, a string, empty / nested / overflowing arrays, an object), either parses, and the config
    /// passes `check`, or fails with an error naming the key.
    pub(crate) fn assert_each_key_under_hostile_values<T, E: Display>(
        keys: &[&str],
        parse: impl Fn(Value) -> Result<T, E>,
        check: impl Fn(&T),
    ) {
        let values = [
            serde_json::json!(0),
            serde_json::json!(-1),
            serde_json::json!(u64::MAX),
            serde_json::json!(1e308),
            serde_json::json!(f64::MIN_POSITIVE),
            serde_json::json!(null),
            serde_json::json!("7"),
            serde_json::json!([]),
            serde_json::json!([0]),
            serde_json::json!([u64::MAX, 2]),
            serde_json::json!([[1, 3, 5], [0]]),
            serde_json::json!([1e308, -1e308]),
            serde_json::json!({}),
        ];
        for key in keys {
            for value in &values {
                let mut c = serde_json::Map::new();
                c.insert(key.to_string(), value.clone());
                match parse(Value::Object(c)) {
                    Ok(config) => check(&config),
                    Err(e) => assert!(e.to_string().contains(key), "{key}={value}: {e}"),
                }
            }
        }
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

    #[test]
    fn class_names_and_per_channel_values() {
        let json = serde_json::json!({"_class_name": "A"});
        assert!(names_class(&json, "A"));
        assert!(!names_class(&json, "B"));
        assert!(!names_class(&serde_json::json!({}), "A"));
        assert!(check_class_name(None, "A", "f").is_ok());
        assert!(check_class_name(Some("A"), "A", "f").is_ok());
        let e = check_class_name(Some("B"), "A", "the a/ folder").unwrap_err();
        assert!(e.contains("\"B\"") && e.contains("(the a/ folder)"), "{e}");
        assert!(check_per_channel("m", &[0.0, 1.0], 2, false).is_ok());
        assert!(check_per_channel("m", &[1.0], 2, false)
            .unwrap_err()
            .contains("1 values"));
        assert!(check_per_channel("s", &[0.0, 1.0], 2, true)
            .unwrap_err()
            .contains("non-zero"));
        assert!(check_per_channel("m", &[f64::NAN, 1.0], 2, false).is_err());
        assert!(check_per_channel("m", &[1e31, 1.0], 2, false).is_err());
    }

    #[test]
    fn parse_validated_names_the_file() {
        let file = Path::new("dir/config.json");
        let ok: Two =
            parse_validated(&serde_json::json!({"a": 2}), file, |_: &Two| Ok(())).unwrap();
        assert_eq!(ok.a, 2);
        let (f, why) =
            parse_validated::<Two>(&serde_json::json!({"a": "x"}), file, |_| Ok(())).unwrap_err();
        assert_eq!(f, "dir/config.json");
        assert!(
            why.starts_with("`a`") && why.ends_with("diffusers default)"),
            "{why}"
        );
        let (_, why) = parse_validated::<Two>(&serde_json::json!({"a": 2}), file, |t| {
            Err(format!("a = {}", t.a))
        })
        .unwrap_err();
        assert_eq!(why, "a = 2");
    }
}
