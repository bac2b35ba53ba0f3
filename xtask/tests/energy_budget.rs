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

/// `python3` when it runs here; else prints that the calling test is skipped (visibly: the script needs it).
fn python() -> Option<&'static str> {
    let found = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        println!("SKIPPED: no python3 on PATH to run tests/python/energy_budget.py");
    }
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

/// A fresh scratch folder for one test's reports.
fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-energy-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Runs the script on `step` and `gemms` (with `extra` arguments), expects a report, and returns its text and JSON.
fn report(
    python: &str,
    step: &str,
    gemms: &str,
    extra: &[&str],
    json: &Path,
) -> (String, serde_json::Value) {
    let mut args = vec![
        "--step",
        step,
        "--gemms",
        gemms,
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = budget(python, &args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{step}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (text, read_json(json))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn splits_measured_steps_into_gemm_and_other_joules() {
    let Some(python) = python() else {
        return;
    };
    let out_dir = scratch_dir("budget");
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
        let (text, report) = report(python, step, gemms, &[], &json);
        assert_eq!(
            report["gemm_energy_key"], key,
            "{step}: the step's own GEMM engine"
        );

        // The sum, recomputed from the inputs: each block GEMM phase's calls times its shape's joules a call.
        let dir = repo_root().join("docs/gpu-runs/2026-12-07");
        let g: serde_json::Value = read_json(&dir.join(gemms));
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
    // A phase that is not an object, with and without GEMM energy.
    let bad_phase =
        std::env::temp_dir().join(format!("tf-energy-bad-phase-{}.json", std::process::id()));
    let mut step =
        read_json(&repo_root().join("docs/gpu-runs/2026-12-07/h3-fp8-bench-run111.json"));
    step["phases"]["phases"][3] = 7.into();
    std::fs::write(&bad_phase, step.to_string()).unwrap();
    let bad_phase = bad_phase.to_str().unwrap();
    let with_gemms = [
        "--step",
        bad_phase,
        "--gemms",
        "gemm-energy-int8-run112.json",
    ];
    let alone = [
        "--step",
        bad_phase,
        "--sm-count",
        "132",
        "--compute-capability",
        "9.0",
    ];
    let cases = cases
        .into_iter()
        .chain([(&with_gemms[..], "phase 3"), (&alone[..], "phase 3")]);
    for (args, cause) in cases {
        let out = budget(python, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(cause), "{args:?}: {err}");
        assert!(!err.contains("Traceback"), "{args:?}: {err}");
    }
}

#[test]
fn clock_bound_is_the_step_mma_flops_at_the_dense_rates_of_the_measured_clock() {
    let Some(python) = python() else {
        return;
    };
    let out_dir = scratch_dir("bound");
    let dir = repo_root().join("docs/gpu-runs/2026-12-07");
    const H3_8BIT: &[&str] = &[
        "qkv GEMM + QK norm + RoPE",
        "out GEMM",
        "fc1 GEMM",
        "fc2 GEMM",
    ];
    // (step, GEMM energy, where its phases are, the phases on 8-bit operands); the calls' JSON predates the device
    // field, so the board is named on the line.
    let cases: [(&str, &str, &str, &[&str]); 3] = [
        (
            "h3-dit-bench-768x448-run111.json",
            "gemm-energy-bf16-run112.json",
            "/phases/phases",
            &[],
        ),
        (
            "h3-fp8-bench-run111.json",
            "gemm-energy-int8-run112.json",
            "/phases/phases",
            H3_8BIT,
        ),
        (
            "qwen21-bench-run112.json",
            "gemm-energy-bf16-run112.json",
            "/phases/cached/phases",
            &[],
        ),
    ];
    for (step, gemms, phases_at, eight_bit) in cases {
        let json = out_dir.join(format!("{step}.bound.json"));
        let board = ["--sm-count", "132", "--compute-capability", "9.0"];
        let (text, report) = report(python, step, gemms, &board, &json);
        let input = read_json(&dir.join(step));
        let energy = input
            .get("energy_graph_step")
            .or_else(|| input.get("energy_cached_step"))
            .unwrap();
        let cycles_per_ms = 132.0 * energy["sm_clock_median_mhz"].as_f64().unwrap() * 1e3;
        // sm_90 dense: 4096 bf16 FLOPs a clock an SM, 8192 on 8-bit operands.
        let expected_ms: f64 = input
            .pointer(phases_at)
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let rate = if eight_bit.contains(&p["phase"].as_str().unwrap()) {
                    8192.0
                } else {
                    4096.0
                };
                p["flops"].as_f64().unwrap() / (rate * cycles_per_ms)
            })
            .sum();
        let bound = &report["clock_bound"];
        let bound_ms = bound["bound_ms"].as_f64().unwrap();
        assert!(
            close(bound_ms, expected_ms),
            "{step}: {bound_ms} against {expected_ms}"
        );
        let goal_ms = report["goal_ms"].as_f64().unwrap();
        assert!(close(
            bound["goal_room_ms"].as_f64().unwrap(),
            goal_ms - expected_ms
        ));
        assert!(close(
            bound["room_now_ms"].as_f64().unwrap(),
            report["step_ms"].as_f64().unwrap() - expected_ms
        ));
        // A bound below the measured step: no phase ran faster than the tensor cores' full rate.
        assert!(bound_ms < report["step_ms"].as_f64().unwrap(), "{step}");
        let phases = bound["mma_phases"].as_array().unwrap();
        for phase in phases {
            let share = phase["share_of_full_rate"].as_f64().unwrap();
            assert!(share > 0.0 && share <= 1.0, "{step}: {phase}");
        }
        let eight_bit_phases = phases.iter().filter(|p| p["operands"] == "8bit").count();
        assert_eq!(eight_bit_phases, eight_bit.len(), "{step}: {phases:?}");
        assert!(text.contains("clock bound:"), "{text}");
    }
    // Without GEMM energy: the bound alone, the same as beside the split.
    let alone = out_dir.join("alone.json");
    let out = budget(
        python,
        &[
            "--step",
            "h3-fp8-bench-run111.json",
            "--sm-count",
            "132",
            "--compute-capability",
            "9.0",
            "--json",
            alone.to_str().unwrap(),
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("the clock bound alone"), "{text}");
    let alone = read_json(&alone);
    let split = read_json(&out_dir.join("h3-fp8-bench-run111.json.bound.json"));
    assert!(alone.get("gemms").is_none());
    for key in ["bound_ms", "goal_room_ms", "room_now_ms"] {
        assert!(
            close(
                alone["clock_bound"][key].as_f64().unwrap(),
                split["clock_bound"][key].as_f64().unwrap()
            ),
            "{key}"
        );
    }
    // Where the operands of a phase's MMAs differ between its calls (bf16 ends), where the JSON names no board, and
    // where the precision is the unresolved alias: said why, not computed.
    let ends = out_dir.join("h3-fp8-ends1.json");
    let mut step = read_json(&dir.join("h3-fp8-bench-run111.json"));
    step["precision"] = "fp8:all,ends=1,gemm=int8".into();
    std::fs::write(&ends, step.to_string()).unwrap();
    step["precision"] = "fp8".into();
    let alias = out_dir.join("h3-fp8-alias.json");
    std::fs::write(&alias, step.to_string()).unwrap();
    for (step, gemms, why, device) in [
        (
            ends.to_str().unwrap(),
            "gemm-energy-int8-run112.json",
            "blocks kept in bf16",
            true,
        ),
        (
            alias.to_str().unwrap(),
            "gemm-energy-int8-run112.json",
            "does not name its groups",
            true,
        ),
        (
            "qwen21-bench-run112.json",
            "gemm-energy-bf16-run112.json",
            "--sm-count",
            false,
        ),
    ] {
        let mut args = vec!["--step", step, "--gemms", gemms];
        if device {
            args.extend(["--sm-count", "132", "--compute-capability", "9.0"]);
        }
        let out = budget(python, &args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{step}: {text}");
        assert!(
            text.contains("clock bound: not computed") && text.contains(why),
            "{step}: {text}"
        );
    }
    let bad = budget(
        python,
        &[
            "--step",
            "qwen21-bench-run112.json",
            "--gemms",
            "gemm-energy-bf16-run112.json",
            "--compute-capability",
            "nine",
        ],
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(
        err.contains("MAJOR.MINOR") && !err.contains("Traceback"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}
