//! Tidy checks: the rules of docs/ARCHITECTURE.md that lints cannot see, checked over the whole tree.
//!
//! - The crate dependency graph (from `cargo metadata`) runs one way only.
//! - No model folder of tf-engines imports another model folder, and the shared layer imports none (any
//!   path: `use` items on one line or many, inline paths, `super::super::`, `tf_engines::`).
//! - Every `unsafe` block and `unsafe impl` in library code has a `SAFETY` comment right above it.
//! - No source file grows past a size ceiling.
//! - No library code sets up NVLink multicast, and tf-nccl keeps NCCL's multicast off.
//! - No engine or tf-nccl code installs a process-wide driver hook (memcap, the allocation hook, the device
//!   limit, an arena) or reaches the driver's entry table (`.api()`) outside a short allow-list.
//! - Engine code makes CUDA streams in one place (`nn::gpu::GpuDevice`, and the `tf` tool's own): components
//!   borrow their pipeline's stream.

// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent()
        .expect("xtask lives one level below the root")
        .to_path_buf()
}

/// Every `.rs` file under `dir`, recursively, skipping `target/` and hidden folders.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name == "target" || name == "bundle" {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The workspace's own crates and the workspace crates each one depends on, normal and build dependencies
/// apart from dev-dependencies.
fn dependency_graph() -> BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(repo_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let ours: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    let mut graph = BTreeMap::new();
    for p in packages {
        let mut normal = BTreeSet::new();
        let mut dev = BTreeSet::new();
        for d in p["dependencies"].as_array().unwrap() {
            let name = d["name"].as_str().unwrap().to_string();
            if !ours.contains(&name) {
                continue;
            }
            if d["kind"].as_str() == Some("dev") {
                dev.insert(name);
            } else {
                normal.insert(name);
            }
        }
        graph.insert(p["name"].as_str().unwrap().to_string(), (normal, dev));
    }
    graph
}

