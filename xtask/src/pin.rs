//! `cargo xtask verify-pin`: checks the TensorFold runtime pin and the separate pins the spec names.
//!
//! Files: `pins/tensorfold.json` ([`Pin`]), `pins/chat-qwen38-27b.json` ([`ChatPin`], follows the main
//! pin), `pins/drama3.json` ([`Drama3Pin`], explicitly does not). Every check runs and every failure is
//! reported, each naming the field, what it holds and what it should hold.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tf_sys::api::{Allocation, Requirement, ENTRIES};

use crate::util::{read_text, sha256_file, write_atomic};
use crate::zighash;
use crate::Error;

/// Path of the main pin, relative to the repository root.
pub const PIN_FILE: &str = "pins/tensorfold.json";
/// Documents that must state the pin (release tag and commit).
pub const PIN_DOCS: &[&str] = &["README.md", "docs/RUNTIME-PIN.md"];
/// The consumed-file change labels.
pub const CHANGE_LABELS: &[&str] = &["byte-identical", "changed", "new"];

/// `pins/tensorfold.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pin {
    pub schema: u32,
    pub project: String,
    pub release: String,
    pub tag: String,
    /// The annotated tag object (abbreviated as the spec gives it).
    pub tag_object: String,
    /// The commit the tag peels to (40 hex).
    pub commit: String,
    pub zig_package_hash: String,
    pub zig_package_hash_source: String,
    /// Earlier pins, newest first.
    pub previous: Vec<PreviousPin>,
    pub consumed: Consumed,
    pub abi: AbiContract,
    pub separate_pins: Vec<String>,
    pub local_kernels: Vec<LocalKernels>,
}

/// An earlier pin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreviousPin {
    pub release: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// Where only an abbreviated commit is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zig_package_hash: Option<String>,
}

/// What is built from the dependency.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Consumed {
    pub modules: Vec<Module>,
    pub not_built: Vec<String>,
    pub files: Vec<ConsumedFile>,
}

/// A Zig module created from the dependency.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Module {
    pub name: String,
    pub root: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub imports: Vec<ModuleImport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wiring: Option<String>,
}

/// A named import of a module.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleImport {
    pub name: String,
    pub root: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

/// A consumed file (or folder, ending in `/`) and how it changed from the previous pin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumedFile {
    pub path: String,
    pub role: String,
    /// One of [`CHANGE_LABELS`], as the spec states it.
    pub change_from_previous: String,
    /// sha256 of the file at the previous pin, where known (for a folder: of its listing, see
    /// [`folder_digest`]).
    pub previous_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The driver entry table the engines rely on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbiContract {
    pub required: Vec<String>,
    pub optional: Vec<String>,
    pub allocating: Vec<String>,
}

/// Local kernel copies with their own provenance (they do not follow the pin).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalKernels {
    pub name: String,
    /// `kernels/<prefix>*`: every file whose path starts with `kernels/<prefix>`.
    pub pattern: String,
    pub follows_pin: bool,
    pub origin: String,
    /// Path (from the repository root) to sha256.
    pub files: BTreeMap<String, String>,
}

/// `pins/chat-qwen38-27b.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatPin {
    pub schema: u32,
    pub name: String,
    pub component: String,
    pub follows_main_pin: bool,
    pub source: String,
    pub release: String,
    pub tag: String,
    pub commit: String,
    pub upstream_record: String,
}

/// `pins/drama3.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drama3Pin {
    pub schema: u32,
    pub name: String,
    pub component: String,
    pub follows_main_pin: bool,
    pub reason: String,
    pub repository_owner: String,
    pub branch: String,
    pub commit_prefix: String,
    pub upstream_record: String,
}

fn is_hex(text: &str, min: usize, max: usize) -> bool {
    (min..=max).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn release_parts(release: &str) -> Option<(u64, u64, u64)> {
    let mut parts = release.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let patch = parts.next()?.parse().ok()?;
    parts.next().is_none().then_some((major, minor, patch))
}

fn load_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|e| Error::config(path, e.to_string()))
}

