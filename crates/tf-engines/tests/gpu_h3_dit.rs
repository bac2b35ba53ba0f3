//! The MiniMax H3 GPU DiT ([`GpuH3Dit`]) on an NVIDIA GPU: each H3 kernel against the host reference ops, the whole
//! forward on every committed diffusers fixture (tests/fixtures/minimax_h3_dit, the original-layout twin included),
//! the original-layout twin bit-equal to its diffusers folder, CUDA graph replay bit-equal to the eager step (also
//! after new input values of the same shape), batch 2 against two batch-1 runs, a seeded reduced-size model giving
//! finite outputs, and a load cycle that gives its device memory back.
//!
//! Tolerance of the whole forward against the fp32 reference: the backend stores weights and activations in bf16
//! (unit roundoff 2^-9, relative error up to 0.2% per rounding) and accumulates in f32. A tiny fixture chains about
//! twenty rounding points (projections, norms, q/k/v, RoPE tables, attention, gates, SwiGLU, heads) over the token
//! refiner and two blocks; independent errors of that size compound to about 1e-2 relative L2, which is what the
//! Qwen-Image GPU DiT measures on its tiny fixtures (2.3e-2). `REL_L2_MAX` = 4e-2 with `COSINE_MIN` = 0.999 leaves
//! that margin while a wrong row index, gate, table row, head layout or half order gives errors of order 1. Kernel
//! tests use tighter bounds: bf16 outputs within 4e-3 relative L2 (one rounding of the output and of its bf16
//! inputs), f32 outputs within 1e-5.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/gpu.rs"]
mod gpu_support;
use gpu_support::{assert_close_within, context};
#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::PathBuf;

use tf_cuda::cublaslt::AlgoSelection;
use tf_cuda::{Context, DeviceBuffer, Stream};
use tf_engines::minimax_h3::config::MiniMaxH3Config;
use tf_engines::minimax_h3::dit::{H3DitBackend, H3Inputs};
use tf_engines::minimax_h3::dit_gpu::kernels::{
    plan_linear_f32, plan_linear_w8_columns, plan_qk_norm_rope, plan_residual_norm, Elem,
    H3Kernels, LinearF32, LinearW8, LinearW8Columns, NormModulation, QkNormRope, ResidualNorm,
    RowTable, RowsOperand,
};
use tf_engines::minimax_h3::dit_gpu::{DitPrecision, GpuH3Dit};
use tf_engines::minimax_h3::dit_host::{HostH3Dit, LoadOptions, RopeTables};
use tf_engines::minimax_h3::layout::{Geometry, LayoutRequest, PackedLayout, StepTimesteps};
use tf_engines::nn::fp8::{self, RowCodes};
use tf_engines::nn::gpu::quant::{
    plan_gated_residual_norm_modulate_with, plan_norm_modulate_codes, Fp8Rows, QuantKernels,
    ResidualGate, SecondRows,
};
use tf_engines::nn::gpu::{
    Matrix, ModulationRows, NormKind, NormModulate, RowModulation, HEAD_DIM,
};
use tf_engines::nn::host as ops;
use tf_engines::nn::sampling::seeded::SplitMix64;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::upload::StagingConfig;
use tf_engines::nn::weights::{write_f32_safetensors, ModelDir, SafetensorsFile};

const REL_L2_MAX: f64 = 4e-2;
const COSINE_MIN: f64 = 0.999;
const BF16_KERNEL_MAX: f64 = 4e-3;
const F32_KERNEL_MAX: f64 = 1e-5;

fn fixtures() -> PathBuf {
    fixture_dir::find("minimax_h3_dit")
}

fn manifest() -> serde_json::Value {
    fixture_dir::manifest(&fixtures())
}

fn cases() -> Vec<String> {
    fixture_dir::manifest_cases(&fixtures(), 5)
}

fn model_dir(case: &str) -> ModelDir {
    ModelDir::open(&fixtures().join(case).join("model")).unwrap()
}

fn inputs(case: &str) -> H3Inputs {
    H3Inputs::from_bundle(
        &SafetensorsFile::open(&fixtures().join(case).join("inputs.safetensors")).unwrap(),
    )
    .unwrap()
}

fn expected(case: &str, name: &str) -> TensorF32 {
    SafetensorsFile::open(&fixtures().join(case).join("expected.safetensors"))
        .unwrap()
        .to_f32(name)
        .unwrap()
}

fn load(ctx: &Context, case: &str) -> GpuH3Dit {
    // Small slots so the tiny models still go through several pinned staging slots.
    let staging = StagingConfig {
        slot_bytes: 8192,
        slots: 2,
        threads: 3,
    };
    GpuH3Dit::load_with(ctx, &model_dir(case), LoadOptions::default(), staging)
        .unwrap_or_else(|e| panic!("{case}: load on the GPU: {e}"))
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

fn round_bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn i32_bytes(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn device(ctx: &Context, bytes: &[u8]) -> DeviceBuffer {
    DeviceBuffer::from_bytes(ctx, bytes).unwrap()
}

fn read_bf16(buf: &DeviceBuffer) -> Vec<f32> {
    buf.to_vec::<u16>()
        .unwrap()
        .into_iter()
        .map(|b| half::bf16::from_bits(b).to_f32())
        .collect()
}

/// `n` bf16-exact values in `[lo, hi)`.
fn bf16_values(rng: &mut SplitMix64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| round_bf16(rng.uniform(lo, hi))).collect()
}

/// `rows` x `padded` values whose columns past `width` are zero.
fn padded(
    rng: &mut SplitMix64,
    rows: usize,
    width: usize,
    padded: usize,
    lo: f32,
    hi: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; rows * padded];
    for r in 0..rows {
        for c in 0..width {
            out[r * padded + c] = round_bf16(rng.uniform(lo, hi));
        }
    }
    out
}

