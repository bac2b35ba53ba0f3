//! `cargo xtask kernels`: compiles the kernel sets listed in `kernels/kernels.toml` into fatbins.
//!
//! Output (in [`crate::paths::kernels_out_dir`], by default `target/fatbins/`): `<set>.fatbin` per set and
//! `manifest.json` ([`Manifest`]), which tf-engines' build script embeds. A set is rebuilt only when its key
//! changes: sha256 over its nvcc arguments, `nvcc --version`, and the content of its source and every
//! header under `kernels/` that the last build included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::toolchain::{self, Tool};
use crate::util::{read, read_text, run_captured, sha256_hex, write_atomic};
use crate::Error;

/// Version of the manifest layout (bump on incompatible change; tf-engines' build script checks it).
pub const MANIFEST_SCHEMA: u32 = 1;

/// SASS instruction families a tensor-core kernel may be required to contain.
pub const TENSOR_CORE_FAMILIES: &[&str] = &["HMMA", "HGMMA", "QGMMA", "IGMMA"];

/// The one target every set must build (the H200).
pub const REQUIRED_TARGET: &str = "sm_90a";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KernelsToml {
    defaults: Defaults,
    #[serde(default)]
    set: Vec<SetToml>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Defaults {
    #[serde(default)]
    flags: Vec<String>,
    targets: Vec<String>,
    ptx: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SetToml {
    name: String,
    source: String,
    #[serde(default)]
    flags: Vec<String>,
    targets: Option<Vec<String>>,
    ptx: Option<String>,
    #[serde(default)]
    hot: Vec<String>,
    #[serde(default)]
    tensor_core: BTreeMap<String, String>,
}

/// One kernel set, resolved from kernels.toml (defaults applied, validated).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSet {
    pub name: String,
    /// Relative to `kernels/`, with `/` separators.
    pub source: String,
    /// Defaults' flags followed by the set's.
    pub flags: Vec<String>,
    pub targets: Vec<String>,
    /// `compute_XX` whose PTX is embedded, or None.
    pub ptx: Option<String>,
    pub hot: Vec<String>,
    pub tensor_core: BTreeMap<String, String>,
}

/// One input file of a set and its content hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputDigest {
    /// Relative to the repository root.
    pub path: String,
    pub sha256: String,
}

/// What was built for one set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetRecord {
    pub name: String,
    /// File name in the output directory.
    pub fatbin: String,
    pub fatbin_sha256: String,
    pub fatbin_bytes: u64,
    /// The source, relative to the repository root.
    pub source: String,
    /// nvcc arguments other than paths and parallelism (they make up the key).
    pub args: Vec<String>,
    pub targets: Vec<String>,
    pub ptx: Option<String>,
    pub hot: Vec<String>,
    pub tensor_core: BTreeMap<String, String>,
    /// The source and every included file under `kernels/`.
    pub inputs: Vec<InputDigest>,
    /// sha256 over args, nvcc version and inputs: equal key, equal fatbin.
    pub key: String,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema: u32,
    pub nvcc_path: String,
    pub nvcc_version: String,
    pub sets: Vec<SetRecord>,
}

impl Manifest {
    /// Reads `manifest.json` from `out_dir`; Ok(None) when there is none.
    pub fn load(out_dir: &Path) -> Result<Option<Manifest>, Error> {
        let path = out_dir.join("manifest.json");
        if !path.is_file() {
            return Ok(None);
        }
        let text = read_text(&path)?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| {
            Error::config(
                &path,
                format!("{e}; delete it and run `cargo xtask kernels`"),
            )
        })?;
        if manifest.schema != MANIFEST_SCHEMA {
            return Err(Error::config(
                &path,
                format!(
                    "schema {} (expected {MANIFEST_SCHEMA}); run `cargo xtask kernels`",
                    manifest.schema
                ),
            ));
        }
        Ok(Some(manifest))
    }
}

fn is_sm_target(target: &str) -> bool {
    let Some(rest) = target.strip_prefix("sm_") else {
        return false;
    };
    let digits = rest.strip_suffix('a').unwrap_or(rest);
    digits.len() >= 2 && digits.bytes().all(|b| b.is_ascii_digit())
}

fn is_plain_compute(ptx: &str) -> bool {
    ptx.strip_prefix("compute_")
        .is_some_and(|d| d.len() >= 2 && d.bytes().all(|b| b.is_ascii_digit()))
}

