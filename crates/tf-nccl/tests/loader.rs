//! The loader against libraries that are not there, not NCCL, half NCCL or too old: every failure is an error
//! naming each path tried and each missing entry point, never a panic; and opening keeps NVLink multicast off.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use tf_nccl::ffi::{Requirement, ENTRIES};
use tf_nccl::loader::{ENV_PATH, NVLS_ENV};
use tf_nccl::{LoadError, Nccl, PathSource, Refusal};

/// The tests change the process environment (TF_NCCL, NCCL_NVLS_ENABLE) and share the fake's state.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn partial() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| common::build_library("loader_partial_nccl", common::PARTIAL_SOURCE))
}

fn fake() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| common::build_library("loader_fake_nccl", common::FAKE_SOURCE))
}

/// Runs `f` with `TF_NCCL` set to `value` (or unset), restoring the previous value.
fn with_env<T>(value: Option<&Path>, f: impl FnOnce() -> T) -> T {
    let previous = std::env::var_os(ENV_PATH);
    match value {
        Some(v) => std::env::set_var(ENV_PATH, v),
        None => std::env::remove_var(ENV_PATH),
    }
    let out = f();
    match previous {
        Some(v) => std::env::set_var(ENV_PATH, v),
        None => std::env::remove_var(ENV_PATH),
    }
    out
}

fn required_names() -> Vec<&'static str> {
    ENTRIES
        .iter()
        .filter(|e| e.requirement == Requirement::Required)
        .map(|e| e.name)
        .collect()
}

#[test]
fn an_explicit_missing_library_names_the_path_and_the_variable() {
    let _serial = serial();
    let missing = Path::new("/nonexistent/tf-nccl-test/libnccl.so.2");
    let err = with_env(Some(missing), Nccl::open).unwrap_err();
    let LoadError::NoLibrary {
        source_of_paths,
        attempts,
    } = &err;
    assert_eq!(*source_of_paths, PathSource::Environment);
    assert_eq!(attempts.len(), 1, "an explicit path is the only one tried");
    assert_eq!(attempts[0].path, missing);
    assert!(matches!(&attempts[0].refusal, Refusal::Open(why) if !why.is_empty()));
    let msg = err.to_string();
    println!("{msg}");
    assert!(
        msg.contains("/nonexistent/tf-nccl-test/libnccl.so.2"),
        "{msg}"
    );
    assert!(msg.contains(ENV_PATH), "{msg}");
    // The explicit helper does not look further when TF_NCCL is set.
    let err = with_env(Some(missing), Nccl::open_with_python_packages).unwrap_err();
    assert_eq!(err.attempts().len(), 1);
}

#[test]
fn every_candidate_is_listed_with_its_reason() {
    let _serial = serial();
    let paths = [
        PathBuf::from("/nonexistent/tf-nccl-a/libnccl.so.2"),
        PathBuf::from("/nonexistent/tf-nccl-b/libnccl.so.2"),
        partial().to_path_buf(),
    ];
    let err = Nccl::open_first(&paths, PathSource::Defaults).unwrap_err();
    assert_eq!(err.attempts().len(), 3);
    let msg = err.to_string();
    println!("{msg}");
    for p in &paths {
        assert!(msg.contains(&p.display().to_string()), "{p:?} in {msg}");
    }
    assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
}

#[test]
fn the_python_package_search_lists_what_it_tried() {
    let _serial = serial();
    // Whatever this machine has, a failure lists the default name first and then package folders; a success
    // found a real NCCL of at least the minimum version.
    match with_env(None, Nccl::open_with_python_packages) {
        Ok(nccl) => assert!(nccl.version() >= tf_nccl::Version(tf_nccl::loader::MIN_VERSION)),
        Err(err) => {
            let LoadError::NoLibrary {
                source_of_paths,
                attempts,
            } = &err;
            assert_eq!(*source_of_paths, PathSource::PythonPackages);
            assert_eq!(attempts[0].path, Path::new("libnccl.so.2"));
            assert!(attempts[1..]
                .iter()
                .all(|a| a.path.ends_with("nvidia/nccl/lib/libnccl.so.2")));
            assert!(err.to_string().contains("nvidia-nccl-cu13"), "{err}");
        }
    }
}

#[test]
fn a_library_that_is_not_nccl_lists_every_missing_entry_point() {
    let _serial = serial();
    // libc opens everywhere and exports none of NCCL's entry points.
    let err = with_env(Some(Path::new("libc.so.6")), Nccl::open).unwrap_err();
    let attempts = err.attempts();
    assert_eq!(attempts.len(), 1);
    match &attempts[0].refusal {
        Refusal::MissingSymbols(names) => assert_eq!(names, &required_names()),
        other => panic!("expected MissingSymbols, got {other:?}"),
    }
    let msg = err.to_string();
    println!("{msg}");
    for name in required_names() {
        assert!(msg.contains(name), "{name} in {msg}");
    }
    // An optional entry is never reported missing.
    assert!(!msg.contains("ncclGetLastError"), "{msg}");
}

#[test]
fn a_half_nccl_lists_exactly_what_it_lacks() {
    let _serial = serial();
    let err = Nccl::open_path(partial()).unwrap_err();
    let Refusal::MissingSymbols(names) = &err.attempts()[0].refusal else {
        panic!("expected MissingSymbols, got {err:?}");
    };
    let mut want = required_names();
    want.retain(|n| *n != "ncclGetVersion" && *n != "ncclGetErrorString");
    assert_eq!(names, &want);
    assert!(names.contains(&"ncclCommInitRankConfig"));
    assert!(names.contains(&"ncclSend"));
}

#[test]
fn a_library_older_than_the_minimum_is_refused_with_its_version() {
    let _serial = serial();
    let controls = common::Fake::open(fake());
    controls.set("version", 21605);
    let err = Nccl::open_path(fake()).unwrap_err();
    assert_eq!(err.attempts()[0].refusal, Refusal::TooOld(21605));
    assert!(
        err.to_string().contains("NCCL 2.16.5 is older than 2.17.0"),
        "{err}"
    );
    controls.set("version", 22803);
    let nccl = Nccl::open_path(fake()).unwrap();
    assert_eq!(nccl.version().to_string(), "2.28.3");
    assert_eq!(nccl.path(), fake());
    assert_eq!(
        nccl.error_string(6),
        "remote process exited or there was a network error"
    );
}

#[test]
fn opening_keeps_nvlink_multicast_off_and_reports_an_override() {
    let _serial = serial();
    let _controls = common::Fake::open(fake());
    std::env::set_var(NVLS_ENV, "1");
    let nccl = Nccl::open_path(fake()).unwrap();
    assert_eq!(std::env::var(NVLS_ENV).unwrap(), "0");
    assert_eq!(nccl.nvls_override().unwrap(), "1");
    // Already 0: nothing to report.
    let nccl = Nccl::open_path(fake()).unwrap();
    assert!(nccl.nvls_override().is_none());
    // Even a failed open leaves it at 0.
    std::env::set_var(NVLS_ENV, "2");
    let _ = Nccl::open_path(Path::new("/nonexistent/libnccl.so.2"));
    assert_eq!(std::env::var(NVLS_ENV).unwrap(), "0");
}

#[test]
fn unique_ids_come_from_the_library() {
    let _serial = serial();
    let controls = common::Fake::open(fake());
    let nccl = Nccl::open_path(fake()).unwrap();
    let id = nccl.unique_id().unwrap();
    assert_eq!(controls.get("unique"), 1);
    let bytes = id.to_bytes();
    assert_eq!(bytes[5], 15);
    assert_eq!(bytes[100], 44); // 300 mod 256
}
