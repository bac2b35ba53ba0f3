//! GPU checks of the shared kernels (`tf_engines::nn::gpu`) and the Qwen-Image DiT's (`tf_engines::qwen_image::ops`) against the host reference
//! (`tf_engines::nn::host`), on seeded random inputs at small, odd and real DiT sizes.
//!
//! Every comparison prints the op, the case, the max abs error, the relative L2 error and the tolerances.
//! Tolerances follow from bf16 rounding: with unit roundoff U = 2^-8, a kernel that computes in f32 and rounds
//! its result once is within U * |ref| per element (so max abs <= U * max|ref| and relative L2 <= U); kernels
//! that round at more points get a small multiple, derived at each check.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use tf_cuda::{Context, DeviceBuffer, Driver, Stream};
use tf_engines::nn::gpu::{
    key_limits_from_blocks, key_pad_from_valid, AttentionInputs, AttentionShape, AttentionTile,
    Matrix, Modulation, ModulationRows, NormKind, NormModulate, PartialRope, QkvInputs, QkvOutputs,
    RopeNorm, RopeTable, RowModulation, Strides, SwigluOrder,
};
use tf_engines::nn::host;
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;
use tf_engines::qwen_image::ops::{
    plan_adaln_modulate, plan_gated_residual, plan_gated_residual_adaln, DitKernels,
};

/// bf16 unit roundoff.
const U: f64 = 1.0 / 256.0;
const EPS: f32 = 1e-6;

struct Gpu {
    ctx: Context,
    stream: Stream,
    kernels: DitKernels,
}

fn gpu() -> Gpu {
    let driver = Arc::new(Driver::open().expect("open the CUDA driver (libcuda.so.1)"));
    let ctx = Context::new(driver, 0).expect("create a context on device 0");
    let stream = Stream::new(&ctx, true).expect("create a stream");
    let kernels =
        DitKernels::load(&ctx).expect("load the shared and the qwen_image_dit kernel sets");
    for tile in AttentionTile::ALL {
        println!(
            "attention tile {tile:?} ({}) loaded: {}",
            tile.kernel(),
            kernels.has_tile(tile)
        );
    }
    Gpu {
        ctx,
        stream,
        kernels,
    }
}

fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x40;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

fn from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `n` random bf16 values in [lo, hi): the device bits and the exact f32 values.
fn random_bf16(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = (0..n).map(|_| to_bf16(rng.uniform(lo, hi))).collect();
    let values = bits.iter().map(|&b| from_bf16(b)).collect();
    (bits, values)
}

fn upload<T: tf_cuda::Pod>(g: &Gpu, data: &[T]) -> DeviceBuffer {
    DeviceBuffer::from_slice(&g.ctx, data).expect("upload")
}

fn download_bf16(g: &Gpu, buf: &DeviceBuffer) -> Vec<f32> {
    g.stream
        .synchronize()
        .expect("stream synchronize after the kernels");
    buf.to_vec::<u16>()
        .expect("download")
        .into_iter()
        .map(from_bf16)
        .collect()
}

/// Rows `rows` x `cols` taken out of a strided matrix.
fn unstride(data: &[f32], rows: usize, cols: usize, stride: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| data[r * stride..r * stride + cols].iter().copied())
        .collect()
}

/// Compares and asserts: max abs error <= max_abs_tol and relative L2 <= rel_tol, all values finite.
fn check(op: &str, case: &str, got: &[f32], want: &[f32], max_abs_tol: f64, rel_tol: f64) {
    assert_eq!(got.len(), want.len(), "{op} {case}: length");
    let mut max_abs = 0f64;
    let mut err2 = 0f64;
    let mut ref2 = 0f64;
    let mut worst = 0usize;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite(),
            "{op} {case}: element {i} is {g} (reference {w})"
        );
        let e = (f64::from(g) - f64::from(w)).abs();
        if e > max_abs {
            max_abs = e;
            worst = i;
        }
        err2 += e * e;
        ref2 += f64::from(w) * f64::from(w);
    }
    let rel = if ref2 > 0.0 {
        (err2 / ref2).sqrt()
    } else {
        err2.sqrt()
    };
    println!(
        "{op} [{case}]: {} values, max abs err {max_abs:.3e} (tol {max_abs_tol:.3e}, worst at {worst}: got {} want {}), \
         rel L2 {rel:.3e} (tol {rel_tol:.3e})",
        got.len(),
        got.get(worst).copied().unwrap_or(0.0),
        want.get(worst).copied().unwrap_or(0.0),
    );
    assert!(
        max_abs <= max_abs_tol,
        "{op} {case}: max abs error {max_abs} > {max_abs_tol}"
    );
    assert!(rel <= rel_tol, "{op} {case}: relative L2 {rel} > {rel_tol}");
}

fn max_abs(values: &[f32]) -> f64 {
    values.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()))
}

/// Single-rounding tolerance: U relative per element, plus f32 noise.
fn check_rounded_once(op: &str, case: &str, got: &[f32], want: &[f32]) {
    check(
        op,
        case,
        got,
        want,
        1.01 * U * max_abs(want) + 1e-6,
        1.01 * U,
    );
}

// ---------------------------------------------------------------------------------------------------------

