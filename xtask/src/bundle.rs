//! `cargo xtask gpu-bundle`: one folder with everything a GPU machine without Rust needs to run the GPU
//! tests and commands: `bin/` (the `tf` binary and every gpu_* test binary, cargo profile `bundle`),
//! `kernels/` (the fatbins and manifest, also embedded in `tf`), files listed by the steps file,
//! `steps.tsv` (name, timeout, command) and `run.sh`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;

use crate::kernels::{self, BuildOptions};
use crate::paths::kernels_out_dir;
use crate::util::{read_text, run_captured, write_atomic};
use crate::Error;

/// The whole carried tree is limited to 64 MiB; the bundle must fit in it.
pub const SIZE_LIMIT: u64 = 64 * 1024 * 1024;
/// The steps file, relative to the repository root.
pub const STEPS_FILE: &str = "xtask/bundle-steps.toml";
/// Arguments every GPU test binary runs with.
pub const TEST_ARGS: &str = "--include-ignored --test-threads=1 --nocapture";

const RUN_SH: &str = include_str!("../run.sh");

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepsFile {
    defaults: StepDefaults,
    #[serde(default)]
    test: Vec<TestStep>,
    #[serde(default)]
    command: Vec<CommandStep>,
    #[serde(default)]
    file: Vec<FileEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepDefaults {
    timeout: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TestStep {
    target: String,
    timeout: Option<u64>,
    #[serde(default)]
    filters: Vec<String>,
    #[serde(default)]
    skip: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandStep {
    name: String,
    command: String,
    timeout: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    path: String,
}

/// One step of run.sh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub name: String,
    pub timeout: u64,
    pub command: String,
}

fn valid_step_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Plans the steps: one per GPU test target (sorted), then the command steps in file order.
pub fn plan_steps(
    steps_text: &str,
    steps_path: &Path,
    test_targets: &[String],
) -> Result<(Vec<Step>, Vec<String>), Error> {
    let file: StepsFile =
        toml::from_str(steps_text).map_err(|e| Error::config(steps_path, e.to_string()))?;
    let mut problems = Vec::new();
    let mut adjust: BTreeMap<&str, &TestStep> = BTreeMap::new();
    for test in &file.test {
        if !test_targets.contains(&test.target) {
            problems.push(format!(
                "[[test]] target {:?} is not a gpu_* integration test of the workspace (found: {})",
                test.target,
                test_targets.join(", ")
            ));
        }
        if adjust.insert(&test.target, test).is_some() {
            problems.push(format!("[[test]] target {:?} is listed twice", test.target));
        }
    }
    let mut steps = Vec::new();
    let mut sorted: Vec<&String> = test_targets.iter().collect();
    sorted.sort();
    for target in sorted {
        let mut command = format!("bin/{target} {TEST_ARGS}");
        let mut timeout = file.defaults.timeout;
        if let Some(test) = adjust.get(target.as_str()) {
            timeout = test.timeout.unwrap_or(timeout);
            for filter in &test.filters {
                command.push(' ');
                command.push_str(&shell_quote(filter));
            }
            for skip in &test.skip {
                command.push_str(" --skip ");
                command.push_str(&shell_quote(skip));
            }
        }
        steps.push(Step {
            name: target.clone(),
            timeout,
            command,
        });
    }
    for command in &file.command {
        if command.command.contains('\t') || command.command.contains('\n') {
            problems.push(format!(
                "[[command]] {}: the command must be one line without tabs",
                command.name
            ));
        }
        steps.push(Step {
            name: command.name.clone(),
            timeout: command.timeout.unwrap_or(file.defaults.timeout),
            command: command.command.clone(),
        });
    }
    let mut names = BTreeSet::new();
    for step in &steps {
        if !valid_step_name(&step.name) {
            problems.push(format!(
                "step name {:?}: use letters, digits, _ - .",
                step.name
            ));
        }
        if !names.insert(step.name.clone()) {
            problems.push(format!("step name {:?} is used twice", step.name));
        }
        if step.timeout == 0 {
            problems.push(format!("step {}: timeout must be positive", step.name));
        }
    }
    let files = file.file.into_iter().map(|f| f.path).collect();
    if problems.is_empty() {
        Ok((steps, files))
    } else {
        Err(Error::config(steps_path, problems.join("\n  ")))
    }
}

/// Quotes a word for bash.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-./=:".contains(&b))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// `steps.tsv`, read by run.sh.
pub fn steps_table(steps: &[Step]) -> String {
    steps
        .iter()
        .map(|s| format!("{}\t{}\t{}\n", s.name, s.timeout, s.command))
        .collect()
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// (package, target) of every integration test target named gpu_* in the workspace.
pub fn gpu_test_targets(root: &Path) -> Result<Vec<(String, String)>, Error> {
    let output = run_captured(cargo().current_dir(root).args([
        "metadata",
        "--no-deps",
        "--format-version",
        "1",
    ]))?;
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| Error::config("cargo metadata", e.to_string()))?;
    let mut found = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let package_name = package["name"].as_str().unwrap_or_default();
        for target in package["targets"].as_array().into_iter().flatten() {
            let is_test = target["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|v| v == "test"));
            let name = target["name"].as_str().unwrap_or_default();
            if is_test && name.starts_with("gpu_") {
                found.push((package_name.to_string(), name.to_string()));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Runs a cargo build with JSON messages; returns target name -> executable for matching artifacts.
fn cargo_executables(
    root: &Path,
    args: &[String],
    want: &dyn Fn(&serde_json::Value) -> bool,
) -> Result<BTreeMap<String, PathBuf>, Error> {
    let mut command = cargo();
    command.current_dir(root).args(args).args([
        "--profile",
        "bundle",
        "--message-format=json-render-diagnostics",
    ]);
    eprintln!("gpu-bundle: {}", crate::util::describe(&command));
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::CommandFailed {
            command: crate::util::describe(&command),
            status: "could not start".into(),
            output: e.to_string(),
        })?;
    if !output.status.success() {
        return Err(Error::CommandFailed {
            command: crate::util::describe(&command),
            status: output.status.to_string(),
            output: "(compiler messages above)".into(),
        });
    }
    let mut found = BTreeMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" || !want(&message["target"]) {
            continue;
        }
        if let (Some(name), Some(executable)) = (
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) {
            found.insert(name.to_string(), PathBuf::from(executable));
        }
    }
    Ok(found)
}

fn copy(from: &Path, to: &Path) -> Result<(), Error> {
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("creating", parent, e))?;
    }
    std::fs::copy(from, to).map_err(|e| Error::io("copying", from, e))?;
    Ok(())
}

/// Sizes of every file under `dir`, largest first.
pub fn sizes(dir: &Path) -> Result<Vec<(String, u64)>, Error> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<(String, u64)>) -> Result<(), Error> {
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))? {
            let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
            let path = entry.path();
            let meta = entry
                .metadata()
                .map_err(|e| Error::io("reading", &path, e))?;
            if meta.is_dir() {
                walk(base, &path, out)?;
            } else {
                let relative = path
                    .strip_prefix(base)
                    .unwrap_or(&path)
                    .display()
                    .to_string();
                out.push((relative, meta.len()));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(out)
}

/// Fails with the list of sizes when the bundle is over [`SIZE_LIMIT`].
pub fn check_size(dir: &Path) -> Result<u64, Error> {
    let sizes = sizes(dir)?;
    let total: u64 = sizes.iter().map(|s| s.1).sum();
    if total <= SIZE_LIMIT {
        return Ok(total);
    }
    let mut failures = vec![format!(
        "{} is {:.1} MiB, over the {} MiB limit; largest files:",
        dir.display(),
        total as f64 / 1048576.0,
        SIZE_LIMIT / 1048576
    )];
    failures.extend(
        sizes
            .iter()
            .map(|(path, size)| format!("{:>10.2} MiB  {path}", *size as f64 / 1048576.0)),
    );
    Err(Error::CheckFailed {
        check: "gpu-bundle size",
        failures,
    })
}

/// Packs `bin/` into `bin.tar.xz` (run.sh unpacks it on the GPU machine). The executables each embed every
/// kernel set and are over 200 MiB together; xz's largest preset (a 64 MiB dictionary) finds the kernel images the
/// executables share, which the default preset's 8 MiB window misses: about 21x against 6x (11 MiB against 39 MiB
/// for the 21 executables), what keeps the bundle under [`SIZE_LIMIT`].
fn pack_executables(out: &Path) -> Result<(), Error> {
    // tar opens the archive relative to its own working directory, not to -C: give it the full path.
    let archive = out.join("bin.tar.xz");
    let mut command = Command::new("tar");
    command
        .arg("-cJf")
        .arg(&archive)
        .arg("-C")
        .arg(out)
        .arg("bin")
        .env("XZ_OPT", "-9 -T0");
    let output = command.output().map_err(|e| Error::CommandFailed {
        command: "tar -cJf bin.tar.xz bin".into(),
        status: format!("could not start tar (with xz): {e}"),
        output: String::new(),
    })?;
    if !output.status.success() {
        return Err(Error::CommandFailed {
            command: "tar -cJf bin.tar.xz bin".into(),
            status: output.status.to_string(),
            output: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    let bin = out.join("bin");
    std::fs::remove_dir_all(&bin).map_err(|e| Error::io("removing the packed bin/", &bin, e))
}

/// Options of `cargo xtask gpu-bundle`.
#[derive(Clone, Debug, Default)]
pub struct BundleOptions {
    pub out: Option<PathBuf>,
    pub skip_kernels: bool,
    /// Only these steps (empty: all): the bundle then holds `tf` and the test executables they run, no fatbins
    /// (the executables embed them), and, when it lies inside the repository, links to the repository's folders
    /// instead of copies of the `[[file]]` entries. Small enough to travel beside the checkout.
    pub only: Vec<String>,
}

/// The steps named in `only`, in the steps file's order (every step when `only` is empty); an unknown name is an
/// error that lists the known ones.
pub fn select_steps(steps: Vec<Step>, only: &[String]) -> Result<Vec<Step>, String> {
    if only.is_empty() {
        return Ok(steps);
    }
    let unknown: Vec<&String> = only
        .iter()
        .filter(|name| !steps.iter().any(|s| &s.name == *name))
        .collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
        return Err(format!(
            "unknown step(s) {unknown:?}; known steps: {}",
            known.join(", ")
        ));
    }
    Ok(steps
        .into_iter()
        .filter(|s| only.contains(&s.name))
        .collect())
}

/// The test executables of `targets` that `steps` run: each named as a word of a step's command (`bin/gpu_x ...`,
/// `TF_X=1 gpu_x ...`).
pub fn executables_used(steps: &[Step], targets: &[String]) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for step in steps {
        for word in step
            .command
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        {
            if let Some(target) = targets.iter().find(|t| t.as_str() == word) {
                used.insert(target.clone());
            }
        }
    }
    used
}

/// `path` relative to `base` when it lies inside it (no `..` components in either).
fn inside(path: &Path, base: &Path) -> Option<PathBuf> {
    path.strip_prefix(base).ok().map(Path::to_path_buf)
}

/// Links `out/<top>` to the repository's `<top>` folder for every first component `top` of `files`, by a relative
/// link (`../tests` from `root/bundle`), so the bundle and the checkout travel together without a second copy.
#[cfg(unix)]
fn link_file_folders(root: &Path, out: &Path, files: &[String]) -> Result<bool, Error> {
    let Some(relative) = inside(out, root) else {
        return Ok(false);
    };
    let up: PathBuf = relative.components().map(|_| "..").collect();
    let tops: BTreeSet<&str> = files.iter().filter_map(|f| f.split('/').next()).collect();
    for top in tops {
        let link = out.join(top);
        std::os::unix::fs::symlink(up.join(top), &link)
            .map_err(|e| Error::io("linking the repository folder", &link, e))?;
    }
    Ok(true)
}

#[cfg(not(unix))]
fn link_file_folders(_root: &Path, _out: &Path, _files: &[String]) -> Result<bool, Error> {
    Ok(false)
}

/// Builds and assembles the bundle; returns its folder.
pub fn build(root: &Path, options: &BundleOptions) -> Result<PathBuf, Error> {
    let out = options.out.clone().unwrap_or_else(|| root.join("bundle"));
    // Absolute, so that a slim bundle can tell whether it lies inside the repository.
    let out =
        std::path::absolute(&out).map_err(|e| Error::io("resolving the output folder", &out, e))?;
    let steps_path = root.join(STEPS_FILE);
    let steps_text = read_text(&steps_path)?;
    let targets = gpu_test_targets(root)?;
    let target_names: Vec<String> = targets.iter().map(|t| t.1.clone()).collect();
    let duplicates: BTreeSet<&String> = target_names
        .iter()
        .filter(|n| target_names.iter().filter(|m| m == n).count() > 1)
        .collect();
    if !duplicates.is_empty() {
        return Err(Error::config(
            &steps_path,
            format!("gpu test target names must be unique across crates: {duplicates:?}"),
        ));
    }
    let (steps, files) = plan_steps(&steps_text, &steps_path, &target_names)?;
    let slim = !options.only.is_empty();
    let steps = select_steps(steps, &options.only)
        .map_err(|e| Error::Usage(format!("gpu-bundle --only: {e}")))?;
    // A slim bundle builds and carries only the test executables its steps run.
    let targets: Vec<(String, String)> = if slim {
        let used = executables_used(&steps, &target_names);
        targets
            .into_iter()
            .filter(|(_, target)| used.contains(target))
            .collect()
    } else {
        targets
    };
    let target_names: Vec<String> = targets.iter().map(|t| t.1.clone()).collect();

    if !options.skip_kernels {
        let (manifest, _) = kernels::build(root, &kernels_out_dir(root), &BuildOptions::default())?;
        eprintln!("gpu-bundle: {} kernel set(s) built", manifest.sets.len());
    }
    let tf = cargo_executables(
        root,
        &[
            "build".into(),
            "-p".into(),
            "tf-engines".into(),
            "--bin".into(),
            "tf".into(),
            // `tf bench` compares every attention tile and times the DiT's phases: build the benchmark-only
            // kernels and timers in.
            "--features".into(),
            "bench,bench-kernels".into(),
        ],
        &|t| t["name"] == "tf",
    )?;
    let tf = tf.get("tf").cloned().ok_or_else(|| Error::CommandFailed {
        command: "cargo build -p tf-engines --bin tf".into(),
        status: "no executable reported".into(),
        output: String::new(),
    })?;
    let mut tests = BTreeMap::new();
    if !targets.is_empty() {
        // The GPU tests compare every attention tile, the benchmark-only ones included.
        let mut args: Vec<String> = vec![
            "test".into(),
            "--no-run".into(),
            "--features".into(),
            "tf-engines/bench,tf-engines/bench-kernels".into(),
        ];
        for (package, target) in &targets {
            args.extend([
                "-p".into(),
                package.clone(),
                "--test".into(),
                target.clone(),
            ]);
        }
        tests = cargo_executables(root, &args, &|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|v| v == "test"))
                && t["name"].as_str().is_some_and(|n| n.starts_with("gpu_"))
        })?;
    }
    for target in &target_names {
        if !tests.contains_key(target) {
            return Err(Error::CommandFailed {
                command: "cargo test --no-run".into(),
                status: format!("no executable reported for {target}"),
                output: String::new(),
            });
        }
    }

    if out.exists() {
        let looks_like_bundle = out.join("run.sh").is_file()
            || std::fs::read_dir(&out)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
        if !looks_like_bundle {
            return Err(Error::Usage(format!(
                "{} exists and is not a bundle (no run.sh); choose another --out",
                out.display()
            )));
        }
        std::fs::remove_dir_all(&out).map_err(|e| Error::io("removing the old bundle", &out, e))?;
    }
    copy(&tf, &out.join("bin/tf"))?;
    for (name, executable) in &tests {
        copy(executable, &out.join("bin").join(name))?;
    }
    let kernels_dir = kernels_out_dir(root);
    for name in ["manifest.json", "embed.tsv"] {
        if kernels_dir.join(name).is_file() {
            copy(&kernels_dir.join(name), &out.join("kernels").join(name))?;
        }
    }
    if let Some(manifest) = kernels::Manifest::load(&kernels_dir)? {
        // The executables embed every fatbin; a slim bundle carries the manifest alone.
        for set in manifest.sets.iter().filter(|_| !slim) {
            copy(
                &kernels_dir.join(&set.fatbin),
                &out.join("kernels").join(&set.fatbin),
            )?;
        }
    }
    for file in &files {
        if file.contains("..") || file.starts_with('/') {
            return Err(Error::config(
                &steps_path,
                format!("[[file]] {file:?} must be a path inside the repository"),
            ));
        }
    }
    let linked = slim && link_file_folders(root, &out, &files)?;
    for file in files.iter().filter(|_| !linked) {
        copy(&root.join(file), &out.join(file))?;
    }
    pack_executables(&out)?;
    write_atomic(&out.join("steps.tsv"), steps_table(&steps).as_bytes())?;
    write_atomic(&out.join("run.sh"), RUN_SH.as_bytes())?;
    set_executable(&out.join("run.sh"))?;
    let total = check_size(&out)?;
    for (path, size) in sizes(&out)? {
        println!("{:>10.2} MiB  {path}", size as f64 / 1048576.0);
    }
    println!(
        "bundle: {} ({:.1} MiB, {} step(s)); run: {}/run.sh OUTDIR [STEP]...",
        out.display(),
        total as f64 / 1048576.0,
        steps.len(),
        out.display()
    );
    Ok(out)
}