fn valid_set_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Parses and validates kernels.toml text. `kernels_dir` is used to check that sources exist.
pub fn parse_config(
    text: &str,
    config_path: &Path,
    kernels_dir: &Path,
) -> Result<Vec<KernelSet>, Error> {
    let parsed: KernelsToml =
        toml::from_str(text).map_err(|e| Error::config(config_path, e.to_string()))?;
    let mut problems = Vec::new();
    let mut names = BTreeSet::new();
    let mut sets = Vec::new();
    for spec in parsed.set {
        let name = spec.name.clone();
        if !valid_set_name(&name) {
            problems.push(format!(
                "set name {name:?}: use lower-case letters, digits and _"
            ));
        }
        if !names.insert(name.clone()) {
            problems.push(format!("set {name:?} is listed twice"));
        }
        let source_ok = !spec.source.contains("..") && !spec.source.starts_with('/');
        if !source_ok {
            problems.push(format!(
                "set {name}: source {:?} must be a path under kernels/",
                spec.source
            ));
        } else if !kernels_dir.join(&spec.source).is_file() {
            problems.push(format!(
                "set {name}: source kernels/{} does not exist",
                spec.source
            ));
        }
        let targets = spec
            .targets
            .unwrap_or_else(|| parsed.defaults.targets.clone());
        for target in &targets {
            if !is_sm_target(target) {
                problems.push(format!(
                    "set {name}: target {target:?} is not sm_XX or sm_XXa"
                ));
            }
        }
        if !targets.iter().any(|t| t == REQUIRED_TARGET) {
            problems.push(format!(
                "set {name}: targets must include {REQUIRED_TARGET}"
            ));
        }
        let ptx_text = spec.ptx.unwrap_or_else(|| parsed.defaults.ptx.clone());
        let ptx = if ptx_text == "none" {
            None
        } else {
            if !is_plain_compute(&ptx_text) {
                problems.push(format!(
                    "set {name}: ptx {ptx_text:?} must be compute_XX (not arch-specific) or \"none\""
                ));
            }
            Some(ptx_text)
        };
        for (kernel, family) in &spec.tensor_core {
            if !TENSOR_CORE_FAMILIES.contains(&family.as_str()) {
                problems.push(format!(
                    "set {name}: tensor_core.{kernel} = {family:?}; expected one of {}",
                    TENSOR_CORE_FAMILIES.join(", ")
                ));
            }
        }
        let mut flags = parsed.defaults.flags.clone();
        flags.extend(spec.flags);
        for flag in &flags {
            if flag.starts_with("-gencode") || flag.starts_with("-arch") || flag == "-o" {
                problems.push(format!(
                    "set {name}: flag {flag:?} is managed by xtask (use targets / ptx)"
                ));
            }
        }
        sets.push(KernelSet {
            name,
            source: spec.source,
            flags,
            targets,
            ptx,
            hot: spec.hot,
            tensor_core: spec.tensor_core,
        });
    }
    if problems.is_empty() {
        Ok(sets)
    } else {
        Err(Error::config(config_path, problems.join("\n  ")))
    }
}

/// Reads `kernels/kernels.toml` under `root`.
pub fn load_config(root: &Path) -> Result<Vec<KernelSet>, Error> {
    let kernels_dir = root.join("kernels");
    let path = kernels_dir.join("kernels.toml");
    parse_config(&read_text(&path)?, &path, &kernels_dir)
}

/// The nvcc arguments of a set that decide its output (no paths, no parallelism).
pub fn key_args(set: &KernelSet) -> Vec<String> {
    let mut args = vec!["-fatbin".to_string()];
    args.extend(set.flags.iter().cloned());
    for target in &set.targets {
        let arch = target.replacen("sm_", "compute_", 1);
        args.push(format!("-gencode=arch={arch},code={target}"));
    }
    if let Some(ptx) = &set.ptx {
        args.push(format!("-gencode=arch={ptx},code={ptx}"));
    }
    args
}

/// The key of a build: equal keys give equal fatbins.
pub fn build_key(args: &[String], nvcc_version: &str, inputs: &[InputDigest]) -> String {
    let mut text = String::new();
    text.push_str("args\n");
    for arg in args {
        text.push_str(arg);
        text.push('\n');
    }
    text.push_str("nvcc\n");
    text.push_str(nvcc_version);
    text.push_str("\ninputs\n");
    for input in inputs {
        text.push_str(&input.path);
        text.push(' ');
        text.push_str(&input.sha256);
        text.push('\n');
    }
    sha256_hex(text.as_bytes())
}