/// The ABI contract as tf-sys's entry table states it.
pub fn abi_from_entries() -> AbiContract {
    let names = |keep: &dyn Fn(&tf_sys::api::EntrySpec) -> bool| {
        ENTRIES
            .iter()
            .filter(|e| keep(e))
            .map(|e| e.name.to_string())
            .collect::<Vec<_>>()
    };
    AbiContract {
        required: names(&|e| e.requirement == Requirement::Required),
        optional: names(&|e| e.requirement == Requirement::Optional),
        allocating: names(&|e| e.allocation == Allocation::Allocates),
    }
}

fn compare_lists(what: &str, pinned: &[String], table: &[String], failures: &mut Vec<String>) {
    let pinned_set: BTreeSet<&String> = pinned.iter().collect();
    let table_set: BTreeSet<&String> = table.iter().collect();
    if pinned_set.len() != pinned.len() {
        failures.push(format!("abi.{what} in {PIN_FILE} lists an entry twice"));
    }
    let missing: Vec<&str> = table_set
        .difference(&pinned_set)
        .map(|s| s.as_str())
        .collect();
    let extra: Vec<&str> = pinned_set
        .difference(&table_set)
        .map(|s| s.as_str())
        .collect();
    if !missing.is_empty() {
        failures.push(format!(
            "abi.{what}: tf-sys's entry table (crates/tf-sys/src/api.rs) has {} that {PIN_FILE} lacks; \
             a table change must be recorded in the pin's ABI contract (and be allowed by the spec)",
            missing.join(", ")
        ));
    }
    if !extra.is_empty() {
        failures.push(format!(
            "abi.{what}: {PIN_FILE} lists {} that tf-sys's entry table does not have as {what}",
            extra.join(", ")
        ));
    }
}

/// Files of the repository matching a local-kernels pattern (`kernels/<prefix>*`), sorted, relative.
pub fn local_kernel_files(root: &Path, pattern: &str) -> Result<Vec<String>, Error> {
    let Some(prefix) = pattern.strip_suffix('*') else {
        return Err(Error::config(
            root.join(PIN_FILE),
            format!("local_kernels pattern {pattern:?} must end with *"),
        ));
    };
    let (dir, name_prefix) = match prefix.rsplit_once('/') {
        Some((dir, name)) => (root.join(dir), name.to_string()),
        None => (root.to_path_buf(), prefix.to_string()),
    };
    let mut found: Vec<PathBuf> = Vec::new();
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("listing", &dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", &dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&name_prefix) {
            collect_files(&entry.path(), &mut found)?;
        }
    }
    let mut relative: Vec<String> = found
        .iter()
        .filter_map(|p| p.strip_prefix(root).ok())
        .map(|p| p.to_string_lossy().replace('\\', "/"))
        .collect();
    relative.sort();
    Ok(relative)
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>) -> Result<(), Error> {
    if path.is_dir() {
        let entries = std::fs::read_dir(path).map_err(|e| Error::io("listing", path, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("listing", path, e))?;
            collect_files(&entry.path(), out)?;
        }
    } else if path.is_file() {
        out.push(path.to_path_buf());
    }
    Ok(())
}

/// What `verify` found that is worth printing even when everything passes.
#[derive(Debug, Default)]
pub struct Report {
    pub lines: Vec<String>,
}