#[cfg(unix)]
fn set_executable(path: &Path) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| Error::io("making executable", path, e))
}

#[cfg(not(unix))]
fn set_executable(_path: &Path) -> Result<(), Error> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEPS: &str = "[defaults]\ntimeout = 600\n[[test]]\ntarget = \"gpu_b\"\ntimeout = 30\nfilters = [\"graph\"]\nskip = [\"slow one\"]\n[[command]]\nname = \"tf-doctor\"\ncommand = \"tf doctor\"\n";

    #[test]
    fn tests_first_then_commands_with_adjustments() {
        let (steps, files) = plan_steps(
            STEPS,
            Path::new("s.toml"),
            &["gpu_b".to_string(), "gpu_a".to_string()],
        )
        .unwrap();
        assert!(files.is_empty());
        let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["gpu_a", "gpu_b", "tf-doctor"]);
        assert_eq!(steps[0].command, format!("bin/gpu_a {TEST_ARGS}"));
        assert_eq!(steps[0].timeout, 600);
        assert_eq!(
            steps[1].command,
            format!("bin/gpu_b {TEST_ARGS} graph --skip 'slow one'")
        );
        assert_eq!(steps[1].timeout, 30);
        assert_eq!(steps_table(&steps).lines().count(), 3);
    }

    #[test]
    fn unknown_test_targets_and_duplicate_names_are_errors() {
        let err = plan_steps(STEPS, Path::new("s.toml"), &["gpu_a".to_string()]).unwrap_err();
        assert!(err.to_string().contains("gpu_b"), "{err}");
        let twice = "[defaults]\ntimeout = 1\n[[command]]\nname = \"x\"\ncommand = \"a\"\n[[command]]\nname = \"x\"\ncommand = \"b\"\n";
        assert!(plan_steps(twice, Path::new("s.toml"), &[]).is_err());
    }

    fn step(name: &str, command: &str) -> Step {
        Step {
            name: name.into(),
            timeout: 1,
            command: command.into(),
        }
    }

    #[test]
    fn only_selects_steps_in_file_order_and_names_the_unknown() {
        let steps = vec![step("a", "x"), step("b", "y"), step("c", "z")];
        let picked = select_steps(steps.clone(), &["c".into(), "a".into()]).unwrap();
        let names: Vec<&str> = picked.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["a", "c"]);
        assert_eq!(select_steps(steps.clone(), &[]).unwrap().len(), 3);
        let err = select_steps(steps, &["a".into(), "nope".into()]).unwrap_err();
        assert!(err.contains("\"nope\"") && err.contains("a, b, c"), "{err}");
    }

    #[test]
    fn the_executables_a_step_runs_are_the_words_of_its_command() {
        let targets: Vec<String> = ["gpu_a", "gpu_ab", "gpu_b", "gpu_c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let steps = vec![
            step("gpu_a", &format!("bin/gpu_a {TEST_ARGS}")),
            step(
                "x",
                "TF_X=1 gpu_b --include-ignored; tf bench h3-dit; echo gpu_cc",
            ),
        ];
        let used: Vec<String> = executables_used(&steps, &targets).into_iter().collect();
        assert_eq!(used, vec!["gpu_a", "gpu_b"]);
    }

    #[cfg(unix)]
    #[test]
    fn a_slim_bundle_links_the_repository_folders_relatively() {
        let root = std::env::temp_dir().join(format!("tf-xtask-link-{}", std::process::id()));
        let out = root.join("devb");
        std::fs::create_dir_all(root.join("tests/python")).unwrap();
        std::fs::write(root.join("tests/python/a.py"), "x").unwrap();
        std::fs::create_dir_all(&out).unwrap();
        let files = vec!["tests/python/a.py".to_string()];
        assert!(link_file_folders(&root, &out, &files).unwrap());
        assert_eq!(
            std::fs::read_link(out.join("tests")).unwrap(),
            PathBuf::from("../tests")
        );
        assert_eq!(
            std::fs::read_to_string(out.join("tests/python/a.py")).unwrap(),
            "x"
        );
        // Outside the repository nothing is linked: the files are copied instead.
        let elsewhere = std::env::temp_dir().join(format!("tf-xtask-out-{}", std::process::id()));
        assert!(!link_file_folders(&root, &elsewhere, &files).unwrap());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn shell_quoting_keeps_words_intact() {
        assert_eq!(shell_quote("plain_name"), "plain_name");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn repository_steps_file_parses_against_the_workspace_tests() {
        let root = crate::paths::repo_root().unwrap();
        let text = read_text(&root.join(STEPS_FILE)).unwrap();
        let targets: Vec<String> = gpu_test_targets(&root)
            .unwrap()
            .into_iter()
            .map(|t| t.1)
            .collect();
        if let Err(e) = plan_steps(&text, Path::new(STEPS_FILE), &targets) {
            panic!("{e}");
        }
    }

    #[test]
    fn oversized_bundles_list_their_files() {
        let dir = std::env::temp_dir().join(format!("xtask-size-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = std::fs::File::create(dir.join("big.bin")).unwrap();
        file.set_len(SIZE_LIMIT + 1).unwrap();
        let err = check_size(&dir).unwrap_err().to_string();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(err.contains("big.bin") && err.contains("64 MiB"), "{err}");
    }
}