fn digest_inputs(root: &Path, paths: &[String]) -> Result<Vec<InputDigest>, Error> {
    paths
        .iter()
        .map(|path| {
            Ok(InputDigest {
                path: path.clone(),
                sha256: sha256_hex(&read(&root.join(path))?),
            })
        })
        .collect()
}

/// Parses a make-style dependency file and keeps the files under `kernels_dir`, as paths relative to
/// `root` with `/` separators, sorted and deduplicated.
pub fn parse_depfile(text: &str, root: &Path, kernels_dir: &Path) -> Vec<String> {
    let joined = text.replace("\\\n", " ").replace("\\\r\n", " ");
    let mut found = BTreeSet::new();
    for line in joined.lines() {
        // Everything after the first ": " is prerequisites (the target is before it).
        let prerequisites = match line.find(": ") {
            Some(at) => &line[at + 2..],
            None => continue,
        };
        for word in prerequisites.split_whitespace() {
            let path = Path::new(word);
            let normalized = normalize(path);
            if normalized.starts_with(kernels_dir) {
                if let Ok(relative) = normalized.strip_prefix(root) {
                    let text: Vec<String> = relative
                        .components()
                        .map(|c| c.as_os_str().to_string_lossy().into_owned())
                        .collect();
                    found.insert(text.join("/"));
                }
            }
        }
    }
    found.into_iter().collect()
}

/// Lexically removes `.` and `..` components (the dependency file writes paths like `bin/..//include`).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Options of `cargo xtask kernels`.
#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    /// Only these sets (all when empty).
    pub only: Vec<String>,
    /// Rebuild even when the key is unchanged.
    pub force: bool,
    /// Sets compiled at once (default: one per two cores, at least one).
    pub jobs: Option<usize>,
}

/// What happened to one set.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    UpToDate,
    Built { seconds: f64 },
}

/// A set's record and its build time in seconds, or why it failed.
type SetResult = Result<(SetRecord, f64), Error>;

/// Builds the kernel sets under `root` into `out_dir`, returning the new manifest and what was done.
pub fn build(
    root: &Path,
    out_dir: &Path,
    options: &BuildOptions,
) -> Result<(Manifest, Vec<(String, Outcome)>), Error> {
    let sets = load_config(root)?;
    for wanted in &options.only {
        if !sets.iter().any(|s| &s.name == wanted) {
            return Err(Error::Usage(format!(
                "no kernel set named {wanted:?} in kernels/kernels.toml"
            )));
        }
    }
    let nvcc = toolchain::nvcc(root)?;
    let nvcc_version = toolchain::nvcc_version(&nvcc)?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating", out_dir, e))?;
    let previous = Manifest::load(out_dir).unwrap_or(None);
    let previous_sets: BTreeMap<String, SetRecord> = previous
        .map(|m| m.sets.into_iter().map(|s| (s.name.clone(), s)).collect())
        .unwrap_or_default();

    let mut records: BTreeMap<String, SetRecord> = BTreeMap::new();
    let mut pending = Vec::new();
    let mut outcomes = Vec::new();
    for set in &sets {
        let selected = options.only.is_empty() || options.only.contains(&set.name);
        let prior = previous_sets.get(&set.name);
        if let Some(prior) = prior {
            if !options.force && up_to_date(root, out_dir, set, prior, &nvcc_version) {
                // The fatbin stands; the checks' tables (hot kernels, tensor-core families) come from the spec as
                // it is now, since they do not change the build.
                let mut record = prior.clone();
                record.hot = set.hot.clone();
                record.tensor_core = set.tensor_core.clone();
                records.insert(set.name.clone(), record);
                outcomes.push((set.name.clone(), Outcome::UpToDate));
                continue;
            }
            if !selected {
                records.insert(set.name.clone(), prior.clone());
                continue;
            }
        }
        if selected {
            pending.push(set.clone());
        }
    }

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = options
        .jobs
        .unwrap_or((cores / 2).max(1))
        .clamp(1, pending.len().max(1));
    let threads_per_job = (cores / jobs).max(1);
    let mut failures = Vec::new();
    for chunk in pending.chunks(jobs) {
        let results: Vec<(String, SetResult)> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|set| {
                    let nvcc = &nvcc;
                    let nvcc_version = nvcc_version.as_str();
                    scope.spawn(move || {
                        eprintln!("kernels: building {} ({})", set.name, set.targets.join(" "));
                        let started = std::time::Instant::now();
                        let result =
                            build_set(root, out_dir, set, nvcc, nvcc_version, threads_per_job)
                                .map(|record| (record, started.elapsed().as_secs_f64()));
                        (set.name.clone(), result)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        (
                            "?".to_string(),
                            Err(Error::ToolMissing {
                                tool: "nvcc",
                                detail: "a build thread panicked".to_string(),
                            }),
                        )
                    })
                })
                .collect()
        });
        for (name, result) in results {
            match result {
                Ok((record, seconds)) => {
                    records.insert(name.clone(), record);
                    outcomes.push((name, Outcome::Built { seconds }));
                }
                Err(e) => failures.push(format!("set {name}: {e}")),
            }
        }
    }

    // Outputs of sets no longer listed are removed, so tf-engines never embeds a stale set.
    for (name, prior) in &previous_sets {
        if !sets.iter().any(|s| &s.name == name) {
            let _ = std::fs::remove_file(out_dir.join(&prior.fatbin));
        }
    }
    let manifest = Manifest {
        schema: MANIFEST_SCHEMA,
        nvcc_path: nvcc.path.display().to_string(),
        nvcc_version,
        sets: sets
            .iter()
            .filter_map(|s| records.get(&s.name).cloned())
            .collect(),
    };
    let json = serde_json::to_string_pretty(&manifest)
        .map_err(|e| Error::config(out_dir.join("manifest.json"), e.to_string()))?;
    write_atomic(
        &out_dir.join(EMBED_TABLE),
        embed_table(&manifest).as_bytes(),
    )?;
    write_atomic(&out_dir.join("manifest.json"), json.as_bytes())?;
    if failures.is_empty() {
        Ok((manifest, outcomes))
    } else {
        Err(Error::CheckFailed {
            check: "cargo xtask kernels",
            failures,
        })
    }
}

