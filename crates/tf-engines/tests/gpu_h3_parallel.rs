//! The MiniMax H3 GPU DiT sequence-parallel over NCCL ([`GpuH3Dit::set_sequence_parallel`]):
//!
//! - one rank, through the whole NCCL path (a world-size-1 communicator: the Ulysses all-to-alls, the K/V
//!   all-gather and the output all-gather all run, as self-copies), equals the one-GPU forward bit for bit, on
//!   every committed tiny H3 fixture and on a full-width model with a few seeded blocks, for both attention
//!   choices;
//! - two ranks (only where two GPUs are visible; otherwise the test says it skipped): each rank's output within
//!   bf16 tolerance of the one-GPU output (relative L2 <= 1e-2, cosine >= 0.9999: the ranks' GEMMs run over other
//!   row counts, so their algorithms and sums may differ in the last bf16 bit), and the step-time ratio printed;
//! - at the pipeline's default canvas (1344x768, 5 s: S = 37838) with the released widths and depth (seeded
//!   weights), on every degree of 2, 4 and 8 the machine has GPUs for: the forward time against one GPU beside
//!   the goals (1.8x on 2, 3.4x on 4, 6.5x on 8) for both attention choices, which is the measurement
//!   that picks the default, and the same tolerance. Long: its own bundle step runs it (`h3-sp-canvas`).
//!
//! - the video VAE decode spread over the ranks (`GpuVideoVae::decode_spread`): one rank equals the one-GPU decode
//!   bit for bit on the tiny pipeline's decoder, with one group of clips and with a group per clip; two ranks
//!   (where two GPUs are visible, else it says it skipped) give rank 0 the same frames bit for bit.
//!
//! NCCL is found through `TF_NCCL`, `libnccl.so.2` or the Python package folders (the nvidia-nccl-cu13 wheel); a
//! machine without it prints why the test skipped. Run through `cargo xtask gpu-bundle` (step `gpu_h3_parallel`).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/gpu.rs"]
mod gpu_support;
use gpu_support::assert_close_within;
#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tf_cuda::cublaslt::AlgoSelection;
use tf_cuda::{Context, Driver, Stream};
use tf_engines::minimax_h3::config::MiniMaxH3Config;
use tf_engines::minimax_h3::dit::{H3DitBackend, H3Inputs, H3Output};
use tf_engines::minimax_h3::dit_gpu::parallel::SpAttention;
use tf_engines::minimax_h3::dit_gpu::GpuH3Dit;
use tf_engines::minimax_h3::layout::{
    Geometry, KeyframeAnchor, LayoutRequest, PackedLayout, SizeRules, StepTimesteps, TEXT_TAG,
};
use tf_engines::minimax_h3::vae_video::{TilingOptions, VideoFrames};
use tf_engines::minimax_h3::vae_video_gpu::{GpuVideoVae, GpuVideoVaeBudget};
use tf_engines::nn::sampling::seeded::SplitMix64;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_nccl::{Comm, CommOptions, Nccl};

const REL_L2_MAX: f64 = 1e-2;
const COSINE_MIN: f64 = 0.9999;
const ATTENTION: [SpAttention; 2] = [SpAttention::Ulysses, SpAttention::KvGather];

fn driver() -> Arc<Driver> {
    tf_cuda::open_driver().unwrap_or_else(|e| panic!("the CUDA driver did not open: {e}"))
}

/// NCCL, or `None` after printing why the test skips.
fn nccl(test: &str) -> Option<Arc<Nccl>> {
    match Nccl::open_with_python_packages() {
        Ok(n) => {
            println!("NCCL {} from {}", n.version(), n.path().display());
            Some(n)
        }
        Err(e) => {
            println!("SKIPPED {test}: NCCL did not load: {e}");
            None
        }
    }
}

/// Attaches a world-size-1 communicator on the DiT's stream.
fn one_rank(nccl: &Arc<Nccl>, dit: &mut GpuH3Dit, attention: SpAttention) {
    let id = nccl.unique_id().unwrap();
    let comm = Comm::init_rank(nccl, dit.stream(), &id, 0, 1, CommOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    dit.set_sequence_parallel(Arc::new(comm), attention)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dit.sequence_parallel(), Some((0, 1, attention)));
}

