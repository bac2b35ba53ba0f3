//! Loading the diffusers fixtures of tests/fixtures/qwen_dit, shared by the host parity test and the GPU test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen_image::dit::DitInputs;

pub fn fixtures() -> PathBuf {
    // The GPU bundle copies the fixtures next to run.sh and exports its folder.
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join("tests/fixtures/qwen_dit");
        if p.is_dir() {
            return p;
        }
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_dit");
    if here.is_dir() {
        return here;
    }
    // A bundle keeps tests/fixtures next to the test binaries' parent folders.
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors()
        .skip(1)
        .take(5)
        .map(|d| d.join("tests/fixtures/qwen_dit"))
        .find(|p| p.is_dir())
        .expect("tests/fixtures/qwen_dit not found next to the checkout or the test binary")
}

pub fn cases() -> Vec<String> {
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
            .unwrap();
    let cases: Vec<String> = manifest["cases"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert!(
        cases.len() >= 4,
        "expected the four fixture cases, found {cases:?}"
    );
    cases
}

pub fn inputs(case: &str, step: &str) -> DitInputs {
    let file =
        SafetensorsFile::open(&fixtures().join(case).join(format!("{step}.safetensors"))).unwrap();
    DitInputs::from_bundle(&file).unwrap()
}

pub fn expected(case: &str) -> SafetensorsFile {
    SafetensorsFile::open(&fixtures().join(case).join("expected.safetensors")).unwrap()
}

pub fn model(case: &str) -> ModelDir {
    ModelDir::open(&fixtures().join(case).join("model")).unwrap()
}
