//! `tf bench int8-gemm`: our INT8 GEMM with a scaling epilogue (bf16 out) beside the two cuBLASLt GEMMs the DiTs
//! run today at the same shapes, through the DiTs' own `GemmRunner`: row-wise FP8 with fast accumulation (bf16 out) and INT8 into int32. Each is timed
//! sustained (back-to-back calls, so the card sits at its power cap as inside a step), best of several rounds that
//! alternate the three; then our output is checked bit for bit against cuBLASLt's int32 products, dequantized.
//! With `--bf16` it times the same pipeline over bf16 operands beside cuBLASLt's bf16 GEMM instead, and reports how
//! far apart the two outputs are (both round f32 sums to bf16; only the order of the sums differs). With `--swiglu`
//! it times the two ways to the down GEMM's INT8 rows at both DiTs' MLP shapes: our INT8 GEMM writing both halves
//! then the INT8 SwiGLU kernel, against the GEMM with the SwiGLU in its epilogue then a row quantizer. With `--qkv`
//! it times both DiTs' q|k|v GEMM followed by their QK norm + RoPE pass against the GEMM with both in its epilogue
//! ([`qkv`]). With `--energy` (default comparison or `--bf16`) each GEMM is also measured over about a second of
//! sustained calls through NVML: millijoules a call, TOP/J and the mean draw, what a power-capped step pays for.

use std::path::PathBuf;
use std::sync::Arc;

use tf_cuda::power::PowerMeter;
use tf_cuda::{Context, DeviceBuffer, Driver, Event, Stream};
use tf_engines::nn::fp8::RowCodes;
use tf_engines::nn::gpu::gemm::{Fp8Linear, GemmRunner, Linear, TIMED};
use tf_engines::nn::gpu::gemm_int8::{
    plan_bf16_gemm, plan_int8_gemm, GemmStore, Int8GemmKernels, Int8GemmOperands, Int8GemmShape,
    STORE_ENV,
};
use tf_engines::nn::gpu::quant::{plan_quantize_rows, plan_swiglu_codes, Fp8Rows, QuantKernels};
use tf_engines::nn::gpu::{Matrix, SwigluOrder};
use tf_engines::nn::precision::Fp8Accumulation;
use tf_engines::nn::sampling::seeded::SplitMix64;
use tf_engines::nn::tensor::relative_l2;

use super::BoxError;

#[path = "int8_gemm_qkv.rs"]
mod qkv;

#[derive(clap::Args)]
pub struct Int8GemmArgs {
    /// Back-to-back calls per timed round.
    #[arg(long, default_value_t = 100)]
    iters: u32,
    /// Timed rounds (each GEMM's best is kept; the three alternate within a round).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Only these shapes (comma-separated names; default all).
    #[arg(long)]
    shapes: Option<String>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Time our bf16 GEMM beside cuBLASLt's bf16 GEMM instead.
    #[arg(long, conflicts_with_all = ["swiglu", "qkv"])]
    bf16: bool,
    /// Time the SwiGLU in the INT8 GEMM's epilogue against the GEMM and SwiGLU kernel apart instead, at the two
    /// DiTs' MLP input shapes (`--shapes` does not apply).
    #[arg(long, conflicts_with = "qkv")]
    swiglu: bool,
    /// Time the QK norm + RoPE in the INT8 q|k|v GEMM's epilogue against the GEMM and each DiT's pass apart instead,
    /// at both DiTs' q|k|v shapes (`--shapes` does not apply).
    #[arg(long)]
    qkv: bool,
    /// Also measure the board's energy per call of each GEMM (NVML; a window of about a second of sustained calls
    /// after the timed rounds), with the default comparison and with `--bf16`.
    #[arg(long, conflicts_with_all = ["swiglu", "qkv"])]
    energy: bool,
}

