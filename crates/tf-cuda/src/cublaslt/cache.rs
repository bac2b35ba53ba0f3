//! The persistent GEMM plan cache: which cuBLASLt algorithm each GEMM shape runs, per software
//! and hardware stack, kept in a small JSON file so that a fresh process reuses the choices of
//! the last one (no timing, same algorithm, same bytes).
//!
//! Where: `$TF_PLAN_CACHE` when set (`off` disables the cache), else
//! `$XDG_CACHE_HOME/tensorfold/gemm-plans.json`, else `$HOME/.cache/tensorfold/gemm-plans.json`
//! ([`plan_cache_path`]). [`reset_plan_cache`] deletes the file.
//!
//! What a choice is keyed by ([`StackKey`] + [`PlanKey`]): the GPU model (name, compute
//! capability, SM count), the driver (its CUDA version and kernel-module release), the cuBLASLt
//! version, the handle's workspace
//! size (it bounds the heuristic's candidates), and the GEMM's full key (M, N, K, types,
//! epilogue, operand alignments, FP8 fast accumulation). The GPU is keyed by model, not by UUID:
//! identical GPUs of one machine or of a fleet then share one choice, so every worker computes
//! the same bytes.
//!
//! Robustness: a missing file is an empty cache; an unreadable, corrupt or foreign file is
//! ignored and reported as a [`PlanCacheError`] value (warning level: the caller prints it, the
//! GEMM path goes on); a file of a newer format is never overwritten. Saving merges what the
//! file holds now (another handle or process may have written it) with this cache, then writes
//! a temporary file beside it and renames it over the old one, so a reader sees the old file or
//! the new one, never half of one.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::ffi::MatmulAlgo;
use super::plan::{AlgoSelection, Fp8ScaleMode, PlanKey};

/// Environment variable naming the cache file, or `off` to disable the cache.
pub const ENV_PLAN_CACHE: &str = "TF_PLAN_CACHE";
/// The file's `format` field.
pub const FILE_FORMAT: &str = "tensorfold-gemm-plans";
/// The file's `version` field this build reads and writes.
pub const FILE_VERSION: u32 = 1;
/// Files larger than this are refused as corrupt (a real one holds a few hundred entries).
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// Entries larger files are refused at (stacks × shapes).
pub const MAX_ENTRIES: usize = 100_000;

