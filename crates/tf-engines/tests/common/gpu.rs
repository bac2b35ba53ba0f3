//! What the GPU tests share: a context on device 0 and the cosine similarity they print beside the relative L2.

#![allow(dead_code)]

use std::sync::Arc;

use tf_cuda::{Context, Driver};

/// A context on device 0.
pub fn context() -> Context {
    let driver = Arc::new(Driver::open().expect("open the CUDA driver (libcuda.so.1)"));
    Context::new(driver, 0).expect("create a context on device 0")
}

/// The cosine similarity of `a` and `b`, in f64 (0 when either is all zeros).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += f64::from(x) * f64::from(y);
        aa += f64::from(x) * f64::from(x);
        bb += f64::from(y) * f64::from(y);
    }
    ab / (aa.sqrt() * bb.sqrt()).max(f64::MIN_POSITIVE)
}