/// Runs every check of `cargo xtask verify-pin` on the repository at `root`.
pub fn verify(root: &Path) -> Result<Report, Error> {
    let mut failures = Vec::new();
    let mut report = Report::default();
    let pin: Pin = load_json(&root.join(PIN_FILE))?;
    check_main_fields(&pin, &mut failures);
    check_consumed(&pin, &mut failures);

    let table = abi_from_entries();
    compare_lists(
        "required",
        &pin.abi.required,
        &table.required,
        &mut failures,
    );
    compare_lists(
        "optional",
        &pin.abi.optional,
        &table.optional,
        &mut failures,
    );
    compare_lists(
        "allocating",
        &pin.abi.allocating,
        &table.allocating,
        &mut failures,
    );
    report.lines.push(format!(
        "abi: {} required, {} optional, {} allocating entries checked against tf-sys",
        table.required.len(),
        table.optional.len(),
        table.allocating.len()
    ));

    for group in &pin.local_kernels {
        check_local_kernels(root, group, &mut failures, &mut report)?;
    }

    for doc in PIN_DOCS {
        let path = root.join(doc);
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                for (what, needle) in [("release tag", &pin.tag), ("commit", &pin.commit)] {
                    if !text.contains(needle.as_str()) {
                        failures.push(format!(
                            "{doc} does not state the pin's {what} {needle}: state the same pin as {PIN_FILE}"
                        ));
                    }
                }
            }
            Err(e) => failures.push(format!(
                "{doc}: cannot read it ({e}); it must state the pin"
            )),
        }
    }

    let expected_separate = ["pins/chat-qwen38-27b.json", "pins/drama3.json"];
    for expected in expected_separate {
        if !pin.separate_pins.iter().any(|p| p == expected) {
            failures.push(format!("separate_pins must list {expected}"));
        }
    }
    match load_json::<ChatPin>(&root.join("pins/chat-qwen38-27b.json")) {
        Ok(chat) => check_chat(&chat, &pin, &mut failures),
        Err(e) => failures.push(e.to_string()),
    }
    match load_json::<Drama3Pin>(&root.join("pins/drama3.json")) {
        Ok(drama) => check_drama(&drama, &pin, &mut failures),
        Err(e) => failures.push(e.to_string()),
    }

    if failures.is_empty() {
        report.lines.insert(
            0,
            format!(
                "pin: {} {} (tag object {}), commit {}, {}",
                pin.project, pin.tag, pin.tag_object, pin.commit, pin.zig_package_hash
            ),
        );
        Ok(report)
    } else {
        Err(Error::CheckFailed {
            check: "verify-pin",
            failures,
        })
    }
}

fn check_main_fields(pin: &Pin, failures: &mut Vec<String>) {
    if pin.schema != 1 {
        failures.push(format!(
            "schema is {}, this xtask reads schema 1",
            pin.schema
        ));
    }
    let current = release_parts(&pin.release);
    if current.is_none() {
        failures.push(format!(
            "release {:?} is not MAJOR.MINOR.PATCH",
            pin.release
        ));
    }
    if pin.tag != format!("v{}", pin.release) {
        failures.push(format!(
            "tag {:?} does not match release {:?} (expected v{})",
            pin.tag, pin.release, pin.release
        ));
    }
    if !is_hex(&pin.tag_object, 7, 40) {
        failures.push(format!(
            "tag_object {:?} is not 7 to 40 lower-case hex digits",
            pin.tag_object
        ));
    }
    if !is_hex(&pin.commit, 40, 40) {
        failures.push(format!(
            "commit {:?} is not 40 lower-case hex digits",
            pin.commit
        ));
    }
    if pin.tag_object.len() <= pin.commit.len() && pin.commit.starts_with(&pin.tag_object) {
        failures.push("tag_object equals the commit: an annotated tag object differs from the commit it peels to".to_string());
    }
    let package_name = pin.project.to_lowercase();
    let main_id = match zighash::parse_hash(&pin.zig_package_hash) {
        Ok(parsed) => {
            if parsed.name != package_name {
                failures.push(format!(
                    "zig_package_hash names package {:?}, expected {package_name:?}",
                    parsed.name
                ));
            }
            if parsed.version != pin.release {
                failures.push(format!(
                    "zig_package_hash is for version {:?}, but release is {:?}",
                    parsed.version, pin.release
                ));
            }
            Some(parsed.id)
        }
        Err(e) => {
            failures.push(format!("zig_package_hash: {e}"));
            None
        }
    };
    let mut newer = current;
    for previous in &pin.previous {
        let label = format!("previous {}", previous.release);
        let parts = release_parts(&previous.release);
        match (parts, newer) {
            (None, _) => failures.push(format!("{label}: release is not MAJOR.MINOR.PATCH")),
            (Some(p), Some(n)) if p >= n => failures.push(format!(
                "{label}: not older than {}.{}.{} (list previous pins newest first)",
                n.0, n.1, n.2
            )),
            _ => {}
        }
        newer = parts.or(newer);
        match (&previous.commit, &previous.commit_prefix) {
            (Some(commit), None) => {
                if !is_hex(commit, 40, 40) {
                    failures.push(format!(
                        "{label}: commit {commit:?} is not 40 lower-case hex digits"
                    ));
                }
            }
            (None, Some(prefix)) => {
                if !is_hex(prefix, 7, 39) {
                    failures.push(format!(
                        "{label}: commit_prefix {prefix:?} is not 7 to 39 hex digits"
                    ));
                }
            }
            _ => failures.push(format!(
                "{label}: give exactly one of commit and commit_prefix"
            )),
        }
        let previous_commit = previous.commit.as_ref().or(previous.commit_prefix.as_ref());
        if let Some(c) = previous_commit {
            if pin.commit.starts_with(c.as_str()) {
                failures.push(format!("{label}: same commit as the current pin"));
            }
        }
        if let Some(hash) = &previous.zig_package_hash {
            match zighash::parse_hash(hash) {
                Ok(parsed) => {
                    if parsed.version != previous.release {
                        failures.push(format!(
                            "{label}: zig_package_hash is for version {:?}",
                            parsed.version
                        ));
                    }
                    if parsed.name != package_name {
                        failures.push(format!(
                            "{label}: zig_package_hash names package {:?}",
                            parsed.name
                        ));
                    }
                    if main_id.is_some_and(|id| id != parsed.id) {
                        failures.push(format!(
                            "{label}: zig_package_hash has another package fingerprint id than the current pin's"
                        ));
                    }
                }
                Err(e) => failures.push(format!("{label}: zig_package_hash: {e}")),
            }
        }
    }
}