/// A warning-level problem of the plan cache. None of these stops a GEMM: the cache is ignored
/// (or a stored choice replaced), and the value says what happened and what to do.
#[derive(Debug, thiserror::Error)]
pub enum PlanCacheError {
    #[error(
        "no folder for the GEMM plan cache: none of {ENV_PLAN_CACHE}, XDG_CACHE_HOME or HOME is set; \
         plan choices last for this process only (set {ENV_PLAN_CACHE} to a file path, or to `off`)"
    )]
    NoLocation,
    #[error(
        "could not read the GEMM plan cache {path}: {source}; continuing without it \
         (check the file's permissions, or set {ENV_PLAN_CACHE} to another path or `off`)"
    )]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the GEMM plan cache {path} is corrupt ({what}); ignored, and replaced on the next save \
         (delete it or reset the plan cache to start afresh)"
    )]
    Corrupt { path: PathBuf, what: String },
    #[error(
        "{path} is not a GEMM plan cache this build reads (format {format:?}, version {version}; \
         expected {FILE_FORMAT:?} version {FILE_VERSION}); ignored and left untouched \
         (set {ENV_PLAN_CACHE} to another file to keep choices)"
    )]
    Foreign {
        path: PathBuf,
        format: String,
        version: u64,
    },
    #[error(
        "the stored GEMM algorithm for {key} is no longer offered by cuBLASLt's heuristic \
         (among its first {requested} results); the heuristic's first runs instead and is stored"
    )]
    StoredAlgoRejected { key: String, requested: usize },
    #[error(
        "could not write the GEMM plan cache {path}: {source}; this process's choices are not kept \
         (check the folder's permissions, or set {ENV_PLAN_CACHE} to another path or `off`)"
    )]
    SaveFailed {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not delete the GEMM plan cache {path}: {source} (delete the file by hand)")]
    ResetFailed {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The cache file for the given environment lookup (pure: no file access); `None` when the
/// cache is disabled (`TF_PLAN_CACHE=off`) or no folder is known.
pub fn plan_cache_path_from(env: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |key: &str| env(key).filter(|v| !v.is_empty());
    if let Some(explicit) = set(ENV_PLAN_CACHE) {
        if explicit.eq_ignore_ascii_case("off") {
            return None;
        }
        return Some(PathBuf::from(explicit));
    }
    let tail = |base: PathBuf| base.join("tensorfold").join("gemm-plans.json");
    // The XDG spec ignores relative values.
    if let Some(xdg) = set("XDG_CACHE_HOME").map(PathBuf::from) {
        if xdg.is_absolute() {
            return Some(tail(xdg));
        }
    }
    set("HOME").map(|home| tail(PathBuf::from(home).join(".cache")))
}

/// The cache file of this process's environment (see [`plan_cache_path_from`]).
pub fn plan_cache_path() -> Option<PathBuf> {
    plan_cache_path_from(|key| std::env::var_os(key))
}

/// The kernel driver's release from the text of `/proc/driver/nvidia/version` (the token
/// after "Kernel Module"), or an empty string.
pub fn driver_release_from(text: &str) -> String {
    let mut words = text.split_whitespace();
    while let Some(word) = words.next() {
        if word == "Module" {
            return words
                .next()
                .filter(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
                .unwrap_or_default()
                .to_string();
        }
    }
    String::new()
}

/// The kernel driver's release on this machine, or an empty string.
pub fn driver_release() -> String {
    std::fs::read_to_string("/proc/driver/nvidia/version")
        .map(|text| driver_release_from(&text))
        .unwrap_or_default()
}

/// True when `TF_PLAN_CACHE=off` (as opposed to no folder being known).
fn disabled_by_env(env: impl Fn(&str) -> Option<OsString>) -> bool {
    env(ENV_PLAN_CACHE).is_some_and(|v| v.eq_ignore_ascii_case("off"))
}

/// Deletes the cache file of this process's environment. Returns the path deleted, or `None`
/// when there was no file (or the cache is disabled). Handles open in this process keep the
/// choices they hold in memory; only later processes start afresh.
pub fn reset_plan_cache() -> Result<Option<PathBuf>, PlanCacheError> {
    match plan_cache_path() {
        Some(path) => remove_file(&path).map(|removed| removed.then_some(path)),
        None => Ok(None),
    }
}

fn remove_file(path: &Path) -> Result<bool, PlanCacheError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(PlanCacheError::ResetFailed {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// What a stored choice depends on besides the GEMM itself.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StackKey {
    /// `cuDeviceGetName`, e.g. "NVIDIA H200".
    pub gpu_name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    /// `cuDriverGetVersion` (13000 for CUDA 13.0).
    pub driver_version: i32,
    /// The kernel driver's release (e.g. "580.159.04", from `/proc/driver/nvidia/version`);
    /// empty where it cannot be read.
    #[serde(default)]
    pub driver_release: String,
    /// `cublasLtGetVersion` (major·10000 + minor·100 + patch).
    pub cublaslt_version: usize,
    /// The handle's workspace: it bounds which algorithms the heuristic offers.
    pub workspace_bytes: usize,
    /// The operands prepared shapes are timed on (files written before it existed read as constant).
    #[serde(default)]
    pub timing_data: super::TimingData,
}

/// How a stored choice was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoredSource {
    /// The fastest of timed candidates.
    Timed,
    /// The heuristic's first result (no timing: budget spent, unprepared shape, or only one
    /// candidate).
    Heuristic,
}

/// A stored choice stands in for a shape that differs from it only in `m`, by at most `m / NEIGHBOUR_M_FRACTION`
/// ([`PlanCache::neighbour`]): a prompt length a few rows longer runs the algorithm timed for its neighbour instead
/// of being timed itself (or taking the heuristic's first) inside a request.
pub const NEIGHBOUR_M_FRACTION: usize = 8;

/// One stored choice: the algorithm (its raw 64 bytes), where it stood in the heuristic's list,
/// and how many results were asked for (a later check asks for as many).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredPlan {
    pub key: PlanKey,
    /// `cublasLtMatmulAlgo_t` as 128 lowercase hex digits (its eight u64 words, little end
    /// first).
    pub algo: String,
    pub source: StoredSource,
    /// Index in the heuristic's usable results when chosen (0 = its first).
    pub index: usize,
    /// Heuristic results requested when chosen (1..=32).
    pub requested: usize,
}

impl StoredPlan {
    /// A stored plan for `algo`.
    pub fn new(
        key: PlanKey,
        algo: &MatmulAlgo,
        source: StoredSource,
        index: usize,
        requested: usize,
    ) -> StoredPlan {
        StoredPlan {
            key,
            algo: algo_hex(algo),
            source,
            index,
            requested,
        }
    }

    /// The stored algorithm, or `None` when its text is not 128 hex digits.
    pub fn algo(&self) -> Option<MatmulAlgo> {
        algo_from_hex(&self.algo)
    }

    /// What is wrong with this entry, if anything.
    fn problem(&self) -> Option<String> {
        let k = &self.key;
        let dims_ok = [k.m, k.n, k.k]
            .iter()
            .all(|&d| (1..=i32::MAX as usize).contains(&d));
        let aligns_ok = [k.align_a, k.align_b, k.align_cd]
            .iter()
            .all(|&a| a.is_power_of_two() && a <= 256);
        if !dims_ok {
            return Some(format!(
                "dimensions M={} N={} K={} out of range",
                k.m, k.n, k.k
            ));
        }
        if !aligns_ok {
            return Some(format!(
                "alignments {}/{}/{} are not powers of two up to 256",
                k.align_a, k.align_b, k.align_cd
            ));
        }
        if self.algo().is_none() {
            return Some(format!("algorithm {:?} is not 128 hex digits", self.algo));
        }
        if !(1..=AlgoSelection::MAX_CANDIDATES).contains(&self.requested)
            || self.index >= self.requested
        {
            return Some(format!(
                "index {} of {} requested results is out of range",
                self.index, self.requested
            ));
        }
        None
    }
}

/// `algo` as 128 hex digits.
pub fn algo_hex(algo: &MatmulAlgo) -> String {
    algo.data.iter().map(|w| format!("{w:016x}")).collect()
}

/// The algorithm written by [`algo_hex`], or `None` for anything else.
pub fn algo_from_hex(text: &str) -> Option<MatmulAlgo> {
    if text.len() != 128 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut algo = MatmulAlgo::default();
    for (word, at) in algo.data.iter_mut().zip((0..128).step_by(16)) {
        *word = u64::from_str_radix(text.get(at..at + 16)?, 16).ok()?;
    }
    Some(algo)
}

/// A plan key as warnings print it.
pub fn describe_key(k: &PlanKey) -> String {
    format!(
        "M={} N={} K={} {:?}->{:?} epilogue {} alignment W/X/Y {}/{}/{}{}{}",
        k.m,
        k.n,
        k.k,
        k.input,
        k.output,
        k.epilogue,
        k.align_a,
        k.align_b,
        k.align_cd,
        if k.fast_accum { " fast-accum" } else { "" },
        match k.scale_mode {
            Fp8ScaleMode::Tensor => "",
            Fp8ScaleMode::RowWise => " row-wise scales",
            Fp8ScaleMode::ChannelAlpha => " channel alphas",
        }
    )
}

#[derive(Serialize, Deserialize)]
struct StackEntry {
    stack: StackKey,
    plans: Vec<StoredPlan>,
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    format: String,
    version: u32,
    stacks: Vec<StackEntry>,
}

/// Only the header, read first so a foreign or newer file is named as such.
#[derive(Deserialize)]
struct Header {
    format: Option<String>,
    version: Option<u64>,
}

type Stacks = HashMap<StackKey, HashMap<PlanKey, StoredPlan>>;

/// What reading the file gave.
enum Loaded {
    Missing,
    Plans(Stacks),
    /// Ignored; saving may replace it.
    Bad(PlanCacheError),
    /// Ignored; never overwritten.
    Foreign(PlanCacheError),
}

fn read_file(path: &Path) -> Loaded {
    let unreadable = |source| {
        Loaded::Bad(PlanCacheError::Unreadable {
            path: path.to_path_buf(),
            source,
        })
    };
    let corrupt = |what: String| {
        Loaded::Bad(PlanCacheError::Corrupt {
            path: path.to_path_buf(),
            what,
        })
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Loaded::Missing,
        Err(e) => return unreadable(e),
    };
    if meta.len() > MAX_FILE_BYTES {
        return corrupt(format!(
            "{} bytes, more than the {MAX_FILE_BYTES} a plan cache can hold",
            meta.len()
        ));
    }
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Loaded::Missing,
        Err(e) => return unreadable(e),
    };
    parse(path, &text)
}

fn parse(path: &Path, text: &[u8]) -> Loaded {
    let corrupt = |what: String| {
        Loaded::Bad(PlanCacheError::Corrupt {
            path: path.to_path_buf(),
            what,
        })
    };
    let header: Header = match serde_json::from_slice(text) {
        Ok(header) => header,
        Err(e) => return corrupt(format!("not JSON: {e}")),
    };
    let (format, version) = (
        header.format.unwrap_or_default(),
        header.version.unwrap_or(0),
    );
    if format != FILE_FORMAT || version != u64::from(FILE_VERSION) {
        return Loaded::Foreign(PlanCacheError::Foreign {
            path: path.to_path_buf(),
            format,
            version,
        });
    }
    let file: CacheFile = match serde_json::from_slice(text) {
        Ok(file) => file,
        Err(e) => return corrupt(format!("unexpected content: {e}")),
    };
    let mut stacks: Stacks = HashMap::new();
    let mut entries = 0usize;
    for entry in file.stacks {
        let plans = stacks.entry(entry.stack).or_default();
        for plan in entry.plans {
            entries += 1;
            if entries > MAX_ENTRIES {
                return corrupt(format!("more than {MAX_ENTRIES} entries"));
            }
            if let Some(problem) = plan.problem() {
                return corrupt(format!("entry {}: {problem}", describe_key(&plan.key)));
            }
            plans.insert(plan.key, plan);
        }
    }
    Loaded::Plans(stacks)
}

fn serialize(stacks: &Stacks) -> Result<Vec<u8>, serde_json::Error> {
    // Sorted, so the file is stable from save to save and diffs read well.
    let mut entries: Vec<StackEntry> = stacks
        .iter()
        .map(|(stack, plans)| {
            let mut plans: Vec<StoredPlan> = plans.values().cloned().collect();
            plans.sort_by_key(|p| sort_key(&p.key));
            StackEntry {
                stack: stack.clone(),
                plans,
            }
        })
        .collect();
    entries.sort_by(|a, b| {
        let key = |s: &StackKey| {
            (
                s.gpu_name.clone(),
                s.compute_capability,
                s.sm_count,
                s.driver_version,
                s.driver_release.clone(),
                s.cublaslt_version,
                s.workspace_bytes,
            )
        };
        key(&a.stack).cmp(&key(&b.stack))
    });
    let file = CacheFile {
        format: FILE_FORMAT.to_string(),
        version: FILE_VERSION,
        stacks: entries,
    };
    let mut bytes = serde_json::to_vec_pretty(&file)?;
    bytes.push(b'\n');
    Ok(bytes)
}

type SortKey = (usize, usize, usize, u8, u8, u32, u32, u32, u32, bool, u8);

fn sort_key(k: &PlanKey) -> SortKey {
    (
        k.m,
        k.n,
        k.k,
        k.input as u8,
        k.output as u8,
        k.epilogue,
        k.align_a,
        k.align_b,
        k.align_cd,
        k.fast_accum,
        k.scale_mode as u8,
    )
}

/// Writes `bytes` to a temporary file beside `path`, flushes it to disk, and renames it over
/// `path`; the temporary file is removed on failure.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "gemm-plans.json".into());
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

struct Inner {
    /// `None`: in memory only (disabled, or no folder known).
    path: Option<PathBuf>,
    /// False when lookups and records are off (`TF_PLAN_CACHE=off`).
    enabled: bool,
    /// False when the file on disk must not be replaced (a foreign or newer format).
    writable: bool,
    stacks: Stacks,
    dirty: bool,
    warnings: Vec<PlanCacheError>,
}

/// The plan cache: choices in memory, loaded from and saved to one file. Share one between the
/// handles of a process (`Arc<PlanCache>`, see [`super::CublasLt::set_plan_cache`]).
pub struct PlanCache {
    inner: Mutex<Inner>,
}

impl fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.inner.lock();
        f.debug_struct("PlanCache")
            .field("path", &inner.path)
            .field("enabled", &inner.enabled)
            .field(
                "plans",
                &inner.stacks.values().map(HashMap::len).sum::<usize>(),
            )
            .finish()
    }
}