/// (name, M, N, K) of one GEMM.
type Shape = (&'static str, usize, usize, usize);

/// MiniMax H3's block GEMMs at S = 6026 and Qwen-Image's at 1024x1024 (image rows; `qwen_step_*`: with its 80
/// text rows, as a step runs them).
const SHAPES: &[Shape] = &[
    ("h3_qkv", 6026, 21504, 5376),
    ("h3_out", 6026, 5376, 7168),
    ("h3_fc1", 6026, 28672, 5376),
    ("h3_fc1_half", 6026, 14336, 5376),
    ("h3_fc2", 6026, 5376, 14336),
    ("qwen_qkv", 4096, 12288, 4096),
    ("qwen_out", 4096, 4096, 4096),
    ("qwen_mlp_in", 4096, 24576, 4096),
    ("qwen_mlp_out", 4096, 4096, 12288),
    ("qwen_step_qkv", 4176, 12288, 4096),
    ("qwen_step_out", 4176, 4096, 4096),
    ("qwen_step_mlp_in", 4176, 24576, 4096),
    ("qwen_step_mlp_out", 4176, 4096, 12288),
];

pub(super) fn random_bytes(rng: &mut SplitMix64, n: usize, e4m3: bool) -> Vec<u8> {
    (0..n)
        .map(|_| {
            let b = (rng.next_u64() >> 32) as u8;
            // e4m3 has NaN at S.1111.111: keep the codes finite. INT8: -128 is left out like the quantizer does.
            match (e4m3, b) {
                (true, 0x7f) | (true, 0xff) => b - 1,
                (false, 0x80) => 0x81,
                _ => b,
            }
        })
        .collect()
}

pub(super) fn scales(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (1 + rng.next_u64() % 1000) as f32 * 1e-5)
        .collect()
}

/// Milliseconds per call of `f` over `iters` back-to-back calls (one warm-up call first).
pub(super) fn sustained_ms(
    ctx: &Context,
    stream: &Stream,
    iters: u32,
    mut f: impl FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    f()?;
    let start = Event::new(ctx, true)?;
    let end = Event::new(ctx, true)?;
    start.record(stream)?;
    for _ in 0..iters {
        f()?;
    }
    end.record(stream)?;
    end.synchronize()?;
    Ok(f64::from(Event::elapsed_ms(&start, &end)?) / f64::from(iters))
}

/// About how long a GEMM's energy window runs (NVML's counter moves in steps of tens of milliseconds).
const ENERGY_WINDOW_MS: f64 = 1000.0;

/// With `--energy`: joules per call of `f` (calls of about `ms` each, sustained for [`ENERGY_WINDOW_MS`]) and the
/// window's mean draw; prints nothing. `None` without `--energy`; an NVML failure is returned as its reason.
fn energy_per_call(
    meter: Option<&Arc<PowerMeter>>,
    (ctx, stream): (&Context, &Stream),
    ms: f64,
    f: impl FnMut() -> Result<(), BoxError>,
) -> Result<Option<serde_json::Value>, BoxError> {
    let Some(meter) = meter else {
        return Ok(None);
    };
    let iters = (ENERGY_WINDOW_MS / ms.max(1e-3))
        .ceil()
        .clamp(10.0, 100_000.0) as u32;
    let window = meter.window(std::time::Duration::from_millis(10));
    // sustained_ms runs one warm-up call before the timed ones: iters + 1 calls in the window.
    let ms_in_window = sustained_ms(ctx, stream, iters, f)?;
    let report = match window.finish() {
        Ok(report) => report,
        Err(e) => return Ok(Some(serde_json::json!({ "error": e.to_string() }))),
    };
    let calls = iters as usize + 1;
    Ok(Some(serde_json::json!({
        "calls": calls,
        "ms_per_call": ms_in_window,
        "joules_per_call": report.joules_per(calls),
        "mean_watts": report.mean_watts(),
        "limit_watts": report.limit_watts,
        "sm_clock_median_mhz": report.sm_clock.map(|c| c.median),
        "power_capped_share": report.power_capped_share(),
    })))
}

/// One GEMM's energy figures as text: millijoules a call, TOP/J (`ops` a call) and the mean draw.
fn describe_energy(label: &str, energy: &Option<serde_json::Value>, ops: f64) -> String {
    let Some(e) = energy else {
        return String::new();
    };
    if let Some(why) = e.get("error").and_then(|v| v.as_str()) {
        return format!("; {label} energy not measured ({why})");
    }
    let get = |k: &str| e.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
    let joules = get("joules_per_call");
    format!(
        "; {label} {:.2} mJ a call ({:.3} TOP/J at {:.0} W mean, SM clock median {:.0} MHz)",
        joules * 1e3,
        ops / joules / 1e12,
        get("mean_watts"),
        get("sm_clock_median_mhz")
    )
}