fn check_consumed(pin: &Pin, failures: &mut Vec<String>) {
    let files: BTreeSet<&str> = pin.consumed.files.iter().map(|f| f.path.as_str()).collect();
    if pin.consumed.modules.is_empty() {
        failures.push("consumed.modules is empty".to_string());
    }
    let covered = |path: &str| {
        files.contains(path)
            || files
                .iter()
                .any(|f| f.ends_with('/') && path.starts_with(f))
    };
    for module in &pin.consumed.modules {
        let mut roots = vec![module.root.as_str()];
        roots.extend(module.imports.iter().map(|i| i.root.as_str()));
        roots.extend(module.wiring.as_deref());
        for root in roots {
            if !covered(root) {
                failures.push(format!(
                    "consumed module {}: {root} is not in consumed.files",
                    module.name
                ));
            }
        }
    }
    for file in &pin.consumed.files {
        if file.path.starts_with('/') || file.path.contains("..") || file.path.contains('\\') {
            failures.push(format!(
                "consumed file {:?}: must be a relative path with /",
                file.path
            ));
        }
        if !CHANGE_LABELS.contains(&file.change_from_previous.as_str()) {
            failures.push(format!(
                "consumed file {}: change_from_previous {:?} is not one of {}",
                file.path,
                file.change_from_previous,
                CHANGE_LABELS.join(", ")
            ));
        }
        if let Some(digest) = &file.previous_sha256 {
            if !is_hex(digest, 64, 64) {
                failures.push(format!(
                    "consumed file {}: previous_sha256 is not 64 hex digits",
                    file.path
                ));
            }
            if file.change_from_previous == "new" {
                failures.push(format!(
                    "consumed file {}: marked new, so it has no previous digest",
                    file.path
                ));
            }
        }
    }
    if files.len() != pin.consumed.files.len() {
        failures.push("consumed.files lists a path twice".to_string());
    }
}