fn assert_bit_equal(what: &str, got: &H3Output, want: &H3Output) {
    for (name, a, b) in [
        ("sample", &got.sample, &want.sample),
        ("audio_sample", &got.audio_sample, &want.audio_sample),
    ] {
        assert_eq!(a.shape(), b.shape(), "{what}: {name} shape");
        let differ = a
            .data()
            .iter()
            .zip(b.data())
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what}: {name}: {differ} of {} values differ",
            a.data().len()
        );
        println!("{what}: {name} {:?} bit-equal", a.shape());
    }
}

/// The one-GPU forward, then the world-size-1 NCCL forward of each attention choice on the same model.
fn one_rank_equals_one_gpu(what: &str, nccl: &Arc<Nccl>, dit: &mut GpuH3Dit, inputs: &H3Inputs) {
    // One algorithm per GEMM shape in both runs, whatever the plan cache holds.
    dit.set_gemm_selection(AlgoSelection::Heuristic).unwrap();
    dit.set_graphs(false);
    let single = dit.forward(inputs).unwrap();
    for attention in ATTENTION {
        one_rank(nccl, dit, attention);
        let parallel = dit.forward(inputs).unwrap();
        assert_bit_equal(
            &format!("{what} ({}, 1 rank)", attention.name()),
            &parallel,
            &single,
        );
        // A second forward reuses the workspace and its exchange buffers.
        let again = dit.forward(inputs).unwrap();
        assert_bit_equal(
            &format!("{what} ({}, 1 rank, again)", attention.name()),
            &again,
            &single,
        );
        dit.clear_sequence_parallel();
        assert_eq!(dit.sequence_parallel(), None);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run through cargo xtask gpu-bundle"]
fn one_rank_through_nccl_equals_one_gpu_on_the_tiny_fixtures() {
    let Some(nccl) = nccl("one_rank_through_nccl_equals_one_gpu_on_the_tiny_fixtures") else {
        return;
    };
    let ctx = Context::new(driver(), 0).unwrap();
    let dir = fixture_dir::find("minimax_h3_dit");
    for case in fixture_dir::manifest_cases(&dir, 1) {
        let model = ModelDir::open(&dir.join(&case).join("model")).unwrap();
        let mut dit = GpuH3Dit::load_on(&ctx, &model).unwrap();
        let inputs = H3Inputs::from_bundle(
            &SafetensorsFile::open(&dir.join(&case).join("inputs.safetensors")).unwrap(),
        )
        .unwrap();
        one_rank_equals_one_gpu(&case, &nccl, &mut dit, &inputs);
    }
}

/// The released widths (56 heads of 128, hidden 5376) with `layers` blocks.
fn full_width(layers: usize) -> MiniMaxH3Config {
    MiniMaxH3Config {
        num_layers: layers,
        num_refiner_layers: 1,
        ..MiniMaxH3Config::default_full_size()
    }
}

/// Seeded inputs of `config` over a 22-frame layout of `h` x `w` latents with 32 text rows.
fn layout_inputs(config: &MiniMaxH3Config, h: usize, w: usize, seed: u64) -> H3Inputs {
    let tags = [1u8; 32];
    let layout = PackedLayout::build(&LayoutRequest {
        text_tags: &tags,
        geometry: Geometry::from_latents(22, h, w).unwrap(),
        patch: config.patch_size,
        keyframes: &[KeyframeAnchor::First],
    })
    .unwrap();
    let t = layout
        .row_timesteps(StepTimesteps::pipeline(0.4, 0.3))
        .unwrap();
    let mut rng = SplitMix64::new(seed);
    let (nv, na) = (layout.video_indices.len(), layout.audio_indices.len());
    let mut rows = |n: usize, c: usize| {
        TensorF32::new(vec![1, n, c], rng.uniform_vec(n * c, -1.0, 1.0)).unwrap()
    };
    let video = rows(nv, config.video_patch_dim());
    let audio = rows(na, config.audio_in_channels);
    let text = rows(tags.len(), config.text_dim);
    println!(
        "layout {h}x{w} latents: {} rows ({nv} video, {na} audio, {} text)",
        layout.seq_len,
        tags.len()
    );
    H3Inputs::from_layout(&layout, &t, video, audio, text).unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run through cargo xtask gpu-bundle"]
fn one_rank_through_nccl_equals_one_gpu_at_full_width() {
    let Some(nccl) = nccl("one_rank_through_nccl_equals_one_gpu_at_full_width") else {
        return;
    };
    let ctx = Context::new(driver(), 0).unwrap();
    let config = full_width(2);
    let mut dit = GpuH3Dit::random_on(&ctx, &config, 11).unwrap();
    let inputs = layout_inputs(&config, 8, 8, 3);
    one_rank_equals_one_gpu("full width, 2 blocks", &nccl, &mut dit, &inputs);
}

/// What every rank of a threaded multi-GPU run shares: the driver, NCCL, the model (seeded weights) and inputs.
struct Job<'a> {
    driver: &'a Arc<Driver>,
    nccl: &'a Arc<Nccl>,
    config: &'a MiniMaxH3Config,
    seed: u64,
    inputs: &'a H3Inputs,
}

impl Job<'_> {
    /// The forward on devices `0..world`, each rank in a thread of its own: every rank's output and its fastest
    /// forward of `repeats` after a warm-up.
    fn ranks(
        &self,
        world: usize,
        attention: SpAttention,
        repeats: usize,
    ) -> Vec<(H3Output, Duration)> {
        let id = self.nccl.unique_id().unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let id = &id;
                    s.spawn(move || {
                        let ctx = Context::new(Arc::clone(self.driver), rank as i32).unwrap();
                        let mut dit = GpuH3Dit::random_on(&ctx, self.config, self.seed).unwrap();
                        let options = CommOptions::default();
                        let comm =
                            Comm::init_rank(self.nccl, dit.stream(), id, rank, world, options)
                                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                        dit.set_sequence_parallel(Arc::new(comm), attention)
                            .unwrap();
                        best_of(repeats, || dit.forward(self.inputs).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

/// The fastest of `n` forwards after a warm-up.
fn best_of(n: usize, mut forward: impl FnMut() -> H3Output) -> (H3Output, Duration) {
    let mut out = forward();
    let mut best = Duration::MAX;
    for _ in 0..n {
        let start = Instant::now();
        out = forward();
        best = best.min(start.elapsed());
    }
    (out, best)
}

#[test]
#[ignore = "needs two NVIDIA GPUs and NCCL: run through cargo xtask gpu-bundle"]
fn two_ranks_match_one_gpu_within_bf16_tolerance() {
    let test = "two_ranks_match_one_gpu_within_bf16_tolerance";
    let driver = driver();
    let visible = driver.device_count().unwrap();
    if visible < 2 {
        println!("SKIPPED {test}: {visible} GPU(s) visible, two needed");
        return;
    }
    let Some(nccl) = nccl(test) else {
        return;
    };
    let config = full_width(4);
    let inputs = layout_inputs(&config, 24, 42, 5);
    let seed = 17;
    let (single, single_time) = {
        let ctx = Context::new(Arc::clone(&driver), 0).unwrap();
        let mut dit = GpuH3Dit::random_on(&ctx, &config, seed).unwrap();
        dit.set_graphs(false);
        best_of(3, || dit.forward(&inputs).unwrap())
    };
    println!(
        "one GPU: {:.2} ms a forward",
        single_time.as_secs_f64() * 1e3
    );
    for attention in ATTENTION {
        let job = Job {
            driver: &driver,
            nccl: &nccl,
            config: &config,
            seed,
            inputs: &inputs,
        };
        let results = job.ranks(2, attention, 3);
        for (rank, (out, time)) in results.iter().enumerate() {
            let what = format!("2 ranks ({}), rank {rank}", attention.name());
            assert_close_within(
                &format!("{what}: sample"),
                &out.sample,
                &single.sample,
                REL_L2_MAX,
                COSINE_MIN,
            );
            assert_close_within(
                &format!("{what}: audio_sample"),
                &out.audio_sample,
                &single.audio_sample,
                REL_L2_MAX,
                COSINE_MIN,
            );
            println!(
                "{what}: {:.2} ms a forward, {:.2}x the one-GPU speed",
                time.as_secs_f64() * 1e3,
                single_time.as_secs_f64() / time.as_secs_f64()
            );
        }
        // Every rank returns the same gathered outputs.
        assert_bit_equal(
            &format!("2 ranks ({}): rank 1 against rank 0", attention.name()),
            &results[1].0,
            &results[0].0,
        );
    }
}

/// The tiny pipeline's video VAE on `ctx`, tiled into 2 x 3 tiles of 16 px, and seeded latents of 17 frames (three
/// chunks): with `max_rows` 1 every clip is a group of its own (three decode units), by default they share one.
fn tiny_video_vae(ctx: &Context, max_rows: Option<usize>) -> (GpuVideoVae, TensorF32) {
    let dir = fixture_dir::find("minimax_h3_pipeline")
        .join("model")
        .join("vae");
    let mut vae = GpuVideoVae::load_on(ctx, &ModelDir::open(&dir).unwrap()).unwrap();
    vae.set_tiling(TilingOptions {
        enabled: true,
        tile_height: 16,
        tile_width: 16,
        min_overlap_height: 4,
        min_overlap_width: 4,
    })
    .unwrap();
    if let Some(max_rows) = max_rows {
        vae.set_budget(GpuVideoVaeBudget { max_rows });
    }
    let c = vae.config().latent_channels;
    let shape = vec![1, c, 17, 6, 10];
    let n: usize = shape.iter().product();
    let latents = TensorF32::new(shape, SplitMix64::new(41).uniform_vec(n, -2.0, 2.0)).unwrap();
    (vae, latents)
}

fn assert_frames_bit_equal(what: &str, got: &VideoFrames, want: &VideoFrames) {
    assert_eq!(
        (got.frames, got.height, got.width),
        (want.frames, want.height, want.width),
        "{what}: size"
    );
    assert!(got.rgb == want.rgb, "{what}: the 8-bit frames differ");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&got.pixels) == bits(&want.pixels),
        "{what}: the f32 frames differ"
    );
}

/// The video decode spread over one rank (the pipeline's `--gpus 1 --force-nccl` path) equals the one-GPU decode
/// bit for bit, with one group and with a group per clip.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run through cargo xtask gpu-bundle"]
fn one_rank_spread_video_decode_equals_one_gpu() {
    let test = "one_rank_spread_video_decode_equals_one_gpu";
    let Some(nccl) = nccl(test) else {
        return;
    };
    let ctx = Context::new(driver(), 0).unwrap();
    for max_rows in [None, Some(1)] {
        let (mut vae, latents) = tiny_video_vae(&ctx, max_rows);
        let single = vae.decode(&latents).unwrap();
        let stream = Arc::new(Stream::new(&ctx, false).unwrap());
        let id = nccl.unique_id().unwrap();
        let comm = Comm::init_rank(&nccl, stream, &id, 0, 1, CommOptions::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let spread = vae
            .decode_spread(&latents, &comm)
            .unwrap()
            .expect("rank 0 holds the frames");
        let what = format!("1 rank, max_rows {max_rows:?}");
        assert_frames_bit_equal(&what, &spread, &single);
        println!(
            "{what}: {} frames of {}x{} bit-equal to one GPU",
            single.frames, single.width, single.height
        );
    }
}

/// Two ranks (where two GPUs are visible; otherwise the test says it skipped): rank 0's frames of the spread decode
/// equal the one-GPU decode bit for bit (both ranks run the one-GPU batches with the same GEMM choices), for one
/// group (rank 1 decodes nothing) and a group per clip (rank 1 decodes every second clip); rank 1 gets no frames.
#[test]
#[ignore = "needs two NVIDIA GPUs and NCCL: run through cargo xtask gpu-bundle"]
fn two_ranks_spread_video_decode_equals_one_gpu() {
    let test = "two_ranks_spread_video_decode_equals_one_gpu";
    let driver = driver();
    let visible = driver.device_count().unwrap();
    if visible < 2 {
        println!("SKIPPED {test}: {visible} GPU(s) visible, two needed");
        return;
    }
    let Some(nccl) = nccl(test) else {
        return;
    };
    for max_rows in [None, Some(1)] {
        let single = {
            let ctx = Context::new(Arc::clone(&driver), 0).unwrap();
            let (mut vae, latents) = tiny_video_vae(&ctx, max_rows);
            vae.decode(&latents).unwrap()
        };
        let id = nccl.unique_id().unwrap();
        let results: Vec<Option<VideoFrames>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (id, driver, nccl) = (&id, &driver, &nccl);
                    s.spawn(move || {
                        let ctx = Context::new(Arc::clone(driver), rank as i32).unwrap();
                        let (mut vae, latents) = tiny_video_vae(&ctx, max_rows);
                        let stream = Arc::new(Stream::new(&ctx, false).unwrap());
                        let comm =
                            Comm::init_rank(nccl, stream, id, rank, 2, CommOptions::default())
                                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                        vae.decode_spread(&latents, &comm)
                            .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let what = format!("2 ranks, max_rows {max_rows:?}");
        let rank0 = results[0].as_ref().expect("rank 0 holds the frames");
        assert_frames_bit_equal(&what, rank0, &single);
        assert!(results[1].is_none(), "{what}: rank 1 got frames");
        println!("{what}: rank 0's frames bit-equal to one GPU");
    }
}

/// Seeded inputs over the pipeline's default canvas: 1344x768, 124 frames (5 s snapped up), 128 text rows.
fn canvas_inputs(config: &MiniMaxH3Config) -> H3Inputs {
    let geometry = Geometry::for_request(768, 1344, 124, &SizeRules::TRANSFORMER).unwrap();
    let tags = vec![TEXT_TAG; 128];
    let layout = PackedLayout::build(&LayoutRequest {
        text_tags: &tags,
        geometry,
        patch: config.patch_size,
        keyframes: &[],
    })
    .unwrap();
    let t = layout
        .row_timesteps(StepTimesteps::pipeline(0.4, 0.3))
        .unwrap();
    let mut rng = SplitMix64::new(29);
    let (nv, na) = (layout.video_indices.len(), layout.audio_indices.len());
    let mut rows = |n: usize, c: usize| {
        TensorF32::new(vec![1, n, c], rng.uniform_vec(n * c, -1.0, 1.0)).unwrap()
    };
    let video = rows(nv, config.video_patch_dim());
    let audio = rows(na, config.audio_in_channels);
    let text = rows(tags.len(), config.text_dim);
    println!("default canvas: {} rows", layout.seq_len);
    H3Inputs::from_layout(&layout, &t, video, audio, text).unwrap()
}

#[test]
#[ignore = "needs two or more NVIDIA GPUs and NCCL, and minutes: bundle step h3-sp-canvas"]
fn zz_several_ranks_at_the_default_canvas() {
    let test = "zz_several_ranks_at_the_default_canvas";
    let driver = driver();
    let visible = usize::try_from(driver.device_count().unwrap()).unwrap_or(0);
    let degrees: Vec<usize> = [2, 4, 8].into_iter().filter(|&d| d <= visible).collect();
    if degrees.is_empty() {
        println!("SKIPPED {test}: {visible} GPU(s) visible, two or more needed");
        return;
    }
    let Some(nccl) = nccl(test) else {
        return;
    };
    let config = MiniMaxH3Config::default_full_size();
    let inputs = canvas_inputs(&config);
    let seed = 23;
    let (single, single_time) = {
        let ctx = Context::new(Arc::clone(&driver), 0).unwrap();
        let mut dit = GpuH3Dit::random_on(&ctx, &config, seed).unwrap();
        dit.set_graphs(false);
        best_of(2, || dit.forward(&inputs).unwrap())
    };
    let one = single_time.as_secs_f64();
    println!(
        "default canvas, one GPU: {:.1} ms a forward (eager)",
        one * 1e3
    );
    let mut failures = Vec::new();
    for &world in &degrees {
        let goal = match world {
            2 => 1.8,
            4 => 3.4,
            _ => 6.5,
        };
        for attention in ATTENTION {
            let job = Job {
                driver: &driver,
                nccl: &nccl,
                config: &config,
                seed,
                inputs: &inputs,
            };
            let results = job.ranks(world, attention, 2);
            // The job's forward takes as long as its slowest rank.
            let slowest = results
                .iter()
                .map(|(_, t)| t.as_secs_f64())
                .fold(0.0, f64::max);
            println!(
                "default canvas, {world} GPUs ({}): {:.1} ms a forward, {:.2}x one GPU (goal {goal}x)",
                attention.name(),
                slowest * 1e3,
                one / slowest
            );
            let out = &results[0].0;
            for (name, a, b) in [
                ("sample", &out.sample, &single.sample),
                ("audio_sample", &out.audio_sample, &single.audio_sample),
            ] {
                let err = relative_l2(a.data(), b.data()).unwrap();
                let cos = gpu_support::cosine(a.data(), b.data());
                println!("  {name}: relative L2 {err:.3e} (max {REL_L2_MAX:e}), cosine {cos:.6} (min {COSINE_MIN})");
                if err > REL_L2_MAX || cos < COSINE_MIN {
                    failures.push(format!("{world} GPUs ({}): {name}", attention.name()));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "outside the bf16 tolerance: {failures:?}"
    );
}