impl PlanCache {
    fn with(path: Option<PathBuf>, enabled: bool) -> PlanCache {
        PlanCache {
            inner: Mutex::new(Inner {
                path,
                enabled,
                writable: true,
                stacks: HashMap::new(),
                dirty: false,
                warnings: Vec::new(),
            }),
        }
    }

    /// The cache of this process's environment ([`plan_cache_path`]): loaded from its file,
    /// disabled by `TF_PLAN_CACHE=off`, in memory only (with a [`PlanCacheError::NoLocation`]
    /// warning) when no folder is known. Never fails: problems become warnings
    /// ([`PlanCache::take_warnings`]).
    pub fn open_default() -> PlanCache {
        Self::open_from_env(|key| std::env::var_os(key))
    }

    /// As [`PlanCache::open_default`] with the given environment lookup.
    pub fn open_from_env(env: impl Fn(&str) -> Option<OsString>) -> PlanCache {
        if disabled_by_env(&env) {
            return PlanCache::disabled();
        }
        match plan_cache_path_from(&env) {
            Some(path) => PlanCache::open(path),
            None => {
                let cache = PlanCache::in_memory();
                cache.inner.lock().warnings.push(PlanCacheError::NoLocation);
                cache
            }
        }
    }

    /// The cache kept in `path`: its choices are loaded now (a missing file is an empty cache; a
    /// bad one is ignored with a warning).
    pub fn open(path: impl Into<PathBuf>) -> PlanCache {
        let path = path.into();
        let cache = PlanCache::with(Some(path.clone()), true);
        {
            let mut inner = cache.inner.lock();
            match read_file(&path) {
                Loaded::Missing => {}
                Loaded::Plans(stacks) => inner.stacks = stacks,
                Loaded::Bad(warning) => inner.warnings.push(warning),
                Loaded::Foreign(warning) => {
                    inner.writable = false;
                    inner.warnings.push(warning);
                }
            }
        }
        cache
    }

