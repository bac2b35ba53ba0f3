//! A GPU pipeline opens one context and one blocking stream at load, and its components borrow them (they make
//! no stream of their own). Runs on the test driver (a fake libcuda over host memory), so no GPU is needed: the
//! device budget is capped so that the memory plan picks the sequential mode, which opens the device at load and
//! uploads nothing (the test driver runs no real kernels).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::Path;

use tf_engines::nn::memory_plan::{MemoryPlanError, Residency};
use tf_testdriver::{library_path, test_lock, Control};

/// Live streams (all and non-blocking) on the test driver.
fn streams(control: &Control) -> (i64, i64) {
    (
        control.counter("streams").unwrap(),
        control.counter("nonblocking_streams").unwrap(),
    )
}

/// Loads the fixture `model` on the test driver's GPU with the device budget capped so the memory plan picks the
/// sequential mode: the cap starts at 1 byte and is raised to each component the plan names as too large (`capped`
/// reads that from a refusal). Checks that the loaded pipeline holds exactly one more live stream, a blocking one,
/// and that dropping it releases the stream.
fn check_one_blocking_stream<P, E: std::fmt::Display>(
    model: &str,
    mut load: impl FnMut(&Path, u64) -> Result<P, E>,
    capped: impl Fn(&E) -> Option<&MemoryPlanError>,
    checks: impl Fn(&P),
) {
    let _serial = test_lock();
    let control = Control::open().expect("open the test driver's controls");
    control.reset();
    std::env::set_var(
        "TF_CUDA_DRIVER",
        library_path().expect("find the test driver"),
    );
    let model = fixture_dir::find(model).join("model");
    let before = streams(&control);
    let mut cap = 1;
    let pipeline = loop {
        match load(&model, cap) {
            Ok(pipeline) => break pipeline,
            Err(e) => match capped(&e) {
                Some(source) if source.bytes > cap => cap = source.bytes,
                _ => panic!("loading {} on the test driver: {e}", model.display()),
            },
        }
    };
    checks(&pipeline);
    assert_eq!(streams(&control), (before.0 + 1, before.1));
    drop(pipeline);
    assert_eq!(
        streams(&control),
        before,
        "the pipeline's stream outlived it"
    );
}

/// One test per model: its pipeline's GPU load, capped to the sequential plan, holds one blocking stream.
macro_rules! holds_one_blocking_stream {
    ($test:ident, $fixture:literal, $model:ident, $pipeline:ident) => {
        #[test]
        fn $test() {
            use tf_engines::$model::pipeline::{$pipeline, Backend, LoadOptions, PipelineError};
            check_one_blocking_stream(
                $fixture,
                |model, cap| {
                    let mut options = LoadOptions::new(Backend::Gpu);
                    options.device_budget = Some(cap);
                    $pipeline::load(model, &options)
                },
                |e| match e {
                    PipelineError::CappedBudget { source, .. } => Some(source),
                    _ => None,
                },
                |pipeline| {
                    assert_eq!(pipeline.load_report().residency, Residency::Sequential);
                    let device = pipeline.device().expect("a GPU pipeline holds its device");
                    assert!(device.context().same_as(pipeline.context().unwrap()));
                },
            );
        }
    };
}

holds_one_blocking_stream!(
    qwen_image_pipeline_holds_one_blocking_stream,
    "qwen_pipeline",
    qwen_image,
    Pipeline
);
holds_one_blocking_stream!(
    minimax_h3_pipeline_holds_one_blocking_stream,
    "minimax_h3_pipeline",
    minimax_h3,
    H3Pipeline
);