/// Modulation tensor `[n_mod, 4 * cols]` (s1 | g1 | s2 | g2); returns the device bits, the f32 values of the block
/// at `block` (`[n_mod, cols]`).
fn modulation(rng: &mut Rng, n_mod: usize, cols: usize, block: usize) -> (Vec<u16>, Vec<f32>) {
    let (bits, values) = random_bf16(rng, n_mod * 4 * cols, -1.0, 1.0);
    let block_values = (0..n_mod)
        .flat_map(|m| {
            values[m * 4 * cols + block * cols..m * 4 * cols + (block + 1) * cols]
                .iter()
                .copied()
        })
        .collect();
    (bits, block_values)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn adaln_modulate_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(1);
    // (samples, seq_len, target_begin, cols, output stride)
    for (samples, seq_len, target_begin, cols, y_stride) in
        [(2, 16, 5, 256, 264), (1, 4176, 80, 4096, 4096)]
    {
        let rows = samples * seq_len;
        let n_mod = samples + 1;
        let (x_bits, x) = random_bf16(&mut rng, rows * cols, -3.0, 5.0);
        let (mod_bits, scale) = modulation(&mut rng, n_mod, cols, 2);
        let select = ModulationRows {
            seq_len,
            target_begin,
            prefix_row: samples,
        };
        let row_mod: Vec<usize> = (0..rows).map(|r| select.row_of(r)).collect();
        let mut want = vec![0f32; rows * cols];
        host::layer_norm_modulate(&x, rows, cols, &scale, n_mod, &row_mod, EPS, &mut want)
            .expect("host reference");

        let x_dev = upload(&g, &x_bits);
        let mod_dev = upload(&g, &mod_bits);
        let mut y_dev = upload(&g, &vec![0u16; rows * y_stride]);
        let mod_view = mod_dev.view();
        let scale_block = Modulation {
            data: &mod_view,
            rows: n_mod,
            stride: 4 * cols,
            offset: 2 * cols,
        };
        g.kernels
            .run(
                &g.stream,
                plan_adaln_modulate(
                    &x_dev.view(),
                    Matrix::dense(rows, cols),
                    &y_dev.view_mut(),
                    y_stride,
                    &scale_block,
                    select,
                    EPS,
                ),
            )
            .expect("launch adaln_modulate");
        let got = unstride(&download_bf16(&g, &y_dev), rows, cols, y_stride);
        check_rounded_once(
            "adaln_modulate",
            &format!("{rows}x{cols}, target from {target_begin}"),
            &got,
            &want,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn rms_norm_zero_centred_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(2);
    for (rows, cols) in [(3, 4096), (80, 4096), (5, 136)] {
        let (x_bits, x) = random_bf16(&mut rng, rows * cols, -4.0, 4.0);
        let (w_bits, w) = random_bf16(&mut rng, cols, -0.5, 0.5);
        let mut want = vec![0f32; rows * cols];
        host::rms_norm_zero_centred(&x, rows, cols, &w, EPS, &mut want).expect("host reference");
        let x_dev = upload(&g, &x_bits);
        let w_dev = upload(&g, &w_bits);
        let mut y_dev = upload(&g, &vec![0u16; rows * cols]);
        g.kernels
            .rms_norm_zc(
                &g.stream,
                &x_dev.view(),
                Matrix::dense(rows, cols),
                &mut y_dev.view_mut(),
                cols,
                &w_dev.view(),
                EPS,
            )
            .expect("launch rms_norm_zc");
        check_rounded_once(
            "rms_norm_zc",
            &format!("{rows}x{cols}"),
            &download_bf16(&g, &y_dev),
            &want,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gated_residual_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(3);
    for (samples, seq_len, target_begin, cols) in
        [(2, 9, 4, 64), (1, 4096, 0, 4096), (1, 4176, 80, 4096)]
    {
        let rows = samples * seq_len;
        let n_mod = samples + 1;
        let (x_bits, x) = random_bf16(&mut rng, rows * cols, -8.0, 8.0);
        let (y_bits, y) = random_bf16(&mut rng, rows * cols, -2.0, 2.0);
        let (mod_bits, gate) = modulation(&mut rng, n_mod, cols, 3);
        let select = ModulationRows {
            seq_len,
            target_begin,
            prefix_row: samples,
        };
        let row_mod: Vec<usize> = (0..rows).map(|r| select.row_of(r)).collect();
        let mut want = x.clone();
        host::gated_residual(&mut want, rows, cols, &y, &gate, n_mod, &row_mod)
            .expect("host reference");

        let mut x_dev = upload(&g, &x_bits);
        let y_dev = upload(&g, &y_bits);
        let mod_dev = upload(&g, &mod_bits);
        let mod_view = mod_dev.view();
        let gate_block = Modulation {
            data: &mod_view,
            rows: n_mod,
            stride: 4 * cols,
            offset: 3 * cols,
        };
        g.kernels
            .run(
                &g.stream,
                plan_gated_residual(
                    &x_dev.view_mut(),
                    Matrix::dense(rows, cols),
                    &y_dev.view(),
                    cols,
                    &gate_block,
                    select,
                ),
            )
            .expect("launch gated_residual");
        check_rounded_once(
            "gated_residual",
            &format!("{rows}x{cols}"),
            &download_bf16(&g, &x_dev),
            &want,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fused_residual_adaln_equals_the_two_kernels() {
    let g = gpu();
    let mut rng = Rng::new(13);
    // Narrow, DiT-wide (4096) and the widest rows the kernel takes (8192).
    for (samples, seq_len, target_begin, cols) in
        [(2, 9, 4, 64), (1, 4176, 80, 4096), (2, 24, 8, 8192)]
    {
        let rows = samples * seq_len;
        let n_mod = samples + 1;
        let (x_bits, _) = random_bf16(&mut rng, rows * cols, -8.0, 8.0);
        let (y_bits, _) = random_bf16(&mut rng, rows * cols, -2.0, 2.0);
        let (mod_bits, _) = modulation(&mut rng, n_mod, cols, 3);
        let select = ModulationRows {
            seq_len,
            target_begin,
            prefix_row: samples,
        };
        let mod_dev = upload(&g, &mod_bits);
        let mod_view = mod_dev.view();
        let block = |offset: usize| Modulation {
            data: &mod_view,
            rows: n_mod,
            stride: 4 * cols,
            offset,
        };
        let layout = Matrix::dense(rows, cols);
        let y_dev = upload(&g, &y_bits);

        // Two kernels.
        let mut x_two = upload(&g, &x_bits);
        let mut out_two = upload(&g, &vec![0u16; rows * cols]);
        g.kernels
            .run(
                &g.stream,
                plan_gated_residual(
                    &x_two.view_mut(),
                    layout,
                    &y_dev.view(),
                    cols,
                    &block(3 * cols),
                    select,
                ),
            )
            .expect("launch gated_residual");
        g.kernels
            .run(
                &g.stream,
                plan_adaln_modulate(
                    &x_two.view(),
                    layout,
                    &out_two.view_mut(),
                    cols,
                    &block(cols),
                    select,
                    1e-6,
                ),
            )
            .expect("launch adaln_modulate");

        // One fused kernel.
        let mut x_one = upload(&g, &x_bits);
        let mut out_one = upload(&g, &vec![0u16; rows * cols]);
        g.kernels
            .run(
                &g.stream,
                plan_gated_residual_adaln(
                    &x_one.view_mut(),
                    layout,
                    &y_dev.view(),
                    cols,
                    &out_one.view_mut(),
                    cols,
                    &block(3 * cols),
                    &block(cols),
                    select,
                    1e-6,
                ),
            )
            .expect("launch gated_residual_adaln");

        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let (xa, xb) = (
            bits(download_bf16(&g, &x_two)),
            bits(download_bf16(&g, &x_one)),
        );
        let (oa, ob) = (
            bits(download_bf16(&g, &out_two)),
            bits(download_bf16(&g, &out_one)),
        );
        let x_diff = xa.iter().zip(&xb).filter(|(a, b)| a != b).count();
        let o_diff = oa.iter().zip(&ob).filter(|(a, b)| a != b).count();
        println!(
            "gated_residual_adaln [{rows}x{cols}]: residual values differing {x_diff}, normed values differing \
             {o_diff} (of {})",
            rows * cols
        );
        assert_eq!(x_diff, 0, "fused residual differs from qi_gated_residual");
        assert_eq!(o_diff, 0, "fused adaLN differs from qi_adaln_modulate");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn swiglu_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(4);
    // (rows, hidden, input stride): a padded input stride exercises strided reads.
    for (rows, hidden, stride) in [(5, 64, 136), (16, 12288, 24576)] {
        let (bits, values) = random_bf16(&mut rng, rows * stride, -6.0, 6.0);
        let gate: Vec<f32> = (0..rows)
            .flat_map(|r| values[r * stride..r * stride + hidden].to_vec())
            .collect();
        let up: Vec<f32> = (0..rows)
            .flat_map(|r| values[r * stride + hidden..r * stride + 2 * hidden].to_vec())
            .collect();
        let mut want = vec![0f32; rows * hidden];
        host::swiglu(&gate, &up, &mut want).expect("host reference");
        let in_dev = upload(&g, &bits);
        let mut out_dev = upload(&g, &vec![0u16; rows * hidden]);
        g.kernels
            .swiglu(
                &g.stream,
                &in_dev.view(),
                Matrix {
                    rows,
                    cols: 2 * hidden,
                    stride,
                },
                &mut out_dev.view_mut(),
                hidden,
            )
            .expect("launch swiglu");
        check_rounded_once(
            "swiglu",
            &format!("{rows}x{hidden}"),
            &download_bf16(&g, &out_dev),
            &want,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gelu_and_silu_match_host() {
    let g = gpu();
    let mut rng = Rng::new(5);
    for n in [1003usize, 80 * 4096] {
        let (bits, x) = random_bf16(&mut rng, n, -8.0, 8.0);
        let mut want_gelu = x.clone();
        host::gelu_tanh_inplace(&mut want_gelu);
        let mut want_silu = x.clone();
        host::silu_inplace(&mut want_silu);

        let x_dev = upload(&g, &bits);
        let mut y_dev = upload(&g, &vec![0u16; n]);
        g.kernels
            .gelu_tanh(&g.stream, &x_dev.view(), &mut y_dev.view_mut(), n)
            .expect("launch gelu_tanh");
        check_rounded_once(
            "gelu_tanh",
            &format!("n={n}"),
            &download_bf16(&g, &y_dev),
            &want_gelu,
        );

        let mut inplace = upload(&g, &bits);
        g.kernels
            .silu_inplace(&g.stream, &mut inplace.view_mut(), n)
            .expect("launch silu in place");
        check_rounded_once(
            "silu (in place)",
            &format!("n={n}"),
            &download_bf16(&g, &inplace),
            &want_silu,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn timestep_embedding_matches_host() {
    let g = gpu();
    let t = [1.0f32, 0.6123, 0.002, 0.0];
    let dim = 256;
    let mut want = vec![0f32; t.len() * dim];
    host::timestep_embedding(&t, dim, &mut want).expect("host reference");
    let t_dev = upload(&g, &t);
    let mut out_dev = upload(&g, &vec![0u16; t.len() * dim]);
    g.kernels
        .timestep_embedding(
            &g.stream,
            &t_dev.view(),
            &mut out_dev.view_mut(),
            t.len(),
            dim,
            1000.0,
            10000.0,
        )
        .expect("launch timestep_embedding");
    // Values are within [-1, 1]: one bf16 rounding (U) plus the argument's error: the device expf may differ
    // from the host's correctly rounded frequency by 2 ulps (2.4e-7 relative), times |arg| <= 1000: 2.4e-4
    // rad; 5e-4 leaves room for the f32 products.
    check(
        "timestep_embedding",
        "4 x 256",
        &download_bf16(&g, &out_dev),
        &want,
        U + 5e-4,
        U + 5e-4,
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn qk_norm_rope_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(6);
    // (text rows, image height, image width, heads, extra qkv columns)
    for (text, h, w, heads, extra) in [(7, 5, 6, 3, 8), (80, 64, 64, 32, 0)] {
        let rows = text + h * w;
        let width = heads * 128;
        let stride = 3 * width + extra;
        let (qkv_bits, qkv) = random_bf16(&mut rng, rows * stride, -3.0, 3.0);
        let (qw_bits, qw) = random_bf16(&mut rng, 128, 0.5, 1.5);
        let (kw_bits, kw) = random_bf16(&mut rng, 128, 0.5, 1.5);
        // Positions by the DiT's rule: text 0..L on all axes, the image at frame L with centred rows/cols.
        let mut positions: Vec<[i64; 3]> = (0..text as i64).map(|p| [p, p, p]).collect();
        for y in 0..h as i64 {
            for x in 0..w as i64 {
                positions.push([
                    text as i64,
                    y - (h as i64 - h as i64 / 2),
                    x - (w as i64 - w as i64 / 2),
                ]);
            }
        }
        let (cos, sin) = host::rope_tables(&positions, [16, 56, 56], 10000.0);

        let mut want = Vec::new();
        for (part, weight) in [(0usize, &qw), (1, &kw)] {
            let x: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    qkv[r * stride + part * width..r * stride + (part + 1) * width].to_vec()
                })
                .collect();
            let mut normed = vec![0f32; rows * width];
            host::rms_norm(&x, rows * heads, 128, weight, EPS, &mut normed).expect("host rms_norm");
            host::rope_interleaved(&mut normed, rows, heads, 128, &cos, &sin).expect("host rope");
            want.push(normed);
        }
        let v_want: Vec<f32> = (0..rows)
            .flat_map(|r| qkv[r * stride + 2 * width..r * stride + 3 * width].to_vec())
            .collect();

        let qkv_dev = upload(&g, &qkv_bits);
        let qw_dev = upload(&g, &qw_bits);
        let kw_dev = upload(&g, &kw_bits);
        let cos_dev = upload(&g, &cos);
        let sin_dev = upload(&g, &sin);
        let mut q_dev = upload(&g, &vec![0u16; rows * width]);
        let mut k_dev = upload(&g, &vec![0u16; rows * width]);
        let mut v_dev = upload(&g, &vec![0u16; rows * width]);
        {
            let (qkv_v, qw_v, kw_v, cos_v, sin_v) = (
                qkv_dev.view(),
                qw_dev.view(),
                kw_dev.view(),
                cos_dev.view(),
                sin_dev.view(),
            );
            let inputs = QkvInputs {
                qkv: &qkv_v,
                qkv_layout: Matrix {
                    rows,
                    cols: 3 * width,
                    stride,
                },
                heads,
                q_weight: &qw_v,
                k_weight: &kw_v,
                eps: EPS,
                rope_cos: &cos_v,
                rope_sin: &sin_v,
                rope_stride: 64,
            };
            let (mut qv, mut kv, mut vv) = (q_dev.view_mut(), k_dev.view_mut(), v_dev.view_mut());
            let mut outputs = QkvOutputs::with_stride((&mut qv, &mut kv, &mut vv), width);
            g.kernels
                .qk_norm_rope(&g.stream, &inputs, &mut outputs)
                .expect("launch qk_norm_rope");
        }
        // Rounded three times (after the norm, after the weight, after the rotation); a rotation mixes two
        // components, so an element's error is at most about (2 * sqrt(2) * sqrt(2) + 1) U = 5 U of the
        // largest element; the L2 error about 3 U.
        let case = format!("{rows} rows x {heads} heads");
        for (name, dev, want) in [("q", &q_dev, &want[0]), ("k", &k_dev, &want[1])] {
            check(
                &format!("qk_norm_rope {name}"),
                &case,
                &download_bf16(&g, dev),
                want,
                6.0 * U * max_abs(want),
                3.0 * U,
            );
        }
        check(
            "qk_norm_rope v (copy)",
            &case,
            &download_bf16(&g, &v_dev),
            &v_want,
            0.0,
            0.0,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn copy_rows_and_transpose_are_exact() {
    let g = gpu();
    let mut rng = Rng::new(7);
    // Copy an 80 x 4096 prefix block into rows of a wider buffer.
    let (rows, cols, dst_stride) = (80, 4096, 4096 + 64);
    let (bits, values) = random_bf16(&mut rng, rows * cols, -1.0, 1.0);
    let src = upload(&g, &bits);
    let mut dst = upload(&g, &vec![0u16; rows * dst_stride]);
    g.kernels
        .copy_rows(
            &g.stream,
            &src.view(),
            Matrix::dense(rows, cols),
            &mut dst.view_mut(),
            dst_stride,
        )
        .expect("launch copy_rows");
    let got = download_bf16(&g, &dst);
    check(
        "copy_rows",
        "80x4096 -> stride 4160",
        &unstride(&got, rows, cols, dst_stride),
        &values,
        0.0,
        0.0,
    );
    let untouched = (0..rows).all(|r| {
        got[r * dst_stride + cols..(r + 1) * dst_stride]
            .iter()
            .all(|&v| v == 0.0)
    });
    assert!(untouched, "copy_rows wrote past the copied columns");

    for (rows, cols) in [(64, 4096), (37, 45)] {
        let (bits, values) = random_bf16(&mut rng, rows * cols, -1.0, 1.0);
        let want: Vec<f32> = (0..cols)
            .flat_map(|c| (0..rows).map(move |r| (r, c)))
            .map(|(r, c)| values[r * cols + c])
            .collect();
        let src = upload(&g, &bits);
        let mut dst = upload(&g, &vec![0u16; rows * cols]);
        g.kernels
            .transpose(&g.stream, &src.view(), &mut dst.view_mut(), rows, cols)
            .expect("launch transpose");
        check(
            "transpose",
            &format!("{rows}x{cols}"),
            &download_bf16(&g, &dst),
            &want,
            0.0,
            0.0,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn launchers_refuse_bad_shapes_before_the_driver() {
    let g = gpu();
    let x = upload(&g, &vec![0u16; 64 * 64]);
    let mut y = upload(&g, &vec![0u16; 64 * 64]);
    let w = upload(&g, &[0u16; 64]);
    // Too many rows for the buffer.
    let err = g
        .kernels
        .rms_norm_zc(
            &g.stream,
            &x.view(),
            Matrix::dense(65, 64),
            &mut y.view_mut(),
            64,
            &w.view(),
            EPS,
        )
        .expect_err("an oversized shape must be refused");
    println!("refused as expected: {err}");
    assert!(matches!(err, tf_cuda::Error::Invalid { .. }), "{err}");
    // Columns not a multiple of 8.
    let err = g
        .kernels
        .copy_rows(
            &g.stream,
            &x.view(),
            Matrix {
                rows: 2,
                cols: 12,
                stride: 64,
            },
            &mut y.view_mut(),
            64,
        )
        .expect_err("unaligned columns must be refused");
    println!("refused as expected: {err}");
    // The stream is still usable afterwards.
    g.stream
        .synchronize()
        .expect("stream healthy after refused launches");
}

// --------------------------------------------------------------------------------------------------------- //
// Attention

/// One attention case: sizes, masks, the prefix split, and which query rows to check against the host.
struct AttentionCase {
    name: &'static str,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    /// Block id per key position (the host reference's mask), shared by the batch.
    block_ids: Vec<i32>,
    /// Position of the first query among the keys (queries are the last `num_queries` positions).
    q_offset: usize,
    /// Keys held as a cached prefix (read from separate buffers).
    prefix_len: usize,
    /// Padding per sample: keys [begin, end) never seen.
    pads: Vec<Option<(usize, usize)>>,
    /// Query rows checked against the host (all when None).
    check_rows: Option<Vec<usize>>,
    /// Use per-query key limits (block-causal) rather than full attention.
    causal: bool,
}

fn run_attention_case(g: &Gpu, case: &AttentionCase, rng: &mut Rng) {
    let num_keys = case.block_ids.len();
    let num_queries = num_keys - case.q_offset;
    let current = num_keys - case.prefix_len;
    let q_width = case.heads * 128;
    let kv_width = case.kv_heads * 128;
    let group = case.heads / case.kv_heads;

    let (q_bits, q) = random_bf16(rng, case.batch * num_queries * q_width, -2.0, 2.0);
    let (mut k_bits, mut k) = random_bf16(rng, case.batch * num_keys * kv_width, -2.0, 2.0);
    let (mut v_bits, mut v) = random_bf16(rng, case.batch * num_keys * kv_width, -1.0, 1.0);
    // Poison padded keys: any leak through the mask moves the output far off.
    for (b, pad) in case.pads.iter().enumerate() {
        if let Some((begin, end)) = *pad {
            for key in begin..end {
                for c in 0..kv_width {
                    let i = (b * num_keys + key) * kv_width + c;
                    k_bits[i] = to_bf16(6.0);
                    v_bits[i] = to_bf16(40.0);
                    k[i] = 6.0;
                    v[i] = 40.0;
                }
            }
        }
    }
    let v_max = max_abs(&v[..]).min(1.0); // the visible values are within [-1, 1]

    // Device layout: prefix keys in their own buffers, current keys in k/v.
    let split = |bits: &[u16], from: usize, to: usize| -> Vec<u16> {
        (0..case.batch)
            .flat_map(|b| {
                bits[(b * num_keys + from) * kv_width..(b * num_keys + to) * kv_width].to_vec()
            })
            .collect()
    };
    let kp_dev = upload(g, &split(&k_bits, 0, case.prefix_len).max_len_one());
    let vp_dev = upload(g, &split(&v_bits, 0, case.prefix_len).max_len_one());
    let k_dev = upload(g, &split(&k_bits, case.prefix_len, num_keys));
    let v_dev = upload(g, &split(&v_bits, case.prefix_len, num_keys));
    let q_dev = upload(g, &q_bits);

    let limits =
        key_limits_from_blocks(&case.block_ids, case.q_offset, num_queries).expect("key limits");
    let limit_dev = upload(g, &limits);
    let pads: Vec<i32> = case
        .pads
        .iter()
        .flat_map(|p| p.map_or([0, 0], |(b, e)| [b as i32, e as i32]))
        .collect();
    let pad_dev = upload(g, &pads);
    for (b, pad) in case.pads.iter().enumerate() {
        let valid: Vec<bool> = (0..num_keys)
            .map(|k| !pad.is_some_and(|(s, e)| (s..e).contains(&k)))
            .collect();
        let derived = key_pad_from_valid(&valid).expect("contiguous pad");
        assert_eq!(
            derived,
            pad.map(|(s, e)| (s as i32, e as i32)),
            "sample {b}: pad range round trip"
        );
    }

    let shape = AttentionShape {
        batch: case.batch,
        num_queries,
        num_keys,
        prefix_len: case.prefix_len,
        num_heads: case.heads,
        num_kv_heads: case.kv_heads,
    };
    let (q_v, kp_v, vp_v, k_v, v_v, lim_v, pad_v) = (
        q_dev.view(),
        kp_dev.view(),
        vp_dev.view(),
        k_dev.view(),
        v_dev.view(),
        limit_dev.view(),
        pad_dev.view(),
    );
    let prefix_strides = Strides {
        batch: case.prefix_len * kv_width,
        row: kv_width,
    };
    let inputs = AttentionInputs {
        q: &q_v,
        q_strides: Strides {
            batch: num_queries * q_width,
            row: q_width,
        },
        prefix: (case.prefix_len > 0).then_some((&kp_v, &vp_v, prefix_strides)),
        k: &k_v,
        v: &v_v,
        kv_strides: Strides {
            batch: current * kv_width,
            row: kv_width,
        },
        key_limit: case.causal.then_some((&lim_v, 0)),
        key_pad: Some(&pad_v),
        scale: 1.0 / (128f32).sqrt(),
    };
    let o_strides = Strides {
        batch: num_queries * q_width,
        row: q_width,
    };

    // Host reference on the selected rows, per sample, with K/V expanded to the query heads.
    let rows: Vec<usize> = case
        .check_rows
        .clone()
        .unwrap_or_else(|| (0..num_queries).collect());
    let mut want = Vec::new();
    for b in 0..case.batch {
        let expand = |src: &[f32]| -> Vec<f32> {
            let mut out = Vec::with_capacity(num_keys * q_width);
            for key in 0..num_keys {
                for h in 0..case.heads {
                    let base = (b * num_keys + key) * kv_width + (h / group) * 128;
                    out.extend_from_slice(&src[base..base + 128]);
                }
            }
            out
        };
        let (k_full, v_full) = (expand(&k), expand(&v));
        let key_valid: Vec<bool> = (0..num_keys)
            .map(|k| !case.pads[b].is_some_and(|(s, e)| (s..e).contains(&k)))
            .collect();
        let all_one_block: Vec<i32> = vec![0; num_keys];
        let block_ids = if case.causal {
            &case.block_ids
        } else {
            &all_one_block
        };
        for &r in &rows {
            let q_row = &q[(b * num_queries + r) * q_width..(b * num_queries + r + 1) * q_width];
            let mut out = vec![0f32; q_width];
            let mask = host::AttentionMask {
                q_offset: case.q_offset + r,
                block_ids,
                key_valid: &key_valid,
            };
            host::attention(
                q_row, &k_full, &v_full, 1, num_keys, case.heads, 128, mask, &mut out,
            )
            .expect("host attention");
            want.extend(out);
        }
    }
    let pick = |all: &[f32]| -> Vec<f32> {
        (0..case.batch)
            .flat_map(|b| rows.iter().map(move |&r| (b, r)))
            .flat_map(|(b, r)| {
                all[(b * num_queries + r) * q_width..(b * num_queries + r + 1) * q_width].to_vec()
            })
            .collect()
    };

    // The first result of each reduction order (key-tile width and tile starts): those must be bit-identical.
    let mut first: Vec<((u32, usize), Vec<f32>)> = Vec::new();
    for tile in AttentionTile::ALL {
        if !g.kernels.has_tile(tile) {
            println!(
                "attention [{}]: tile {tile:?} does not fit this GPU, skipped",
                case.name
            );
            continue;
        }
        let mut o_dev = upload(
            g,
            &vec![to_bf16(f32::NAN); case.batch * num_queries * q_width],
        );
        g.kernels
            .attention_with(
                &g.stream,
                tile,
                shape,
                &inputs,
                &mut o_dev.view_mut(),
                o_strides,
            )
            .expect("launch attention");
        let all = download_bf16(g, &o_dev);
        assert!(
            all.iter().all(|v| v.is_finite()),
            "attention {} {tile:?}: a row was not written",
            case.name
        );
        // P is rounded to bf16 before P.V (U relative per weight) and the output once more (U): the error of an
        // element is at most U * max|v| + U * |o|, so 2 U * max|v| bounds it; the L2 error is about U.
        check(
            &format!("attention {tile:?}"),
            &format!("{} ({} checked rows/sample)", case.name, rows.len()),
            &pick(&all),
            &want,
            2.0 * U * v_max,
            2.0 * U,
        );
        // Same tile order and arithmetic per row in every tile shape, and no atomics: bit-identical.
        g.kernels
            .attention_with(
                &g.stream,
                tile,
                shape,
                &inputs,
                &mut o_dev.view_mut(),
                o_strides,
            )
            .expect("launch attention again");
        let again = download_bf16(g, &o_dev);
        assert!(
            all.iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "attention {} {tile:?}: a second run differs (must be deterministic)",
            case.name
        );
        let order = tile.reduction_order(shape.prefix_len);
        match first.iter().find(|(o, _)| *o == order) {
            None => first.push((order, all)),
            Some(((width, _), reference)) => {
                let same = reference
                    .iter()
                    .zip(&all)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                println!(
                    "attention [{}]: {tile:?} bit-identical to the first {width}-key tile shape: {same}",
                    case.name
                );
                assert!(
                    same,
                    "attention {} {tile:?}: differs from the first {width}-key tile shape",
                    case.name
                );
            }
        }
    }
    assert!(!first.is_empty(), "no attention tile shape could run");
}

/// Keeps a device buffer non-empty (an empty prefix still needs a valid allocation).
trait MaxLenOne {
    fn max_len_one(self) -> Self;
}
impl MaxLenOne for Vec<u16> {
    fn max_len_one(mut self) -> Self {
        if self.is_empty() {
            self.resize(8, 0);
        }
        self
    }
}

/// Block ids of `[text | image block 1 | text | target block 2]`.
fn joint_blocks(text1: usize, image: usize, text2: usize, target: usize) -> Vec<i32> {
    let mut ids = vec![-1; text1];
    ids.extend(std::iter::repeat_n(1, image));
    ids.extend(std::iter::repeat_n(-1, text2));
    ids.extend(std::iter::repeat_n(2, target));
    ids
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn attention_small_shapes_match_host() {
    let g = gpu();
    let mut rng = Rng::new(8);
    let cases = [
        // Full (extract) pass over a joint sequence: text causal, a condition image and the target bidirectional;
        // sample 0 padded inside the text, sample 1 padded from key 0 (its first queries see nothing: zeros).
        AttentionCase {
            name: "block-causal extract, GQA 4/2, 150 keys",
            batch: 2,
            heads: 4,
            kv_heads: 2,
            block_ids: joint_blocks(20, 25, 7, 98),
            q_offset: 0,
            prefix_len: 0,
            pads: vec![Some((14, 20)), Some((0, 5))],
            check_rows: None,
            causal: true,
        },
        // Cached step: 52 prefix keys from the cache, 98 target queries over all keys.
        AttentionCase {
            name: "cached prefix 52 + 98, GQA 4/2",
            batch: 2,
            heads: 4,
            kv_heads: 2,
            block_ids: joint_blocks(20, 25, 7, 98),
            q_offset: 52,
            prefix_len: 52,
            pads: vec![Some((14, 20)), None],
            check_rows: None,
            causal: false,
        },
        // Odd sizes: partial query and key tiles, a prefix that ends inside a key tile.
        AttentionCase {
            name: "odd sizes 77 queries x 131 keys, prefix 54",
            batch: 1,
            heads: 3,
            kv_heads: 3,
            block_ids: joint_blocks(40, 0, 14, 77),
            q_offset: 54,
            prefix_len: 54,
            pads: vec![Some((33, 40))],
            check_rows: None,
            causal: true,
        },
    ];
    for case in &cases {
        run_attention_case(&g, case, &mut rng);
    }
}

/// Rows spread over the queries, including both ends and tile boundaries.
fn spread_rows(num_queries: usize, extra: &[usize]) -> Vec<usize> {
    let mut rows: Vec<usize> = (0..24).map(|i| i * (num_queries - 1) / 23).collect();
    rows.extend(extra.iter().copied().filter(|&r| r < num_queries));
    rows.sort_unstable();
    rows.dedup();
    rows
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn attention_real_shapes_match_host() {
    let g = gpu();
    let mut rng = Rng::new(9);
    // The 1024x1024 cached step: 4096 target queries over 80 cached text keys (10 of them padding) + 4096.
    let cached = AttentionCase {
        name: "cached step 4096 x (80 + 4096), 32 heads",
        batch: 1,
        heads: 32,
        kv_heads: 32,
        block_ids: joint_blocks(80, 0, 0, 4096),
        q_offset: 80,
        prefix_len: 80,
        pads: vec![Some((70, 80))],
        check_rows: Some(spread_rows(4096, &[63, 64, 127, 128, 4095])),
        causal: false,
    };
    run_attention_case(&g, &cached, &mut rng);
    // The extract pass: all 4176 rows, causal text (padded at 70..80) then the bidirectional target.
    let extract = AttentionCase {
        name: "extract 4176 x 4176 block-causal, 32 heads",
        batch: 1,
        heads: 32,
        kv_heads: 32,
        block_ids: joint_blocks(80, 0, 0, 4096),
        q_offset: 0,
        prefix_len: 0,
        pads: vec![Some((70, 80))],
        check_rows: Some(spread_rows(4176, &[0, 1, 69, 70, 75, 79, 80, 81, 127, 128])),
        causal: true,
    };
    run_attention_case(&g, &extract, &mut rng);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn norm_modulate_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(21);
    let (rows, cols, n_mod) = (12, 3072, 3);
    let (x_bits, x) = random_bf16(&mut rng, rows * cols, -3.0, 3.0);
    let (w_bits, w) = random_bf16(&mut rng, 2 * cols, -1.5, 1.5);
    // [n_mod, shift | scale] rows.
    let (m_bits, m) = random_bf16(&mut rng, n_mod * 2 * cols, -0.5, 0.5);
    let shift: Vec<f32> = (0..n_mod)
        .flat_map(|r| m[r * 2 * cols..r * 2 * cols + cols].to_vec())
        .collect();
    let scale: Vec<f32> = (0..n_mod)
        .flat_map(|r| m[r * 2 * cols + cols..(r + 1) * 2 * cols].to_vec())
        .collect();
    let index: Vec<i32> = (0..rows).map(|r| ((r * 7) % n_mod) as i32).collect();
    let row_mod: Vec<usize> = index.iter().map(|&i| i as usize).collect();
    let (x_dev, w_dev, m_dev, i_dev) = (
        upload(&g, &x_bits),
        upload(&g, &w_bits),
        upload(&g, &m_bits),
        upload(&g, &index),
    );
    let mut y_dev = upload(&g, &vec![0u16; rows * cols]);
    let (wv, bv) = (
        w_dev.slice(0, cols * 2).unwrap(),
        w_dev.slice(cols * 2, cols * 2).unwrap(),
    );
    let (mv, iv) = (m_dev.view(), i_dev.view());
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for (affine, modulated, shifted) in [
            (false, false, false),
            (true, false, false),
            (false, true, false),
            (true, true, true),
        ] {
            let modulation = RowModulation {
                data: &mv,
                rows: n_mod,
                stride: 2 * cols,
                scale_offset: cols,
                shift_offset: shifted.then_some(0),
                select: tf_engines::nn::gpu::ModulationRows::targets_only(1),
                row_index: Some(&iv),
            };
            let norm = NormModulate {
                kind,
                weight: affine.then_some(&wv),
                bias: (affine && kind == NormKind::LayerNorm).then_some(&bv),
                eps: EPS,
                modulation: modulated.then_some(modulation),
            };
            g.kernels
                .norm_modulate(
                    &g.stream,
                    &x_dev.view(),
                    Matrix::dense(rows, cols),
                    &mut y_dev.view_mut(),
                    cols,
                    &norm,
                )
                .expect("launch norm_modulate");
            let parts = host::NormModulation {
                weight: affine.then_some(&w[..cols]),
                bias: (affine && kind == NormKind::LayerNorm).then_some(&w[cols..]),
                scale: modulated.then_some(&scale[..]),
                shift: shifted.then_some(&shift[..]),
                n_mod,
                row_mod: &row_mod,
            };
            let host_kind = match kind {
                NormKind::LayerNorm => host::NormKind::LayerNorm,
                NormKind::RmsNorm => host::NormKind::RmsNorm,
            };
            let mut want = vec![0f32; rows * cols];
            host::norm_modulate(&x, rows, cols, host_kind, parts, EPS, &mut want)
                .expect("host reference");
            check_rounded_once(
                "norm_modulate",
                &format!("{kind:?} affine {affine} modulated {modulated} shift {shifted}"),
                &download_bf16(&g, &y_dev),
                &want,
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn partial_rope_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(22);
    // (head_dim, rotated, table padding): the H3 DiT and its VAE; the whole head as a check of the full-width case;
    // a rotated half that is not a multiple of the lane's channels (the shared-memory path); tables whose row
    // stride is not a multiple of the lane's channels (the shuffle path with scalar table loads).
    for (head_dim, rotated, pad) in [
        (128usize, 96usize, 0usize),
        (64, 48, 0),
        (128, 128, 0),
        (128, 100, 0),
        (64, 46, 0),
        (128, 96, 2),
        (64, 48, 1),
    ] {
        let (rows, q_heads, kv_heads) = (9, 4, 2);
        let heads = q_heads + kv_heads;
        let cols = (heads + kv_heads) * head_dim;
        let (bits, values) = random_bf16(&mut rng, rows * cols, -3.0, 3.0);
        let half = rotated / 2;
        let (cos, sin) = tf_engines::nn::host::rotate_half_tables(rows, 0, rotated, 10_000.0);
        let stride = half + pad;
        let padded = |t: &[f32]| -> Vec<f32> {
            t.chunks(half)
                .flat_map(|row| {
                    row.iter()
                        .copied()
                        .chain(std::iter::repeat_n(f32::NAN, pad))
                })
                .collect()
        };
        let (cos_padded, sin_padded) = (padded(&cos), padded(&sin));
        for table in [RopeTable::F32, RopeTable::Bf16] {
            let (cos_dev, sin_dev) = match table {
                RopeTable::F32 => (upload(&g, &cos_padded), upload(&g, &sin_padded)),
                RopeTable::Bf16 => {
                    let b = |t: &[f32]| t.iter().map(|&v| to_bf16(v)).collect::<Vec<u16>>();
                    (upload(&g, &b(&cos_padded)), upload(&g, &b(&sin_padded)))
                }
            };
            let mut qkv = upload(&g, &bits);
            let (cv, sv) = (cos_dev.view(), sin_dev.view());
            let mut view = qkv.view_mut();
            g.kernels
                .rope_half_partial(
                    &g.stream,
                    &PartialRope {
                        qkv: &mut view,
                        qkv_layout: Matrix::dense(rows, cols),
                        q_heads,
                        kv_heads,
                        head_dim,
                        rotated,
                        norm: RopeNorm::Plain { eps: EPS },
                        rope_cos: &cv,
                        rope_sin: &sv,
                        rope_stride: stride,
                        table,
                    },
                )
                .expect("launch rope_half_partial");
            let got = download_bf16(&g, &qkv);
            // Host: per-head RMSNorm without weight (rounded to bf16 as the kernel does), then the partial rotation.
            let mut want = values.clone();
            for r in 0..rows {
                let mut heads_x: Vec<f32> = values[r * cols..r * cols + heads * head_dim].to_vec();
                let ones = vec![1f32; head_dim];
                let mut normed = vec![0f32; heads * head_dim];
                host::rms_norm(&heads_x, heads, head_dim, &ones, EPS, &mut normed)
                    .expect("host norm");
                heads_x = normed.iter().map(|&v| from_bf16(to_bf16(v))).collect();
                host::rope_rotate_half_partial(
                    &mut heads_x,
                    1,
                    heads,
                    head_dim,
                    rotated,
                    &cos[r * half..(r + 1) * half],
                    &sin[r * half..(r + 1) * half],
                    host::RopeTableRounding::Bf16,
                )
                .expect("host rope");
                want[r * cols..r * cols + heads * head_dim].copy_from_slice(&heads_x);
            }
            // The kernel rounds each product and the sum (3 roundings of values up to |n| ~ 3): 4 U relative.
            let bound = 4.0 * U * max_abs(&want);
            check(
                "rope_half_partial",
                &format!("d{head_dim} r{rotated} stride {stride} {table:?}"),
                &got,
                &want,
                bound,
                4.0 * U,
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn swiglu_value_gate_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(23);
    let (rows, hidden) = (7, 2048);
    let (bits, values) = random_bf16(&mut rng, rows * 2 * hidden, -6.0, 6.0);
    let in_dev = upload(&g, &bits);
    let mut out_dev = upload(&g, &vec![0u16; rows * hidden]);
    for (order, gate_first) in [
        (SwigluOrder::GateValue, true),
        (SwigluOrder::ValueGate, false),
    ] {
        g.kernels
            .swiglu_ordered(
                &g.stream,
                order,
                &in_dev.view(),
                Matrix::dense(rows, 2 * hidden),
                &mut out_dev.view_mut(),
                hidden,
            )
            .expect("launch swiglu");
        let mut want = vec![0f32; rows * hidden];
        host::swiglu_fused(&values, rows, hidden, gate_first, &mut want).expect("host reference");
        check_rounded_once(
            "swiglu",
            &format!("{order:?}"),
            &download_bf16(&g, &out_dev),
            &want,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn attention_d64_matches_host() {
    let g = gpu();
    let mut rng = Rng::new(24);
    // The H3 video VAE: 32 heads of 64, no mask; an odd token count exercises the partial tiles.
    let (heads, tokens) = (32usize, 333usize);
    let width = heads * 64;
    let (q_bits, q) = random_bf16(&mut rng, tokens * width, -2.0, 2.0);
    let (k_bits, k) = random_bf16(&mut rng, tokens * width, -2.0, 2.0);
    let (v_bits, v) = random_bf16(&mut rng, tokens * width, -1.0, 1.0);
    let (q_dev, k_dev, v_dev) = (
        upload(&g, &q_bits),
        upload(&g, &k_bits),
        upload(&g, &v_bits),
    );
    let mut o_dev = upload(&g, &vec![0u16; tokens * width]);
    let strides = Strides {
        batch: tokens * width,
        row: width,
    };
    let (qv, kv, vv) = (q_dev.view(), k_dev.view(), v_dev.view());
    let inputs = AttentionInputs {
        q: &qv,
        q_strides: strides,
        prefix: None,
        k: &kv,
        v: &vv,
        kv_strides: strides,
        key_limit: None,
        key_pad: None,
        scale: 0.125,
    };
    let shape = AttentionShape {
        batch: 1,
        num_queries: tokens,
        num_keys: tokens,
        prefix_len: 0,
        num_heads: heads,
        num_kv_heads: heads,
    };
    g.kernels
        .attention_d64(&g.stream, shape, &inputs, &mut o_dev.view_mut(), strides)
        .expect("launch attention d64");
    let got = download_bf16(&g, &o_dev);
    let block_ids = vec![0i32; tokens];
    let key_valid = vec![true; tokens];
    let mask = host::AttentionMask {
        q_offset: 0,
        block_ids: &block_ids,
        key_valid: &key_valid,
    };
    let mut want = vec![0f32; tokens * width];
    host::attention(&q, &k, &v, tokens, tokens, heads, 64, mask, &mut want)
        .expect("host attention");
    // As the d128 tiles: P rounded to bf16 before P.V, the output once more.
    check(
        "attention d64",
        &format!("{heads}x64, {tokens} tokens"),
        &got,
        &want,
        2.0 * U,
        2.0 * U,
    );
}
