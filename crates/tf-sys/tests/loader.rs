//! Loader tests against the real test-driver library (built next to the test executables).
//!
//! Every test holds `tf_testdriver::test_lock()`: they share the process environment
//! (`TF_CUDA_DRIVER`) and the test driver's process-wide state.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use tf_sys::{check, Driver, Error, LoadError, PathSource, DRIVER_ENV};
use tf_testdriver::{library_path, patched_copy, test_lock, Control};

fn driver_lib() -> PathBuf {
    library_path().expect("the test driver is built as a dev-dependency")
}

fn fresh_control() -> Control {
    let control = Control::open().expect("open the test driver's control functions");
    control.reset();
    control
}

/// Runs `f` with `TF_CUDA_DRIVER` set to `value` (or unset), restoring the previous value.
fn with_driver_env<T>(value: Option<&Path>, f: impl FnOnce() -> T) -> T {
    let previous = std::env::var_os(DRIVER_ENV);
    match value {
        Some(v) => std::env::set_var(DRIVER_ENV, v),
        None => std::env::remove_var(DRIVER_ENV),
    }
    let out = f();
    match previous {
        Some(v) => std::env::set_var(DRIVER_ENV, v),
        None => std::env::remove_var(DRIVER_ENV),
    }
    out
}

#[test]
fn explicit_missing_file_names_the_path_and_the_variable() {
    let _serial = test_lock();
    let missing = Path::new("/nonexistent/tf-sys-test/libcuda.so.1");
    let err = with_driver_env(Some(missing), Driver::open).unwrap_err();
    match &err {
        LoadError::NotFound {
            source_of_paths,
            attempts,
        } => {
            assert_eq!(*source_of_paths, PathSource::Environment);
            assert_eq!(
                attempts.len(),
                1,
                "an explicit path is the only one tried: {attempts:?}"
            );
            assert_eq!(attempts[0].path, missing);
            assert!(!attempts[0].reason.is_empty());
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    let msg = err.to_string();
    println!("{msg}");
    assert!(
        msg.contains("/nonexistent/tf-sys-test/libcuda.so.1"),
        "{msg}"
    );
    assert!(msg.contains(DRIVER_ENV), "{msg}");
}

#[test]
fn default_search_lists_every_name_tried() {
    let _serial = test_lock();
    match with_driver_env(None, Driver::open) {
        Err(err @ LoadError::NotFound { .. }) => {
            let LoadError::NotFound {
                source_of_paths,
                attempts,
            } = &err
            else {
                unreachable!()
            };
            assert_eq!(*source_of_paths, PathSource::Defaults);
            let tried: Vec<String> = attempts
                .iter()
                .map(|a| a.path.display().to_string())
                .collect();
            assert_eq!(tried, tf_sys::DEFAULT_CANDIDATES.to_vec());
            let msg = err.to_string();
            println!("{msg}");
            for name in tf_sys::DEFAULT_CANDIDATES {
                assert!(msg.contains(name), "{msg}");
            }
            assert!(
                msg.contains("mounted"),
                "the message says what to check: {msg}"
            );
        }
        // A machine with NVIDIA's driver installed: nothing to assert about a missing library.
        Ok(driver) => println!(
            "a system driver is installed at {}",
            driver.path().display()
        ),
        Err(other) => println!("a system driver is installed but unusable here: {other}"),
    }
}

#[test]
fn open_path_missing_file() {
    let _serial = test_lock();
    let err = Driver::open_path(Path::new("/nonexistent/libnothing.so")).unwrap_err();
    assert!(
        matches!(&err, LoadError::NotFound { source_of_paths: PathSource::Caller, attempts } if attempts.len() == 1)
    );
    assert!(err.to_string().contains("/nonexistent/libnothing.so"));
}

#[test]
fn tf_cuda_driver_is_honoured() {
    let _serial = test_lock();
    let control = fresh_control();
    let lib = driver_lib();
    let driver = with_driver_env(Some(&lib), Driver::open)
        .expect("open the test driver through TF_CUDA_DRIVER");
    assert_eq!(driver.path(), lib.as_path());
    assert_eq!(
        control.call_count("cuInit"),
        1,
        "cuInit is called exactly once by open"
    );
    assert_eq!(
        driver.version().unwrap(),
        tf_testdriver::DEFAULT_DRIVER_VERSION
    );
    assert_eq!(driver.device_count().unwrap(), 1);
    control.set_driver_version(12080);
    control.set_device_count(3);
    assert_eq!(driver.version().unwrap(), 12080);
    assert_eq!(driver.device_count().unwrap(), 3);
}

#[test]
fn missing_required_symbols_are_all_named() {
    let _serial = test_lock();
    let copy = patched_copy(&["cuStreamQuery", "cuGraphUpload"]).expect("patch a copy");
    let err = Driver::open_path(copy.path()).unwrap_err();
    match &err {
        LoadError::MissingSymbols { path, names } => {
            assert_eq!(path, copy.path());
            assert_eq!(
                names,
                &vec!["cuStreamQuery", "cuGraphUpload"],
                "all missing entries, in table order"
            );
        }
        other => panic!("expected MissingSymbols, got {other:?}"),
    }
    let msg = err.to_string();
    println!("{msg}");
    assert!(
        msg.contains("cuStreamQuery") && msg.contains("cuGraphUpload"),
        "{msg}"
    );
    assert!(msg.contains("update the NVIDIA driver"), "{msg}");
}

#[test]
fn missing_cuinit_is_reported_with_everything_else_missing() {
    let _serial = test_lock();
    let copy = patched_copy(&["cuInit", "cuMemAlloc_v2"]).expect("patch a copy");
    match Driver::open_path(copy.path()) {
        Err(LoadError::MissingSymbols { names, .. }) => {
            assert_eq!(names, vec!["cuInit", "cuMemAlloc_v2"])
        }
        other => panic!(
            "expected MissingSymbols, got {:?}",
            other.map(|d| d.path().to_path_buf())
        ),
    }
}

#[test]
fn missing_optional_symbol_still_opens() {
    let _serial = test_lock();
    let copy = patched_copy(&["cuFuncGetName"]).expect("patch a copy");
    let driver = Driver::open_path(copy.path()).expect("a driver without an optional entry opens");
    assert!(driver.api().cuFuncGetName.is_none());
    assert!(driver.api().cuFuncGetParamInfo.is_some());
    // The original library still has it.
    let full = Driver::open_path(&driver_lib()).expect("open the unpatched library");
    assert!(full.api().cuFuncGetName.is_some());
}

#[test]
fn cuinit_failure_gives_code_and_name() {
    let _serial = test_lock();
    let control = fresh_control();
    control.fail_init(100);
    let err = Driver::open_path(&driver_lib()).unwrap_err();
    control.reset();
    match &err {
        LoadError::InitFailed {
            code, name, text, ..
        } => {
            assert_eq!(*code, 100);
            assert_eq!(name, "CUDA_ERROR_NO_DEVICE");
            assert!(
                text.starts_with("[tf-testdriver]"),
                "the driver's own text: {text}"
            );
        }
        other => panic!("expected InitFailed, got {other:?}"),
    }
    let msg = err.to_string();
    println!("{msg}");
    assert!(
        msg.contains("cuInit") && msg.contains("CUDA_ERROR_NO_DEVICE") && msg.contains("(100)"),
        "{msg}"
    );
}

#[test]
fn cuinit_failure_with_an_unknown_code_uses_the_placeholder_name() {
    let _serial = test_lock();
    let control = fresh_control();
    control.fail_init(4242);
    let err = Driver::open_path(&driver_lib()).unwrap_err();
    control.reset();
    assert!(
        matches!(&err, LoadError::InitFailed { code: 4242, name, .. } if name == "CUDA_ERROR_UNKNOWN_CODE"),
        "{err:?}"
    );
}

#[test]
fn deinitialized_gets_the_shutdown_note() {
    let _serial = test_lock();
    let control = fresh_control();
    control.fail_init(4);
    let msg = Driver::open_path(&driver_lib()).unwrap_err().to_string();
    control.reset();
    assert!(
        msg.contains("CUDA_ERROR_DEINITIALIZED") && msg.contains("process is exiting"),
        "{msg}"
    );
}

#[test]
fn error_text_comes_from_the_driver_with_a_fallback() {
    let _serial = test_lock();
    let control = fresh_control();
    let driver = Driver::open_path(&driver_lib()).unwrap();
    assert_eq!(driver.error_name(700), "CUDA_ERROR_ILLEGAL_ADDRESS");
    assert!(driver.error_text(700).starts_with("[tf-testdriver]"));
    assert_eq!(driver.error_name(4242), "CUDA_ERROR_UNKNOWN_CODE");

    // During exit the driver cannot answer; the built-in table does.
    assert!(control.fail_call("cuGetErrorName", 1, 4, 0));
    assert!(control.fail_call("cuGetErrorString", 1, 4, 0));
    assert_eq!(driver.error_name(700), "CUDA_ERROR_ILLEGAL_ADDRESS");
    let text = driver.error_text(700);
    assert!(
        !text.is_empty() && !text.starts_with("[tf-testdriver]"),
        "fallback text: {text}"
    );
    control.reset();
}

#[test]
fn check_classifies_driver_results() {
    let _serial = test_lock();
    let _control = fresh_control();
    let driver = Driver::open_path(&driver_lib()).unwrap();
    assert!(check(&driver, "x", 0).is_ok());
    assert!(matches!(
        check(&driver, "cuMemAlloc_v2", 2),
        Err(Error::OutOfMemory {
            call: "cuMemAlloc_v2"
        })
    ));
    assert!(matches!(
        check(&driver, "cuStreamQuery", 600),
        Err(Error::NotReady)
    ));
    assert!(matches!(
        check(&driver, "cuModuleGetFunction", 500),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        check(&driver, "cuStreamSynchronize", 700),
        Err(Error::ContextLost { code: 700, .. })
    ));
    match check(&driver, "cuModuleLoadData", 200) {
        Err(Error::Failed {
            call,
            code,
            name,
            text,
        }) => {
            assert_eq!(
                (call, code, name.as_str()),
                ("cuModuleLoadData", 200, "CUDA_ERROR_INVALID_IMAGE")
            );
            assert!(text.starts_with("[tf-testdriver]"), "{text}");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
}

#[test]
fn driver_is_send_and_sync_and_usable_across_threads() {
    let _serial = test_lock();
    let _control = fresh_control();
    let driver = std::sync::Arc::new(Driver::open_path(&driver_lib()).unwrap());
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let d = driver.clone();
            std::thread::spawn(move || d.device_count())
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("thread ran").unwrap(), 1);
    }
}
