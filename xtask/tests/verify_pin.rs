//! `verify-pin` passes on the repository's pins and fails, naming the problem, when any pin field, ABI
//! entry, kernel digest or document is altered. Each case works on a copy of the pins in a temp folder.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use xtask::pin;

const COMMIT: &str = "eab8582819688325e371907e4706e1c602b8a273";

struct Repo {
    root: PathBuf,
}

impl Drop for Repo {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn repo(tag: &str) -> Repo {
    let real = xtask::paths::repo_root().unwrap();
    let root = std::env::temp_dir().join(format!("xtask-pin-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("pins")).unwrap();
    std::fs::create_dir_all(root.join("docs")).unwrap();
    for file in ["tensorfold.json", "chat-qwen38-27b.json", "drama3.json"] {
        std::fs::copy(real.join("pins").join(file), root.join("pins").join(file)).unwrap();
    }
    std::fs::copy(
        real.join("docs/RUNTIME-PIN.md"),
        root.join("docs/RUNTIME-PIN.md"),
    )
    .unwrap();
    std::fs::write(
        root.join("README.md"),
        format!("The runtime follows TensorFold v1.1.4 (commit {COMMIT}).\n"),
    )
    .unwrap();
    Repo { root }
}

fn edit(root: &Path, file: &str, change: impl FnOnce(&mut Value)) {
    let path = root.join("pins").join(file);
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    change(&mut value);
    std::fs::write(&path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

fn failure(root: &Path) -> String {
    match pin::verify(root) {
        Ok(report) => panic!("verify-pin passed an altered pin: {:?}", report.lines),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_repository_pins_pass() {
    let repo = repo("ok");
    let report = pin::verify(&repo.root).unwrap_or_else(|e| panic!("{e}"));
    let text = report.lines.join("\n");
    println!("{text}");
    assert!(text.contains(COMMIT));
    assert!(text.contains("no local copies"), "{text}");
}

type Case = (
    &'static str,
    &'static str,
    Box<dyn FnOnce(&mut Value)>,
    &'static str,
);

#[test]
fn every_altered_field_fails_with_a_message_naming_it() {
    let cases: Vec<Case> = vec![
        (
            "release",
            "tensorfold.json",
            Box::new(|v| v["release"] = json!("1.1.5")),
            "tag",
        ),
        (
            "release format",
            "tensorfold.json",
            Box::new(|v| v["release"] = json!("1.1")),
            "MAJOR.MINOR.PATCH",
        ),
        (
            "tag",
            "tensorfold.json",
            Box::new(|v| v["tag"] = json!("v1.1.3")),
            "tag \"v1.1.3\"",
        ),
        (
            "tag object",
            "tensorfold.json",
            Box::new(|v| v["tag_object"] = json!("585dx8ba")),
            "tag_object",
        ),
        (
            "commit length",
            "tensorfold.json",
            Box::new(|v| v["commit"] = json!(&COMMIT[..39])),
            "40 lower-case hex",
        ),
        (
            "commit case",
            "tensorfold.json",
            Box::new(|v| v["commit"] = json!(COMMIT.to_uppercase())),
            "40 lower-case hex",
        ),
        (
            "hash version",
            "tensorfold.json",
            Box::new(|v| {
                v["zig_package_hash"] =
                    json!("tensorfold-1.1.3-CphTLduviwLsoiZR_ltHyW5xZtYz0ZnoMMJIxn1J6X13")
            }),
            "version \"1.1.3\"",
        ),
        (
            "hash name",
            "tensorfold.json",
            Box::new(|v| {
                v["zig_package_hash"] =
                    json!("tensorflow-1.1.4-CphTLduviwLsoiZR_ltHyW5xZtYz0ZnoMMJIxn1J6X13")
            }),
            "names package",
        ),
        (
            "hash encoding",
            "tensorfold.json",
            Box::new(|v| {
                v["zig_package_hash"] =
                    json!("tensorfold-1.1.4-CphTLduviwLsoiZR_ltHyW5xZtYz0ZnoMMJIxn1J6X1!")
            }),
            "base64url",
        ),
        (
            "hash length",
            "tensorfold.json",
            Box::new(|v| {
                v["zig_package_hash"] =
                    json!("tensorfold-1.1.4-CphTLduviwLsoiZR_ltHyW5xZtYz0ZnoMMJIxn1J6X")
            }),
            "name-version-hash",
        ),
        (
            "previous commit",
            "tensorfold.json",
            Box::new(|v| {
                v["previous"][0]["commit"] = json!("e7c523ebfa16b8094cf9e35e3773a7d25befcc5")
            }),
            "previous 1.0.7",
        ),
        (
            "previous order",
            "tensorfold.json",
            Box::new(|v| v["previous"][0]["release"] = json!("1.2.0")),
            "not older",
        ),
        (
            "previous hash version",
            "tensorfold.json",
            Box::new(|v| {
                v["previous"][0]["zig_package_hash"] =
                    json!("tensorfold-1.0.6-CphTLULywQAUe2LxgT29-AserW8gMmK9C-ltOxIaw1pG")
            }),
            "previous 1.0.7: zig_package_hash is for version",
        ),
        (
            "previous hash id",
            "tensorfold.json",
            Box::new(|v| {
                v["previous"][0]["zig_package_hash"] =
                    json!("tensorfold-1.0.7-DphTLULywQAUe2LxgT29-AserW8gMmK9C-ltOxIaw1pG")
            }),
            "fingerprint id",
        ),
        (
            "previous prefix",
            "tensorfold.json",
            Box::new(|v| v["previous"][1]["commit_prefix"] = json!("88c4")),
            "commit_prefix",
        ),
        (
            "consumed label",
            "tensorfold.json",
            Box::new(|v| v["consumed"]["files"][1]["change_from_previous"] = json!("same")),
            "change_from_previous",
        ),
        (
            "consumed module root",
            "tensorfold.json",
            Box::new(|v| v["consumed"]["modules"][0]["root"] = json!("zig/src/cuda/main.zig")),
            "not in consumed.files",
        ),
        (
            "abi required missing",
            "tensorfold.json",
            Box::new(|v| {
                v["abi"]["required"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|e| e != "cuStreamCreateWithPriority");
            }),
            "cuStreamCreateWithPriority",
        ),
        (
            "abi required extra",
            "tensorfold.json",
            Box::new(|v| {
                v["abi"]["required"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("cuMemAllocManaged"))
            }),
            "cuMemAllocManaged",
        ),
        (
            "abi optional",
            "tensorfold.json",
            Box::new(|v| v["abi"]["optional"] = json!(["cuFuncGetName"])),
            "cuFuncGetParamInfo",
        ),
        (
            "abi allocating",
            "tensorfold.json",
            Box::new(|v| {
                v["abi"]["allocating"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|e| e != "cuMemHostRegister_v2");
            }),
            "abi.allocating",
        ),
        (
            "abi renamed",
            "tensorfold.json",
            Box::new(|v| {
                for e in v["abi"]["required"].as_array_mut().unwrap() {
                    if e == "cuMemAlloc_v2" {
                        *e = json!("cuMemAlloc");
                    }
                }
            }),
            "cuMemAlloc_v2",
        ),
        (
            "kernels follow pin",
            "tensorfold.json",
            Box::new(|v| v["local_kernels"][0]["follows_pin"] = json!(true)),
            "follows_pin",
        ),
        (
            "kernels phantom record",
            "tensorfold.json",
            Box::new(|v| {
                v["local_kernels"][0]["files"] = json!({"kernels/nvfp4/act.cu": "00".repeat(32)})
            }),
            "missing",
        ),
        (
            "separate pins",
            "tensorfold.json",
            Box::new(|v| v["separate_pins"] = json!(["pins/drama3.json"])),
            "chat-qwen38-27b",
        ),
        (
            "unknown field",
            "tensorfold.json",
            Box::new(|v| v["extra"] = json!(1)),
            "unknown field",
        ),
        (
            "chat commit",
            "chat-qwen38-27b.json",
            Box::new(|v| v["commit"] = json!("e7c523ebfa16b8094cf9e35e3773a7d25befcc5b")),
            "follows the main pin",
        ),
        (
            "chat release",
            "chat-qwen38-27b.json",
            Box::new(|v| v["release"] = json!("1.1.3")),
            "chat-qwen38-27b.json",
        ),
        (
            "drama follows",
            "drama3.json",
            Box::new(|v| v["follows_main_pin"] = json!(true)),
            "follows_main_pin must be false",
        ),
        (
            "drama commit is main",
            "drama3.json",
            Box::new(|v| v["commit_prefix"] = json!("eab85828")),
            "does not follow the main pin",
        ),
        (
            "drama commit format",
            "drama3.json",
            Box::new(|v| v["commit_prefix"] = json!("c7137")),
            "commit_prefix",
        ),
        (
            "drama branch",
            "drama3.json",
            Box::new(|v| v["branch"] = json!("")),
            "branch",
        ),
    ];
    let mut problems = Vec::new();
    for (name, file, change, needle) in cases {
        let repo = repo("case");
        edit(&repo.root, file, change);
        let message = failure(&repo.root);
        println!("{name}: {message}");
        if !message.contains(needle) {
            problems.push(format!("{name}: expected {needle:?} in: {message}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn documents_must_state_the_same_pin() {
    let repo = repo("docs");
    std::fs::write(
        repo.root.join("README.md"),
        "TensorFold v1.1.4, commit e7c523ebfa16b8094cf9e35e3773a7d25befcc5b\n",
    )
    .unwrap();
    let message = failure(&repo.root);
    assert!(
        message.contains("README.md") && message.contains(COMMIT),
        "{message}"
    );
    drop(repo);
    let repo = self::repo("docs2");
    let page = std::fs::read_to_string(repo.root.join("docs/RUNTIME-PIN.md")).unwrap();
    std::fs::write(
        repo.root.join("docs/RUNTIME-PIN.md"),
        page.replace("v1.1.4", "v1.1.3"),
    )
    .unwrap();
    let message = failure(&repo.root);
    assert!(
        message.contains("docs/RUNTIME-PIN.md") && message.contains("v1.1.4"),
        "{message}"
    );
}

#[test]
fn local_kernel_digests_are_recorded_and_checked() {
    let repo = repo("kernels");
    let kernel = repo.root.join("kernels/nvfp4/act.cu");
    std::fs::create_dir_all(kernel.parent().unwrap()).unwrap();
    std::fs::write(&kernel, "// quantizer\n").unwrap();
    // Present but unrecorded.
    assert!(failure(&repo.root).contains("no recorded digest"));
    let recorded = pin::record_kernels(&repo.root).unwrap();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    let report = pin::verify(&repo.root).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        report.lines.iter().any(|l| l.contains("1 file(s) checked")),
        "{:?}",
        report.lines
    );
    // Altered content.
    std::fs::write(&kernel, "// quantizer, edited\n").unwrap();
    assert!(failure(&repo.root).contains("the record says"));
    std::fs::write(&kernel, "// quantizer\n").unwrap();
    // An altered digest in the record.
    edit(&repo.root, "tensorfold.json", |v| {
        v["local_kernels"][0]["files"]["kernels/nvfp4/act.cu"] = json!("ab".repeat(32));
    });
    assert!(failure(&repo.root).contains("the record says"));
    pin::record_kernels(&repo.root).unwrap();
    // A second copy matching the pattern (kernels/nvfp4*) without a record.
    std::fs::write(repo.root.join("kernels/nvfp4_extra.cuh"), "// helper\n").unwrap();
    assert!(failure(&repo.root).contains("kernels/nvfp4_extra.cuh"));
    // A recorded file that disappeared.
    std::fs::remove_file(repo.root.join("kernels/nvfp4_extra.cuh")).unwrap();
    std::fs::remove_file(&kernel).unwrap();
    assert!(failure(&repo.root).contains("missing"));
}

#[test]
fn upstream_check_compares_the_package_hash_and_reports_each_file() {
    let repo = repo("upstream");
    let upstream = repo.root.join("upstream");
    std::fs::create_dir_all(upstream.join("zig/src/cuda")).unwrap();
    std::fs::write(
        upstream.join("build.zig.zon"),
        ".{ .name = .tensorfold, .version = \"1.1.4\", .fingerprint = 0xb6dc5a482d53980a, .paths = .{\"\"} }\n",
    )
    .unwrap();
    std::fs::write(upstream.join("zig/src/cuda/root.zig"), "// root\n").unwrap();
    let message = match pin::verify_upstream(&repo.root, &upstream) {
        Ok(report) => panic!("a different tree matched the pin: {:?}", report.lines),
        Err(e) => e.to_string(),
    };
    assert!(message.contains("not the pinned source"), "{message}");
    assert!(
        message.contains("zig/src/core/stagger.zig is missing"),
        "{message}"
    );
}
