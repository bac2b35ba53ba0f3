//! `tests/python/energy_budget.py` on the committed JSON of a measured run (docs/gpu-runs/2026-12-07, calls 111 and
//! 112): the GEMM joules it sums, what it leaves for the rest, and exit 2 with a message naming the cause on bad input.
//! Needs `python3` (standard library only); where there is none the test says SKIPPED and why.

// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the root")
        .to_path_buf()
}

fn python() -> Option<&'static str> {
    let found = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    found.then_some("python3")
}

fn budget(python: &str, args: &[&str]) -> Output {
    let root = repo_root();
    Command::new(python)
        .arg(root.join("tests/python/energy_budget.py"))
        .args(args)
        .current_dir(root.join("docs/gpu-runs/2026-12-07"))
        .output()
        .expect("run energy_budget.py")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn splits_measured_steps_into_gemm_and_other_joules() {
    let Some(python) = python() else {
        println!("SKIPPED: no python3 on PATH to run tests/python/energy_budget.py");
        return;
    };
    let out_dir = std::env::temp_dir().join(format!("tf-energy-budget-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    // (step, GEMM energy, the engine whose joules a call stand for the step's GEMMs)
    let cases = [
        (
            "h3-dit-bench-768x448-run111.json",
            "gemm-energy-bf16-run112.json",
            "cublaslt_energy",
        ),
        (
            "h3-fp8-bench-run111.json",
            "gemm-energy-int8-run112.json",
            "ours_energy",
        ),
        (
            "qwen21-bench-run112.json",
            "gemm-energy-bf16-run112.json",
            "cublaslt_energy",
        ),
    ];
    for (step, gemms, key) in cases {
        let json = out_dir.join(format!("{step}.budget.json"));
        let out = budget(
            python,
            &[
                "--step",
                step,
                "--gemms",
                gemms,
                "--json",
                json.to_str().unwrap(),
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{step}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(
            report["gemm_energy_key"], key,
            "{step}: the step's own GEMM engine"
        );

        // The sum, recomputed from the inputs: each block GEMM phase's calls times its shape's joules a call.
        let dir = repo_root().join("docs/gpu-runs/2026-12-07");
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(gemms)).unwrap()).unwrap();
        let per_call = |shape: &str| -> f64 {
            g["results"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["shape"] == shape)
                .unwrap_or_else(|| panic!("{gemms}: no {shape}"))[key]["joules_per_call"]
                .as_f64()
                .unwrap()
        };
        let groups = report["gemms"].as_array().unwrap();
        assert_eq!(groups.len(), 4, "{step}: four block GEMM groups");
        let mut sum = 0.0;
        for group in groups {
            let calls = group["calls"].as_f64().unwrap();
            let expected = calls * per_call(group["shape"].as_str().unwrap());
            assert!(
                close(group["joules"].as_f64().unwrap(), expected),
                "{step}: {group}"
            );
            sum += expected;
        }
        let gemm_j = report["gemm_joules"].as_f64().unwrap();
        let step_j = report["step_joules"].as_f64().unwrap();
        let goal_j = report["goal_joules"].as_f64().unwrap();
        assert!(close(gemm_j, sum), "{step}: {gemm_j} against {sum}");
        assert!(close(report["rest_joules"].as_f64().unwrap(), step_j - sum));
        assert!(close(
            report["rest_factor_needed"].as_f64().unwrap(),
            (goal_j - sum) / (step_j - sum)
        ));
        // The rest's phases at the rest's mean draw add up to the rest; the flat bound puts every phase at the step's.
        let rest_estimates: f64 = report["rest_phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["joules_estimate"].as_f64().unwrap())
            .sum();
        assert!(
            close(rest_estimates, step_j - sum),
            "{step}: {rest_estimates}"
        );
        let watts = report["mean_watts"].as_f64().unwrap();
        let flat_gemm = report["gemm_phase_ms"].as_f64().unwrap() * watts / 1000.0;
        let flat_rest = report["rest_phase_ms"].as_f64().unwrap() * watts / 1000.0;
        assert!(close(
            report["flat_gemm_joules"].as_f64().unwrap(),
            flat_gemm
        ));
        assert!(close(
            report["flat_rest_factor_needed"].as_f64().unwrap(),
            (goal_j - flat_gemm) / flat_rest
        ));
        assert!(text.contains("everything else may spend"), "{text}");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn bad_input_exits_2_and_names_the_cause() {
    let Some(python) = python() else {
        println!("SKIPPED: no python3 on PATH to run tests/python/energy_budget.py");
        return;
    };
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                "--step",
                "no-such.json",
                "--gemms",
                "gemm-energy-bf16-run112.json",
            ],
            "no-such.json",
        ),
        // A bf16 step against the INT8 file: the key it needs is not there, and the keys it has are named.
        (
            &[
                "--step",
                "qwen21-bench-run112.json",
                "--gemms",
                "gemm-energy-int8-run112.json",
            ],
            "it has fp8_energy, ours_energy",
        ),
        // A JSON without an energy line.
        (
            &[
                "--step",
                "h3-dit-compare-run111.json",
                "--gemms",
                "gemm-energy-bf16-run112.json",
            ],
            "no energy line",
        ),
    ];
    for (args, cause) in cases {
        let out = budget(python, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(cause), "{args:?}: {err}");
        assert!(!err.contains("Traceback"), "{args:?}: {err}");
    }
}
