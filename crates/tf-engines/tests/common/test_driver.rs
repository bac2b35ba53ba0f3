//! A context on the test driver (tf-testdriver's host-memory CUDA driver), for the tests that plan launches or
//! upload weights without a GPU.

#![allow(dead_code)]

use std::sync::Arc;

use tf_cuda::{Context, Driver};
use tf_testdriver::library_path;

/// A context on the test driver's device 0 (hold `tf_testdriver::test_lock` while it lives).
pub fn context() -> Context {
    let driver = Arc::new(
        Driver::open_path(&library_path().expect("find the test driver")).expect("open it"),
    );
    Context::new(driver, 0).expect("context on device 0")
}