    /// A cache that stores nothing and finds nothing (what `TF_PLAN_CACHE=off` gives).
    pub fn disabled() -> PlanCache {
        PlanCache::with(None, false)
    }

    /// A cache without a file: choices last as long as it does.
    pub fn in_memory() -> PlanCache {
        PlanCache::with(None, true)
    }

    /// The file, when there is one.
    pub fn path(&self) -> Option<PathBuf> {
        self.inner.lock().path.clone()
    }

    /// False for [`PlanCache::disabled`].
    pub fn is_enabled(&self) -> bool {
        self.inner.lock().enabled
    }

    /// Stored choices, over every stack.
    pub fn len(&self) -> usize {
        self.inner.lock().stacks.values().map(HashMap::len).sum()
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored choice for `key` on `stack`.
    pub fn lookup(&self, stack: &StackKey, key: &PlanKey) -> Option<StoredPlan> {
        let inner = self.inner.lock();
        if !inner.enabled {
            return None;
        }
        inner.stacks.get(stack)?.get(key).cloned()
    }

    /// The stored choice for the shape nearest `key` in `m` among those equal to it in everything else (`n`, `k`,
    /// types, epilogue, alignment, accumulation, scale mode) with `m` within 1/[`NEIGHBOUR_M_FRACTION`] of
    /// `key.m` (the nearer below on a tie); `None` when there is none (or the cache is disabled). The exact key
    /// itself is [`PlanCache::lookup`]'s.
    pub fn neighbour(&self, stack: &StackKey, key: &PlanKey) -> Option<StoredPlan> {
        let inner = self.inner.lock();
        if !inner.enabled {
            return None;
        }
        let band = key.m / NEIGHBOUR_M_FRACTION;
        inner
            .stacks
            .get(stack)?
            .values()
            .filter(|plan| {
                plan.key.m != key.m
                    && plan.key.m.abs_diff(key.m) <= band
                    && PlanKey {
                        m: key.m,
                        ..plan.key
                    } == *key
            })
            .min_by_key(|plan| (plan.key.m.abs_diff(key.m), plan.key.m))
            .cloned()
    }

    /// Every choice stored for `stack`, ordered by key (the file's order is not kept); empty when disabled.
    pub fn stored(&self, stack: &StackKey) -> Vec<StoredPlan> {
        let inner = self.inner.lock();
        if !inner.enabled {
            return Vec::new();
        }
        let mut plans: Vec<StoredPlan> = inner
            .stacks
            .get(stack)
            .map(|plans| plans.values().cloned().collect())
            .unwrap_or_default();
        plans.sort_by(|a, b| {
            (a.key.m, a.key.n, a.key.k)
                .cmp(&(b.key.m, b.key.n, b.key.k))
                .then_with(|| describe_key(&a.key).cmp(&describe_key(&b.key)))
        });
        plans
    }

    /// Stores (or replaces) a choice on `stack`; written by the next [`PlanCache::save`].
    pub fn record(&self, stack: &StackKey, plan: StoredPlan) {
        let mut inner = self.inner.lock();
        if !inner.enabled {
            return;
        }
        let plans = inner.stacks.entry(stack.clone()).or_default();
        if plans.get(&plan.key) != Some(&plan) {
            plans.insert(plan.key, plan);
            inner.dirty = true;
        }
    }

    /// Adds a warning for the caller to print (see [`PlanCache::take_warnings`]).
    pub(crate) fn warn(&self, warning: PlanCacheError) {
        self.inner.lock().warnings.push(warning);
    }

    /// The warnings gathered since the last call (loading, rejected entries, failed saves).
    pub fn take_warnings(&self) -> Vec<PlanCacheError> {
        std::mem::take(&mut self.inner.lock().warnings)
    }

    /// Writes the choices recorded since the last save to the file: merges the file's current
    /// entries in first (ours win for the same key), then replaces it atomically. Returns the
    /// path written, or `None` when there was nothing to write (no change, no file, or a
    /// foreign file that must be left alone).
    pub fn save(&self) -> Result<Option<PathBuf>, PlanCacheError> {
        let mut inner = self.inner.lock();
        let Some(path) = inner.path.clone() else {
            return Ok(None);
        };
        if !inner.dirty || !inner.writable || !inner.enabled {
            return Ok(None);
        }
        match read_file(&path) {
            Loaded::Plans(on_disk) => {
                for (stack, plans) in on_disk {
                    let mine = inner.stacks.entry(stack).or_default();
                    for (key, plan) in plans {
                        mine.entry(key).or_insert(plan);
                    }
                }
            }
            Loaded::Foreign(warning) => {
                // Written by another build meanwhile: leave it alone.
                inner.writable = false;
                return Err(warning);
            }
            // Replaced: what is there cannot be read anyway.
            Loaded::Missing | Loaded::Bad(_) => {}
        }
        let bytes = serialize(&inner.stacks).map_err(|e| PlanCacheError::SaveFailed {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        write_atomically(&path, &bytes).map_err(|source| PlanCacheError::SaveFailed {
            path: path.clone(),
            source,
        })?;
        inner.dirty = false;
        Ok(Some(path))
    }

    /// Forgets every choice and deletes the file (handles keep the plans they built).
    pub fn reset(&self) -> Result<(), PlanCacheError> {
        let mut inner = self.inner.lock();
        inner.stacks.clear();
        inner.dirty = false;
        inner.writable = true;
        match inner.path.clone() {
            Some(path) => remove_file(&path).map(|_| ()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::cublaslt::plan::{InputType, OutputType};

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "tf-plan-cache-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
        fn file(&self) -> PathBuf {
            self.0.join("sub").join("gemm-plans.json")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub(crate) fn stack(driver: i32) -> StackKey {
        StackKey {
            gpu_name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            driver_version: driver,
            driver_release: "580.159.04".into(),
            cublaslt_version: 130_100,
            workspace_bytes: 32 << 20,
            timing_data: super::super::TimingData::Constant,
        }
    }

    pub(crate) fn key(m: usize) -> PlanKey {
        PlanKey {
            m,
            n: 3072,
            k: 3072,
            input: InputType::Bf16,
            output: OutputType::Bf16,
            epilogue: 1,
            align_a: 256,
            align_b: 256,
            align_cd: 256,
            fast_accum: false,
            scale_mode: Fp8ScaleMode::Tensor,
        }
    }

    fn algo(tag: u64) -> MatmulAlgo {
        MatmulAlgo {
            data: [tag, u64::MAX - tag, 0, 1, 2, 3, 4, tag << 32],
        }
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn a_neighbour_differs_only_in_m_and_within_an_eighth() {
        let cache = PlanCache::in_memory();
        let s = stack(13000);
        for m in [4096, 4150, 4400, 8192] {
            cache.record(
                &s,
                StoredPlan::new(key(m), &algo(m as u64), StoredSource::Timed, 0, 8),
            );
        }
        let other_n = PlanKey {
            n: 4096,
            ..key(4120)
        };
        cache.record(
            &s,
            StoredPlan::new(other_n, &algo(1), StoredSource::Timed, 0, 8),
        );
        let near = |m: usize| cache.neighbour(&s, &key(m)).map(|p| p.key.m);
        assert_eq!(near(4131), Some(4150), "the nearest in m");
        assert_eq!(near(4123), Some(4096), "the nearer below on a tie");
        assert_eq!(near(4096), Some(4150), "never the key itself");
        assert_eq!(near(4700), Some(4400));
        assert_eq!(near(5200), None, "farther than an eighth");
        assert_eq!(near(7300), Some(8192));
        // Only n differs: not a neighbour of key(4120)'s shape family, but of its own.
        assert_eq!(
            cache
                .neighbour(
                    &s,
                    &PlanKey {
                        n: 4096,
                        ..key(4100)
                    }
                )
                .map(|p| p.key.m),
            Some(4120)
        );
        assert_eq!(
            cache.neighbour(&stack(13010), &key(4131)),
            None,
            "another stack"
        );
        assert_eq!(PlanCache::disabled().neighbour(&s, &key(4131)), None);
    }

    #[test]
    fn stored_lists_one_stack_in_key_order() {
        let cache = PlanCache::in_memory();
        let other = stack(13010);
        for m in [4176, 64, 4096] {
            cache.record(
                &stack(13000),
                StoredPlan::new(key(m), &algo(1), StoredSource::Timed, 0, 8),
            );
        }
        cache.record(
            &other,
            StoredPlan::new(key(8), &algo(2), StoredSource::Timed, 0, 8),
        );
        let ms: Vec<usize> = cache
            .stored(&stack(13000))
            .iter()
            .map(|p| p.key.m)
            .collect();
        assert_eq!(ms, vec![64, 4096, 4176]);
        assert_eq!(cache.stored(&other).len(), 1);
        assert!(PlanCache::disabled().stored(&stack(13000)).is_empty());
    }

    #[test]
    fn path_follows_the_variables_in_order() {
        let p = |pairs: &[(&str, &str)]| plan_cache_path_from(env(pairs));
        assert_eq!(
            p(&[(ENV_PLAN_CACHE, "/x/p.json"), ("HOME", "/h")]),
            Some(PathBuf::from("/x/p.json"))
        );
        assert_eq!(p(&[(ENV_PLAN_CACHE, "off"), ("HOME", "/h")]), None);
        assert_eq!(p(&[(ENV_PLAN_CACHE, "OFF")]), None);
        assert_eq!(
            p(&[("XDG_CACHE_HOME", "/c"), ("HOME", "/h")]),
            Some(PathBuf::from("/c/tensorfold/gemm-plans.json"))
        );
        // A relative XDG value is ignored, as the spec says.
        assert_eq!(
            p(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")]),
            Some(PathBuf::from("/h/.cache/tensorfold/gemm-plans.json"))
        );
        assert_eq!(
            p(&[(ENV_PLAN_CACHE, ""), ("HOME", "/h")]),
            Some(PathBuf::from("/h/.cache/tensorfold/gemm-plans.json"))
        );
        assert_eq!(p(&[]), None);
    }

    #[test]
    fn open_from_env_disables_or_warns() {
        let off = PlanCache::open_from_env(env(&[(ENV_PLAN_CACHE, "off")]));
        assert!(!off.is_enabled());
        off.record(
            &stack(1),
            StoredPlan::new(key(1), &algo(1), StoredSource::Timed, 0, 8),
        );
        assert!(off.is_empty());
        assert!(off.lookup(&stack(1), &key(1)).is_none());
        assert!(off.take_warnings().is_empty());
        let nowhere = PlanCache::open_from_env(env(&[]));
        assert!(nowhere.is_enabled() && nowhere.path().is_none());
        let warnings = nowhere.take_warnings();
        assert!(matches!(warnings[..], [PlanCacheError::NoLocation]));
        assert!(warnings[0].to_string().contains(ENV_PLAN_CACHE));
    }

    #[test]
    fn driver_release_is_read_from_the_kernel_module_line() {
        let text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 2 2025\nGCC version: gcc 12\n";
        assert_eq!(driver_release_from(text), "580.159.04");
        assert_eq!(
            driver_release_from("NVRM version: open Kernel Module for x86_64"),
            ""
        );
        assert_eq!(driver_release_from(""), "");
    }

    #[test]
    fn algo_hex_round_trips_and_refuses_other_text() {
        let a = algo(0xdead_beef);
        let text = algo_hex(&a);
        assert_eq!(text.len(), 128);
        assert_eq!(algo_from_hex(&text), Some(a));
        assert_eq!(algo_from_hex(&text[1..]), None);
        assert_eq!(algo_from_hex(&text.replace('0', "g")), None);
        assert_eq!(algo_from_hex("+0000000000000001"), None);
    }

    #[test]
    fn choices_round_trip_through_the_file() {
        let dir = TempDir::new("round");
        let path = dir.file();
        let cache = PlanCache::open(&path);
        assert!(cache.is_empty() && cache.take_warnings().is_empty());
        let timed = StoredPlan::new(key(64), &algo(7), StoredSource::Timed, 3, 8);
        let first = StoredPlan::new(key(128), &algo(9), StoredSource::Heuristic, 0, 8);
        cache.record(&stack(13000), timed.clone());
        cache.record(&stack(13000), first.clone());
        assert_eq!(cache.save().unwrap(), Some(path.clone()));
        // Nothing changed: nothing written.
        assert_eq!(cache.save().unwrap(), None);
        let again = PlanCache::open(&path);
        assert!(again.take_warnings().is_empty());
        assert_eq!(again.len(), 2);
        assert_eq!(again.lookup(&stack(13000), &key(64)), Some(timed));
        assert_eq!(again.lookup(&stack(13000), &key(128)), Some(first));
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [OsString::from("gemm-plans.json")]);
    }

    #[test]
    fn a_choice_of_another_stack_is_not_used_but_kept() {
        let dir = TempDir::new("stack");
        let path = dir.file();
        let cache = PlanCache::open(&path);
        cache.record(
            &stack(12080),
            StoredPlan::new(key(64), &algo(1), StoredSource::Timed, 1, 8),
        );
        cache.save().unwrap();
        let newer = PlanCache::open(&path);
        // Another driver, another cuBLASLt, another GPU, another workspace: all misses.
        assert_eq!(newer.lookup(&stack(13000), &key(64)), None);
        let other_lt = StackKey {
            cublaslt_version: 120_900,
            ..stack(12080)
        };
        assert_eq!(newer.lookup(&other_lt, &key(64)), None);
        let other_gpu = StackKey {
            gpu_name: "NVIDIA H100 80GB HBM3".into(),
            ..stack(12080)
        };
        assert_eq!(newer.lookup(&other_gpu, &key(64)), None);
        let other_ws = StackKey {
            workspace_bytes: 4 << 20,
            ..stack(12080)
        };
        assert_eq!(newer.lookup(&other_ws, &key(64)), None);
        let other_data = StackKey {
            timing_data: super::super::TimingData::Random,
            ..stack(12080)
        };
        assert_eq!(newer.lookup(&other_data, &key(64)), None);
        // Another shape: a miss as well.
        assert_eq!(newer.lookup(&stack(12080), &key(65)), None);
        newer.record(
            &stack(13000),
            StoredPlan::new(key(64), &algo(2), StoredSource::Heuristic, 0, 8),
        );
        newer.save().unwrap();
        let both = PlanCache::open(&path);
        assert_eq!(both.len(), 2);
        assert!(both.lookup(&stack(12080), &key(64)).is_some());
        assert!(both.lookup(&stack(13000), &key(64)).is_some());
    }

    #[test]
    fn saving_merges_what_another_writer_stored() {
        let dir = TempDir::new("merge");
        let path = dir.file();
        let a = PlanCache::open(&path);
        let b = PlanCache::open(&path);
        a.record(
            &stack(1),
            StoredPlan::new(key(1), &algo(1), StoredSource::Timed, 1, 8),
        );
        a.save().unwrap();
        b.record(
            &stack(1),
            StoredPlan::new(key(2), &algo(2), StoredSource::Timed, 2, 8),
        );
        b.save().unwrap();
        let read = PlanCache::open(&path);
        assert_eq!(read.len(), 2);
    }

    #[test]
    fn corrupt_files_are_ignored_with_a_warning_and_replaced() {
        let dir = TempDir::new("corrupt");
        let path = dir.file();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let good = {
            let cache = PlanCache::in_memory();
            cache.record(
                &stack(1),
                StoredPlan::new(key(1), &algo(1), StoredSource::Timed, 1, 8),
            );
            let inner = cache.inner.lock();
            String::from_utf8(serialize(&inner.stacks).unwrap()).unwrap()
        };
        let bad_entries = [
            good.replace(&algo_hex(&algo(1)), "00ff"),
            good.replace("\"index\": 1", "\"index\": 9"),
            good.replace("\"m\": 1,", "\"m\": 0,"),
            good.replace("\"align_a\": 256", "\"align_a\": 24"),
            good.replace("\"timed\"", "\"guessed\""),
        ];
        let cases: Vec<(String, &str)> = [
            (String::new(), "not JSON"),
            ("{\"format\": ".into(), "not JSON"),
            ("[1, 2, 3]".into(), "not JSON"),
            (good[..good.len() / 2].to_string(), "not JSON"),
            (
                format!("{{\"format\": \"{FILE_FORMAT}\", \"version\": 1, \"stacks\": 7}}"),
                "unexpected content",
            ),
        ]
        .into_iter()
        .chain(bad_entries.into_iter().map(|t| (t, "")))
        .collect();
        for (text, what) in cases {
            std::fs::write(&path, &text).unwrap();
            let cache = PlanCache::open(&path);
            assert!(cache.is_empty(), "{text}");
            let warnings = cache.take_warnings();
            assert!(
                matches!(&warnings[..], [PlanCacheError::Corrupt { what: w, .. }] if w.contains(what)),
                "{text}: {warnings:?}"
            );
            assert!(
                warnings[0].to_string().contains("reset"),
                "says how to fix it"
            );
            // The next save replaces it with a readable file.
            cache.record(
                &stack(1),
                StoredPlan::new(key(5), &algo(5), StoredSource::Timed, 0, 8),
            );
            cache.save().unwrap();
            let again = PlanCache::open(&path);
            assert!(again.take_warnings().is_empty());
            assert_eq!(again.len(), 1);
        }
        std::fs::write(&path, &good).unwrap();
        assert_eq!(PlanCache::open(&path).len(), 1);
    }

    #[test]
    fn oversized_files_are_refused_before_reading() {
        let dir = TempDir::new("big");
        let path = dir.file();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(MAX_FILE_BYTES + 1).unwrap();
        let warnings = PlanCache::open(&path).take_warnings();
        assert!(
            matches!(&warnings[..], [PlanCacheError::Corrupt { what, .. }] if what.contains("bytes"))
        );
    }

    #[test]
    fn foreign_files_are_ignored_and_never_overwritten() {
        let dir = TempDir::new("foreign");
        let path = dir.file();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        for text in [
            format!("{{\"format\": \"{FILE_FORMAT}\", \"version\": 2, \"stacks\": []}}"),
            "{\"format\": \"something-else\", \"version\": 1}".to_string(),
            "{\"name\": \"x\"}".to_string(),
        ] {
            std::fs::write(&path, &text).unwrap();
            let cache = PlanCache::open(&path);
            let warnings = cache.take_warnings();
            assert!(
                matches!(&warnings[..], [PlanCacheError::Foreign { .. }]),
                "{text}: {warnings:?}"
            );
            cache.record(
                &stack(1),
                StoredPlan::new(key(1), &algo(1), StoredSource::Timed, 0, 8),
            );
            assert_eq!(cache.save().unwrap(), None);
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
            // The choice still serves this process.
            assert!(cache.lookup(&stack(1), &key(1)).is_some());
        }
    }

    #[cfg(unix)]
    #[test]
    fn an_unwritable_folder_is_a_save_warning_not_a_panic() {
        // A file where the folder should be: creating the folder fails on any user, root too.
        let dir = TempDir::new("unwritable");
        let blocker = dir.0.join("sub");
        std::fs::write(&blocker, b"not a folder").unwrap();
        let cache = PlanCache::open(dir.file());
        let warnings = cache.take_warnings();
        assert!(
            matches!(&warnings[..], [PlanCacheError::Unreadable { .. }]),
            "{warnings:?}"
        );
        cache.record(
            &stack(1),
            StoredPlan::new(key(1), &algo(1), StoredSource::Timed, 0, 8),
        );
        let err = cache.save().unwrap_err();
        assert!(matches!(err, PlanCacheError::SaveFailed { .. }), "{err}");
        assert!(err.to_string().contains(ENV_PLAN_CACHE));
    }

    #[test]
    fn reset_deletes_the_file_and_forgets() {
        let dir = TempDir::new("reset");
        let path = dir.file();
        let cache = PlanCache::open(&path);
        cache.record(
            &stack(1),
            StoredPlan::new(key(1), &algo(1), StoredSource::Timed, 0, 8),
        );
        cache.save().unwrap();
        assert!(path.is_file());
        cache.reset().unwrap();
        assert!(!path.exists());
        assert!(cache.is_empty());
        // Resetting twice is fine.
        cache.reset().unwrap();
        assert!(PlanCache::open(&path).is_empty());
        assert!(!remove_file(&path).unwrap());
    }

    #[test]
    fn entries_written_before_scale_modes_read_as_per_tensor() {
        let mut plan = StoredPlan {
            key: key(4096),
            algo: algo_hex(&algo(7)),
            source: StoredSource::Timed,
            index: 0,
            requested: 8,
        };
        let mut value = serde_json::to_value(&plan).unwrap();
        let Some(key_object) = value.get_mut("key").and_then(|k| k.as_object_mut()) else {
            panic!("a stored plan's key is an object: {value}");
        };
        assert_eq!(key_object.remove("scale_mode"), Some("tensor".into()));
        let old: StoredPlan = serde_json::from_value(value).unwrap();
        assert_eq!(old, plan);
        // A row-wise key is written and read back as such, and describes itself.
        plan.key.scale_mode = Fp8ScaleMode::RowWise;
        plan.key.input = InputType::Fp8E4m3;
        let text = serde_json::to_string(&plan).unwrap();
        assert!(text.contains("\"scale_mode\":\"row_wise\""), "{text}");
        let back: StoredPlan = serde_json::from_str(&text).unwrap();
        assert_eq!(back, plan);
        assert!(describe_key(&plan.key).ends_with("row-wise scales"));
        assert_ne!(sort_key(&plan.key), sort_key(&key(4096)));
    }
}
