//! Tidy checks: the rules of docs/ARCHITECTURE.md that lints cannot see, checked over the whole tree.
//!
//! - The crate dependency graph (from `cargo metadata`) runs one way only.
//! - No model folder of tf-engines imports another model folder, and the shared layer imports none.
//! - Every `unsafe` block and `unsafe impl` in library code has a `SAFETY` comment right above it.
//! - No source file grows past a size ceiling.
//! - No library code sets up NVLink multicast, and tf-nccl keeps NCCL's multicast off.

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

/// The top-level modules of tf-engines a source line names through `crate::`, `tf_engines::` or
/// `super::super::...` paths that climb out of its own tree.
fn modules_named(line: &str) -> BTreeSet<&'static str> {
    let mut found = BTreeSet::new();
    for prefix in ["crate::", "tf_engines::"] {
        let mut rest = line;
        while let Some(i) = rest.find(prefix) {
            let after = &rest[i + prefix.len()..];
            for m in MODULES {
                if after.starts_with(m)
                    && !after[m.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
                {
                    found.insert(*m);
                }
            }
            // `use crate::{a, b}` groups.
            if let Some(group) = after.strip_prefix('{') {
                for m in MODULES {
                    if group
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .any(|w| w == *m)
                    {
                        found.insert(*m);
                    }
                }
            }
            rest = after;
        }
    }
    found
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
            for (n, line) in text.lines().enumerate() {
                for named in modules_named(line) {
                    if named != *module && !may_use.contains(&named) {
                        problems.push(format!(
                            "{}:{}: `{module}` names `{named}`; move what both need into the shared layer (nn/)",
                            relative(&file),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_module_rules_see_imports() {
    assert_eq!(
        modules_named("use crate::qwen_image::dit::X;"),
        BTreeSet::from(["qwen_image"])
    );
    assert_eq!(
        modules_named("use crate::{nn::gpu, qwen3_vl::text_encoder};"),
        BTreeSet::from(["nn", "qwen3_vl"])
    );
    assert_eq!(
        modules_named("//! see [`tf_engines::minimax_h3::layout`]"),
        BTreeSet::from(["minimax_h3"])
    );
    assert!(modules_named("use crate::nnx::y; use std::ops;").is_empty());
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