#[test]
fn crate_dependencies_run_one_way() {
    // crate -> the workspace crates it may depend on (normal and build dependencies).
    let allowed: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("tf-sys", &[][..]),
        ("tf-copysource", &[][..]),
        ("tf-tokenizer", &[][..]),
        ("tf-cuda", &["tf-sys", "tf-copysource"][..]),
        // tf-nccl: the MiniMax H3 DiT across GPUs (`--gpus N`); NCCL itself is opened only then.
        ("tf-engines", &["tf-cuda", "tf-tokenizer", "tf-nccl"][..]),
        // NCCL on tf-cuda's contexts and streams; engines opt into it, nothing below depends on it.
        ("tf-nccl", &["tf-cuda"][..]),
        ("tf-testdriver", &["tf-sys"][..]),
        ("xtask", &["tf-sys"][..]),
    ]);
    let graph = dependency_graph();
    let mut problems = Vec::new();
    for (krate, (normal, dev)) in &graph {
        let Some(ok) = allowed.get(krate.as_str()) else {
            problems.push(format!(
                "{krate} is not in the tidy test's map: add it with the crates it may use"
            ));
            continue;
        };
        for dep in normal {
            if !ok.contains(&dep.as_str()) {
                problems.push(format!(
                    "{krate} depends on {dep}, against the direction in docs/ARCHITECTURE.md"
                ));
            }
        }
        for dep in dev {
            if dep != "tf-testdriver" && !ok.contains(&dep.as_str()) {
                problems.push(format!("{krate} has a dev-dependency on {dep}: only tf-testdriver (the fake driver) may be one"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The fake driver is a fixture, never a normal dependency of anything.
    for (krate, (normal, _)) in &graph {
        assert!(
            !normal.contains("tf-testdriver"),
            "{krate} depends on tf-testdriver outside dev-dependencies"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Reading Rust source for the rules below: a small lexer and path reader, so a rule sees a path the way the
// compiler does (across lines, through `{...}` groups and `::<...>` arguments) and never the inside of a
// string or char literal. Comments are kept apart: the module rule reads them too (a doc link to another
// model is a reference to it), the driver-hook rule does not.

/// One token of code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tok<'a> {
    /// A name or keyword (`$crate` included).
    Ident(&'a str),
    /// `::`.
    Sep,
    Punct(char),
}

#[derive(Clone, Copy, Debug)]
struct Token<'a> {
    tok: Tok<'a>,
    line: usize,
}

/// A comment's text, the line it starts on, and the index of the code token that follows it.
#[derive(Clone, Copy, Debug)]
struct Comment<'a> {
    text: &'a str,
    line: usize,
    before: usize,
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The index just past a string literal whose body starts at `j`; `raw` is the number of `#`s of a raw
/// string (no escapes in it).
fn skip_string(b: &[u8], mut j: usize, raw: Option<usize>, line: &mut usize) -> usize {
    while j < b.len() {
        match b[j] {
            b'\n' => *line += 1,
            b'\\' if raw.is_none() => {
                if b.get(j + 1) == Some(&b'\n') {
                    *line += 1;
                }
                j += 1;
            }
            b'"' => {
                let hashes = raw.unwrap_or(0);
                if b.len() > j + hashes && b[j + 1..=j + hashes].iter().all(|&h| h == b'#') {
                    return j + 1 + hashes;
                }
            }
            _ => {}
        }
        j += 1;
    }
    j
}

/// Code tokens (string, char and number literals dropped) and comments, apart. With `code` false (a
/// comment's own text) quotes and apostrophes are plain punctuation and nothing starts a comment.
fn lex(src: &str, first_line: usize, code: bool) -> (Vec<Token<'_>>, Vec<Comment<'_>>) {
    let b = src.as_bytes();
    let mut toks = Vec::new();
    let mut comments = Vec::new();
    let mut line = first_line;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if code && c == b'/' && next == Some(b'/') {
            let end = src[i..].find('\n').map_or(b.len(), |n| i + n);
            comments.push(Comment {
                text: &src[i + 2..end],
                line,
                before: toks.len(),
            });
            i = end;
        } else if code && c == b'/' && next == Some(b'*') {
            // Block comments nest.
            let (mut depth, mut j) = (1, i + 2);
            while j < b.len() && depth > 0 {
                if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                    depth += 1;
                    j += 2;
                } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            let end = if depth == 0 { j - 2 } else { j };
            comments.push(Comment {
                text: &src[i + 2..end],
                line,
                before: toks.len(),
            });
            line += b[i..j].iter().filter(|&&x| x == b'\n').count();
            i = j;
        } else if code && c == b'"' {
            i = skip_string(b, i + 1, None, &mut line);
        } else if code && c == b'\'' {
            // A char literal ('x', '\n', '\u{..}', '{') or a lifetime ('a, whose name then lexes as a word).
            if next == Some(b'\\') {
                let mut j = i + 3;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                i = j + 1;
            } else {
                let width = src[i + 1..].chars().next().map_or(0, char::len_utf8);
                i += if width > 0 && b.get(i + 1 + width) == Some(&b'\'') {
                    2 + width
                } else {
                    1
                };
            }
        } else if (is_ident_byte(c) && !c.is_ascii_digit())
            || (c == b'$' && next.is_some_and(is_ident_byte))
        {
            let start = i;
            i += 1;
            while i < b.len() && is_ident_byte(b[i]) {
                i += 1;
            }
            let word = &src[start..i];
            if code && matches!(word, "r" | "br" | "cr") && matches!(b.get(i), Some(b'"' | b'#')) {
                let mut j = i;
                while b.get(j) == Some(&b'#') {
                    j += 1;
                }
                if b.get(j) == Some(&b'"') {
                    i = skip_string(b, j + 1, Some(j - i), &mut line);
                } else {
                    // A raw identifier, `r#name`: the name lexes next.
                    i = j;
                }
            } else if code && matches!(word, "b" | "c") && b.get(i) == Some(&b'"') {
                i = skip_string(b, i + 1, None, &mut line);
            } else if code && word == "b" && b.get(i) == Some(&b'\'') {
                // A byte literal: the apostrophe's branch skips it next.
            } else {
                toks.push(Token {
                    tok: Tok::Ident(word),
                    line,
                });
            }
        } else if c.is_ascii_digit() {
            while i < b.len() && is_ident_byte(b[i]) {
                i += 1;
            }
        } else if c == b':' && next == Some(b':') {
            toks.push(Token {
                tok: Tok::Sep,
                line,
            });
            i += 2;
        } else {
            if c.is_ascii() {
                toks.push(Token {
                    tok: Tok::Punct(c as char),
                    line,
                });
            }
            i += 1;
        }
    }
    (toks, comments)
}

/// A path as written, one `(name, line)` per segment.
type RustPath<'a> = Vec<(&'a str, usize)>;

fn tok_at<'a>(toks: &[Token<'a>], i: usize) -> Option<Tok<'a>> {
    toks.get(i).map(|t| t.tok)
}

/// The index past the `<...>` that opens at `i` (an arrow's `>` does not close it).
fn skip_angles(toks: &[Token<'_>], mut i: usize) -> usize {
    let mut depth = 0usize;
    while let Some(t) = tok_at(toks, i) {
        match t {
            Tok::Punct('<') => depth += 1,
            Tok::Punct('>') if tok_at(toks, i.wrapping_sub(1)) != Some(Tok::Punct('-')) => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            Tok::Punct(';' | '{' | '}') => return i,
            _ => {}
        }
        i += 1;
    }
    i
}

/// The index of the `,` or `}` that ends the group item at `i` (past an `as alias` and the like).
fn skip_group_item(toks: &[Token<'_>], mut i: usize) -> usize {
    let mut depth = 0usize;
    while let Some(t) = tok_at(toks, i) {
        match t {
            Tok::Punct('{' | '(' | '[') => depth += 1,
            Tok::Punct('}' | ')' | ']') if depth > 0 => depth -= 1,
            Tok::Punct(',' | '}') if depth == 0 => return i,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Reads the path whose first segment is `toks[i]` (a word) onto `prefix` and pushes every path it spells to
/// `out` (`a::{b, c::{d}}` spells `a::b` and `a::c::d`); returns the index past it.
fn read_path<'a>(
    toks: &[Token<'a>],
    mut i: usize,
    mut prefix: RustPath<'a>,
    out: &mut Vec<RustPath<'a>>,
) -> usize {
    while let Some(Tok::Ident(name)) = tok_at(toks, i) {
        prefix.push((name, toks[i].line));
        i += 1;
        if tok_at(toks, i) != Some(Tok::Sep) {
            break;
        }
        i += 1;
        // Generic arguments (`Arena::<B>::install`): their own paths are read, and this one goes on after them.
        if tok_at(toks, i) == Some(Tok::Punct('<')) {
            let end = skip_angles(toks, i);
            i += 1;
            while i < end {
                if matches!(tok_at(toks, i), Some(Tok::Ident(_))) {
                    i = read_path(toks, i, Vec::new(), out);
                } else {
                    i += 1;
                }
            }
            i = end;
            if tok_at(toks, i) != Some(Tok::Sep) {
                break;
            }
            i += 1;
        }
        if tok_at(toks, i) == Some(Tok::Punct('{')) {
            i += 1;
            loop {
                match tok_at(toks, i) {
                    None => return i,
                    Some(Tok::Punct('}')) => return i + 1,
                    Some(Tok::Ident(_)) => {
                        i = read_path(toks, i, prefix.clone(), out);
                        i = skip_group_item(toks, i);
                    }
                    Some(_) => i += 1,
                }
            }
        }
    }
    out.push(prefix);
    i
}

/// Every path of `toks`, each with the module it is written in: `module` at the start, deeper inside inline
/// `mod name { ... }` blocks. With `comments`, the paths of those comments as well (doc links), in the module
/// they are written in.
fn paths_in<'a>(
    toks: &[Token<'a>],
    comments: &[Comment<'a>],
    module: &[String],
) -> Vec<(RustPath<'a>, Vec<String>)> {
    let mut module = module.to_vec();
    let mut out = Vec::new();
    // Brace depth, and the depth inside each open inline module's braces.
    let mut depth = 0usize;
    let mut open = Vec::new();
    let mut mod_brace: Option<(usize, &str)> = None;
    let mut comments = comments.iter().peekable();
    let mut i = 0;
    loop {
        while let Some(c) = comments.next_if(|c| c.before <= i) {
            let (words, _) = lex(c.text, c.line, false);
            let mut j = 0;
            while j < words.len() {
                if matches!(words[j].tok, Tok::Ident(_)) {
                    let mut found = Vec::new();
                    j = read_path(&words, j, Vec::new(), &mut found);
                    out.extend(found.into_iter().map(|p| (p, module.clone())));
                } else {
                    j += 1;
                }
            }
        }
        let Some(t) = toks.get(i) else { break };
        match t.tok {
            Tok::Punct('{') => {
                depth += 1;
                if let Some((_, name)) = mod_brace.take_if(|(at, _)| *at == i) {
                    module.push(name.to_string());
                    open.push(depth);
                }
                i += 1;
            }
            Tok::Punct('}') => {
                if open.last() == Some(&depth) {
                    open.pop();
                    module.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(word) => {
                if let ("mod", Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (word, tok_at(toks, i + 1), tok_at(toks, i + 2))
                {
                    mod_brace = Some((i + 2, name));
                }
                let mut found = Vec::new();
                i = read_path(toks, i, Vec::new(), &mut found);
                out.extend(found.into_iter().map(|p| (p, module.clone())));
            }
            _ => i += 1,
        }
    }
    out
}

/// The module path of a source file below `src/` (`qwen_image/dit_gpu/plan.rs` is `qwen_image::dit_gpu::plan`,
/// `qwen_image/mod.rs` is `qwen_image`, `lib.rs` the root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

// ---------------------------------------------------------------------------------------------
// Model folders.

/// The top-level module trees of tf-engines and which of them each may import. Models import the shared
/// layer (`nn`) and shared components (`qwen3_vl`), never each other; the shared layer imports nothing
/// above it.
const MODULE_RULES: &[(&str, &[&str])] = &[
    ("nn", &[]),
    ("qwen3_vl", &["nn"]),
    ("qwen_image", &["nn", "qwen3_vl"]),
    ("minimax_h3", &["nn", "qwen3_vl"]),
];
const MODULES: &[&str] = &["nn", "qwen3_vl", "qwen_image", "minimax_h3", "worker"];

/// The top-level module of tf-engines a path reaches, with its line, when the path climbs to the crate root
/// (`crate::`, `$crate::`, `tf_engines::`, or enough `super::`s from `module`) and goes on into one.
fn top_module(path: &RustPath<'_>, module: &[String]) -> Option<(usize, &'static str)> {
    let (first, _) = *path.first()?;
    let (mut at, rest): (Vec<&str>, _) = match first {
        "crate" | "$crate" | "tf_engines" => (Vec::new(), &path[1..]),
        "self" | "super" => (module.iter().map(String::as_str).collect(), &path[..]),
        _ => return None,
    };
    for &(segment, line) in rest {
        match segment {
            "self" => {}
            "super" => {
                at.pop()?;
            }
            _ if at.is_empty() => {
                return MODULES.iter().find(|m| **m == segment).map(|m| (line, *m));
            }
            _ => return None,
        }
    }
    None
}

/// The top-level modules of tf-engines a source file names, with their lines, read as the file of module
/// `module` (its path from the crate root): through `crate::`, `$crate::`, `tf_engines::` (`::tf_engines::`)
/// and `super::super::...` paths that climb out of its own tree, in `use` items (one line or many, `{...}`
/// groups nested or not) and anywhere in code (expressions, types, attributes), and in comments (doc links).
/// String and char literals are not read.
fn modules_named(src: &str, module: &[String]) -> BTreeSet<(usize, &'static str)> {
    let (toks, comments) = lex(src, 1, true);
    paths_in(&toks, &comments, module)
        .iter()
        .filter_map(|(path, module)| top_module(path, module))
        .collect()
}

#[test]
fn no_model_folder_imports_another() {
    let src = repo_root().join("crates/tf-engines/src");
    let mut problems = Vec::new();
    for (module, may_use) in MODULE_RULES {
        let mut files = Vec::new();
        let dir = src.join(module);
        rust_files(&dir, &mut files);
        let flat = src.join(format!("{module}.rs"));
        if flat.is_file() {
            files.push(flat);
        }
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let at = module_of(&src, &file);
            assert_eq!(
                at.first().map(String::as_str),
                Some(*module),
                "{}",
                file.display()
            );
            for (line, named) in modules_named(&text, &at) {
                if named != *module && !may_use.contains(&named) {
                    problems.push(format!(
                        "{}:{line}: `{module}` names `{named}`; move what both need into the shared layer (nn/)",
                        relative(&file),
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The modules `src` names from module `at` (`"qwen_image::dit_gpu"`, or `""` for the root).
fn named_from(src: &str, at: &str) -> BTreeSet<&'static str> {
    let at: Vec<String> = at
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    modules_named(src, &at)
        .into_iter()
        .map(|(_, m)| m)
        .collect()
}

#[test]
fn the_module_rules_see_imports() {
    assert_eq!(
        named_from("use crate::qwen_image::dit::X;", ""),
        BTreeSet::from(["qwen_image"])
    );
    assert_eq!(
        named_from("use crate::{nn::gpu, qwen3_vl::text_encoder};", ""),
        BTreeSet::from(["nn", "qwen3_vl"])
    );
    assert_eq!(
        named_from("//! see [`tf_engines::minimax_h3::layout`]", ""),
        BTreeSet::from(["minimax_h3"])
    );
    assert!(named_from("use crate::nnx::y; use std::ops;", "").is_empty());

    // rustfmt's form of a long import, with a comment inside the group, and the line it names the model on.
    let wrapped = "use std::sync::Arc;\n\nuse crate::{\n    // the shared layer only\n    minimax_h3::layout::Geometry,\n    nn::gpu::Linear,\n};\n";
    assert_eq!(
        modules_named(wrapped, &["qwen_image".into()]),
        BTreeSet::from([(5, "minimax_h3"), (6, "nn")])
    );
    // Nested groups.
    assert_eq!(
        named_from(
            "use crate::{\n    nn::{gpu::{Linear, Matrix}, host},\n    qwen_image::{self, dit::{X, Y as Z}},\n};",
            "minimax_h3"
        ),
        BTreeSet::from(["nn", "qwen_image"])
    );
    // Inline in expressions, types, generic arguments and attributes, and split over lines.
    for code in [
        "let steps = crate::qwen_image::pipeline::DEFAULT_STEPS;",
        "fn f(x: &crate::qwen_image::Config) {}",
        "let v: Vec<crate::qwen_image::Config> = Vec::new();",
        "let v = Vec::<crate::qwen_image::Config>::new();",
        "#[doc(alias = \"x\")] impl From<crate::qwen_image::A> for B {}",
        "let steps = crate::\n    qwen_image::pipeline::DEFAULT_STEPS;",
        "let y = tf_engines::qwen_image::run(1);",
        "let y = ::tf_engines::qwen_image::run(1);",
        "macro_rules! m { () => { $crate::qwen_image::f() }; }",
        "pub(in crate::qwen_image) fn f() {}",
    ] {
        assert_eq!(
            named_from(code, "minimax_h3::dit"),
            BTreeSet::from(["qwen_image"]),
            "{code}"
        );
    }
    // `super::` paths resolve from the file's module, and inline modules deepen it.
    let up = "use super::super::qwen_image::X;";
    assert_eq!(
        named_from(up, "minimax_h3::dit"),
        BTreeSet::from(["qwen_image"])
    );
    assert!(named_from(up, "minimax_h3::dit_gpu::plan").is_empty());
    assert_eq!(
        named_from(
            "let s = super::super::super::qwen_image::f();",
            "minimax_h3::a::b"
        ),
        BTreeSet::from(["qwen_image"])
    );
    assert_eq!(
        named_from("use super::{super::qwen_image};", "minimax_h3::dit"),
        BTreeSet::from(["qwen_image"])
    );
    let in_tests = "fn f() { let c = '{'; }\n#[cfg(test)]\nmod tests {\n    use super::super::super::qwen_image::X;\n}\nuse super::super::qwen_image::Y;";
    assert_eq!(
        modules_named(in_tests, &["minimax_h3".into(), "dit".into()]),
        BTreeSet::from([(4, "qwen_image"), (6, "qwen_image")])
    );
    assert!(named_from("mod tests { use super::super::layout; }", "minimax_h3::dit").is_empty());
    // A model's own paths, lookalike names, and string and char literals name nothing else.
    for code in [
        "use self::dit::X; use super::ops; let x = self.crate_name;",
        "use crate::qwen_image_extra::x; pub(crate) fn f() {}",
        "let s = \"use crate::qwen_image::X;\";",
        "let s = r#\"crate::qwen_image \"quoted\" \"#; let t = b\"crate::qwen_image\";",
        "let c = '\"'; let s = \"crate::qwen_image\"; let d = '\\'';",
        "fn f<'a>(x: &'a str) -> &'a str { x }",
    ] {
        assert!(named_from(code, "minimax_h3").is_empty(), "{code}");
    }
}

/// Library source files: `src/` of every crate and of xtask, with `#[cfg(test)]` modules included (they are
/// held to the same SAFETY rule).
fn library_files() -> Vec<PathBuf> {
    let root = repo_root();
    let mut files = Vec::new();
    let crates = std::fs::read_dir(root.join("crates")).unwrap();
    for krate in crates.flatten() {
        rust_files(&krate.path().join("src"), &mut files);
    }
    rust_files(&root.join("xtask/src"), &mut files);
    files
}

/// Whether the comment lines right above line `i` (skipping attributes and one wrapped statement head)
/// carry a SAFETY note.
fn has_safety_above(lines: &[&str], i: usize) -> bool {
    let same = lines[i];
    if same.contains("SAFETY") {
        return true;
    }
    let mut j = i;
    let mut code_lines_skipped = 0;
    while j > 0 {
        j -= 1;
        let t = lines[j].trim_start();
        if t.starts_with("//") || t.starts_with("/*") || t.starts_with('*') {
            if t.contains("SAFETY") || t.contains("# Safety") {
                return true;
            }
            continue;
        }
        if t.starts_with("#[") {
            continue;
        }
        // A statement wrapped over lines (`let x =` above `unsafe { ... }`) may hold the comment one line up.
        if code_lines_skipped == 0 && !t.is_empty() && !t.ends_with(';') && !t.ends_with('}') {
            code_lines_skipped += 1;
            continue;
        }
        return false;
    }
    false
}

#[test]
fn every_unsafe_block_in_library_code_says_why() {
    let mut problems = Vec::new();
    for file in library_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let is_block = code.contains("unsafe {") || code.trim_end().ends_with("unsafe");
            let is_impl = code.contains("unsafe impl");
            if (is_block || is_impl) && !has_safety_above(&lines, i) {
                problems.push(format!(
                    "{}:{}: `unsafe` without a SAFETY comment above it",
                    relative(&file),
                    i + 1
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// NVLink multicast stays off on the GPU hosts: no library code sets up multicast memory (the driver's
/// `cuMulticast*` entries), and tf-nccl keeps NCCL's multicast switch at 0.
#[test]
fn no_library_code_sets_up_nvlink_multicast() {
    let mut problems = Vec::new();
    for file in library_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in text.lines().enumerate() {
            if line.contains(concat!("cuMulticast", "Create"))
                || line.contains(concat!("cuMulticast", "BindMem"))
            {
                problems.push(format!(
                    "{}:{}: NVLink multicast set up",
                    relative(&file),
                    i + 1
                ));
            }
        }
    }
    let nccl = std::fs::read_to_string(repo_root().join("crates/tf-nccl/src/loader.rs")).unwrap();
    if !nccl.contains("std::env::set_var(NVLS_ENV, \"0\")") {
        problems.push(
            "crates/tf-nccl/src/loader.rs no longer sets NCCL_NVLS_ENABLE=0 before opening NCCL"
                .into(),
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Process-wide driver hooks.

/// What installs a process-wide driver hook, by the names tf-sys and tf-cuda give it. Engines (and tf-nccl)
/// run on the driver as the program loaded it; capping or redirecting every allocation of the process is the
/// embedding program's choice, never a library's (docs/ARCHITECTURE.md: "memcap and the allocation hook are
/// never installed by the engines").
const HOOK_NAMES: &[(&str, &str)] = &[
    (
        "install_allocation_hook",
        "tf_cuda::usage::install_allocation_hook installs the process's allocation hook",
    ),
    (
        "set_device_limit",
        "tf_cuda::usage::set_device_limit caps every DeviceBuffer::alloc of the process",
    ),
    (
        "api_mut",
        "Driver::api_mut hands out the driver's entry table for patching (what memcap::install patches)",
    ),
];

/// Paths whose two segments, in a row, name a hook installer (`tf_sys::memcap::install(..)`,
/// `use tf_sys::memcap::{self, install}`, `Arena::<B>::install(&a)`).
const HOOK_PATHS: &[(&str, &str, &str)] = &[
    (
        "memcap",
        "install",
        "tf_sys::memcap::install patches the driver table's allocating entries",
    ),
    (
        "Arena",
        "install",
        "tf_cuda::arena::Arena::install makes an arena serve every later DeviceBuffer::alloc of the process",
    ),
];

/// `.api()` calls allowed in engine and tf-nccl code: (file, receiver, why). Anywhere else `.api()` is the
/// raw driver table (`tf_sys::Driver::api`), which engines never reach past tf-cuda.
const API_ALLOWED: &[(&str, &str, &str)] = &[(
    "crates/tf-nccl/src/comm.rs",
    "nccl",
    "`Nccl::api` is NCCL's own entry-point table (`NcclApi`: \"NCCL's entry points, one field per exported \
     symbol\", ffi.rs), not the driver's",
)];

/// A place where a source reaches for a driver hook or an entry table.
#[derive(Debug, PartialEq, Eq)]
struct HookUse {
    line: usize,
    what: String,
    /// The `API_ALLOWED` entry that allows it.
    allowed: Option<usize>,
}

/// The driver hooks and entry-table reaches of `src`, the code of the file `file` (relative to the root).
/// Comments and string literals are not read.
fn driver_hooks_in(src: &str, file: &str) -> Vec<HookUse> {
    let (toks, _) = lex(src, 1, true);
    let mut found = Vec::new();
    let api_use = |line: usize, receiver: &str, how: &str| HookUse {
        line,
        what: format!("{how} reaches an entry table (the driver's, through tf_sys::Driver::api)"),
        allowed: API_ALLOWED
            .iter()
            .position(|(f, r, _)| *f == file && *r == receiver),
    };
    for (path, _) in paths_in(&toks, &[], &[]) {
        for &(segment, line) in &path {
            if let Some((_, why)) = HOOK_NAMES.iter().find(|(n, _)| *n == segment) {
                found.push(HookUse {
                    line,
                    what: format!("`{segment}`: {why}"),
                    allowed: None,
                });
            }
        }
        for pair in path.windows(2) {
            let ((a, _), (b, line)) = (pair[0], pair[1]);
            if let Some((_, _, why)) = HOOK_PATHS.iter().find(|(x, y, _)| (*x, *y) == (a, b)) {
                found.push(HookUse {
                    line,
                    what: format!("`{a}::{b}`: {why}"),
                    allowed: None,
                });
            }
            // `Driver::api(&driver)`: a method called as a path.
            if b == "api" && a.starts_with(|c: char| c.is_ascii_uppercase()) {
                found.push(api_use(line, a, &format!("`{a}::api`")));
            }
        }
    }
    // Method calls: `.install()` (Arena::install is the one `install` method these crates can reach) and
    // `.api()`, also with `::<...>` arguments and split over lines.
    for (i, t) in toks.iter().enumerate() {
        let Tok::Ident(method) = t.tok else { continue };
        let called = matches!(tok_at(&toks, i + 1), Some(Tok::Punct('(') | Tok::Sep));
        if !called || i == 0 || tok_at(&toks, i - 1) != Some(Tok::Punct('.')) {
            continue;
        }
        let receiver = match tok_at(&toks, i.wrapping_sub(2)) {
            Some(Tok::Ident(name)) => name,
            _ => "(an expression)",
        };
        match method {
            "install" => found.push(HookUse {
                line: t.line,
                what: format!(
                    "`{receiver}.install()`: Arena::install (tf_cuda::arena) makes an arena serve every later \
                     DeviceBuffer::alloc of the process"
                ),
                allowed: None,
            }),
            "api" => found.push(api_use(t.line, receiver, &format!("`{receiver}.api()`"))),
            _ => {}
        }
    }
    found.sort_by_key(|h| h.line);
    found
}

/// Engine and tf-nccl sources, test folders (`tests/`) apart.
fn engine_files() -> Vec<PathBuf> {
    let root = repo_root();
    let mut files = Vec::new();
    rust_files(&root.join("crates/tf-engines/src"), &mut files);
    rust_files(&root.join("crates/tf-nccl/src"), &mut files);
    files.retain(|f| {
        !f.strip_prefix(&root)
            .unwrap_or(f)
            .components()
            .any(|c| c.as_os_str() == "tests")
    });
    files
}

#[test]
fn engines_install_no_driver_hooks() {
    let mut problems = Vec::new();
    let mut allowed_seen = BTreeSet::new();
    for file in engine_files() {
        let name = relative(&file);
        let text = std::fs::read_to_string(&file).unwrap();
        for hook in driver_hooks_in(&text, &name) {
            match hook.allowed {
                Some(entry) => {
                    allowed_seen.insert(entry);
                }
                None => problems.push(format!(
                    "{name}:{}: {}; engines never install process-wide driver hooks",
                    hook.line, hook.what
                )),
            }
        }
    }
    for (entry, (file, receiver, _)) in API_ALLOWED.iter().enumerate() {
        if !allowed_seen.contains(&entry) {
            problems.push(format!(
                "API_ALLOWED lists `{receiver}.api()` in {file}, which no longer has one: remove the entry"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_driver_hook_rule_sees_installs() {
    let flagged = |src: &str, file: &str| -> Vec<usize> {
        driver_hooks_in(src, file)
            .into_iter()
            .filter(|h| h.allowed.is_none())
            .map(|h| h.line)
            .collect()
    };
    let engine = "crates/tf-engines/src/minimax_h3/pipeline.rs";
    for code in [
        "tf_sys::memcap::install(driver.api_mut(), 1 << 30)?;",
        "use tf_sys::memcap::install as cap;",
        "use tf_sys::{\n    memcap::{self, install},\n    Driver,\n};",
        "tf_cuda::usage::install_allocation_hook(Box::new(hook)).ok();",
        "use tf_cuda::usage::{reset_peaks, set_device_limit};",
        "tf_cuda::usage::set_device_limit(Some(1 << 30));",
        "let arena = Arc::new(Arena::new(backend));\narena\n    .install()?;",
        "tf_cuda::arena::Arena::<Vmm>::install(&arena)?;",
        "let r = unsafe { (driver.api().cuMemAlloc_v2)(&mut p, n) };",
        "let api = ctx.driver().api();",
        "let api = Driver::api(&driver);",
        "let api = nccl.api();",
    ] {
        assert!(!flagged(code, engine).is_empty(), "{code}");
    }
    assert_eq!(
        flagged(
            "fn f() {}\n\nfn g() {\n    set_device_limit(None);\n}",
            engine
        ),
        vec![4]
    );
    // The allow-list holds for its own file and receiver only.
    let comm = "crates/tf-nccl/src/comm.rs";
    let nccl = "let code = unsafe { (self.nccl.api().ncclCommAbort)(raw) };";
    assert!(flagged(nccl, comm).is_empty());
    assert_eq!(driver_hooks_in(nccl, comm)[0].allowed, Some(0));
    assert!(!flagged("let api = self.driver.api();", comm).is_empty());
    // Comments, strings, reads and lookalike names are clean.
    for code in [
        "// memcap::install and Arena::install are never called here; nor is set_device_limit.",
        "/// `tf_cuda::usage::install_allocation_hook` is the program's to call.\nfn f() {}",
        "let s = \"tf_sys::memcap::install\"; let t = r#\"arena.install()\"#;",
        "tf_cuda::usage::reset_peaks(); let c = tf_sys::memcap::counters();",
        "let installed = tf_cuda::usage::allocation_hook_installed(); let n = self.api.ncclX;",
        "let limit = tf_cuda::usage::device_limit(); let x = cfg.install_dir(); let y = s.apis();",
    ] {
        assert!(flagged(code, engine).is_empty(), "{code}");
    }
}

// Streams.

/// The engine files that may make a CUDA stream (`Stream::new`, `Stream::with_priority`), and why. Everywhere
/// else in tf-engines' library code a component runs on the stream its pipeline opened (`GpuDevice`; the spec's
/// engine contract: components borrow the pipeline's stream and never create their own). Test modules apart.
const STREAM_MAKERS: &[(&str, &str)] = &[
    (
        "crates/tf-engines/src/nn/gpu/device.rs",
        "GpuDevice: the context and the one blocking stream a pipeline opens and its components borrow",
    ),
    (
        "crates/tf-engines/src/bin/tf/ranks.rs",
        "a rank's communicator streams; its pipeline takes the DiT communicator's as its one stream",
    ),
    (
        "crates/tf-engines/src/bin/tf/bench.rs",
        "the kernel benchmarks' own stream (no pipeline, no component)",
    ),
    (
        "crates/tf-engines/src/bin/tf/bench/int8_gemm.rs",
        "the GEMM benchmark's own stream (no pipeline, no component)",
    ),
];

/// The lines of `src` (a file of module `module`) that make a stream, test modules apart.
fn streams_made_in(src: &str, module: &[String]) -> Vec<usize> {
    let (toks, _) = lex(src, 1, true);
    let mut lines: Vec<usize> = paths_in(&toks, &[], module)
        .iter()
        .filter(|(_, module)| !module.iter().any(|m| m == "tests"))
        .flat_map(|(path, _)| {
            path.windows(2)
                .filter(|w| w[0].0 == "Stream" && matches!(w[1].0, "new" | "with_priority"))
                .map(|w| w[1].1)
                .collect::<Vec<_>>()
        })
        .collect();
    lines.sort_unstable();
    lines
}

#[test]
fn engine_components_make_no_streams() {
    let root = repo_root();
    let src = root.join("crates/tf-engines/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut problems = Vec::new();
    let mut makers_seen = BTreeSet::new();
    for file in files {
        let name = relative(&file);
        let text = std::fs::read_to_string(&file).unwrap();
        let lines = streams_made_in(&text, &module_of(&src, &file));
        if lines.is_empty() {
            continue;
        }
        match STREAM_MAKERS.iter().position(|(f, _)| *f == name) {
            Some(entry) => {
                makers_seen.insert(entry);
            }
            None => problems.extend(lines.iter().map(|line| {
                format!(
                    "{name}:{line}: makes a stream; a component runs on its pipeline's stream (take a \
                     `&GpuDevice` and use `device.stream()`)"
                )
            })),
        }
    }
    for (entry, (file, _)) in STREAM_MAKERS.iter().enumerate() {
        if !makers_seen.contains(&entry) {
            problems.push(format!(
                "STREAM_MAKERS lists {file}, which makes no stream any more: remove the entry"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_stream_rule_sees_streams() {
    let at = |m: &str| -> Vec<String> { m.split("::").map(str::to_string).collect() };
    let dit = at("qwen_image::dit_gpu");
    for code in [
        "let stream = Stream::new(ctx, false)?;",
        "let s = tf_cuda::Stream::with_priority(ctx, true, Priority::Highest)?;",
        "let s = Arc::new(\n    tf_cuda::Stream::new(\n        ctx, true,\n    ).unwrap(),\n);",
    ] {
        assert!(!streams_made_in(code, &dit).is_empty(), "{code}");
    }
    assert_eq!(
        streams_made_in("fn f() {}\n\nfn g() {\n    Stream::new(c, true);\n}", &dit),
        vec![4]
    );
    for code in [
        "// Stream::new is the pipeline's to call.",
        "let s = \"Stream::new\"; let n = NormalStream::new(seed); let t = stream.new_event();",
        "let stream = Arc::clone(device.stream());",
        "#[cfg(test)]\nmod tests {\n    fn f() { let s = Stream::new(&ctx, false).unwrap(); }\n}",
    ] {
        assert!(streams_made_in(code, &dit).is_empty(), "{code}");
    }
    // A test file of its own (`weights/tests.rs`) is a test module too.
    let tests = at("minimax_h3::dit_gpu::weights::tests");
    assert!(streams_made_in("let s = Stream::new(&ctx, false).unwrap();", &tests).is_empty());
}

/// Lines a source file may have. Past it a file mixes concerns: split it by concern.
const MAX_LINES: usize = 1800;

#[test]
fn no_source_file_outgrows_the_ceiling() {
    let root = repo_root();
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("xtask"), &mut files);
    let mut problems = Vec::new();
    for file in files {
        let lines = std::fs::read_to_string(&file).unwrap().lines().count();
        if lines > MAX_LINES {
            problems.push(format!(
                "{}: {lines} lines (ceiling {MAX_LINES}): split it by concern",
                relative(&file)
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_safety_check_sees_a_missing_comment() {
    let bare = ["let x = 1;", "unsafe { f() }"];
    assert!(!has_safety_above(&bare, 1));
    let noted = ["// SAFETY: f has no preconditions.", "unsafe { f() }"];
    assert!(has_safety_above(&noted, 1));
    let wrapped = [
        "// SAFETY: the pointer is live.",
        "let v =",
        "    unsafe { *p };",
    ];
    assert!(has_safety_above(&wrapped, 2));
    let far = ["// SAFETY: stale.", "a();", "unsafe { f() }"];
    assert!(!has_safety_above(&far, 2));
}