fn columns(values: &[f32], stride: usize, first: usize, width: usize) -> Vec<f32> {
    values
        .chunks_exact(stride)
        .flat_map(|row| row[first..first + width].iter().copied())
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn residual_norm_matches_the_host_ops() {
    let ctx = context();
    let kernels = H3Kernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut rng = SplitMix64::new(11);
    // 37 rows of width 20 padded to 24; two timesteps x three modalities of [shift|scale|gate|shift|scale|gate].
    let (rows, width, cols, table_rows) = (37, 20, 24, 6);
    let stride = 6 * cols;
    let x = padded(&mut rng, rows, width, cols, -2.0, 2.0);
    let y = padded(&mut rng, rows, width, cols, -1.0, 1.0);
    let table = padded(&mut rng, table_rows * 6, width, cols, -0.5, 0.5);
    let weight = padded(&mut rng, 1, width, cols, 0.8, 1.2);
    let index: Vec<i32> = (0..rows).map(|_| rng.below(table_rows) as i32).collect();
    let scatter: Vec<i32> = (0..rows as i32).map(|r| 2 * r + 1).collect();
    let sentinel = vec![7.0f32; 2 * rows * cols];
    let mut xd = device(&ctx, &bf16_bytes(&x));
    let yd = device(&ctx, &bf16_bytes(&y));
    let td = device(&ctx, &bf16_bytes(&table));
    let wd = device(&ctx, &bf16_bytes(&weight));
    let id = device(&ctx, &i32_bytes(&index));
    let sd = device(&ctx, &i32_bytes(&scatter));
    let mut od = device(&ctx, &bf16_bytes(&sentinel));
    {
        let (xv, yv, tv, wv, iv, sv, ov) = (
            xd.view_mut(),
            yd.view(),
            td.view(),
            wd.view(),
            id.view(),
            sd.view(),
            od.view_mut(),
        );
        let gate_view = tv.slice(2 * cols * 2, tv.len() - 2 * cols * 2).unwrap();
        let op = ResidualNorm {
            x: &xv,
            x_layout: Matrix::dense(rows, cols),
            residual: Some((&yv, cols)),
            gate: Some(RowTable {
                data: &gate_view,
                rows: table_rows,
                stride,
                index: &iv,
            }),
            norm_cols: width,
            eps: 1e-5,
            weight: &wv,
            modulation: Some(NormModulation {
                table: RowTable {
                    data: &tv,
                    rows: table_rows,
                    stride,
                    index: &iv,
                },
                scale_offset: 4 * cols,
                shift_offset: Some(3 * cols),
            }),
            out: &ov,
            out_stride: cols,
            out_index: Some((&sv, 2 * rows)),
        };
        kernels.run(&stream, plan_residual_norm(&op)).unwrap();
    }
    stream.synchronize().unwrap();

    // Host: x += gate * y in f32, stored as bf16; then RMSNorm * weight * (1 + scale) + shift over the true width.
    let mut xh = columns(&x, cols, 0, width);
    let yh = columns(&y, cols, 0, width);
    let gate = columns(&table, stride, 2 * cols, width);
    let row_mod: Vec<usize> = index.iter().map(|&i| i as usize).collect();
    ops::gate_residual(&mut xh, rows, width, &yh, &gate, table_rows, &row_mod).unwrap();
    xh.iter_mut().for_each(|v| *v = round_bf16(*v));
    let x_gpu = read_bf16(&xd);
    let x_gpu_used = columns(&x_gpu, cols, 0, width);
    for (i, (&g, &h)) in x_gpu_used.iter().zip(&xh).enumerate() {
        assert!(
            (g - h).abs() <= h.abs() * 2f32.powi(-8) + 1e-6,
            "x[{i}]: {g} vs {h}"
        );
    }
    assert!(columns(&x_gpu, cols, width, cols - width)
        .iter()
        .all(|&v| v == 0.0));
    let (scale, shift) = (
        columns(&table, stride, 4 * cols, width),
        columns(&table, stride, 3 * cols, width),
    );
    let mut expected = vec![0f32; rows * width];
    ops::norm_modulate(
        &xh,
        rows,
        width,
        ops::NormKind::RmsNorm,
        ops::NormModulation {
            weight: Some(&weight[..width]),
            bias: None,
            scale: Some(&scale),
            shift: Some(&shift),
            n_mod: table_rows,
            row_mod: &row_mod,
        },
        1e-5,
        &mut expected,
    )
    .unwrap();
    let out = read_bf16(&od);
    let mut written = Vec::with_capacity(rows * width);
    for r in 0..rows {
        let row = &out[(2 * r + 1) * cols..(2 * r + 2) * cols];
        written.extend_from_slice(&row[..width]);
        assert!(
            row[width..].iter().all(|&v| v == 0.0),
            "row {r}: padding not zero"
        );
        assert!(
            out[2 * r * cols..(2 * r + 1) * cols]
                .iter()
                .all(|&v| v == 7.0),
            "row {}: written",
            2 * r
        );
    }
    let err = relative_l2(&written, &expected).unwrap();
    println!("residual_norm: relative L2 {err:.3e}");
    assert!(err <= BF16_KERNEL_MAX, "residual_norm: {err:e}");

    // Plain residual, no modulation, into h (the token refiner's form).
    let mut xd = device(&ctx, &bf16_bytes(&x));
    let mut hd = device(&ctx, &vec![0u8; rows * cols * 2]);
    {
        let (xv, yv, wv, hv) = (xd.view_mut(), yd.view(), wd.view(), hd.view_mut());
        let op = ResidualNorm {
            x: &xv,
            x_layout: Matrix::dense(rows, cols),
            residual: Some((&yv, cols)),
            gate: None,
            norm_cols: width,
            eps: 1e-5,
            weight: &wv,
            modulation: None,
            out: &hv,
            out_stride: cols,
            out_index: None,
        };
        kernels.run(&stream, plan_residual_norm(&op)).unwrap();
    }
    stream.synchronize().unwrap();
    let mut xh = columns(&x, cols, 0, width);
    xh.iter_mut()
        .zip(&yh)
        .for_each(|(a, b)| *a = round_bf16(*a + b));
    let mut plain = vec![0f32; rows * width];
    ops::rms_norm(&xh, rows, width, &weight[..width], 1e-5, &mut plain).unwrap();
    let err = relative_l2(&columns(&read_bf16(&hd), cols, 0, width), &plain).unwrap();
    println!("residual_norm (plain): relative L2 {err:.3e}");
    assert!(err <= BF16_KERNEL_MAX, "plain residual_norm: {err:e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn qk_norm_rope_matches_the_host_ops() {
    let ctx = context();
    let kernels = H3Kernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut rng = SplitMix64::new(12);
    // (heads, true head dim, rotated, table stride): the released shape (partners by shuffle, vector table loads),
    // a padded tiny one (partners through shared memory), the norm alone, and a stride that is not a multiple of 8
    // (partners by shuffle, scalar table loads).
    for (heads, hd, rotated, stride) in [
        (3usize, 128usize, 96usize, 48usize),
        (2, 16, 12, 6),
        (2, 128, 0, 1),
        (2, 128, 64, 36),
    ] {
        let rows = 19;
        let width = heads * HEAD_DIM;
        let mut qkv = vec![0f32; rows * 3 * width];
        for r in 0..rows {
            for head in 0..3 * heads {
                for c in 0..hd {
                    qkv[r * 3 * width + head * HEAD_DIM + c] = round_bf16(rng.uniform(-3.0, 3.0));
                }
            }
        }
        let mut weights = vec![0f32; 2 * HEAD_DIM];
        for c in 0..hd {
            weights[c] = round_bf16(rng.uniform(0.7, 1.3));
            weights[HEAD_DIM + c] = round_bf16(rng.uniform(0.7, 1.3));
        }
        let half = rotated / 2;
        let angles: Vec<f32> = (0..rows * stride).map(|_| rng.uniform(-6.0, 6.0)).collect();
        let cos: Vec<f32> = angles.iter().map(|a| round_bf16(a.cos())).collect();
        let sin: Vec<f32> = angles.iter().map(|a| round_bf16(a.sin())).collect();
        // The host op reads dense [rows, half] tables.
        let dense = |t: &[f32]| -> Vec<f32> {
            (0..rows)
                .flat_map(|r| t[r * stride..r * stride + half].to_vec())
                .collect()
        };
        let (cos_dense, sin_dense) = (dense(&cos), dense(&sin));
        let mut qd = device(&ctx, &bf16_bytes(&qkv));
        let wd = device(&ctx, &bf16_bytes(&weights));
        let (cd, sd) = (
            device(&ctx, &bf16_bytes(&cos)),
            device(&ctx, &bf16_bytes(&sin)),
        );
        {
            let qv = qd.view_mut();
            let (qw, kw) = (
                wd.slice(0, HEAD_DIM * 2).unwrap(),
                wd.slice(HEAD_DIM * 2, HEAD_DIM * 2).unwrap(),
            );
            let (cv, sv) = (cd.view(), sd.view());
            let op = QkNormRope {
                qkv: &qv,
                qkv_layout: Matrix::dense(rows, 3 * width),
                heads,
                q_weight: &qw,
                k_weight: &kw,
                norm_dim: hd,
                eps: 1e-5,
                rope: (rotated > 0).then_some((&cv, &sv, stride, rotated)),
            };
            kernels.run(&stream, plan_qk_norm_rope(&op)).unwrap();
        }
        stream.synchronize().unwrap();
        let out = read_bf16(&qd);
        for part in 0..3 {
            // [rows, heads, hd] of the part, before and after.
            let take = |v: &[f32]| -> Vec<f32> {
                let mut o = Vec::with_capacity(rows * heads * hd);
                for r in 0..rows {
                    for head in 0..heads {
                        let at = r * 3 * width + part * width + head * HEAD_DIM;
                        o.extend_from_slice(&v[at..at + hd]);
                    }
                }
                o
            };
            let (before, after) = (take(&qkv), take(&out));
            if part == 2 {
                assert_eq!(before, after, "value heads must be left as they are");
                continue;
            }
            let w = &weights[part * HEAD_DIM..part * HEAD_DIM + hd];
            let mut expected = vec![0f32; rows * heads * hd];
            ops::rms_norm(&before, rows * heads, hd, w, 1e-5, &mut expected).unwrap();
            if rotated > 0 {
                ops::rope_rotate_half_partial(
                    &mut expected,
                    rows,
                    heads,
                    hd,
                    rotated,
                    &cos_dense,
                    &sin_dense,
                    RopeTables::Bf16,
                )
                .unwrap();
            }
            let err = relative_l2(&after, &expected).unwrap();
            println!("qk_norm_rope heads {heads} x {hd}, rotated {rotated}, part {part}: relative L2 {err:.3e}");
            assert!(
                err <= BF16_KERNEL_MAX,
                "{heads}x{hd}/{rotated} part {part}: {err:e}"
            );
        }
        // Padding channels stay zero.
        for r in 0..rows {
            for head in 0..3 * heads {
                let at = r * 3 * width + head * HEAD_DIM;
                assert!(out[at + hd..at + HEAD_DIM].iter().all(|&v| v == 0.0));
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn linear_f32_matches_the_host_ops() {
    let ctx = context();
    let kernels = H3Kernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut rng = SplitMix64::new(13);
    struct Case {
        m: usize,
        n: usize,
        k: usize,
        x_bf16: bool,
        y_bf16: bool,
        gather: bool,
        scatter: bool,
        silu: bool,
    }
    let cases = [
        // proj_in: f32 rows scattered into bf16 rows of x.
        Case {
            m: 150,
            n: 70,
            k: 96,
            x_bf16: false,
            y_bf16: true,
            gather: false,
            scatter: true,
            silu: false,
        },
        // proj_out: bf16 rows gathered, f32 out.
        Case {
            m: 90,
            n: 33,
            k: 40,
            x_bf16: true,
            y_bf16: false,
            gather: true,
            scatter: false,
            silu: false,
        },
        // time embedder: a few f32 rows, SiLU, f32 and bf16 out.
        Case {
            m: 3,
            n: 50,
            k: 300,
            x_bf16: false,
            y_bf16: false,
            gather: false,
            scatter: false,
            silu: true,
        },
        Case {
            m: 5,
            n: 24,
            k: 64,
            x_bf16: false,
            y_bf16: true,
            gather: false,
            scatter: false,
            silu: true,
        },
        // Few rows gathered from bf16, and a tile case with every option.
        Case {
            m: 7,
            n: 9,
            k: 33,
            x_bf16: true,
            y_bf16: false,
            gather: true,
            scatter: true,
            silu: false,
        },
        Case {
            m: 65,
            n: 65,
            k: 17,
            x_bf16: true,
            y_bf16: false,
            gather: true,
            scatter: true,
            silu: true,
        },
    ];
    for c in cases {
        let x_rows = if c.gather { 2 * c.m + 3 } else { c.m };
        let y_rows = if c.scatter { 2 * c.m + 1 } else { c.m };
        let x_stride = c.k + 5;
        let x: Vec<f32> = bf16_values(&mut rng, x_rows * x_stride, -1.0, 1.0);
        let w: Vec<f32> = (0..c.n * c.k).map(|_| rng.uniform(-0.3, 0.3)).collect();
        let bias: Vec<f32> = (0..c.n).map(|_| rng.uniform(-0.5, 0.5)).collect();
        let gather: Vec<i32> = (0..c.m).map(|r| (x_rows - 1 - 2 * r) as i32).collect();
        let scatter: Vec<i32> = (0..c.m).map(|r| (2 * r + 1) as i32).collect();
        let xd = device(
            &ctx,
            &if c.x_bf16 {
                bf16_bytes(&x)
            } else {
                f32_bytes(&x)
            },
        );
        let wd = device(&ctx, &f32_bytes(&w));
        let bd = device(&ctx, &f32_bytes(&bias));
        let gd = device(&ctx, &i32_bytes(&gather));
        let sd = device(&ctx, &i32_bytes(&scatter));
        let y_bytes = y_rows * c.n * if c.y_bf16 { 2 } else { 4 };
        let sentinel = if c.y_bf16 {
            bf16_bytes(&vec![5.0; y_rows * c.n])
        } else {
            f32_bytes(&vec![5.0; y_rows * c.n])
        };
        assert_eq!(sentinel.len(), y_bytes);
        let mut yd = device(&ctx, &sentinel);
        {
            let (xv, wv, bv, gv, sv, yv) = (
                xd.view(),
                wd.view(),
                bd.view(),
                gd.view(),
                sd.view(),
                yd.view_mut(),
            );
            let op = LinearF32 {
                m: c.m,
                n: c.n,
                k: c.k,
                x: &xv,
                x_rows: RowsOperand {
                    elem: if c.x_bf16 { Elem::Bf16 } else { Elem::F32 },
                    rows: x_rows,
                    stride: x_stride,
                    index: c.gather.then_some(&gv),
                },
                w: &wv,
                bias: Some(&bv),
                y: &yv,
                y_rows: RowsOperand {
                    elem: if c.y_bf16 { Elem::Bf16 } else { Elem::F32 },
                    rows: y_rows,
                    stride: c.n,
                    index: c.scatter.then_some(&sv),
                },
                silu: c.silu,
            };
            kernels.run(&stream, plan_linear_f32(&op)).unwrap();
        }
        stream.synchronize().unwrap();
        // Host: gather, linear, bias, SiLU.
        let mut xs = Vec::with_capacity(c.m * c.k);
        for (r, &g) in gather.iter().enumerate() {
            let src = if c.gather { g as usize } else { r };
            xs.extend_from_slice(&x[src * x_stride..src * x_stride + c.k]);
        }
        let mut expected = vec![0f32; c.m * c.n];
        ops::linear(&xs, c.m, c.k, &w, c.n, &mut expected).unwrap();
        ops::add_bias(&mut expected, c.m, c.n, &bias).unwrap();
        if c.silu {
            ops::silu_inplace(&mut expected);
        }
        let all: Vec<f32> = if c.y_bf16 {
            read_bf16(&yd)
        } else {
            yd.to_vec::<f32>().unwrap()
        };
        let mut got = Vec::with_capacity(c.m * c.n);
        for (r, &to) in scatter.iter().enumerate() {
            let dst = if c.scatter { to as usize } else { r };
            got.extend_from_slice(&all[dst * c.n..(dst + 1) * c.n]);
        }
        if c.scatter {
            for r in (0..y_rows).step_by(2) {
                assert!(
                    all[r * c.n..(r + 1) * c.n].iter().all(|&v| v == 5.0),
                    "row {r} written"
                );
            }
        }
        let err = relative_l2(&got, &expected).unwrap();
        let max = if c.y_bf16 {
            BF16_KERNEL_MAX
        } else {
            F32_KERNEL_MAX
        };
        println!(
            "linear_f32 {}x{}x{} (x bf16 {}, y bf16 {}): relative L2 {err:.3e}",
            c.m, c.n, c.k, c.x_bf16, c.y_bf16
        );
        assert!(err <= max, "{}x{}x{}: {err:e} > {max:e}", c.m, c.n, c.k);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn every_fixture_case_matches_diffusers() {
    let ctx = context();
    let mut ran = 0;
    for case in cases() {
        let mut dit = load(&ctx, &case);
        dit.set_graphs(false);
        let inputs = inputs(&case);
        let out = dit
            .forward(&inputs)
            .unwrap_or_else(|e| panic!("{case}: forward: {e}"));
        // For reference: the host f32 forward with bf16 RoPE tables, as the GPU uses them.
        let mut host = HostH3Dit::load(&model_dir(&case)).unwrap();
        host.set_rope_tables(RopeTables::Bf16);
        let host_out = host.forward(&inputs).unwrap();
        println!(
            "{case}: GPU against the host reference with bf16 tables: sample {:.3e}, audio_sample {:.3e}",
            relative_l2(out.sample.data(), host_out.sample.data()).unwrap(),
            relative_l2(out.audio_sample.data(), host_out.audio_sample.data()).unwrap()
        );
        assert_close(&case, "sample", &out.sample, &expected(&case, "sample"));
        assert_close(
            &case,
            "audio_sample",
            &out.audio_sample,
            &expected(&case, "audio_sample"),
        );
        ran += 1;
    }
    assert!(ran >= 5, "expected at least five fixture cases, ran {ran}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn the_original_layout_twin_is_bit_equal_to_its_diffusers_folder() {
    let ctx = context();
    let m = manifest();
    let (twin, of) = m["cases"]
        .as_object()
        .unwrap()
        .iter()
        .find_map(|(k, v)| v["twin_of"].as_str().map(|of| (k.clone(), of.to_string())))
        .expect("an original-layout twin");
    let mut original = load(&ctx, &twin);
    let mut diffusers = load(&ctx, &of);
    assert!(matches!(
        original.checkpoint_layout(),
        Some(tf_engines::minimax_h3::checkpoint::CheckpointLayout::Original(_))
    ));
    // The heuristic's algorithms in both (no dependence on a plan cache), the same inputs through both: the device
    // images of the weights are the same, so are the outputs, bit for bit.
    for dit in [&original, &diffusers] {
        dit.set_gemm_selection(AlgoSelection::Heuristic).unwrap();
    }
    let a = original.forward(&inputs(&of)).unwrap();
    let b = diffusers.forward(&inputs(&of)).unwrap();
    assert_eq!(
        a.sample.data(),
        b.sample.data(),
        "{twin} against {of}: sample"
    );
    assert_eq!(
        a.audio_sample.data(),
        b.audio_sample.data(),
        "{twin} against {of}: audio_sample"
    );
}

/// The same shape with other values: hidden states and text halved, every timestep scaled by 0.9.
fn perturbed(inputs: &H3Inputs) -> H3Inputs {
    let mut p = inputs.clone();
    for t in [
        &mut p.hidden_states,
        &mut p.audio_hidden_states,
        &mut p.encoder_hidden_states,
    ] {
        t.data_mut().iter_mut().for_each(|v| *v *= 0.5);
    }
    p.timestep.data_mut().iter_mut().for_each(|v| *v *= 0.9);
    p
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn graph_replay_is_bit_equal_to_eager() {
    let ctx = context();
    for case in cases() {
        // One instance, so eager and replayed steps run the same GEMM plans.
        let mut dit = load(&ctx, &case);
        let step = inputs(&case);
        dit.set_graphs(false);
        let eager = dit.forward(&step).unwrap();
        let eager_again = dit.forward(&step).unwrap();
        assert_eq!(
            eager.sample.data(),
            eager_again.sample.data(),
            "{case}: eager steps differ"
        );
        dit.set_graphs(true);
        let replay = dit.forward(&step).unwrap(); // captured, then replayed
        let again = dit.forward(&step).unwrap(); // replayed
        for (what, out) in [("replay", &replay), ("second replay", &again)] {
            assert_eq!(
                out.sample.data(),
                eager.sample.data(),
                "{case}: {what} sample"
            );
            assert_eq!(
                out.audio_sample.data(),
                eager.audio_sample.data(),
                "{case}: {what} audio_sample"
            );
        }
        // New values of the same shape reach the captured graph through the per-forward uploads.
        let other = perturbed(&step);
        dit.set_graphs(false);
        let eager_other = dit.forward(&other).unwrap();
        dit.set_graphs(true);
        let replay_other = dit.forward(&other).unwrap();
        assert_eq!(
            replay_other.sample.data(),
            eager_other.sample.data(),
            "{case}: perturbed sample"
        );
        assert_eq!(
            replay_other.audio_sample.data(),
            eager_other.audio_sample.data(),
            "{case}: perturbed audio_sample"
        );
        assert_ne!(
            replay_other.sample.data(),
            eager.sample.data(),
            "{case}: the perturbed inputs changed nothing"
        );
        println!("{case}: graph replay bit-equal to the eager step (two input sets)");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn a_timestep_schedule_makes_the_tables_once() {
    let ctx = context();
    for case in cases() {
        let mut dit = load(&ctx, &case);
        let a = inputs(&case);
        let b = perturbed(&a);
        // Without a schedule every forward makes the tables of its own timesteps.
        let plain_a = dit.forward(&a).unwrap();
        let plain_b = dit.forward(&b).unwrap();
        // A request's schedule: both steps' values and one that no step uses.
        let mut schedule: Vec<f32> = b.timestep.data().to_vec();
        schedule.extend_from_slice(a.timestep.data());
        schedule.push(0.5);
        assert!(
            dit.set_timestep_schedule(&schedule).unwrap(),
            "{case}: schedule refused"
        );
        let made_before = dit.timestep_tables_made();
        let on_a = dit.forward(&a).unwrap(); // eager, makes the schedule's tables
        let on_b = dit.forward(&b).unwrap(); // the step without its tables, captured and replayed
        let on_a_again = dit.forward(&a).unwrap(); // replayed
        assert_eq!(
            dit.timestep_tables_made() - made_before,
            1,
            "{case}: three steps on one schedule made the tables more than once"
        );
        assert_eq!(
            on_a_again.sample.data(),
            on_a.sample.data(),
            "{case}: the replayed step without tables differs from the eager step"
        );
        assert_eq!(on_a_again.audio_sample.data(), on_a.audio_sample.data());
        // The same tables made by a GEMM over more rows (cuBLASLt may take another algorithm): close to the
        // per-step tables' outputs, not necessarily bit-equal.
        for (what, on, plain) in [("a", &on_a, &plain_a), ("b", &on_b, &plain_b)] {
            let sample = relative_l2(on.sample.data(), plain.sample.data()).unwrap();
            let audio = relative_l2(on.audio_sample.data(), plain.audio_sample.data()).unwrap();
            println!("{case}/{what}: on the schedule vs per-step tables: rel L2 sample {sample:.2e}, audio {audio:.2e}");
            assert!(
                sample <= 1e-2 && audio <= 1e-2,
                "{case}/{what}: {sample} {audio}"
            );
        }
        // Forgotten: back to the per-step workspace, whose tables still hold b's values.
        assert!(!dit.set_timestep_schedule(&[]).unwrap());
        let plain_b_again = dit.forward(&b).unwrap();
        assert_eq!(
            plain_b_again.sample.data(),
            plain_b.sample.data(),
            "{case}: after the schedule"
        );
        // A schedule missing a step's value leaves that step on its own tables.
        assert!(dit.set_timestep_schedule(&[0.25, 0.75]).unwrap());
        let off_schedule = dit.forward(&a).unwrap();
        assert_eq!(
            off_schedule.sample.data(),
            plain_a.sample.data(),
            "{case}: off the schedule"
        );
        assert!(!dit.set_timestep_schedule(&[]).unwrap());
        assert!(dit.set_timestep_schedule(&[f32::NAN]).is_err());
        println!("{case}: tables made once for a 3-step schedule; off-schedule steps unchanged");
    }
}

/// Two batch items: the case's inputs and their perturbed twin (same layout, other rows), stacked.
fn stacked(a: &H3Inputs, b: &H3Inputs) -> H3Inputs {
    let cat = |x: &TensorF32, y: &TensorF32| {
        let mut shape = x.shape().to_vec();
        shape[0] += y.shape()[0];
        TensorF32::new(shape, x.data().iter().chain(y.data()).copied().collect()).unwrap()
    };
    H3Inputs {
        hidden_states: cat(&a.hidden_states, &b.hidden_states),
        audio_hidden_states: cat(&a.audio_hidden_states, &b.audio_hidden_states),
        encoder_hidden_states: cat(&a.encoder_hidden_states, &b.encoder_hidden_states),
        ..a.clone()
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn batch_two_matches_two_single_runs() {
    let ctx = context();
    let case = "fl2va_first";
    let mut dit = load(&ctx, case);
    let one = inputs(case);
    assert_eq!(one.batch(), 1);
    let mut two = perturbed(&one);
    two.timestep = one.timestep.clone(); // batch items share the timesteps
    let both = dit.forward(&stacked(&one, &two)).unwrap();
    assert_eq!(both.sample.shape()[0], 2);
    for (item, single_inputs) in [(0usize, &one), (1, &two)] {
        let single = dit.forward(single_inputs).unwrap();
        for (what, batched, alone) in [
            ("sample", &both.sample, &single.sample),
            ("audio_sample", &both.audio_sample, &single.audio_sample),
        ] {
            let n = alone.data().len();
            let part = &batched.data()[item * n..(item + 1) * n];
            let err = relative_l2(part, alone.data()).unwrap();
            println!("{case}: batch item {item} {what} against its own run: relative L2 {err:.3e}");
            // The batched GEMMs (twice the rows) may pick other algorithms than the single ones, which moves
            // some bf16 roundings by one unit: close (a row mix-up would be of order 1), not bit-equal.
            assert!(err <= 1e-2, "item {item} {what}: {err:e}");
        }
    }
    // Item 0 is the fixture's own case.
    let n = expected(case, "sample").data().len();
    let first = TensorF32::new(
        vec![1, both.sample.shape()[1], both.sample.shape()[2]],
        both.sample.data()[..n].to_vec(),
    )
    .unwrap();
    assert_close(
        case,
        "sample (batch item 0)",
        &first,
        &expected(case, "sample"),
    );
}

/// A reduced model: 4 heads of 128, hidden 512, 3 blocks, the released channel counts and RoPE width.
fn reduced_config() -> MiniMaxH3Config {
    MiniMaxH3Config {
        num_attention_heads: 4,
        hidden_size: 512,
        num_layers: 3,
        num_refiner_layers: 1,
        ffn_dim: 1024,
        text_dim: 256,
        time_embed_hidden_dim: 512,
        time_embed_dim: 256,
        ..MiniMaxH3Config::default_full_size()
    }
}

/// Inputs of `config` over a 22-frame, 8x8-latent layout with 16 text rows (one keyframe block at the start).
fn layout_inputs(config: &MiniMaxH3Config, seed: u64) -> H3Inputs {
    let tags = [1u8; 16];
    let layout = PackedLayout::build(&LayoutRequest {
        text_tags: &tags,
        geometry: Geometry::from_latents(22, 8, 8).unwrap(),
        patch: config.patch_size,
        keyframes: &[tf_engines::minimax_h3::layout::KeyframeAnchor::First],
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
    H3Inputs::from_layout(&layout, &t, video, audio, text).unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn random_weights_at_a_reduced_size_give_finite_outputs() {
    let ctx = context();
    let config = reduced_config();
    let mut dit = GpuH3Dit::random_on(&ctx, &config, 5).unwrap();
    assert!(dit.checkpoint_layout().is_none());
    let inputs = layout_inputs(&config, 9);
    let out = dit.forward(&inputs).unwrap();
    for (what, t) in [("sample", &out.sample), ("audio_sample", &out.audio_sample)] {
        assert!(t.data().iter().all(|v| v.is_finite()), "{what}: non-finite");
        let rms = (t.data().iter().map(|v| f64::from(*v).powi(2)).sum::<f64>()
            / t.data().len() as f64)
            .sqrt();
        println!("random reduced model: {what} {:?}, rms {rms:.4}", t.shape());
        assert!(rms > 1e-4, "{what}: all zero");
    }
    // The same seed gives the same model.
    let mut again = GpuH3Dit::random_on(&ctx, &config, 5).unwrap();
    assert_eq!(
        again.forward(&inputs).unwrap().sample.data(),
        out.sample.data()
    );
    assert!(dit.weight_bytes() > 0 && dit.workspace_bytes() > 0);
    #[cfg(feature = "bench")]
    {
        let times = dit.time_step(&inputs, 1, 3).unwrap();
        println!("random reduced model: {times:?}");
        assert!(times.eager_ms > 0.0 && times.graph_ms > 0.0);
        assert!(times.peak_device_bytes >= dit.weight_bytes());
        let phases = dit.time_phases(&inputs).unwrap();
        for p in &phases.phases {
            println!(
                "  {:<32} {:>3}x {:>9.4} ms  {:>7.2} TFLOP/s  {:>7.1} GB/s",
                p.name,
                p.count,
                p.ms,
                p.tflops(),
                p.gb_per_s()
            );
        }
        let sum: f64 = phases.phases.iter().map(|p| p.ms).sum();
        let marks: usize = phases.phases.iter().map(|p| p.count).sum();
        assert!(
            (sum - phases.total_ms).abs() <= 2e-3 * marks as f64,
            "phases sum to {sum} ms, the step took {} ms",
            phases.total_ms
        );
        // The q|k|v GEMM's phase carries the QK norm's name where that runs in its epilogue (TF_BF16_GEMM=ours).
        for names in [
            &["attention"][..],
            &["qkv GEMM", "qkv GEMM + QK norm + RoPE"],
            &["SwiGLU"],
            &["residual + norm (feed-forward)"],
        ] {
            let p = phases
                .phases
                .iter()
                .find(|p| names.contains(&p.name))
                .unwrap_or_else(|| panic!("no phase named {names:?}"));
            assert_eq!(p.count, config.num_layers, "{names:?}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn a_load_cycle_gives_its_device_memory_back() {
    let ctx = context();
    let case = "t2va_b2_full_rotary";
    let cycle = || {
        let mut dit = load(&ctx, case);
        dit.forward(&inputs(case)).unwrap();
        dit.forward(&inputs(case)).unwrap();
        assert!(tf_cuda::usage().device > 0);
    };
    // The first cycle may leave the runtime's pinned copy pools warm; the second must return to the same usage.
    cycle();
    ctx.synchronize().unwrap();
    let before = tf_cuda::usage();
    cycle();
    ctx.synchronize().unwrap();
    let after = tf_cuda::usage();
    assert_eq!(
        after.device, before.device,
        "device bytes held after the model was dropped"
    );
    assert_eq!(
        after.host, before.host,
        "pinned bytes held after the model was dropped"
    );
}

// ---------------------------------------------------------------------------------------------------------
// FP8 (DitPrecision::Fp8): the fused quantizing norm against h3_residual_norm and the host, the whole forward
// of every fixture in FP8 against the bf16 GPU forward and the fp32 reference, a checkpoint whose FP8 weights
// are quantized on the upload ring, graph replay, and the resident bytes of a seeded FP8 model.
//
// Bounds of the whole forward in FP8: e4m3 keeps three mantissa bits, about 2.5% relative error per quantized
// operand (tests/gpu_fp8.rs), on top of the bf16 path's 1-3e-2 on these tiny models; every block GEMM of the
// two blocks runs in FP8 (`fp8:all,ends=0`). `FP8_REL_L2_MAX` = 0.15 with `FP8_COSINE_MIN` = 0.99 (the
// Qwen-Image FP8 fixture bounds) guard the structure: a wrong scale, row, table row or half order gives errors
// of order 1. The accuracy criterion is the full-size one (`h3-fp8-compare` in the GPU bundle: 4x the floor).

const FP8_REL_L2_MAX: f64 = 0.15;
const FP8_COSINE_MIN: f64 = 0.99;

/// Every block GEMM of every block in FP8: the tiny fixtures have two blocks, which the default mode keeps bf16.
fn fp8_everywhere() -> DitPrecision {
    "fp8:all,ends=0".parse().unwrap()
}

/// A context when the GPU runs row-wise scaled FP8 GEMMs (sm_90); otherwise says why the test is skipped.
fn fp8_context(test: &str) -> Option<Context> {
    let ctx = context();
    let cc = ctx.device_info().map(|i| i.compute_capability).ok();
    if cc != Some((9, 0)) {
        println!(
            "{test}: SKIPPED: FP8 GEMMs with row-wise scales need an sm_90 GPU (this one: {cc:?})"
        );
        return None;
    }
    Some(ctx)
}

fn load_in(ctx: &Context, case: &str, precision: DitPrecision) -> GpuH3Dit {
    let staging = StagingConfig {
        slot_bytes: 8192,
        slots: 2,
        threads: 3,
    };
    let dit = GpuH3Dit::load_in(
        &tf_engines::nn::gpu::GpuDevice::on(ctx).expect("a stream"),
        &model_dir(case),
        LoadOptions::default(),
        staging,
        precision,
    )
    .unwrap_or_else(|e| panic!("{case}: load in {precision}: {e}"));
    println!(
        "{case}: loaded in {} ({}), {} B resident",
        dit.precision(),
        dit.describe_precision(),
        dit.weight_bytes()
    );
    dit
}

/// Holds an FP8 output against the fp32 reference (FP8 bounds) and prints it beside the bf16 GPU output's error;
/// returns the FP8 relative L2 error.
fn compare_fp8(
    case: &str,
    what: &str,
    fp8: &TensorF32,
    bf16: &TensorF32,
    reference: &TensorF32,
) -> f64 {
    let e16 = relative_l2(bf16.data(), reference.data()).unwrap();
    let e8_bf16 = relative_l2(fp8.data(), bf16.data()).unwrap();
    assert_close_within(
        &format!("{case}/{what} fp8 vs fp32 (bf16 vs fp32 {e16:.3e}, fp8 vs bf16 {e8_bf16:.3e})"),
        fp8,
        reference,
        FP8_REL_L2_MAX,
        FP8_COSINE_MIN,
    );
    assert!(
        e8_bf16 <= FP8_REL_L2_MAX,
        "{case}/{what}: FP8 vs the bf16 GPU forward {e8_bf16:.3e}"
    );
    relative_l2(fp8.data(), reference.data()).unwrap()
}

#[path = "gpu_h3_dit/fp8_norms.rs"]
mod fp8_norms;

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fp8_forward_of_every_fixture_stays_near_bf16_and_the_reference() {
    let Some(ctx) = fp8_context("fp8_forward_of_every_fixture_stays_near_bf16_and_the_reference")
    else {
        return;
    };
    let mut worst: f64 = 0.0;
    for case in cases() {
        let step = inputs(&case);
        // The heuristic's algorithms (no plan cache): the default mode below must equal this bit for bit.
        let mut bf16_dit = load(&ctx, &case);
        bf16_dit
            .set_gemm_selection(AlgoSelection::Heuristic)
            .unwrap();
        let bf16 = bf16_dit.forward(&step).unwrap();
        let mut dit = load_in(&ctx, &case, fp8_everywhere());
        assert_eq!(dit.precision(), fp8_everywhere());
        let fp8_out = dit.forward(&step).unwrap();
        for (what, ours, base) in [
            ("sample", &fp8_out.sample, &bf16.sample),
            ("audio_sample", &fp8_out.audio_sample, &bf16.audio_sample),
        ] {
            worst = worst.max(compare_fp8(&case, what, ours, base, &expected(&case, what)));
        }
        // The adaLN projections in FP8 too (weight-only), and alone; one half of mlp_in apart from the other; every
        // group in INT8 on our INT8 GEMM (gemm=int8), and some.
        for spec in [
            "fp8:all,adaln,ends=0",
            "fp8:adaln,ends=0",
            "fp8:all,adaln=int8,ends=0",
            "fp8:adaln=int8,ends=0",
            "fp8:mlp_value,mlp_out,ends=0",
            "fp8:mlp_value,mlp_gate=int8,mlp_out,ends=0",
            "fp8:mlp_gate,ends=0",
            "fp8:all,ends=0,gemm=int8",
            "fp8:qkv,mlp_out,adaln=int8,ends=0,gemm=int8",
            "fp8:none,ends=0,attn=int8-fp8",
            "fp8:all,ends=0,attn=int8-fp8",
        ] {
            let precision: DitPrecision = spec.parse().unwrap();
            let out = load_in(&ctx, &case, precision).forward(&step).unwrap();
            for (what, ours, base) in [
                ("sample", &out.sample, &bf16.sample),
                ("audio_sample", &out.audio_sample, &bf16.audio_sample),
            ] {
                let e = compare_fp8(
                    &case,
                    &format!("{what} in {spec}"),
                    ours,
                    base,
                    &expected(&case, what),
                );
                worst = worst.max(e);
            }
        }
        // The default mode runs every block in INT8 (gemm=int8, ends=0): near bf16 and the reference, as the
        // mode it is named for.
        let mut default_mode = load_in(&ctx, &case, DitPrecision::FP8);
        assert_eq!(
            default_mode.precision().to_string(),
            "fp8:qkv,out,mlp_in,mlp_out,adaln=int8,ends=0,gemm=int8",
            "{case}"
        );
        let out = default_mode.forward(&step).unwrap();
        for (what, ours, base) in [
            ("sample", &out.sample, &bf16.sample),
            ("audio_sample", &out.audio_sample, &bf16.audio_sample),
        ] {
            let e = compare_fp8(
                &case,
                &format!("{what} in the default fp8"),
                ours,
                base,
                &expected(&case, what),
            );
            worst = worst.max(e);
        }
    }
    println!("FP8 fixtures: worst relative L2 against fp32 {worst:.3e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fp8_graph_replay_is_bit_equal_to_eager_and_groups_mix() {
    let Some(ctx) = fp8_context("fp8_graph_replay_is_bit_equal_to_eager_and_groups_mix") else {
        return;
    };
    let case = "first_last_odd";
    let step = inputs(case);
    for spec in [
        "fp8:all,ends=0",
        "fp8:all,adaln,ends=0",
        "fp8:adaln,ends=0",
        "fp8:adaln=int8,ends=0",
        "fp8:qkv,out,mlp_value,mlp_out,adaln=int8,ends=0",
        "fp8:qkv,out,mlp_value,mlp_gate=int8,mlp_out,adaln=int8,ends=0",
        "fp8:qkv,ends=0",
        "fp8:out,ends=0",
        "fp8:mlp_in,ends=0",
        "fp8:mlp_out,ends=0",
        "fp8:qkv,mlp_out,ends=0",
        "fp8:mlp_value,ends=0",
        "fp8:mlp_gate,ends=0",
        "fp8:qkv,out,mlp_value,mlp_out,ends=0",
        "fp8:none,ends=0,attn=int8-fp8",
        "fp8:qkv,out,mlp_value,mlp_out,ends=0,attn=int8-fp8",
        "fp8:all,ends=0,gemm=int8",
        "fp8:out,mlp_in,adaln=int8,ends=0,gemm=int8",
    ] {
        let precision: DitPrecision = spec.parse().unwrap();
        let mut dit = load_in(&ctx, case, precision);
        dit.set_graphs(false);
        let eager = dit.forward(&step).unwrap();
        dit.set_graphs(true);
        let replay = dit.forward(&step).unwrap(); // captured, then replayed
        let again = dit.forward(&step).unwrap(); // replayed
        for (what, out) in [("replay", &replay), ("second replay", &again)] {
            assert_eq!(
                out.sample.data(),
                eager.sample.data(),
                "{spec}: {what} sample"
            );
            assert_eq!(
                out.audio_sample.data(),
                eager.audio_sample.data(),
                "{spec}: {what} audio_sample"
            );
        }
        let other = perturbed(&step);
        dit.set_graphs(false);
        let eager_other = dit.forward(&other).unwrap();
        dit.set_graphs(true);
        assert_eq!(
            dit.forward(&other).unwrap().sample.data(),
            eager_other.sample.data(),
            "{spec}: perturbed sample"
        );
        let e = relative_l2(eager.sample.data(), expected(case, "sample").data()).unwrap();
        println!(
            "{case} in {spec}: graph replay bit-equal to eager; sample vs fp32 rel L2 {e:.3e}"
        );
        assert!(e <= FP8_REL_L2_MAX, "{spec}: {e:.3e}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn eight_bit_adaln_over_a_long_schedule_matches_its_per_step_tables() {
    let Some(ctx) = fp8_context("eight_bit_adaln_over_a_long_schedule_matches_its_per_step_tables")
    else {
        return;
    };
    let case = "first_last_odd";
    let a = inputs(case);
    let b = perturbed(&a);
    // More timestep values than the weight-only kernel takes: each block's projection is dequantized to bf16 and
    // multiplied by a GEMM; a few per-step values stay on the kernel.
    let mut schedule: Vec<f32> = b.timestep.data().to_vec();
    schedule.extend_from_slice(a.timestep.data());
    schedule.extend((1..=12).map(|i| i as f32 / 13.0));
    for spec in ["fp8:adaln=int8,ends=0", "fp8:adaln,ends=0"] {
        let precision: DitPrecision = spec.parse().unwrap();
        let mut dit = load_in(&ctx, case, precision);
        let plain_a = dit.forward(&a).unwrap();
        let plain_b = dit.forward(&b).unwrap();
        assert!(
            dit.set_timestep_schedule(&schedule).unwrap(),
            "{spec}: schedule refused"
        );
        let made_before = dit.timestep_tables_made();
        let on_a = dit.forward(&a).unwrap();
        let on_b = dit.forward(&b).unwrap();
        let on_a_again = dit.forward(&a).unwrap();
        assert_eq!(dit.timestep_tables_made() - made_before, 1, "{spec}");
        assert_eq!(
            on_a_again.sample.data(),
            on_a.sample.data(),
            "{spec}: replay"
        );
        // The GEMM's tables round each dequantized weight to bf16 (the kernel multiplies the codes in f32): close,
        // not bit-equal.
        for (what, on, plain) in [("a", &on_a, &plain_a), ("b", &on_b, &plain_b)] {
            let sample = relative_l2(on.sample.data(), plain.sample.data()).unwrap();
            let audio = relative_l2(on.audio_sample.data(), plain.audio_sample.data()).unwrap();
            println!(
                "{case} in {spec}/{what}: {}-value schedule (GEMM tables) vs per-step kernel tables: rel L2 sample {sample:.2e}, audio {audio:.2e}",
                schedule.len()
            );
            assert!(
                sample <= 1e-2 && audio <= 1e-2,
                "{spec}/{what}: {sample} {audio}"
            );
        }
        let e = relative_l2(on_a.sample.data(), expected(case, "sample").data()).unwrap();
        assert!(e <= FP8_REL_L2_MAX, "{spec}: {e:.3e} against fp32");
    }
}

/// A folder of `reduced_config()` with seeded f32 weights (nothing padded: the FP8 weights are quantized on the
/// upload ring), removed when dropped.
struct ReducedFolder(PathBuf);

impl ReducedFolder {
    fn write(seed: u64) -> ReducedFolder {
        let dir = std::env::temp_dir().join(format!("h3_fp8_ring_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = reduced_config();
        let mut json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(model_dir("fl2va_first").dir().join("config.json")).unwrap(),
        )
        .unwrap();
        for (key, value) in [
            ("num_attention_heads", config.num_attention_heads),
            ("attention_head_dim", config.attention_head_dim),
            ("hidden_size", config.hidden_size),
            ("num_layers", config.num_layers),
            ("num_refiner_layers", config.num_refiner_layers),
            ("ffn_dim", config.ffn_dim),
            ("text_dim", config.text_dim),
            ("time_embed_hidden_dim", config.time_embed_hidden_dim),
            ("time_embed_dim", config.time_embed_dim),
            ("freq_dim", config.freq_dim),
            ("in_channels", config.in_channels),
            ("audio_in_channels", config.audio_in_channels),
            ("rope_freq_dim", config.rope_freq_dim),
        ] {
            json[key] = serde_json::json!(value);
        }
        json["patch_size"] = serde_json::json!(config.patch_size);
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
        let mut rng = SplitMix64::new(seed);
        let tensors: Vec<(String, TensorF32)> = config
            .tensor_specs()
            .into_iter()
            .map(|spec| {
                let n: usize = spec.shape.iter().product();
                let values = if spec.name.contains("norm") && spec.shape.len() == 1 {
                    rng.uniform_vec(n, 0.95, 1.05)
                } else {
                    let bound = 1.0 / (*spec.shape.last().unwrap() as f32).sqrt();
                    rng.uniform_vec(n, -bound, bound)
                };
                (spec.name, TensorF32::new(spec.shape, values).unwrap())
            })
            .collect();
        write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
        ReducedFolder(dir)
    }
}

impl Drop for ReducedFolder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fp8_weights_quantized_on_the_upload_ring_run_near_bf16() {
    let Some(ctx) = fp8_context("fp8_weights_quantized_on_the_upload_ring_run_near_bf16") else {
        return;
    };
    let folder = ReducedFolder::write(17);
    let model = ModelDir::open(&folder.0).unwrap();
    // Small slots: each FP8 weight crosses several staging slots, whole rows at a time.
    let staging = StagingConfig {
        slot_bytes: 16384,
        slots: 2,
        threads: 3,
    };
    let load = |precision: DitPrecision| {
        GpuH3Dit::load_in(
            &tf_engines::nn::gpu::GpuDevice::on(&ctx).expect("a stream"),
            &model,
            LoadOptions::default(),
            staging,
            precision,
        )
        .unwrap_or_else(|e| panic!("load in {precision}: {e}"))
    };
    let mut bf16 = load(DitPrecision::Bf16);
    let mut fp8_dit = load(fp8_everywhere());
    let inputs = layout_inputs(bf16.config(), 3);
    let base = bf16.forward(&inputs).unwrap();
    fp8_dit.set_graphs(false);
    let eager = fp8_dit.forward(&inputs).unwrap();
    fp8_dit.set_graphs(true);
    fp8_dit.forward(&inputs).unwrap();
    let replay = fp8_dit.forward(&inputs).unwrap();
    assert_eq!(
        replay.sample.data(),
        eager.sample.data(),
        "replay differs from eager"
    );
    for (what, ours, theirs) in [
        ("sample", &eager.sample, &base.sample),
        ("audio_sample", &eager.audio_sample, &base.audio_sample),
    ] {
        assert_close_within(
            &format!("ring-quantized reduced model {what}: fp8 vs bf16"),
            ours,
            theirs,
            FP8_REL_L2_MAX,
            FP8_COSINE_MIN,
        );
    }
    let ratio = fp8_dit.weight_bytes() as f64 / bf16.weight_bytes() as f64;
    println!(
        "ring-quantized reduced model: {} B resident in FP8, {} B in bf16 ({ratio:.3}); {}",
        fp8_dit.weight_bytes(),
        bf16.weight_bytes(),
        fp8_dit.describe_precision()
    );
    // All three blocks' four groups at one byte a weight: about 0.79 of bf16 at this size (the adaLN projections,
    // the refiner and the embedders stay as they are).
    assert!(ratio < 0.85, "FP8 resident bytes {ratio:.3} of bf16");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn seeded_fp8_model_is_its_bf16_twin_quantized_at_about_half_the_bytes() {
    let Some(ctx) =
        fp8_context("seeded_fp8_model_is_its_bf16_twin_quantized_at_about_half_the_bytes")
    else {
        return;
    };
    let config = MiniMaxH3Config {
        num_layers: 6,
        ..reduced_config()
    };
    let inputs = layout_inputs(&config, 9);
    let mut bf16 = GpuH3Dit::random_on(&ctx, &config, 5).unwrap();
    let base = bf16.forward(&inputs).unwrap();
    // Every GEMM group (H3's `fp8` default keeps the gate half of `mlp_in` in bf16): the most bytes FP8 can save here.
    let all_groups: DitPrecision = "fp8:all,ends=1".parse().unwrap();
    let mut fp8_dit = GpuH3Dit::random_in(
        &tf_engines::nn::gpu::GpuDevice::on(&ctx).expect("a stream"),
        &config,
        5,
        all_groups,
    )
    .unwrap();
    let out = fp8_dit.forward(&inputs).unwrap();
    assert_close_within(
        "seeded reduced model, fp8:all,ends=1 vs bf16 from the same seed",
        &out.sample,
        &base.sample,
        FP8_REL_L2_MAX,
        FP8_COSINE_MIN,
    );
    let again = GpuH3Dit::random_in(
        &tf_engines::nn::gpu::GpuDevice::on(&ctx).expect("a stream"),
        &config,
        5,
        all_groups,
    )
    .unwrap()
    .forward(&inputs)
    .unwrap();
    assert_eq!(
        again.sample.data(),
        out.sample.data(),
        "the same seed gives another FP8 model"
    );
    let ratio = fp8_dit.weight_bytes() as f64 / bf16.weight_bytes() as f64;
    println!(
        "seeded reduced model: {} B resident in FP8 ({}), {} B in bf16: {ratio:.3}",
        fp8_dit.weight_bytes(),
        fp8_dit.describe_precision(),
        bf16.weight_bytes()
    );
    // Four of six blocks' groups in FP8 at this size (about 0.84 of bf16: the adaLN projections, the refiner and
    // the embedders stay as they are).
    assert!(ratio < 0.9, "{ratio:.3}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn linear_w8_matches_the_host_product_of_its_dequantized_weights() {
    let ctx = context();
    let kernels = H3Kernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut rng = SplitMix64::new(31);
    // The tiny fixtures' adaLN (18 x 32 rows of 16), the release's (k 2688) over 1, 6 and 97 timestep rows (a
    // request's schedule: 4 row groups of 32, the last partial), outputs written into rows wider than n; in e4m3 and
    // in INT8. The two widest give the ring form's persistent CTAs many groups each (its stages refilled and their
    // phases turned over; 1057 and 1189 groups of 16 on about 132 SMs), the last group partial.
    for (m, n, k, y_stride, codes) in [
        (2usize, 16904usize, 2688usize, 16904usize, RowCodes::E4m3),
        (3, 19016, 64, 19024, RowCodes::Int8),
        (3, 576, 16, 584, RowCodes::E4m3),
        (1, 1024, 2688, 1024, RowCodes::E4m3),
        (6, 968, 2688, 976, RowCodes::E4m3),
        (97, 264, 2688, 272, RowCodes::E4m3),
        (3, 576, 16, 584, RowCodes::Int8),
        (6, 968, 2688, 976, RowCodes::Int8),
        (97, 264, 2688, 272, RowCodes::Int8),
    ] {
        let x = bf16_values(&mut rng, m * k, -1.5, 1.5);
        let weights: Vec<f32> = (0..n * k)
            .map(|i| rng.uniform(-1.0, 1.0) * 2f32.powi((i / k % 5) as i32 - 6))
            .collect();
        let (w_codes, scales) = codes.quantize_rows(&weights, k);
        let bias = bf16_values(&mut rng, n, -0.5, 0.5);
        let xd = device(&ctx, &bf16_bytes(&x));
        let wd = device(&ctx, &w_codes);
        let sd = device(&ctx, &f32_bytes(&scales));
        let bd = device(&ctx, &bf16_bytes(&bias));
        // Every form of the layer: two columns a warp (the default), one (TF_LINEAR_W8_COLS=1), one for four
        // column groups in turn (1t4), and the codes streamed through a shared-memory ring (ring; sm_90 and newer).
        let mut forms = vec![
            LinearW8Columns::Two,
            LinearW8Columns::One,
            LinearW8Columns::OneFourInTurn,
        ];
        if kernels.has_ring() {
            forms.push(LinearW8Columns::Ring);
        } else {
            println!("linear_w8 ring form: SKIPPED (its kernels need sm_90 or newer and 192 KiB of shared memory)");
        }
        let mut outputs = Vec::new();
        for &columns in &forms {
            let mut yd = device(&ctx, &bf16_bytes(&vec![7.0f32; m * y_stride]));
            {
                let (xv, wv, sv, bv, yv) =
                    (xd.view(), wd.view(), sd.view(), bd.view(), yd.view_mut());
                let op = LinearW8 {
                    m,
                    n,
                    k,
                    codes,
                    x: &xv,
                    x_stride: k,
                    w: &wv,
                    w_scale: &sv,
                    bias: Some(&bv),
                    y: &yv,
                    y_stride,
                    sm_count: kernels.sm_count(),
                };
                kernels
                    .run(&stream, plan_linear_w8_columns(&op, columns))
                    .unwrap();
                stream.synchronize().unwrap();
            }
            outputs.push(read_bf16(&yd));
        }
        // A column's sum is the same in every form: bit-equal outputs.
        for (form, output) in forms.iter().zip(&outputs).skip(1) {
            let differ = outputs[0]
                .iter()
                .zip(output)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            println!(
                "linear_w8 {} [{m}x{n}x{k}]: {form:?} against two columns a warp: {differ} of {} values differ",
                codes.name(),
                outputs[0].len()
            );
            assert_eq!(differ, 0, "{} {m}x{n}x{k} {form:?}", codes.name());
        }
        let got = outputs.swap_remove(0);
        let deq = codes.dequantize_rows(&w_codes, &scales, k);
        let mut want = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                let dot: f64 = (0..k)
                    .map(|j| f64::from(x[r * k + j]) * f64::from(deq[c * k + j]))
                    .sum();
                want[r * n + c] = (dot + f64::from(bias[c])) as f32;
            }
        }
        let ours = columns(&got, y_stride, 0, n);
        let err = relative_l2(&ours, &want).unwrap();
        println!(
            "linear_w8 {} [{m}x{n}x{k}]: rel L2 against the host product {err:.3e} (bound {BF16_KERNEL_MAX})",
            codes.name()
        );
        assert!(
            err <= BF16_KERNEL_MAX,
            "{} {m}x{n}x{k}: {err:.3e}",
            codes.name()
        );
        // The columns past n are not written.
        for r in 0..m {
            assert!(got[r * y_stride + n..(r + 1) * y_stride]
                .iter()
                .all(|&v| v == 7.0));
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Scaled-FP8 checkpoints (tests/fixtures/minimax_h3_fp8, tests/python/h3_fp8_checkpoint_fixtures.py): the
// fl2va_first weights stored as e4m3 with per-tensor or per-channel scales, diffusers and original names. In FP8
// the main blocks' GEMM weights go to the device as the file's codes; everything else is dequantized. Both modes
// are held against the host forward on the same file (its weights dequantized to f32, bf16 RoPE tables as the
// GPU uses them): bf16 within the bf16 bounds, FP8 within the FP8 bounds (the weights are exactly the host's, so
// only the activations' e4m3 rounding adds to the bf16 error).

fn h3_fp8_checkpoint(variant: &str) -> ModelDir {
    ModelDir::open(&fixture_dir::find("minimax_h3_fp8").join(variant)).unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fp8_checkpoints_load_as_stored_and_dequantized_near_the_host_forward() {
    let test = "fp8_checkpoints_load_as_stored_and_dequantized_near_the_host_forward";
    let Some(ctx) = fp8_context(test) else {
        return;
    };
    let staging = StagingConfig {
        slot_bytes: 8192,
        slots: 2,
        threads: 3,
    };
    let step = inputs("fl2va_first");
    let fp8_mode: DitPrecision = "fp8:all,adaln,ends=0".parse().unwrap();
    let int8_adaln_mode: DitPrecision = "fp8:all,adaln=int8,ends=0".parse().unwrap();
    let int8_gate_mode: DitPrecision =
        "fp8:qkv,out,mlp_value,mlp_gate=int8,mlp_out,adaln=int8,ends=0"
            .parse()
            .unwrap();
    let mut per_channel_fp8 = None;
    // (variant, weights stored in FP8, of those used as stored in FP8 mode: q|k|v, out, fc1, fc2, adaLN per block)
    for (variant, stored, as_stored) in [
        ("per_tensor", 27, 14),
        ("per_channel", 27, 14),
        ("original_per_channel", 19, 10),
    ] {
        let model = h3_fp8_checkpoint(variant);
        let mut host = HostH3Dit::load(&model).unwrap();
        host.set_rope_tables(RopeTables::Bf16);
        let host_out = host.forward(&step).unwrap();
        // With the adaLN projections asked for in INT8, the file's e4m3 adaLN codes are still used as stored (INT8
        // would round them again); with the fc1 gate half asked for in INT8, the file's fc1 codes feed the e4m3
        // value half as stored and the gate half runs in bf16 (the load line then names no INT8 gate).
        // The default `fp8` on a file stored in e4m3 is H3's e4m3 mode (gemm=int8 would keep every block in e4m3).
        let default_mode = GpuH3Dit::load_in(
            &tf_engines::nn::gpu::GpuDevice::on(&ctx).expect("a stream"),
            &model,
            LoadOptions::default(),
            staging,
            DitPrecision::FP8,
        )
        .unwrap_or_else(|e| panic!("{variant}: load in fp8: {e}"));
        assert_eq!(
            default_mode.precision(),
            DitPrecision::Fp8(tf_engines::minimax_h3::dit_gpu::E4M3_FP8),
            "{variant}: {}",
            default_mode.describe_precision()
        );
        drop(default_mode);
        for (precision, want_as_stored, rel, cos) in [
            (DitPrecision::Bf16, Some(0), REL_L2_MAX, COSINE_MIN),
            (fp8_mode, Some(as_stored), FP8_REL_L2_MAX, FP8_COSINE_MIN),
            (
                int8_adaln_mode,
                Some(as_stored),
                FP8_REL_L2_MAX,
                FP8_COSINE_MIN,
            ),
            (int8_gate_mode, None, FP8_REL_L2_MAX, FP8_COSINE_MIN),
        ] {
            let mut dit = GpuH3Dit::load_in(
                &tf_engines::nn::gpu::GpuDevice::on(&ctx).expect("a stream"),
                &model,
                LoadOptions::default(),
                staging,
                precision,
            )
            .unwrap_or_else(|e| panic!("{variant}: load in {precision}: {e}"));
            let used = dit.checkpoint_fp8();
            println!(
                "{variant} in {precision}: {}, {} B resident",
                dit.describe_precision(),
                dit.weight_bytes()
            );
            assert_eq!(used.stored, stored, "{variant} in {precision}");
            match want_as_stored {
                Some(want) => assert_eq!(used.as_stored, want, "{variant} in {precision}"),
                None => {
                    assert!(used.as_stored > 0, "{variant} in {precision}: {used:?}");
                    assert!(
                        used.kept.gate_bf16 > 0,
                        "{variant} in {precision}: {used:?}"
                    );
                    assert!(
                        dit.describe_precision()
                            .contains("fc1's gate half runs in bf16"),
                        "{variant} in {precision}: {}",
                        dit.describe_precision()
                    );
                }
            }
            assert!(dit.describe_precision().contains("used as stored"));
            dit.set_graphs(false);
            let out = dit.forward(&step).unwrap();
            for (what, ours, theirs) in [
                ("sample", &out.sample, &host_out.sample),
                ("audio_sample", &out.audio_sample, &host_out.audio_sample),
            ] {
                assert_close_within(
                    &format!("{variant}/{what} in {precision} vs the host on the same file"),
                    ours,
                    theirs,
                    rel,
                    cos,
                );
            }
            // The original names hold the same codes and row scales: the same device image, the same output.
            if precision == fp8_mode {
                match variant {
                    "per_channel" => per_channel_fp8 = Some(out),
                    "original_per_channel" => {
                        let diffusers = per_channel_fp8.as_ref().unwrap();
                        assert_eq!(out.sample.data(), diffusers.sample.data());
                        assert_eq!(out.audio_sample.data(), diffusers.audio_sample.data());
                    }
                    _ => {}
                }
            }
        }
    }
}
