//! The GPU DiT backend against the diffusers 0.42.1 fp32 fixtures (tests/fixtures/qwen_dit): every case, no
//! cache, extract then cached (also with a cache extracted on the host), CUDA graph replay bit-equal to the
//! eager step, a bounded set of workspaces across prompt lengths, and a load/unload cycle that leaves no device
//! or pinned memory behind.
//!
//! Tolerance: the backend stores bf16 and accumulates in f32, so its distance to the fp32 reference is a few
//! bf16 unit roundoffs (2^-8 = 0.39%) compounded over every rounding point of the layers. On the tiny
//! fixtures the first H200 run measured 2.3e-2 relative L2 at cosine 0.99973 (cond_b2), so `REL_L2_MAX` is
//! 4e-2 and `COSINE_MIN` 0.9995. The binding accuracy criterion is the full-size one (ours against fp32 at
//! most 1.5x the diffusers bf16 floor, `qwen21-compare` in the GPU bundle); these tests guard the structure
//! (every path, both KV modes) where a wrong mask or row order gives errors of order 1. Every comparison
//! prints both figures.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/gpu.rs"]
mod gpu_support;
use gpu_support::{assert_close_within, context};

use tf_cuda::Context;
use tf_engines::nn::tensor::{Tensor, TensorF32};
use tf_engines::nn::upload::StagingConfig;
use tf_engines::qwen_image::dit::{DitBackend, DitInputs, HostKvCache, KvStep};
use tf_engines::qwen_image::dit_gpu::GpuDit;
use tf_engines::qwen_image::dit_host::HostDit;

const REL_L2_MAX: f64 = 4e-2;
const COSINE_MIN: f64 = 0.9995;

#[path = "common/qwen_fixtures.rs"]
mod qwen_fixtures;
use qwen_fixtures::{cases, expected, inputs, model};

fn load(ctx: &Context, case: &str) -> GpuDit {
    // Small slots so even the tiny models exercise the ring of pinned staging slots.
    let staging = StagingConfig {
        slot_bytes: 8192,
        slots: 2,
        threads: 3,
    };
    let dit = GpuDit::load_on(ctx, &model(case), staging).expect("load the model on the GPU");
    println!("{case}: loaded ({})", dit.load_stats());
    dit
}

fn assert_close(case: &str, what: &str, actual: &TensorF32, reference: &TensorF32) {
    assert_close_within(
        &format!("{case}/{what}"),
        actual,
        reference,
        REL_L2_MAX,
        COSINE_MIN,
    );
}