/// The file tf-engines' build script reads (a plain table, so the build script needs no JSON parser).
pub const EMBED_TABLE: &str = "embed.tsv";

/// One line per set, tab-separated: name, fatbin file, fatbin sha256, targets, ptx (or `-`), hot kernels,
/// tensor-core `kernel=FAMILY` pairs; lists are space-separated (kernel symbols contain no spaces).
pub fn embed_table(manifest: &Manifest) -> String {
    let mut text = String::from(
        "# name\tfatbin\tsha256\ttargets\tptx\thot\ttensor_core (written by cargo xtask kernels)\n",
    );
    for set in &manifest.sets {
        let tensor_core: Vec<String> = set
            .tensor_core
            .iter()
            .map(|(kernel, family)| format!("{kernel}={family}"))
            .collect();
        let fields = [
            set.name.clone(),
            set.fatbin.clone(),
            set.fatbin_sha256.clone(),
            set.targets.join(" "),
            set.ptx.clone().unwrap_or_else(|| "-".to_string()),
            set.hot.join(" "),
            tensor_core.join(" "),
        ];
        text.push_str(&fields.join("\t"));
        text.push('\n');
    }
    text
}

fn up_to_date(
    root: &Path,
    out_dir: &Path,
    set: &KernelSet,
    prior: &SetRecord,
    nvcc_version: &str,
) -> bool {
    let args = key_args(set);
    let paths: Vec<String> = prior.inputs.iter().map(|i| i.path.clone()).collect();
    let Ok(inputs) = digest_inputs(root, &paths) else {
        return false;
    };
    let source = format!("kernels/{}", set.source);
    if !paths.contains(&source) || build_key(&args, nvcc_version, &inputs) != prior.key {
        return false;
    }
    match read(&out_dir.join(&prior.fatbin)) {
        Ok(bytes) => sha256_hex(&bytes) == prior.fatbin_sha256,
        Err(_) => false,
    }
}