fn check_local_kernels(
    root: &Path,
    group: &LocalKernels,
    failures: &mut Vec<String>,
    report: &mut Report,
) -> Result<(), Error> {
    let label = format!("local_kernels {}", group.name);
    if group.follows_pin {
        failures.push(format!(
            "{label}: follows_pin must be false (local kernel copies keep their own provenance)"
        ));
    }
    if !group.pattern.starts_with("kernels/") {
        failures.push(format!(
            "{label}: pattern {:?} must be under kernels/",
            group.pattern
        ));
        return Ok(());
    }
    let present = local_kernel_files(root, &group.pattern)?;
    for path in &present {
        match group.files.get(path) {
            None => failures.push(format!(
                "{label}: {path} exists but has no recorded digest; record it with `cargo xtask verify-pin --record-kernels` once its provenance is checked"
            )),
            Some(recorded) => {
                let actual = sha256_file(&root.join(path))?;
                if &actual != recorded {
                    failures.push(format!(
                        "{label}: {path} has sha256 {actual}, the record says {recorded}: restore the recorded copy, or re-record after checking its origin"
                    ));
                }
            }
        }
    }
    for (path, digest) in &group.files {
        if !is_hex(digest, 64, 64) {
            failures.push(format!("{label}: digest of {path} is not 64 hex digits"));
        }
        if !present.contains(path) {
            failures.push(format!(
                "{label}: recorded file {path} is missing (or outside {})",
                group.pattern
            ));
        }
    }
    report
        .lines
        .push(if present.is_empty() && group.files.is_empty() {
            format!(
                "{label}: no local copies ({} matches nothing) and none recorded",
                group.pattern
            )
        } else {
            format!(
                "{label}: {} file(s) checked against their record",
                present.len()
            )
        });
    Ok(())
}

fn check_chat(chat: &ChatPin, pin: &Pin, failures: &mut Vec<String>) {
    let file = "pins/chat-qwen38-27b.json";
    if chat.schema != 1 {
        failures.push(format!("{file}: schema {} (expected 1)", chat.schema));
    }
    if release_parts(&chat.release).is_none() {
        failures.push(format!(
            "{file}: release {:?} is not MAJOR.MINOR.PATCH",
            chat.release
        ));
    }
    if chat.tag != format!("v{}", chat.release) {
        failures.push(format!(
            "{file}: tag {:?} does not match release {:?}",
            chat.tag, chat.release
        ));
    }
    if !is_hex(&chat.commit, 40, 40) {
        failures.push(format!(
            "{file}: commit {:?} is not 40 lower-case hex digits",
            chat.commit
        ));
    }
    if chat.upstream_record.is_empty() || chat.source.is_empty() {
        failures.push(format!(
            "{file}: source and upstream_record must say where the pin comes from"
        ));
    }
    if chat.follows_main_pin && (chat.release != pin.release || chat.commit != pin.commit) {
        failures.push(format!(
            "{file}: says it follows the main pin but records {} {} (main pin: {} {})",
            chat.release, chat.commit, pin.release, pin.commit
        ));
    }
}

fn check_drama(drama: &Drama3Pin, pin: &Pin, failures: &mut Vec<String>) {
    let file = "pins/drama3.json";
    if drama.schema != 1 {
        failures.push(format!("{file}: schema {} (expected 1)", drama.schema));
    }
    if drama.follows_main_pin {
        failures.push(format!(
            "{file}: follows_main_pin must be false: Drama 3's NVFP4 engine is its own pin"
        ));
    }
    if !is_hex(&drama.commit_prefix, 7, 40) {
        failures.push(format!(
            "{file}: commit_prefix {:?} is not 7 to 40 hex digits",
            drama.commit_prefix
        ));
    }
    if pin.commit.starts_with(&drama.commit_prefix) {
        failures.push(format!(
            "{file}: commit {} is the main pin's; Drama 3 does not follow the main pin",
            drama.commit_prefix
        ));
    }
    if drama.branch.is_empty() || drama.repository_owner.is_empty() || drama.reason.is_empty() {
        failures.push(format!(
            "{file}: branch, repository_owner and reason must be set"
        ));
    }
}

/// Rewrites the local kernel digests of `pins/tensorfold.json` from the files present.
pub fn record_kernels(root: &Path) -> Result<Vec<String>, Error> {
    let path = root.join(PIN_FILE);
    let mut pin: Pin = load_json(&path)?;
    let mut lines = Vec::new();
    for group in &mut pin.local_kernels {
        let mut files = BTreeMap::new();
        for file in local_kernel_files(root, &group.pattern)? {
            let digest = sha256_file(&root.join(&file))?;
            lines.push(format!("{}: {file} {digest}", group.name));
            files.insert(file, digest);
        }
        group.files = files;
    }
    let mut text =
        serde_json::to_string_pretty(&pin).map_err(|e| Error::config(&path, e.to_string()))?;
    text.push('\n');
    write_atomic(&path, text.as_bytes())?;
    Ok(lines)
}

