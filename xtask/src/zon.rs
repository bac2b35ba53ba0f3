//! A small reader for Zig Object Notation, enough for `build.zig.zon` (structs, tuples, strings, numbers,
//! enum literals, identifiers, `@"quoted"` names and `//` comments).

use std::collections::BTreeMap;

/// A parsed ZON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `.{ .field = value, ... }`
    Struct(BTreeMap<String, Value>),
    /// `.{ value, ... }`
    Tuple(Vec<Value>),
    String(String),
    /// A number literal, kept as written (`0x...`, decimal).
    Number(String),
    /// `.name`
    EnumLiteral(String),
    /// `true`, `false`, `null`, ...
    Identifier(String),
}

impl Value {
    /// A struct field.
    pub fn field(&self, name: &str) -> Option<&Value> {
        match self {
            Value::Struct(fields) => fields.get(name),
            _ => None,
        }
    }
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
}

type Parsed<T> = Result<T, String>;

impl Parser<'_> {
    fn skip_space(&mut self) {
        loop {
            while self.at < self.text.len() && self.text[self.at].is_ascii_whitespace() {
                self.at += 1;
            }
            if self.text[self.at..].starts_with(b"//") {
                while self.at < self.text.len() && self.text[self.at] != b'\n' {
                    self.at += 1;
                }
            } else {
                return;
            }
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.text.get(self.at).copied()
    }

    fn expect(&mut self, byte: u8) -> Parsed<()> {
        if self.peek() == Some(byte) {
            self.at += 1;
            Ok(())
        } else {
            Err(format!(
                "expected '{}' at byte {}",
                char::from(byte),
                self.at
            ))
        }
    }

    fn word(&mut self) -> String {
        let start = self.at;
        while self.at < self.text.len()
            && (self.text[self.at].is_ascii_alphanumeric() || self.text[self.at] == b'_')
        {
            self.at += 1;
        }
        String::from_utf8_lossy(&self.text[start..self.at]).into_owned()
    }

    fn name(&mut self) -> Parsed<String> {
        if self.peek() == Some(b'@') {
            self.at += 1;
            return self.string();
        }
        let word = self.word();
        if word.is_empty() {
            Err(format!("expected a name at byte {}", self.at))
        } else {
            Ok(word)
        }
    }

    fn string(&mut self) -> Parsed<String> {
        self.expect(b'"')?;
        let mut bytes = Vec::new();
        loop {
            let Some(&byte) = self.text.get(self.at) else {
                return Err("unterminated string".to_string());
            };
            self.at += 1;
            match byte {
                b'"' => break,
                b'\\' => {
                    let Some(&escaped) = self.text.get(self.at) else {
                        return Err("unterminated escape".to_string());
                    };
                    self.at += 1;
                    match escaped {
                        b'n' => bytes.push(b'\n'),
                        b't' => bytes.push(b'\t'),
                        b'r' => bytes.push(b'\r'),
                        b'x' => {
                            let hex = self
                                .text
                                .get(self.at..self.at + 2)
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u8::from_str_radix(h, 16).ok())
                                .ok_or("bad \\x escape")?;
                            self.at += 2;
                            bytes.push(hex);
                        }
                        other => bytes.push(other),
                    }
                }
                other => bytes.push(other),
            }
        }
        String::from_utf8(bytes).map_err(|_| "string is not UTF-8".to_string())
    }

    fn value(&mut self) -> Parsed<Value> {
        match self.peek() {
            Some(b'.') => {
                self.at += 1;
                if self.peek() == Some(b'{') {
                    self.aggregate()
                } else {
                    Ok(Value::EnumLiteral(self.name()?))
                }
            }
            Some(b'"') => Ok(Value::String(self.string()?)),
            Some(b) if b.is_ascii_digit() || b == b'-' => {
                let start = self.at;
                self.at += 1;
                while self.at < self.text.len()
                    && (self.text[self.at].is_ascii_alphanumeric()
                        || b"_.".contains(&self.text[self.at]))
                {
                    self.at += 1;
                }
                Ok(Value::Number(
                    String::from_utf8_lossy(&self.text[start..self.at]).into_owned(),
                ))
            }
            Some(_) => Ok(Value::Identifier(self.name()?)),
            None => Err("unexpected end of file".to_string()),
        }
    }

    /// After `.`: `{ }`, a struct or a tuple.
    fn aggregate(&mut self) -> Parsed<Value> {
        self.expect(b'{')?;
        let mut fields = BTreeMap::new();
        let mut items = Vec::new();
        loop {
            if self.peek() == Some(b'}') {
                self.at += 1;
                break;
            }
            // A field starts with `.name =`; anything else is a tuple item.
            let save = self.at;
            let mut is_field = false;
            if self.peek() == Some(b'.') {
                self.at += 1;
                if self.peek() != Some(b'{') {
                    if let Ok(name) = self.name() {
                        if self.peek() == Some(b'=') {
                            self.at += 1;
                            let value = self.value()?;
                            fields.insert(name, value);
                            is_field = true;
                        }
                    }
                }
                if !is_field {
                    self.at = save;
                }
            }
            if !is_field {
                items.push(self.value()?);
            }
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b'}') => {}
                _ => return Err(format!("expected ',' or '}}' at byte {}", self.at)),
            }
        }
        if !fields.is_empty() && !items.is_empty() {
            return Err("a value mixes fields and tuple items".to_string());
        }
        Ok(if items.is_empty() {
            Value::Struct(fields)
        } else {
            Value::Tuple(items)
        })
    }
}

/// Parses a ZON document.
pub fn parse(text: &str) -> Result<Value, String> {
    let mut parser = Parser {
        text: text.as_bytes(),
        at: 0,
    };
    let value = parser.value()?;
    if parser.peek().is_some() {
        return Err(format!("trailing text at byte {}", parser.at));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_build_zig_zon() {
        let text = r#"
        // comment
        .{
            .name = .tensorfold,
            .version = "1.0.4",
            .fingerprint = 0xb6dc5a482d53980a, // trailing comment
            .minimum_zig_version = "0.17.0",
            .dependencies = .{},
            .paths = .{ "build.zig", "build.zig.zon", "zig", },
            .@"quoted name" = "a\"b\x41",
        }"#;
        let value = parse(text).unwrap();
        assert_eq!(
            value.field("name"),
            Some(&Value::EnumLiteral("tensorfold".into()))
        );
        assert_eq!(value.field("version"), Some(&Value::String("1.0.4".into())));
        assert_eq!(
            value.field("fingerprint"),
            Some(&Value::Number("0xb6dc5a482d53980a".into()))
        );
        assert_eq!(
            value.field("dependencies"),
            Some(&Value::Struct(BTreeMap::new()))
        );
        assert_eq!(
            value.field("paths"),
            Some(&Value::Tuple(vec![
                Value::String("build.zig".into()),
                Value::String("build.zig.zon".into()),
                Value::String("zig".into())
            ]))
        );
        assert_eq!(
            value.field("quoted name"),
            Some(&Value::String("a\"bA".into()))
        );
    }

    #[test]
    fn rejects_unterminated_input() {
        assert!(parse(".{ .name = \"x }").is_err());
        assert!(parse(".{ .name = .x ").is_err());
    }
}
