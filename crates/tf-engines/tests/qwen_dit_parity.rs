//! The host reference DiT against the diffusers 0.42.1 fp32 fixtures (tests/fixtures/qwen_dit, made by
//! tests/python/qwen_dit_fixtures.py): every case, no cache, extract then cached, and the `tf forward` binary.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::SafetensorsFile;
use tf_engines::qwen_image::dit::{DitBackend, HostKvCache, KvStep};
use tf_engines::qwen_image::dit_host::HostDit;

const TOLERANCE: f64 = 1e-5;

#[path = "common/qwen_fixtures.rs"]
mod qwen_fixtures;
use qwen_fixtures::{cases, expected, fixtures, inputs, model};

fn assert_close(case: &str, what: &str, actual: &TensorF32, reference: &TensorF32) {
    assert_eq!(actual.shape(), reference.shape(), "{case}/{what}: shape");
    let err = relative_l2(actual.data(), reference.data()).unwrap();
    println!(
        "{case}/{what}: shape {:?}, relative L2 {err:.3e}",
        actual.shape()
    );
    assert!(
        err <= TOLERANCE,
        "{case}/{what}: relative L2 {err:.3e} > {TOLERANCE:e}"
    );
}

fn load(case: &str) -> HostDit {
    HostDit::load(&model(case)).unwrap()
}

#[test]
fn full_forward_matches_diffusers() {
    for case in cases() {
        let mut dit = load(&case);
        let out = dit.forward(&inputs(&case, "step0"), KvStep::None).unwrap();
        assert!(out.kv_cache.is_none());
        assert_close(
            &case,
            "sample_full",
            &out.sample,
            &expected(&case).to_f32("sample_full").unwrap(),
        );
    }
}

#[test]
fn extract_then_cached_matches_diffusers() {
    let mut covered = 0;
    for case in cases() {
        let reference = expected(&case);
        if !reference.contains("sample_cached") {
            continue;
        }
        covered += 1;
        let mut dit = load(&case);
        let extract = dit
            .forward(&inputs(&case, "step0"), KvStep::Extract)
            .unwrap();
        assert_close(
            &case,
            "sample_extract",
            &extract.sample,
            &reference.to_f32("sample_extract").unwrap(),
        );
        let cache = extract.kv_cache.expect("extract returns the cache");
        for (i, (k, v)) in cache.layers.iter().enumerate() {
            assert_close(
                &case,
                &format!("kv.{i}.k"),
                k,
                &reference.to_f32(&format!("kv.{i}.k")).unwrap(),
            );
            assert_close(
                &case,
                &format!("kv.{i}.v"),
                v,
                &reference.to_f32(&format!("kv.{i}.v")).unwrap(),
            );
        }
        let cached = dit
            .forward(&inputs(&case, "step1"), KvStep::Cached(&cache))
            .unwrap();
        assert_close(
            &case,
            "sample_cached",
            &cached.sample,
            &reference.to_f32("sample_cached").unwrap(),
        );
    }
    assert!(
        covered >= 3,
        "expected at least three cases with a KV cache"
    );
}

#[test]
fn cache_refused_without_causal_condition_and_on_wrong_prefix() {
    let mut dit = load("no_causal");
    let err = dit
        .forward(&inputs("no_causal", "step0"), KvStep::Extract)
        .unwrap_err();
    assert!(err.to_string().contains("causal_condition"), "{err}");

    let mut dit = load("cond_b2");
    let cache = dit
        .forward(&inputs("cond_b2", "step0"), KvStep::Extract)
        .unwrap()
        .kv_cache
        .unwrap();
    // t2i has another prefix length and batch.
    let mut t2i = load("t2i");
    let err = t2i
        .forward(&inputs("t2i", "step1"), KvStep::Cached(&cache))
        .unwrap_err();
    assert!(err.to_string().contains("KV cache"), "{err}");
}

#[test]
fn kv_cache_file_round_trip() {
    let mut dit = load("two_cond");
    let cache = dit
        .forward(&inputs("two_cond", "step0"), KvStep::Extract)
        .unwrap()
        .kv_cache
        .unwrap();
    let dir = tempdir("kv_round_trip");
    let path = dir.join("kv.safetensors");
    cache.save(&path).unwrap();
    let back = HostKvCache::load(&path).unwrap();
    assert_eq!(back, cache);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-engines-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tf(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(args)
        .output()
        .unwrap();
    println!(
        "tf {}: {}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `tf forward` with `args` (which write `out`) and checks its `sample` against `reference[name]`.
fn forward_matches(args: &[&str], out: &Path, what: &str, reference: &SafetensorsFile, name: &str) {
    let run = tf(args);
    assert!(run.status.success());
    let sample = SafetensorsFile::open(out)
        .unwrap()
        .to_f32("sample")
        .unwrap();
    assert_close("cond_b2", what, &sample, &reference.to_f32(name).unwrap());
}

#[test]
fn tf_forward_binary_reproduces_the_fixtures() {
    let dir = tempdir("tf_forward");
    let case_dir = fixtures().join("cond_b2");
    let model = case_dir.join("model");
    let (m, s0, s1) = (
        model.to_str().unwrap().to_string(),
        case_dir
            .join("step0.safetensors")
            .to_str()
            .unwrap()
            .to_string(),
        case_dir
            .join("step1.safetensors")
            .to_str()
            .unwrap()
            .to_string(),
    );
    let (full, ext, cached, kv) = (
        dir.join("full.st"),
        dir.join("extract.st"),
        dir.join("cached.st"),
        dir.join("kv.st"),
    );
    let reference = expected("cond_b2");

    forward_matches(
        &[
            "forward",
            "--model",
            &m,
            "--inputs",
            &s0,
            "--out",
            full.to_str().unwrap(),
            "--backend",
            "host",
        ],
        &full,
        "tf forward (none)",
        &reference,
        "sample_full",
    );

    forward_matches(
        &[
            "forward",
            "--model",
            &m,
            "--inputs",
            &s0,
            "--out",
            ext.to_str().unwrap(),
            "--kv-cache",
            "extract",
            "--kv-file",
            kv.to_str().unwrap(),
        ],
        &ext,
        "tf forward (extract)",
        &reference,
        "sample_extract",
    );

    forward_matches(
        &[
            "forward",
            "--model",
            &m,
            "--inputs",
            &s1,
            "--out",
            cached.to_str().unwrap(),
            "--kv-cache",
            "cached",
            "--kv-file",
            kv.to_str().unwrap(),
        ],
        &cached,
        "tf forward (cached)",
        &reference,
        "sample_cached",
    );

    // Clear failures, not panics: the GPU backend before it is wired, a missing cache file, a missing model.
    let out = tf(&[
        "forward",
        "--model",
        &m,
        "--inputs",
        &s0,
        "--out",
        full.to_str().unwrap(),
        "--backend",
        "gpu",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("gpu"));
    let out = tf(&[
        "forward",
        "--model",
        &m,
        "--inputs",
        &s1,
        "--out",
        cached.to_str().unwrap(),
        "--kv-cache",
        "cached",
        "--kv-file",
        dir.join("absent.st").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let out = tf(&[
        "forward",
        "--model",
        dir.to_str().unwrap(),
        "--inputs",
        &s0,
        "--out",
        full.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
    let _ = std::fs::remove_dir_all(&dir);
}
