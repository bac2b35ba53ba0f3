//! `tf video --gpus N` on any machine: the degrees the model's heads cannot split, the host backend, unknown
//! attention choices and malformed rank arguments are refused with the flag named, before any model is loaded
//! or any GPU work starts (the tiny pipeline fixture has 2 heads: degrees 1 and 2 only).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tf() -> &'static str {
    env!("CARGO_BIN_EXE_tf")
}

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_pipeline/model")
}

fn video(extra: &[&str]) -> Output {
    let out = std::env::temp_dir().join(format!("tf-gpus-cli-{}.mp4", std::process::id()));
    Command::new(tf())
        .args(["video", "--prompt", "a cat", "--seconds", "0.9", "--model"])
        .arg(model())
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

fn refused(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{n:?} missing from: {stderr}");
    }
    assert!(
        !stderr.contains("loaded in"),
        "the model was loaded: {stderr}"
    );
}

#[test]
fn degrees_the_heads_cannot_split_are_refused_naming_the_flag() {
    for gpus in ["3", "4", "0", "9"] {
        refused(
            &video(&["--gpus", gpus, "--backend", "gpu"]),
            &[
                &format!("--gpus {gpus}: "),
                "2 attention heads",
                "use one of 1, 2",
            ],
        );
    }
}

#[test]
fn several_gpus_need_the_gpu_backend() {
    refused(
        &video(&["--gpus", "2", "--backend", "host"]),
        &["--gpus 2 needs the GPU backend"],
    );
    refused(
        &video(&["--gpus", "1", "--force-nccl", "--backend", "host"]),
        &["needs the GPU backend"],
    );
}

#[test]
fn unknown_attention_choices_are_refused() {
    refused(
        &video(&["--gpus", "2", "--sp-attention", "ring"]),
        &["--sp-attention", "ulysses", "kv-gather"],
    );
}

#[test]
fn malformed_rank_arguments_are_refused() {
    let out = Command::new(tf())
        .args([
            "rank",
            "--rank",
            "1",
            "--world",
            "2",
            "--device",
            "1",
            "--control-id",
            "00",
            "--dit-id",
            "00",
            "--parent",
            "1",
            "--",
            "video",
            "--prompt",
            "x",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("NCCL id has 1 bytes"), "{stderr}");
    let out = Command::new(tf())
        .args(["rank", "--rank", "0", "--world", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn the_testpattern_engine_refuses_several_gpus() {
    let out = Command::new(tf())
        .args([
            "video",
            "--engine",
            "testpattern",
            "--prompt",
            "x",
            "--gpus",
            "2",
            "-o",
        ])
        .arg(std::env::temp_dir().join(format!("tf-gpus-tp-{}.mp4", std::process::id())))
        .output()
        .unwrap();
    refused(&out, &["--gpus 2 spreads the MiniMax H3 DiT"]);
}

#[test]
fn the_worker_refuses_what_cannot_run_on_several_gpus() {
    let worker = |extra: &[&str]| {
        Command::new(tf())
            .args(["worker", "--engine"])
            .args(extra)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let model = model();
    let model = model.to_str().unwrap();
    for (extra, needle) in [
        (
            vec!["minimax_h3", "--model", model, "--gpus", "3"],
            "--gpus 3: ",
        ),
        (
            vec![
                "minimax_h3",
                "--model",
                model,
                "--gpus",
                "2",
                "--backend",
                "host",
            ],
            "--gpus 2 needs the GPU backend",
        ),
        (vec!["testpattern", "--gpus", "2"], "runs in one process"),
    ] {
        let out = worker(&extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(needle), "{needle:?} missing from: {stderr}");
        assert!(out.stdout.is_empty(), "{extra:?} answered on stdout");
    }
}