/// Runs step0 without a cache (also warms the workspace); every fixture case must run, including padding in
/// several ranges (no_causal), which the backend handles by gathering the valid keys.
fn warm_up(case: &str, dit: &mut GpuDit) {
    if let Err(e) = dit.forward(&inputs(case, "step0"), KvStep::None) {
        panic!("{case}: forward failed: {e}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn full_forward_matches_diffusers() {
    let ctx = context();
    let mut ran = 0;
    for case in cases() {
        let mut dit = load(&ctx, &case);
        dit.set_graphs(false);
        warm_up(&case, &mut dit);
        ran += 1;
        let out = dit.forward(&inputs(&case, "step0"), KvStep::None).unwrap();
        assert!(out.kv_cache.is_none());
        assert_close(
            &case,
            "sample_full",
            &out.sample,
            &expected(&case).to_f32("sample_full").unwrap(),
        );
    }
    assert!(
        ran >= 3,
        "expected at least three fixture cases, found {ran}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn extract_then_cached_matches_diffusers() {
    let ctx = context();
    let mut covered = 0;
    for case in cases() {
        let reference = expected(&case);
        if !reference.contains("sample_cached") {
            continue;
        }
        covered += 1;
        let mut dit = load(&ctx, &case);
        let extract = dit
            .forward(&inputs(&case, "step0"), KvStep::Extract)
            .unwrap();
        assert_close(
            &case,
            "sample_extract",
            &extract.sample,
            &reference.to_f32("sample_extract").unwrap(),
        );
        let cache = extract.kv_cache.expect("extract returns the cache");
        let host = dit.kv_to_host(&cache).unwrap();
        for (i, (k, v)) in host.layers.iter().enumerate() {
            assert_close(
                &case,
                &format!("kv.{i}.k"),
                k,
                &reference.to_f32(&format!("kv.{i}.k")).unwrap(),
            );
            assert_close(
                &case,
                &format!("kv.{i}.v"),
                v,
                &reference.to_f32(&format!("kv.{i}.v")).unwrap(),
            );
        }
        let cached = dit
            .forward(&inputs(&case, "step1"), KvStep::Cached(&cache))
            .unwrap();
        assert_close(
            &case,
            "sample_cached",
            &cached.sample,
            &reference.to_f32("sample_cached").unwrap(),
        );
        // Second cached step: replays the captured graph.
        let again = dit
            .forward(&inputs(&case, "step1"), KvStep::Cached(&cache))
            .unwrap();
        assert_eq!(
            again.sample.data(),
            cached.sample.data(),
            "{case}: cached graph replay differs from the eager step"
        );

        // A cache extracted by the host reference works on the GPU (and the round trip through the host format).
        let mut host_dit = HostDit::load(&model(&case)).unwrap();
        let host_cache: HostKvCache = host_dit
            .forward(&inputs(&case, "step0"), KvStep::Extract)
            .unwrap()
            .kv_cache
            .unwrap();
        let from_host = dit.kv_from_host(host_cache).unwrap();
        let cached2 = dit
            .forward(&inputs(&case, "step1"), KvStep::Cached(&from_host))
            .unwrap();
        assert_close(
            &case,
            "sample_cached (host cache)",
            &cached2.sample,
            &reference.to_f32("sample_cached").unwrap(),
        );
    }
    assert!(
        covered >= 3,
        "expected at least three cases with a KV cache"
    );
}

/// Whether two outputs hold the same bits, value for value.
fn bit_equal(a: &TensorF32, b: &TensorF32) -> bool {
    a.data()
        .iter()
        .zip(b.data())
        .all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn graph_replay_is_bit_equal_to_eager() {
    let ctx = context();
    for case in cases() {
        let mut eager = load(&ctx, &case);
        eager.set_graphs(false);
        warm_up(&case, &mut eager);
        let step = inputs(&case, "step0");
        let reference = eager.forward(&step, KvStep::None).unwrap();
        let mut graphed = load(&ctx, &case);
        graphed.set_graphs(true);
        let first = graphed.forward(&step, KvStep::None).unwrap(); // eager, graph captured meanwhile
        let replay = graphed.forward(&step, KvStep::None).unwrap(); // replay
        let replay2 = graphed.forward(&step, KvStep::None).unwrap(); // replay
        let same = bit_equal;
        println!(
            "{case}: eager vs graph replay: {} values compared bitwise",
            reference.sample.data().len()
        );
        assert!(
            same(&reference.sample, &first.sample),
            "{case}: two eager steps differ"
        );
        assert!(
            same(&reference.sample, &replay.sample),
            "{case}: graph replay differs from eager"
        );
        assert!(
            same(&reference.sample, &replay2.sample),
            "{case}: second graph replay differs"
        );
        // New inputs of the same layout go through the same graph (only the uploaded buffers change).
        if case != "no_causal" {
            let step1 = inputs(&case, "step1");
            let mut eager1 = load(&ctx, &case);
            eager1.set_graphs(false);
            let want = eager1.forward(&step1, KvStep::None).unwrap();
            let got = graphed.forward(&step1, KvStep::None).unwrap();
            assert!(
                same(&want.sample, &got.sample),
                "{case}: graph replay on new inputs differs from eager"
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn cached_step_graph_is_reused_across_requests() {
    let ctx = context();
    let mut dit = load(&ctx, "t2i");
    dit.set_graphs(true);
    let mut eager = load(&ctx, "t2i");
    eager.set_graphs(false);
    let extract = eager
        .forward(&inputs("t2i", "step0"), KvStep::Extract)
        .unwrap();
    let cache = extract.kv_cache.expect("an extract step returns its cache");
    let want = eager
        .forward(&inputs("t2i", "step1"), KvStep::Cached(&cache))
        .unwrap();
    // Three requests: extract, then two cached steps, each with a fresh cache dropped at the request's end.
    let mut graphs_after = Vec::new();
    for request in 0..3 {
        let out = dit
            .forward(&inputs("t2i", "step0"), KvStep::Extract)
            .unwrap();
        let cache = out.kv_cache.expect("an extract step returns its cache");
        for _ in 0..2 {
            let got = dit
                .forward(&inputs("t2i", "step1"), KvStep::Cached(&cache))
                .unwrap();
            assert!(
                bit_equal(&got.sample, &want.sample),
                "request {request}: cached step differs from eager"
            );
        }
        graphs_after.push(dit.captured_graphs());
    }
    println!("captured graphs after each request: {graphs_after:?}");
    // Request 0 captures both steps while their eager runs execute (the extract step's graph and the cached
    // step's, for its cache); requests 1 and 2 find both: the driver hands the freed cache's block back at the
    // same address, so no capture is needed.
    assert_eq!(
        graphs_after[0], 2,
        "request 0 did not capture both steps ahead: {graphs_after:?}"
    );
    assert_eq!(
        graphs_after[2], graphs_after[1],
        "request 2 captured again: {graphs_after:?}"
    );
}

/// `base` with only its first `text_rows` text rows (a t2i input: the image mask's first entries are the text).
fn with_text_rows(base: &DitInputs, text_rows: usize) -> DitInputs {
    let [batch, rows, width] = base.encoder_hidden_states.dims::<3>("text").unwrap();
    assert!(batch == 1 && text_rows <= rows);
    let text = base.encoder_hidden_states.data()[..text_rows * width].to_vec();
    let mask = base.img_mask.data();
    assert!(mask[..rows].iter().all(|&m| m == 0), "not a t2i input");
    let mut img_mask = vec![0u8; text_rows];
    img_mask.extend_from_slice(&mask[rows..]);
    let mask_len = img_mask.len();
    DitInputs {
        hidden_states: base.hidden_states.clone(),
        encoder_hidden_states: Tensor::new(vec![1, text_rows, width], text).unwrap(),
        timestep: base.timestep.clone(),
        img_mask: Tensor::new(vec![1, mask_len], img_mask).unwrap(),
        encoder_hidden_states_mask: None,
        img_shapes: base.img_shapes.clone(),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn workspaces_stay_bounded_across_prompt_lengths() {
    let ctx = context();
    let mut dit = load(&ctx, "t2i");
    dit.set_graphs(true);
    let base = inputs("t2i", "step0");
    let rows = base.encoder_hidden_states.shape()[1];
    // Every prompt length is a step shape of its own: more lengths than the DiT keeps workspaces for, then two
    // repeats, one whose workspace was dropped (made again, eager) and one still held (graph capture and replay).
    let mut lengths: Vec<usize> = (1..=rows).rev().collect();
    lengths.extend([rows, 2.min(rows)]);
    let mut first: Vec<(usize, TensorF32)> = Vec::new();
    // A new shape met by a full set builds its workspace from the buffers of the one it gives up: only the
    // exact-size output is allocated (the text rows here only shrink or repeat, so every other part fits).
    const MOST_NEW_ALLOCATIONS: u64 = 2;
    // A GEMM kernel that has not run yet is launched once on scratch operands when its shape is planned (up to
    // five scratch buffers each), before the step is enqueued, never first inside the step.
    const PRIMING_ALLOCATIONS: u64 = 5;
    for &n in &lengths {
        let full_before = dit.workspaces_held().0 == dit.workspaces_held().1;
        let seen = first.iter().any(|(m, _)| *m == n);
        let driver_before = tf_cuda::driver_costs();
        let gemm_before = dit.gemm_cache_stats();
        let out = dit
            .forward(&with_text_rows(&base, n), KvStep::None)
            .unwrap();
        let driver = tf_cuda::driver_costs().since(&driver_before);
        let gemm = dit.gemm_cache_stats();
        let primed = (gemm.kernels - gemm_before.kernels) as u64;
        let (held, capacity) = dit.workspaces_held();
        println!(
            "{n} text rows: {held} of at most {capacity} workspaces held; {driver}; GEMM kernels {} (+{primed})",
            gemm.kernels
        );
        assert_eq!(
            gemm.kernels_first_run_by_calls, gemm_before.kernels_first_run_by_calls,
            "{n} text rows: a GEMM kernel was first launched inside the step"
        );
        assert!(
            held <= capacity,
            "{held} workspaces held, more than {capacity}"
        );
        if full_before && !seen {
            assert!(
                driver.device_allocs.calls <= MOST_NEW_ALLOCATIONS + PRIMING_ALLOCATIONS * primed,
                "{n} text rows: a new shape on a full set made {} device allocations ({primed} kernels primed)",
                driver.device_allocs.calls
            );
        }
        match first.iter().find(|(m, _)| *m == n) {
            Some((_, want)) => assert!(
                bit_equal(&out.sample, want),
                "{n} text rows: the repeat differs from the first run"
            ),
            None => first.push((n, out.sample)),
        }
    }
    let (held, capacity) = dit.workspaces_held();
    assert_eq!(
        held,
        capacity.min(rows),
        "workspaces held after {rows} shapes"
    );

    // What a warm-up leaves: every workspace given up, its buffers kept as spares; the next shapes are built from
    // them and give the same bits as their first runs.
    dit.recycle_workspaces().unwrap();
    let (spares, spare_bytes) = dit.spare_buffers();
    println!("after recycling: {spares} spare buffers, {spare_bytes} B");
    assert_eq!(dit.workspaces_held().0, 0);
    assert!(spares > 0, "recycled workspaces left no spare buffers");
    for n in [rows, 1] {
        let driver_before = tf_cuda::driver_costs();
        let kernels_before = dit.gemm_cache_stats().kernels;
        let out = dit
            .forward(&with_text_rows(&base, n), KvStep::None)
            .unwrap();
        let driver = tf_cuda::driver_costs().since(&driver_before);
        println!("{n} text rows from spares: {driver}");
        // Every shape ran before: nothing new to prime.
        assert_eq!(dit.gemm_cache_stats().kernels, kernels_before);
        assert!(
            driver.device_allocs.calls <= MOST_NEW_ALLOCATIONS,
            "{n} text rows: a workspace built from spares made {} device allocations",
            driver.device_allocs.calls
        );
        let (_, want) = first.iter().find(|(m, _)| *m == n).unwrap();
        assert!(
            bit_equal(&out.sample, want),
            "{n} text rows: the run on reused buffers differs from the first run"
        );
    }
}

/// Loads the model, runs extract, eager cached and graph-replayed cached steps, and drops everything.
fn load_run_unload(ctx: &Context) {
    let mut dit = load(ctx, "t2i");
    let extract = dit
        .forward(&inputs("t2i", "step0"), KvStep::Extract)
        .unwrap();
    let cache = extract.kv_cache.unwrap();
    let _ = dit
        .forward(&inputs("t2i", "step1"), KvStep::Cached(&cache))
        .unwrap();
    let _ = dit
        .forward(&inputs("t2i", "step1"), KvStep::Cached(&cache))
        .unwrap();
    let during = tf_cuda::usage();
    println!(
        "usage while loaded: {during:?}; weights {} B",
        dit.load_stats().weight_bytes
    );
    assert!(during.device > 0, "a loaded model holds device memory");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn load_and_unload_leave_usage_at_zero() {
    let ctx = context();
    let start = tf_cuda::usage();
    println!("usage before any load: {start:?}");
    // The first cycle may leave the runtime's own pinned copy pools warm; every later cycle must return to
    // exactly the same usage.
    load_run_unload(&ctx);
    ctx.synchronize().unwrap();
    let before = tf_cuda::usage();
    println!("usage after the first unload: {before:?}");
    assert_eq!(
        before.device, start.device,
        "device bytes left behind by the first load/unload"
    );
    load_run_unload(&ctx);
    ctx.synchronize().unwrap();
    let after = tf_cuda::usage();
    println!("usage after the second unload: {after:?}");
    assert_eq!(after.device, before.device, "device bytes left behind");
    assert_eq!(
        after.device_allocs, before.device_allocs,
        "device allocations left behind"
    );
    assert_eq!(after.host, before.host, "pinned host bytes left behind");
}