/// The board's meter for `--energy` (None without it); NVML missing is an error then, since energy was asked for.
fn energy_meter(args: &Int8GemmArgs, ctx: &Context) -> Result<Option<Arc<PowerMeter>>, BoxError> {
    if !args.energy {
        return Ok(None);
    }
    Ok(Some(PowerMeter::for_context(ctx)?))
}

/// The [`SHAPES`] `--shapes` names (all without it), each name checked.
fn wanted_shapes(args: &Int8GemmArgs) -> Result<Vec<Shape>, BoxError> {
    let Some(names) = args.shapes.as_deref() else {
        return Ok(SHAPES.to_vec());
    };
    let names: Vec<&str> = names.split(',').collect();
    if let Some(bad) = names.iter().find(|n| !SHAPES.iter().any(|s| s.0 == **n)) {
        let known: Vec<&str> = SHAPES.iter().map(|s| s.0).collect();
        return Err(format!("unknown shape {bad:?}; known: {}", known.join(", ")).into());
    }
    Ok(SHAPES
        .iter()
        .copied()
        .filter(|s| names.contains(&s.0))
        .collect())
}

/// Writes `rows` with the run's settings as JSON to `--json`, when given.
pub(super) fn write_json(
    args: &Int8GemmArgs,
    gemms: &GemmRunner,
    rows: Vec<serde_json::Value>,
) -> Result<(), BoxError> {
    if let Some(path) = &args.json {
        let report = serde_json::json!({
            "cublaslt_version": gemms.lt().library().version(),
            "gemm_store": format!("{:?}", GemmStore::from_env()?),
            "iters": args.iters,
            "rounds": args.rounds,
            "operands": if args.bf16 {
                "bf16"
            } else if args.swiglu {
                "int8, swiglu"
            } else if args.qkv {
                "int8, qkv"
            } else {
                "int8"
            },
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// The best sustained milliseconds per call of `apart` and of `fused` over `args.rounds` rounds that alternate them.
pub(super) fn best_apart_and_fused(
    args: &Int8GemmArgs,
    (ctx, stream): (&Context, &Stream),
    mut apart: impl FnMut() -> Result<(), BoxError>,
    mut fused: impl FnMut() -> Result<(), BoxError>,
) -> Result<[f64; 2], BoxError> {
    let mut best = [f64::INFINITY; 2];
    for _ in 0..args.rounds {
        let apart_ms = sustained_ms(ctx, stream, args.iters, &mut apart)?;
        let fused_ms = sustained_ms(ctx, stream, args.iters, &mut fused)?;
        for (b, t) in best.iter_mut().zip([apart_ms, fused_ms]) {
            *b = b.min(t);
        }
    }
    Ok(best)
}

pub fn run(args: &Int8GemmArgs) -> Result<(), BoxError> {
    if args.iters == 0 || args.rounds == 0 {
        return Err("--iters and --rounds must be at least 1".into());
    }
    let driver = Arc::new(Driver::open()?);
    let ctx = Context::new(driver, 0)?;
    let stream = Stream::new(&ctx, true)?;
    let kernels = Int8GemmKernels::load(&ctx)?;
    // The DiTs' own cuBLASLt handle: timed selection and the process's plan cache.
    let gemms = GemmRunner::new(&ctx, TIMED)?;
    let wanted = wanted_shapes(args)?;
    println!(
        "our GEMMs' tile stores: {:?} ({STORE_ENV}; the q|k|v GEMMs always store directly)",
        GemmStore::from_env()?
    );
    if args.bf16 {
        return run_bf16(args, (&ctx, &stream), &kernels, &gemms, wanted);
    }
    if args.swiglu {
        return run_swiglu(args, (&ctx, &stream), &kernels, &gemms);
    }
    if args.qkv {
        return qkv::run_qkv(args, (&ctx, &stream), &kernels, &gemms);
    }
    println!(
        "INT8 GEMM with a scaling epilogue (ours, bf16 out) beside cuBLASLt {} row-wise FP8 (bf16 out) and INT8 \
         (int32 out); {} calls back to back, best of {} rounds",
        gemms.lt().library().version(),
        args.iters,
        args.rounds
    );
    let meter = energy_meter(args, &ctx)?;
    let mut rows = Vec::new();
    for (name, m, n, k) in wanted {
        let mut rng = SplitMix64::new(0x1a7e_0000 + m as u64 * 31 + n as u64);
        let x = DeviceBuffer::from_slice(&ctx, &random_bytes(&mut rng, m * k, false))?;
        let w = DeviceBuffer::from_slice(&ctx, &random_bytes(&mut rng, n * k, false))?;
        let x8 = DeviceBuffer::from_slice(&ctx, &random_bytes(&mut rng, m * k, true))?;
        let w8 = DeviceBuffer::from_slice(&ctx, &random_bytes(&mut rng, n * k, true))?;
        let xs = DeviceBuffer::from_slice(&ctx, &scales(&mut rng, m))?;
        let ws = DeviceBuffer::from_slice(&ctx, &scales(&mut rng, n))?;
        let mut y = DeviceBuffer::alloc(&ctx, m * n * 2)?;
        let y_fp8 = DeviceBuffer::alloc(&ctx, m * n * 2)?;
        let y32 = DeviceBuffer::alloc(&ctx, m * n * 4)?;
        let shape = Int8GemmShape { m, n, k };
        let (xv, wv, xsv, wsv) = (x.view(), w.view(), xs.view(), ws.view());
        let inputs = Int8GemmOperands {
            x: &xv,
            x_scale: &xsv,
            w: &wv,
            w_scale: &wsv,
        };
        let mut yv = y.view_mut();
        let launch = plan_int8_gemm(&ctx, kernels.sm_count(), shape, &inputs, &mut yv, n)?;
        let fp8 = Fp8Linear::new(
            (m, n, k),
            ((&x8).into(), (&xs).into()),
            ((&w8).into(), (&ws).into()),
            (&y_fp8).into(),
        )
        .accumulation(Fp8Accumulation::Fast);
        let int8 = ((m, n, k), ((&x).into(), (&w).into(), (&y32).into()));
        let mut best = [f64::INFINITY; 3];
        for _ in 0..args.rounds {
            let ours = sustained_ms(&ctx, &stream, args.iters, || {
                Ok(kernels.submit(&stream, &launch)?)
            })?;
            let fp8_ms = sustained_ms(&ctx, &stream, args.iters, || {
                // SAFETY: every span lies in a buffer alive until after the stream is synchronized (the timing
                // synchronizes on its end event before returning).
                Ok(unsafe { gemms.run_fp8(&fp8, &stream) }?)
            })?;
            let int8_ms = sustained_ms(&ctx, &stream, args.iters, || {
                // SAFETY: as above.
                Ok(unsafe { gemms.run_int8(int8.0, int8.1, &stream) }?)
            })?;
            for (b, t) in best.iter_mut().zip([ours, fp8_ms, int8_ms]) {
                *b = b.min(t);
            }
        }
        let ours_energy = energy_per_call(meter.as_ref(), (&ctx, &stream), best[0], || {
            Ok(kernels.submit(&stream, &launch)?)
        })?;
        let fp8_energy = energy_per_call(meter.as_ref(), (&ctx, &stream), best[1], || {
            // SAFETY: as in the timed rounds.
            Ok(unsafe { gemms.run_fp8(&fp8, &stream) }?)
        })?;
        // Ours against cuBLASLt's exact int32 products, dequantized as ours does (the scales' product, one rounding
        // to bf16): every element must agree bit for bit.
        stream.synchronize()?;
        let ours_bits: Vec<u16> = y.to_vec()?;
        let products: Vec<i32> = y32.to_vec()?;
        let (x_scales, w_scales) = (xs.to_vec::<f32>()?, ws.to_vec::<f32>()?);
        let differing = ours_bits
            .iter()
            .zip(&products)
            .enumerate()
            .filter(|&(i, (&bits, &p))| {
                let want = p as f32 * (x_scales[i / n] * w_scales[i % n]);
                half::bf16::from_f32(want).to_bits() != bits
            })
            .count();
        if differing > 0 {
            return Err(format!(
                "{name}: {differing} of {} elements of our INT8 GEMM differ from cuBLASLt's products",
                m * n
            )
            .into());
        }
        let ops = 2.0 * (m * n * k) as f64;
        let rate = |ms: f64| ops / (ms * 1e-3) / 1e12;
        let [ours, fp8_ms, int8_ms] = best;
        println!(
            "  {name:<17} {m:>5} x {n:>5} x {k:>5}: ours {ours:.4} ms ({:.0} TOP/s), FP8 {fp8_ms:.4} ms ({:.0}), \
             INT8->int32 {int8_ms:.4} ms ({:.0}); ours / FP8 {:.3}, ours / INT8 {:.3} (< 1 means ours is faster); \
             every element bit-equal to cuBLASLt's products dequantized{}{}",
            rate(ours),
            rate(fp8_ms),
            rate(int8_ms),
            ours / fp8_ms,
            ours / int8_ms,
            describe_energy("ours", &ours_energy, ops),
            describe_energy("FP8", &fp8_energy, ops)
        );
        rows.push(serde_json::json!({
            "shape": name, "m": m, "n": n, "k": k,
            "ours_ms": ours, "fp8_ms": fp8_ms, "int8_i32_ms": int8_ms,
            "ours_over_fp8": ours / fp8_ms, "ours_over_int8": ours / int8_ms, "bit_equal": true,
            "ours_energy": ours_energy, "fp8_energy": fp8_energy,
        }));
    }
    write_json(args, &gemms, rows)
}

/// Random bf16 values in [-1, 1).
fn random_bf16(rng: &mut SplitMix64, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| {
            let v = (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            half::bf16::from_f32(v).to_bits()
        })
        .collect()
}

/// `tf bench int8-gemm --bf16`: our bf16 GEMM beside cuBLASLt's bf16 GEMM (the DiTs' bf16 path) at every shape.
fn run_bf16(
    args: &Int8GemmArgs,
    (ctx, stream): (&Context, &Stream),
    kernels: &Int8GemmKernels,
    gemms: &GemmRunner,
    wanted: Vec<Shape>,
) -> Result<(), BoxError> {
    println!(
        "bf16 GEMM (ours, the INT8 GEMM's pipeline over bf16) beside cuBLASLt {} bf16; {} calls back to back, \
         best of {} rounds",
        gemms.lt().library().version(),
        args.iters,
        args.rounds
    );
    let meter = energy_meter(args, ctx)?;
    let mut rows = Vec::new();
    for (name, m, n, k) in wanted {
        let mut rng = SplitMix64::new(0xbf16_0000 + m as u64 * 31 + n as u64);
        let x = DeviceBuffer::from_slice(ctx, &random_bf16(&mut rng, m * k))?;
        let w = DeviceBuffer::from_slice(ctx, &random_bf16(&mut rng, n * k))?;
        let mut y = DeviceBuffer::alloc(ctx, m * n * 2)?;
        let y_lt = DeviceBuffer::alloc(ctx, m * n * 2)?;
        let shape = Int8GemmShape { m, n, k };
        let (xv, wv) = (x.view(), w.view());
        let mut yv = y.view_mut();
        let launch = plan_bf16_gemm(ctx, kernels.sm_count(), shape, (&xv, &wv), &mut yv, n)?;
        let linear = Linear::new(m, n, k, (&x).into(), (&w).into(), (&y_lt).into());
        let mut best = [f64::INFINITY; 2];
        for _ in 0..args.rounds {
            let ours = sustained_ms(ctx, stream, args.iters, || {
                Ok(kernels.submit(stream, &launch)?)
            })?;
            let lt_ms = sustained_ms(ctx, stream, args.iters, || {
                // SAFETY: every span lies in a buffer alive until after the stream is synchronized (the timing
                // synchronizes on its end event before returning).
                Ok(unsafe { gemms.run(&linear, stream) }?)
            })?;
            for (b, t) in best.iter_mut().zip([ours, lt_ms]) {
                *b = b.min(t);
            }
        }
        let ours_energy = energy_per_call(meter.as_ref(), (ctx, stream), best[0], || {
            Ok(kernels.submit(stream, &launch)?)
        })?;
        let lt_energy = energy_per_call(meter.as_ref(), (ctx, stream), best[1], || {
            // SAFETY: as in the timed rounds.
            Ok(unsafe { gemms.run(&linear, stream) }?)
        })?;
        stream.synchronize()?;
        let to_f32 = |bits: Vec<u16>| -> Vec<f32> {
            bits.into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect()
        };
        let ours_out = to_f32(y.to_vec()?);
        let lt_out = to_f32(y_lt.to_vec()?);
        let rel_l2 = relative_l2(&ours_out, &lt_out).ok_or("an empty output")?;
        if rel_l2.is_nan() || rel_l2 >= 1e-2 {
            return Err(format!(
                "{name}: our bf16 GEMM is {rel_l2:.3e} (relative L2) from cuBLASLt's: wrong, not just rounding"
            )
            .into());
        }
        let ops = 2.0 * (m * n * k) as f64;
        let rate = |ms: f64| ops / (ms * 1e-3) / 1e12;
        let [ours, lt_ms] = best;
        println!(
            "  {name:<17} {m:>5} x {n:>5} x {k:>5}: ours {ours:.4} ms ({:.0} TFLOP/s), cuBLASLt {lt_ms:.4} ms \
             ({:.0}); ours / cuBLASLt {:.3} (< 1 means ours is faster); outputs {rel_l2:.2e} apart (relative L2)\
             {}{}",
            rate(ours),
            rate(lt_ms),
            ours / lt_ms,
            describe_energy("ours", &ours_energy, ops),
            describe_energy("cuBLASLt", &lt_energy, ops)
        );
        rows.push(serde_json::json!({
            "shape": name, "m": m, "n": n, "k": k,
            "ours_ms": ours, "cublaslt_ms": lt_ms, "ours_over_cublaslt": ours / lt_ms, "rel_l2": rel_l2,
            "ours_energy": ours_energy, "cublaslt_energy": lt_energy,
        }));
    }
    write_json(args, gemms, rows)
}

/// (name, M, hidden, K, order): the MLP input projections of MiniMax H3 at S = 6026 and of Qwen-Image at 1024x1024
/// (image and text rows).
const SWIGLU_SHAPES: &[(&str, usize, usize, usize, SwigluOrder)] = &[
    ("h3_fc1", 6026, 14336, 5376, SwigluOrder::ValueGate),
    ("qwen_mlp_in", 4176, 12288, 4096, SwigluOrder::GateValue),
];

/// `tf bench int8-gemm --swiglu`: the down GEMM's INT8 rows made two ways, each sustained; then how far apart their
/// dequantized rows are (the fused path rounds the activation to bf16 before quantizing it).
fn run_swiglu(
    args: &Int8GemmArgs,
    (ctx, stream): (&Context, &Stream),
    kernels: &Int8GemmKernels,
    gemms: &GemmRunner,
) -> Result<(), BoxError> {
    let quant = QuantKernels::load(ctx)?;
    println!(
        "INT8 MLP input to the down GEMM's INT8 rows: our INT8 GEMM (both halves, bf16) then the INT8 SwiGLU kernel, \
         against the GEMM with the SwiGLU in its epilogue (bf16 activation) then the row quantizer; {} calls back \
         to back, best of {} rounds",
        args.iters, args.rounds
    );
    let mut rows = Vec::new();
    for &(name, m, hidden, k, order) in SWIGLU_SHAPES {
        let mut rng = SplitMix64::new(0x5e1_0000 + m as u64 * 31 + hidden as u64);
        let both = 2 * hidden;
        let x = DeviceBuffer::from_slice(ctx, &random_bytes(&mut rng, m * k, false))?;
        let w = DeviceBuffer::from_slice(ctx, &random_bytes(&mut rng, both * k, false))?;
        let xs = DeviceBuffer::from_slice(ctx, &scales(&mut rng, m))?;
        let ws = DeviceBuffer::from_slice(ctx, &scales(&mut rng, both))?;
        let mut products = DeviceBuffer::alloc(ctx, m * both * 2)?;
        let mut act = DeviceBuffer::alloc(ctx, m * hidden * 2)?;
        let mut codes = [
            DeviceBuffer::alloc(ctx, m * hidden)?,
            DeviceBuffer::alloc(ctx, m * hidden)?,
        ];
        let mut row_scales = [
            DeviceBuffer::alloc(ctx, m * 4)?,
            DeviceBuffer::alloc(ctx, m * 4)?,
        ];
        let (xv, wv, xsv, wsv) = (x.view(), w.view(), xs.view(), ws.view());
        let inputs = Int8GemmOperands {
            x: &xv,
            x_scale: &xsv,
            w: &wv,
            w_scale: &wsv,
        };
        let [codes_apart, codes_fused] = &mut codes;
        let [scales_apart, scales_fused] = &mut row_scales;
        let (ca, sa) = (codes_apart.view_mut(), scales_apart.view_mut());
        let (cf, sf) = (codes_fused.view_mut(), scales_fused.view_mut());
        let out_apart = Fp8Rows {
            codes: &ca,
            stride: hidden,
            scales: &sa,
        };
        let out_fused = Fp8Rows {
            codes: &cf,
            stride: hidden,
            scales: &sf,
        };
        // Each call plans its launches (the planned writer of a buffer and its reader cannot both be held), as a
        // step does: both paths pay the same tensor-map encoding.
        let mut apart = || -> Result<(), BoxError> {
            {
                let mut pv = products.view_mut();
                let shape = Int8GemmShape { m, n: both, k };
                kernels.gemm(ctx, stream, shape, &inputs, &mut pv, both)?;
            }
            let pr = products.view();
            let plan = plan_swiglu_codes(
                order,
                &pr,
                Matrix::dense(m, both),
                &out_apart,
                RowCodes::Int8,
            );
            Ok(quant.run(stream, plan)?)
        };
        let mut fused = || -> Result<(), BoxError> {
            {
                let mut av = act.view_mut();
                kernels.gemm_swiglu(
                    ctx,
                    stream,
                    (m, hidden, k),
                    order,
                    &inputs,
                    &mut av,
                    hidden,
                )?;
            }
            let ar = act.view();
            let plan =
                plan_quantize_rows(&ar, Matrix::dense(m, hidden), &out_fused, RowCodes::Int8);
            Ok(quant.run(stream, plan)?)
        };
        let best = best_apart_and_fused(args, (ctx, stream), &mut apart, &mut fused)?;
        stream.synchronize()?;
        let dequantized =
            |codes: &DeviceBuffer, scales: &DeviceBuffer| -> Result<Vec<f32>, BoxError> {
                let c: Vec<u8> = codes.to_vec()?;
                Ok(RowCodes::Int8.dequantize_rows(&c, &scales.to_vec::<f32>()?, hidden))
            };
        let apart_rows = dequantized(codes_apart, scales_apart)?;
        let fused_rows = dequantized(codes_fused, scales_fused)?;
        let rel_l2 = relative_l2(&fused_rows, &apart_rows).ok_or("an empty output")?;
        let [apart_ms, fused_ms] = best;
        println!(
            "  {name:<12} {m:>5} x {hidden:>5} (x2) x {k:>5}: apart {apart_ms:.4} ms, fused {fused_ms:.4} ms; \
             fused / apart {:.3} (< 1 means fused is faster); INT8 rows {rel_l2:.2e} apart (relative L2, dequantized)",
            fused_ms / apart_ms
        );
        if rel_l2.is_nan() || rel_l2 >= 2e-2 {
            return Err(format!(
                "{name}: the fused path's INT8 rows are {rel_l2:.3e} (relative L2) from the apart path's: wrong, \
                 not just rounding"
            )
            .into());
        }
        rows.push(serde_json::json!({
            "shape": name, "m": m, "hidden": hidden, "k": k,
            "apart_ms": apart_ms, "fused_ms": fused_ms, "fused_over_apart": fused_ms / apart_ms, "rel_l2": rel_l2,
        }));
    }
    write_json(args, gemms, rows)
}
