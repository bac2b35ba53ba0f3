//! What the GPU tests share: a context on device 0, the cosine similarity they print beside the relative L2, the
//! assertion that bounds both, and the event timing of enqueued work.

#![allow(dead_code)]

use std::sync::Arc;

use tf_cuda::{Context, Driver, Event, Stream};
use tf_engines::nn::tensor::{relative_l2, TensorF32};

/// A context on device 0.
pub fn context() -> Context {
    let driver = Arc::new(Driver::open().expect("open the CUDA driver (libcuda.so.1)"));
    Context::new(driver, 0).expect("create a context on device 0")
}

/// A context on device 0 when it is an sm_90 GPU, or None (printed as SKIPPED, naming `what` needs sm_90). With no
/// driver or no GPU at all the test panics: it must never pass on a machine that could not run it.
pub fn sm90_context(test: &str, what: &str) -> Option<Context> {
    let driver = Arc::new(
        Driver::open()
            .unwrap_or_else(|e| panic!("{test}: no CUDA driver ({e}); run it on the GPU machine")),
    );
    let ctx = Context::new(driver, 0)
        .unwrap_or_else(|e| panic!("{test}: no GPU ({e}); run it on the GPU machine"));
    let cc = ctx.device_info().map(|i| i.compute_capability).ok();
    if cc != Some((9, 0)) {
        println!("{test}: SKIPPED: {what} needs an sm_90 GPU (this one: {cc:?})");
        return None;
    }
    Some(ctx)
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

/// Asserts `actual` has `reference`'s shape, finite values, a relative L2 error at most `rel_l2_max` and a cosine
/// at least `cosine_min`, printing both figures and their bounds under the label `what`.
pub fn assert_close_within(
    what: &str,
    actual: &TensorF32,
    reference: &TensorF32,
    rel_l2_max: f64,
    cosine_min: f64,
) {
    assert_eq!(actual.shape(), reference.shape(), "{what}: shape");
    assert!(
        actual.data().iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let err = relative_l2(actual.data(), reference.data()).unwrap();
    let cos = cosine(actual.data(), reference.data());
    println!(
        "{what}: shape {:?}, relative L2 {err:.3e} (max {rel_l2_max:e}), cosine {cos:.6} (min {cosine_min})",
        actual.shape()
    );
    assert!(
        err <= rel_l2_max,
        "{what}: relative L2 {err:.3e} > {rel_l2_max:e}"
    );
    assert!(cos >= cosine_min, "{what}: cosine {cos:.6} < {cosine_min}");
}

/// Times `f` (which enqueues work on `stream`) over `iters` runs after 3 warm-up runs, with events on `stream`;
/// milliseconds per run.
pub fn time_ms(ctx: &Context, stream: &Stream, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let start = Event::new(ctx, true).expect("event");
    let end = Event::new(ctx, true).expect("event");
    start.record(stream).expect("record");
    for _ in 0..iters {
        f();
    }
    end.record(stream).expect("record");
    end.synchronize().expect("synchronize");
    f64::from(Event::elapsed_ms(&start, &end).expect("elapsed")) / iters as f64
}
