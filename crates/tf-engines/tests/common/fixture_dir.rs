//! Where a committed fixture folder is, for the tests that read one: under the GPU bundle's folder, in the
//! checkout, or next to the test binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `tests/fixtures/<name>`: in the GPU bundle (`TF_BUNDLE_DIR`, which holds the fixtures next to run.sh), in the
/// checkout, or in one of the test binary's parent folders. Panics naming the folder when none holds it.
pub fn find(name: &str) -> PathBuf {
    let rel = Path::new("tests/fixtures").join(name);
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join(&rel);
        if p.is_dir() {
            return p;
        }
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(&rel);
    if here.is_dir() {
        return here;
    }
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors()
        .skip(1)
        .take(5)
        .map(|d| d.join(&rel))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| {
            panic!(
                "{} not found in TF_BUNDLE_DIR, the checkout or next to the test binary",
                rel.display()
            )
        })
}

/// The folder's `manifest.json`.
pub fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

/// The case names of the folder's manifest (the keys of its `cases` object), at least `min` of them.
pub fn manifest_cases(dir: &Path, min: usize) -> Vec<String> {
    let cases: Vec<String> = manifest(dir)["cases"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert!(
        cases.len() >= min,
        "expected at least {min} fixture cases, found {cases:?}"
    );
    cases
}
