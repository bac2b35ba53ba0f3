//! One device context per process on the multi-GPU path: the MiniMax H3 pipeline of a rank loads into its DiT
//! communicator's context, which the rank made before the pipeline (as `tf video --gpus N` and `tf worker --gpus N`
//! do), and opens no context of its own. Two contexts of one device are distinct to tf-cuda: the DiT's step runs on
//! the communicator's stream, and its GEMM plans and buffers refuse a stream of another context. Runs on the test
//! driver (a fake libcuda over host memory) and a fake NCCL, so no GPU is needed.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/fixture_dir.rs"]
mod fixture_dir;
// The fake NCCL that tf-nccl's own host tests build (from C) and drive.
#[path = "../../tf-nccl/tests/common/mod.rs"]
mod fake_nccl;

use std::path::Path;
use std::sync::Arc;

use tf_cuda::{Context, Stream};
use tf_engines::minimax_h3::dit_gpu::parallel::{SequenceParallel, SpAttention};
use tf_engines::minimax_h3::pipeline::{Backend, H3Pipeline, LoadOptions, PipelineError};
use tf_engines::nn::memory_plan::Residency;
use tf_nccl::{Comm, CommOptions, Nccl};
use tf_testdriver::{library_path, test_lock, Control};

const RETAIN: &str = "cuDevicePrimaryCtxRetain";
const CREATE_STREAM: &str = "cuStreamCreate";

/// Loads on the GPU backend with the device budget capped so the memory plan picks the sequential mode: nothing
/// is uploaded at load (the test driver runs no real kernels), yet the load opens its context. The cap starts
/// below every component and is raised to each component the plan names as too large, until one fits at a time.
fn load_sequential(model: &Path, options: &LoadOptions) -> H3Pipeline {
    let mut options = options.clone();
    let mut cap = 1;
    for _ in 0..8 {
        options.device_budget = Some(cap);
        match H3Pipeline::load(model, &options) {
            Ok(pipeline) => {
                assert_eq!(pipeline.load_report().residency, Residency::Sequential);
                return pipeline;
            }
            Err(PipelineError::CappedBudget { source, .. }) => cap = source.bytes,
            Err(e) => panic!("loading {} on the test driver: {e}", model.display()),
        }
    }
    panic!("no cap gave the sequential plan");
}

#[test]
fn a_ranks_pipeline_loads_into_its_communicators_context() {
    let _serial = test_lock();
    let control = Control::open().expect("open the test driver's controls");
    control.reset();
    let driver_path = library_path().expect("find the test driver");
    // The pipeline opens the driver by this variable when it opens a context itself (one GPU).
    std::env::set_var("TF_CUDA_DRIVER", &driver_path);
    let nccl_path = fake_nccl::build_library("h3_context_fake_nccl", fake_nccl::FAKE_SOURCE);
    let _fake = fake_nccl::Fake::open(&nccl_path);
    let nccl = Nccl::open_path(&nccl_path).unwrap();
    let model = fixture_dir::find("minimax_h3_pipeline").join("model");

    // The rank's communicator, on a context and stream of its own making, before any pipeline.
    let driver = tf_cuda::open_driver().unwrap();
    let rank_ctx = Context::new(driver, 0).unwrap();
    let stream = Arc::new(Stream::new(&rank_ctx, false).unwrap());
    let id = nccl.unique_id().unwrap();
    let comm = Comm::init_rank(&nccl, stream, &id, 0, 1, CommOptions::default()).unwrap();
    let sp = SequenceParallel {
        comm: Arc::new(comm),
        attention: SpAttention::Ulysses,
    };
    assert!(sp.context().same_as(&rank_ctx));

    let mut options = LoadOptions::new(Backend::Gpu);
    options.sequence_parallel = Some(sp.clone());
    let retains = control.call_count(RETAIN);
    let streams = control.call_count(CREATE_STREAM);
    let pipeline = load_sequential(&model, &options);
    let ctx = pipeline
        .context()
        .expect("a GPU pipeline holds its context");
    assert!(
        ctx.same_as(&rank_ctx),
        "the rank's pipeline opened a context of its own beside the communicator's"
    );
    assert_eq!(
        control.call_count(RETAIN),
        retains,
        "the rank's pipeline retained the device's context again"
    );
    // Every component of the rank's pipeline runs on the communicator's stream, and the load made none.
    let device = pipeline.device().expect("a GPU pipeline holds its device");
    assert!(Arc::ptr_eq(device.stream(), sp.comm.stream()));
    assert_eq!(control.call_count(CREATE_STREAM), streams);
    drop(pipeline);

    // One GPU: the pipeline opens its own context (the check above tells the two apart) and one blocking
    // stream for all its components.
    let single = load_sequential(&model, &LoadOptions::new(Backend::Gpu));
    let own = single.context().expect("a GPU pipeline holds its context");
    assert!(!own.same_as(&rank_ctx));
    assert!(control.call_count(RETAIN) > retains);
    // Live now: the communicator's stream (made non-blocking above) and the pipeline's one, blocking.
    assert_eq!(control.counter("streams"), Some(2));
    assert_eq!(control.counter("nonblocking_streams"), Some(1));
}