fn build_set(
    root: &Path,
    out_dir: &Path,
    set: &KernelSet,
    nvcc: &Tool,
    nvcc_version: &str,
    threads: usize,
) -> Result<SetRecord, Error> {
    let kernels_dir = root.join("kernels");
    let fatbin_name = format!("{}.fatbin", set.name);
    // Per-process names: two builds sharing the output folder must not consume each other's files.
    let staging = out_dir.join(format!("{}.{}.building", set.name, std::process::id()));
    let depfile = out_dir.join(format!("{}.{}.d", set.name, std::process::id()));
    let args = key_args(set);
    let mut command: Command = nvcc.command();
    command
        .args(&args)
        .arg(format!("--threads={threads}"))
        .arg("-I")
        .arg(&kernels_dir)
        .arg("-MD")
        .arg("-MF")
        .arg(&depfile)
        .arg("-o")
        .arg(&staging)
        .arg(kernels_dir.join(&set.source));
    run_captured(&mut command)?;
    let dep_text = read_text(&depfile)?;
    let _ = std::fs::remove_file(&depfile);
    let mut paths = parse_depfile(&dep_text, root, &kernels_dir);
    let source = format!("kernels/{}", set.source);
    if !paths.contains(&source) {
        paths.push(source.clone());
        paths.sort();
    }
    let inputs = digest_inputs(root, &paths)?;
    let bytes = read(&staging)?;
    let final_path = out_dir.join(&fatbin_name);
    std::fs::rename(&staging, &final_path)
        .map_err(|e| Error::io("renaming into place", &final_path, e))?;
    Ok(SetRecord {
        name: set.name.clone(),
        fatbin: fatbin_name,
        fatbin_sha256: sha256_hex(&bytes),
        fatbin_bytes: bytes.len() as u64,
        source,
        key: build_key(&args, nvcc_version, &inputs),
        args,
        targets: set.targets.clone(),
        ptx: set.ptx.clone(),
        hot: set.hot.clone(),
        tensor_core: set.tensor_core.clone(),
        inputs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_kernels() -> (PathBuf, PathBuf) {
        let root = std::env::temp_dir().join(format!(
            "xtask-kernels-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let kernels = root.join("kernels");
        std::fs::create_dir_all(kernels.join("a")).unwrap();
        std::fs::write(kernels.join("a/a.cu"), "// a\n").unwrap();
        (root, kernels)
    }

    const DEFAULTS: &str =
        "[defaults]\nflags = [\"-O3\"]\ntargets = [\"sm_80\", \"sm_90a\"]\nptx = \"compute_80\"\n";

    #[test]
    fn defaults_apply_and_flags_append() {
        let (root, kernels) = temp_kernels();
        let text = format!(
            "{DEFAULTS}[[set]]\nname = \"a\"\nsource = \"a/a.cu\"\nflags = [\"-lineinfo\"]\n"
        );
        let sets = parse_config(&text, Path::new("k.toml"), &kernels).unwrap();
        assert_eq!(sets.len(), 1);
        assert_eq!(sets[0].flags, vec!["-O3", "-lineinfo"]);
        assert_eq!(sets[0].targets, vec!["sm_80", "sm_90a"]);
        assert_eq!(sets[0].ptx.as_deref(), Some("compute_80"));
        let args = key_args(&sets[0]);
        assert!(args.contains(&"-gencode=arch=compute_90a,code=sm_90a".to_string()));
        assert!(args.contains(&"-gencode=arch=compute_80,code=compute_80".to_string()));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn invalid_sets_are_rejected_with_every_reason() {
        let (root, kernels) = temp_kernels();
        let text = format!(
            "{DEFAULTS}[[set]]\nname = \"A\"\nsource = \"missing.cu\"\ntargets = [\"sm_80\"]\nptx = \"compute_90a\"\n\
             [set.tensor_core]\nk = \"WGMMA\"\n"
        );
        let err = parse_config(&text, Path::new("k.toml"), &kernels)
            .unwrap_err()
            .to_string();
        for needle in [
            "set name",
            "does not exist",
            "sm_90a",
            "compute_XX",
            "WGMMA",
        ] {
            assert!(err.contains(needle), "{needle} missing from: {err}");
        }
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn depfile_keeps_only_kernel_files() {
        let root = Path::new("/r");
        let kernels = Path::new("/r/kernels");
        let text = "/tmp/x.fatbin : /r/kernels/a/a.cu \\\n    /usr/include/stdio.h \\\n    /r/kernels/a/../common/h.cuh \\\n    /r/.tools/cuda/bin/..//include/cuda.h\n";
        assert_eq!(
            parse_depfile(text, root, kernels),
            vec![
                "kernels/a/a.cu".to_string(),
                "kernels/common/h.cuh".to_string()
            ]
        );
    }

    #[test]
    fn key_changes_with_each_input() {
        let inputs = vec![InputDigest {
            path: "kernels/a.cu".into(),
            sha256: "00".into(),
        }];
        let args = vec!["-O3".to_string()];
        let base = build_key(&args, "v1", &inputs);
        assert_ne!(base, build_key(&["-O2".to_string()], "v1", &inputs));
        assert_ne!(base, build_key(&args, "v2", &inputs));
        let mut changed = inputs.clone();
        changed[0].sha256 = "01".into();
        assert_ne!(base, build_key(&args, "v1", &changed));
        assert_eq!(base, build_key(&args, "v1", &inputs));
    }
}