/// Digest of a folder's files for the consumed-file comparison: sha256 over sorted `path sha256` lines.
pub fn folder_digest(dir: &Path) -> Result<String, Error> {
    let mut files = Vec::new();
    collect_files(dir, &mut files)?;
    let mut lines = Vec::new();
    for file in &files {
        let relative = file
            .strip_prefix(dir)
            .unwrap_or(file)
            .to_string_lossy()
            .replace('\\', "/");
        lines.push(format!("{relative} {}\n", sha256_file(file)?));
    }
    lines.sort();
    Ok(crate::util::sha256_hex(lines.concat().as_bytes()))
}

/// `verify-pin --upstream DIR`: the Zig package hash of DIR against the pin, and each consumed file
/// against the previous pin's digest.
pub fn verify_upstream(root: &Path, upstream: &Path) -> Result<Report, Error> {
    let pin: Pin = load_json(&root.join(PIN_FILE))?;
    let mut failures = Vec::new();
    let mut report = Report::default();
    let hash = zighash::package_hash(upstream)?;
    if hash.text == pin.zig_package_hash {
        report.lines.push(format!(
            "zig package hash of {}: {} (matches the pin)",
            upstream.display(),
            hash.text
        ));
    } else {
        failures.push(format!(
            "zig package hash of {} is {}, the pin says {}: this is not the pinned source",
            upstream.display(),
            hash.text,
            pin.zig_package_hash
        ));
    }
    report.lines.push(format!(
        "{:<40} {:<16} {:<16} sha256",
        "consumed file", "expected", "measured"
    ));
    for file in &pin.consumed.files {
        let path = upstream.join(&file.path);
        let digest = if file.path.ends_with('/') {
            path.is_dir().then(|| folder_digest(&path)).transpose()?
        } else {
            path.is_file().then(|| sha256_file(&path)).transpose()?
        };
        let measured = match (&digest, &file.previous_sha256) {
            (None, _) => "missing",
            (Some(_), None) if file.change_from_previous == "new" => "new",
            (Some(_), None) => "unknown",
            (Some(d), Some(p)) if d == p => "byte-identical",
            (Some(_), Some(_)) => "changed",
        };
        if digest.is_none() {
            failures.push(format!(
                "{} is missing from {}",
                file.path,
                upstream.display()
            ));
        } else if measured != "unknown" && measured != file.change_from_previous {
            failures.push(format!(
                "{}: the pin says {}, measured {}",
                file.path, file.change_from_previous, measured
            ));
        }
        report.lines.push(format!(
            "{:<40} {:<16} {:<16} {}",
            file.path,
            file.change_from_previous,
            measured,
            digest.as_deref().unwrap_or("-")
        ));
    }
    if failures.is_empty() {
        Ok(report)
    } else {
        for line in &report.lines {
            eprintln!("{line}");
        }
        Err(Error::CheckFailed {
            check: "verify-pin --upstream",
            failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_release_parsing() {
        assert!(is_hex("eab8582819688325e371907e4706e1c602b8a273", 40, 40));
        assert!(!is_hex("EAB8582819688325e371907e4706e1c602b8a273", 40, 40));
        assert!(!is_hex("585df8b", 8, 40));
        assert_eq!(release_parts("1.1.4"), Some((1, 1, 4)));
        assert_eq!(release_parts("1.1"), None);
        assert_eq!(release_parts("1.1.4.0"), None);
    }

    #[test]
    fn abi_contract_from_the_table_has_the_three_allocating_entries() {
        let abi = abi_from_entries();
        assert_eq!(
            abi.allocating,
            vec!["cuMemAlloc_v2", "cuMemHostAlloc", "cuMemHostRegister_v2"]
        );
        assert!(abi.optional.contains(&"cuFuncGetName".to_string()));
    }
}
