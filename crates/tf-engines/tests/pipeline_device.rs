//! A GPU pipeline opens one context and one blocking stream at load, and its components borrow them (they make
//! no stream of their own). Runs on the test driver (a fake libcuda over host memory), so no GPU is needed: the
//! device budget is capped so that the memory plan picks the sequential mode, which opens the device at load and
//! uploads nothing (the test driver runs no real kernels).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use tf_engines::nn::memory_plan::{MemoryPlanError, Residency};
use tf_testdriver::{library_path, test_lock, Control};

/// Raises a device-budget cap from 1 byte to each component the plan names as too large, until `load` succeeds
/// in the sequential mode; returns what it loaded.
fn load_capped<P, E: std::fmt::Display>(
    mut load: impl FnMut(u64) -> Result<P, E>,
    capped: impl Fn(&E) -> Option<&MemoryPlanError>,
) -> P {
    let mut cap = 1;
    for _ in 0..8 {
        match load(cap) {
            Ok(pipeline) => return pipeline,
            Err(e) => match capped(&e) {
                Some(source) => cap = source.bytes,
                None => panic!("loading on the test driver: {e}"),
            },
        }
    }
    panic!("no cap gave the sequential plan");
}

/// Live streams (all and non-blocking) on the test driver.
fn streams(control: &Control) -> (i64, i64) {
    (
        control.counter("streams").unwrap(),
        control.counter("nonblocking_streams").unwrap(),
    )
}

#[test]
fn qwen_image_pipeline_holds_one_blocking_stream() {
    use tf_engines::qwen_image::pipeline::{Backend, LoadOptions, Pipeline, PipelineError};
    let _serial = test_lock();
    let control = Control::open().expect("open the test driver's controls");
    control.reset();
    std::env::set_var(
        "TF_CUDA_DRIVER",
        library_path().expect("find the test driver"),
    );
    let model = fixture_dir::find("qwen_pipeline").join("model");
    let before = streams(&control);
    let pipeline = load_capped(
        |cap| {
            let mut options = LoadOptions::new(Backend::Gpu);
            options.device_budget = Some(cap);
            Pipeline::load(&model, &options)
        },
        |e| match e {
            PipelineError::CappedBudget { source, .. } => Some(source),
            _ => None,
        },
    );
    assert_eq!(pipeline.load_report().residency, Residency::Sequential);
    let device = pipeline.device().expect("a GPU pipeline holds its device");
    assert!(device.context().same_as(pipeline.context().unwrap()));
    assert_eq!(streams(&control), (before.0 + 1, before.1));
    drop(pipeline);
    assert_eq!(
        streams(&control),
        before,
        "the pipeline's stream outlived it"
    );
}

#[test]
fn minimax_h3_pipeline_holds_one_blocking_stream() {
    use tf_engines::minimax_h3::pipeline::{Backend, H3Pipeline, LoadOptions, PipelineError};
    let _serial = test_lock();
    let control = Control::open().expect("open the test driver's controls");
    control.reset();
    std::env::set_var(
        "TF_CUDA_DRIVER",
        library_path().expect("find the test driver"),
    );
    let model = fixture_dir::find("minimax_h3_pipeline").join("model");
    let before = streams(&control);
    let pipeline = load_capped(
        |cap| {
            let mut options = LoadOptions::new(Backend::Gpu);
            options.device_budget = Some(cap);
            H3Pipeline::load(&model, &options)
        },
        |e| match e {
            PipelineError::CappedBudget { source, .. } => Some(source),
            _ => None,
        },
    );
    assert_eq!(pipeline.load_report().residency, Residency::Sequential);
    assert!(pipeline.device().is_some());
    assert_eq!(streams(&control), (before.0 + 1, before.1));
    drop(pipeline);
    assert_eq!(
        streams(&control),
        before,
        "the pipeline's stream outlived it"
    );
}
