//! GPU checks of our INT8 GEMM with a scaling epilogue (`tf_engines::nn::gpu::gemm_int8`, kernel set
//! nn_gemm_int8, sm_90a only).
//!
//! The kernel sums exactly in int32, converts once to f32, multiplies by the product of the row's and the column's
//! scale and rounds to bf16, which is what `int8_gemm_host` does (and what the int32-gate SwiGLU makes of cuBLASLt's
//! exact products, so either INT8 gate path gives the same values): every output element must equal the host's bit
//! for bit, at shapes with partial row and column tiles, several column tiles, a strided output, K from less than
//! one slice to the MiniMax H3 widths and K not a whole number of slices. The launcher's refusals are host tests (`int8_gemm_plan.rs`); speed is measured by `tf bench
//! int8-gemm`, not here.
//!
//! The same pipeline over bf16 operands (`plan_bf16_gemm`, kernel nn_gemm_bf16) is held bit for bit to the host
//! too, on operands whose products and sums are exact in f32 (multiples of 1/8 up to 1 in magnitude), so the order
//! of the kernel's sums cannot change a bit and any wrong row, column, slice or store shows.
//!
//! The INT8 GEMM of a SwiGLU's two halves with the SwiGLU in its epilogue (`plan_int8_swiglu_gemm`) is held to the
//! host's bf16 products of both halves through silu(gate) * value, within one bf16 step (the kernel's silu divides
//! approximately).
//!
//! The INT8 GEMM of a fused q|k|v projection with the QK norm and RoPE in its epilogue (`plan_int8_qkv_gemm`) is
//! held to the two launches it replaces on the same GPU (the plain INT8 GEMM, then `nn_qk_norm_rope_interleaved`):
//! the values bit for bit, q and k within two bf16 steps at their row's largest magnitude (a head's sum of squares adds
//! in another order, and a flipped rounding of the norm's intermediates moves an output by a step of those sizes); its
//! rotate-half form, in place on one q|k|v matrix, to the GEMM and MiniMax H3's own pass (`h3_qk_norm_rope`) alike.
//!
//! The bf16 forms of both epilogue kernels (`EpilogueOperands::Bf16`: the SwiGLU, and the rotate-half q|k|v in
//! place) are held to the plain bf16 GEMM and the pass each replaces (`nn_swiglu_value_gate`, `h3_qk_norm_rope`):
//! the SwiGLU bit for bit (the same products, silu and rounding), the q|k|v as the INT8 form is held.
//!
//! The TMA-store forms of the plain and SwiGLU kernels (`GemmStore::Tma`, kernels `*_tma`) are held bit for bit to
//! the direct-store kernels on the same operands (the same values, stored through shared memory and the TMA unit),
//! the elements past N of a strided output left as they were, at shapes with partial row tiles, a tile's second
//! half wholly past N, more tiles than SMs, and a stride the TMA form cannot take (which runs the direct form).
//!
//! The implicit-GEMM 3x3 convolution (`nn::gpu::conv`, kernels nn_conv3x3_bf16_*) is held bit for bit to the host's
//! padded convolution plus bias (plus the output it adds to), on exact operands as the bf16 GEMM: maps wider than a
//! tile (a row's last tile hanging over its end) and narrower (whole rows a tile), channel counts that leave a
//! slice partly past a tap, both tile widths and partial output tiles.
//!
//! They are ignored in a plain `cargo test`; run without a GPU they fail, and on a GPU that is not sm_90 each prints
//! that it is skipped.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tf_cuda::{Context, DeviceBuffer, Stream};
use tf_engines::minimax_h3::dit_gpu::kernels::{plan_qk_norm_rope, H3Kernels, QkNormRope};
use tf_engines::nn::gpu::conv::{plan_conv3x3_spans, Conv3x3Shape, ConvOutput, ConvTile};
use tf_engines::nn::gpu::gemm_int8::HALF96_ROTATED;
use tf_engines::nn::gpu::gemm_int8::{
    int8_gemm_host, plan_bf16_gemm_stored, plan_int8_gemm_stored, plan_int8_swiglu_gemm_stored,
    EpilogueOperands, GemmStore, Int8GemmKernels, Int8GemmOperands, Int8GemmShape, QkvDest,
    QkvNormRope, QkvRope,
};
use tf_engines::nn::gpu::plan_swiglu_ordered;
use tf_engines::nn::gpu::rope::QkvOutputs;
use tf_engines::nn::gpu::{Matrix, NnKernels, SwigluOrder};
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;

#[path = "common/gpu.rs"]
mod gpu_support;

struct Gpu {
    ctx: Context,
    stream: Stream,
    kernels: Int8GemmKernels,
}

/// The GPU, or None (printed) when it is not sm_90. Run (with `--include-ignored`) where there is no GPU at all,
/// the test fails: it must never pass on a machine that could not run it.
fn gpu(test: &str) -> Option<Gpu> {
    let ctx = gpu_support::sm90_context(test, "the INT8 GEMM")?;
    let stream = Stream::new(&ctx, true).expect("create a stream");
    let kernels = Int8GemmKernels::load(&ctx).expect("load the nn_gemm_int8 set");
    Some(Gpu {
        ctx,
        stream,
        kernels,
    })
}

/// How far the bf16 value `got` lies from `want`, in bf16 steps at the magnitude of `want` or `floor`, whichever is
/// larger (a step at magnitude x is 2^(floor(log2 x) - 7)). The floor keeps values near zero, where a step is tiny,
/// from counting a difference far below the sizes around them as many steps.
fn bf16_steps_at(got: u16, want: u16, floor: f32) -> f32 {
    let (g, w) = (
        half::bf16::from_bits(got).to_f32(),
        half::bf16::from_bits(want).to_f32(),
    );
    if got == want {
        return 0.0;
    }
    let magnitude = w.abs().max(floor).max(f32::MIN_POSITIVE);
    let step = 2f32.powi(magnitude.log2().floor() as i32 - 7);
    (g - w).abs() / step
}

/// The largest magnitude among bf16 values.
fn abs_max(bits: &[u16]) -> f32 {
    bits.iter()
        .map(|&b| half::bf16::from_bits(b).to_f32().abs())
        .fold(0.0, f32::max)
}

/// Every element of `got` (bf16 rows of `stride`) equals the host's `want` (`m` x `n` f32 values, rounded to bf16)
/// bit for bit, and the columns past N still hold `sentinel`.
fn assert_equals_host(
    kind: &str,
    (m, n, k, stride): (usize, usize, usize, usize),
    got: &[u16],
    want: &[f32],
    sentinel: u16,
) {
    let mut wrong = 0usize;
    let mut first = None;
    for r in 0..m {
        for c in 0..stride {
            let bits = got[r * stride + c];
            let ok = if c < n {
                bits == half::bf16::from_f32(want[r * n + c]).to_bits()
            } else {
                bits == sentinel
            };
            if !ok {
                wrong += 1;
                first.get_or_insert((r, c, bits));
            }
        }
    }
    println!(
        "{kind} gemm {m}x{n}x{k} (y stride {stride}): {wrong} of {} elements differ from the host's{}",
        m * stride,
        first.map_or(String::new(), |(r, c, b)| format!(
            " (first at row {r}, column {c}: {:#06x})",
            b
        ))
    );
    assert_eq!(wrong, 0, "{kind} GEMM {m}x{n}x{k} differs from the host");
}

/// Random operands of an INT8 GEMM `[m, k] . [n, k]^T` (codes, then their scales, drawn in that order) on the host
/// and on the device.
struct Int8Case {
    shape: Int8GemmShape,
    x: Vec<i8>,
    w: Vec<i8>,
    xs: Vec<f32>,
    ws: Vec<f32>,
    dev: [DeviceBuffer; 4],
}

impl Int8Case {
    fn random(g: &Gpu, rng: &mut Rng, shape: Int8GemmShape) -> Int8Case {
        let Int8GemmShape { m, n, k } = shape;
        let (x, w) = (codes(rng, m * k), codes(rng, n * k));
        let (xs, ws) = (scales(rng, m), scales(rng, n));
        let dev = [
            DeviceBuffer::from_slice(&g.ctx, &x).expect("x"),
            DeviceBuffer::from_slice(&g.ctx, &w).expect("w"),
            DeviceBuffer::from_slice(&g.ctx, &xs).expect("x scales"),
            DeviceBuffer::from_slice(&g.ctx, &ws).expect("w scales"),
        ];
        Int8Case {
            shape,
            x,
            w,
            xs,
            ws,
            dev,
        }
    }

    /// The host's product, as the kernel computes it.
    fn host(&self) -> Vec<f32> {
        int8_gemm_host(self.shape, &self.x, &self.xs, &self.w, &self.ws)
    }

    /// Runs `f` on the device operands.
    fn with_inputs<R>(&self, f: impl FnOnce(&Int8GemmOperands<'_, '_>) -> R) -> R {
        let [x, w, xs, ws] = &self.dev;
        let (xv, wv, xsv, wsv) = (x.view(), w.view(), xs.view(), ws.view());
        f(&Int8GemmOperands {
            x: &xv,
            x_scale: &xsv,
            w: &wv,
            w_scale: &wsv,
        })
    }
}

fn codes(rng: &mut Rng, n: usize) -> Vec<i8> {
    (0..n)
        .map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8)
        .collect()
}

fn scales(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (1 + rng.next_u64() % 1000) as f32 * 1e-5)
        .collect()
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn int8_gemm_matches_the_host_bit_for_bit() {
    let Some(g) = gpu("int8_gemm_matches_the_host_bit_for_bit") else {
        return;
    };
    // (M, N, K, y row stride): one tile; partial row tiles; several column tiles with a strided output; H3's
    // widths of K with few rows (the host product stays quick); and more tiles than a GPU has SMs (2000 x 4096:
    // 256 tiles), so persistent CTAs take several tiles each and their pipeline runs on from one tile to the next;
    // then N past a tile's edge and K past a slice's (the maps' zero fill, the stores' column guard), and K below
    // one slice. N and the stride multiples of 8 take the epilogue's 16-byte stores, the last two shapes its pairs.
    for (i, &(m, n, k, stride)) in [
        (128, 256, 128, 256),
        (70, 328, 400, 336),
        (300, 1000, 5392, 1000),
        (9, 26, 48, 32),
        (40, 512, 256, 514),
        (5, 256, 384, 256),
        (130, 512, 256, 520),
        (33, 768, 5376, 768),
        (200, 256, 7168, 256),
        (17, 512, 14336, 512),
        (2000, 4096, 384, 4096),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(8100 + i as u64);
        let shape = Int8GemmShape { m, n, k };
        let case = Int8Case::random(&g, &mut rng, shape);
        let want = case.host();
        // A sentinel in every element, so a store that lands outside the rows and columns shows up.
        let sentinel = 0x7fc1u16;
        let mut y_dev = DeviceBuffer::from_slice(&g.ctx, &vec![sentinel; m * stride]).expect("y");
        let mut yv = y_dev.view_mut();
        case.with_inputs(|inputs| {
            g.kernels
                .gemm(&g.ctx, &g.stream, shape, inputs, &mut yv, stride)
        })
        .unwrap_or_else(|e| panic!("INT8 GEMM {m}x{n}x{k}: {e}"));
        g.stream.synchronize().expect("synchronize");
        let got: Vec<u16> = y_dev.to_vec().expect("y back");
        assert_equals_host("int8", (m, n, k, stride), &got, &want, sentinel);
    }
}

fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// bf16 values k / 8 with |k| <= 8: every product is a multiple of 1/64 and every sum up to K = 2^18 is exact in f32.
fn eighths(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| ((rng.next_u64() % 17) as i32 - 8) as f32 / 8.0)
        .collect()
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn bf16_gemm_matches_the_host_bit_for_bit_on_exact_sums() {
    let Some(g) = gpu("bf16_gemm_matches_the_host_bit_for_bit_on_exact_sums") else {
        return;
    };
    // As the INT8 shapes, plus K = 200 and 40 (a multiple of 8 but not 16: the bf16 rows' 16-byte rule) and the
    // DiT widths of K, with a strided output and more tiles than SMs.
    for (i, &(m, n, k, stride)) in [
        (128, 256, 64, 256),
        (70, 328, 400, 336),
        (300, 1000, 5392, 1000),
        (9, 26, 40, 32),
        (40, 512, 200, 514),
        (33, 768, 5376, 768),
        (200, 256, 7168, 256),
        (17, 512, 14336, 512),
        (2000, 4096, 384, 4096),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(8200 + i as u64);
        let x = eighths(&mut rng, m * k);
        let w = eighths(&mut rng, n * k);
        let mut want = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                let sum: f64 = (0..k)
                    .map(|j| f64::from(x[r * k + j]) * f64::from(w[c * k + j]))
                    .sum();
                want[r * n + c] = sum as f32;
            }
        }
        let x_dev = DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&x)).expect("x");
        let w_dev = DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&w)).expect("w");
        let sentinel = 0x7fc1u16;
        let mut y_dev = DeviceBuffer::from_slice(&g.ctx, &vec![sentinel; m * stride]).expect("y");
        let (xv, wv) = (x_dev.view(), w_dev.view());
        let mut yv = y_dev.view_mut();
        let shape = Int8GemmShape { m, n, k };
        g.kernels
            .gemm_bf16(&g.ctx, &g.stream, shape, (&xv, &wv), &mut yv, stride)
            .unwrap_or_else(|e| panic!("bf16 GEMM {m}x{n}x{k}: {e}"));
        g.stream.synchronize().expect("synchronize");
        let got: Vec<u16> = y_dev.to_vec().expect("y back");
        assert_equals_host("bf16", (m, n, k, stride), &got, &want, sentinel);
    }
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn int8_swiglu_gemm_matches_the_host_within_one_bf16_step() {
    let Some(g) = gpu("int8_swiglu_gemm_matches_the_host_within_one_bf16_step") else {
        return;
    };
    // (M, hidden, K, order): one tile; partial row tiles and K past a slice; several column tiles in the other
    // order; H3's fc2-width K; more tiles than SMs (16 x 12 = 192).
    for (i, &(m, hidden, k, order)) in [
        (128, 128, 128, SwigluOrder::GateValue),
        (70, 256, 400, SwigluOrder::GateValue),
        (300, 384, 5392, SwigluOrder::ValueGate),
        (33, 128, 14336, SwigluOrder::ValueGate),
        (2000, 1536, 384, SwigluOrder::GateValue),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(8300 + i as u64);
        let both = 2 * hidden;
        let case = Int8Case::random(&g, &mut rng, Int8GemmShape { m, n: both, k });
        // The plain GEMM's bf16 products of both halves, then silu(gate) * value in f32, rounded to bf16.
        let products = case.host();
        let (gate_base, value_base) = match order {
            SwigluOrder::GateValue => (0, hidden),
            SwigluOrder::ValueGate => (hidden, 0),
        };
        let mut want = vec![0u16; m * hidden];
        for r in 0..m {
            for c in 0..hidden {
                let gate = products[r * both + gate_base + c];
                let value = products[r * both + value_base + c];
                let h = gate / (1.0 + (-gate).exp()) * value;
                want[r * hidden + c] = half::bf16::from_f32(h).to_bits();
            }
        }
        let mut y_dev = DeviceBuffer::from_slice(&g.ctx, &vec![0x7fc1u16; m * hidden]).expect("y");
        let mut yv = y_dev.view_mut();
        case.with_inputs(|inputs| {
            g.kernels.gemm_swiglu(
                &g.ctx,
                &g.stream,
                (m, hidden, k),
                order,
                inputs,
                &mut yv,
                hidden,
            )
        })
        .unwrap_or_else(|e| panic!("INT8 SwiGLU GEMM {m}x{hidden}x{k}: {e}"));
        g.stream.synchronize().expect("synchronize");
        let got: Vec<u16> = y_dev.to_vec().expect("y back");
        // The kernel's silu divides approximately (2 ulp of f32), so a value next to a rounding boundary may land
        // one bf16 step off; values under 1/256 of their row's largest are measured in steps at that size.
        let mut worst = 0f32;
        let mut one_step = 0usize;
        for r in 0..m {
            let row = r * hidden..(r + 1) * hidden;
            let floor = abs_max(&want[row.clone()]) / 256.0;
            for (&a, &b) in got[row.clone()].iter().zip(&want[row]) {
                let d = bf16_steps_at(a, b, floor);
                worst = worst.max(d);
                one_step += usize::from(a != b);
            }
        }
        println!(
            "int8 swiglu gemm {m}x{hidden}x{k} ({order:?}): {one_step} of {} values differ from the host's, \
             worst {worst:.3} bf16 steps",
            m * hidden
        );
        assert!(
            worst <= 1.0,
            "INT8 SwiGLU GEMM {m}x{hidden}x{k}: {worst} bf16 steps from the host"
        );
        assert!(
            one_step * 100 <= m * hidden,
            "INT8 SwiGLU GEMM {m}x{hidden}x{k}: {one_step} values one step off (over 1%)"
        );
    }
}

/// Runs `plan` for each store form into a fresh output of `rows` x `stride` sentinels and returns both outputs (direct,
/// TMA) and the TMA form's kernel name.
fn both_stores(
    g: &Gpu,
    (rows, stride): (usize, usize),
    plan: &dyn Fn(&mut tf_cuda::DeviceViewMut<'_>, GemmStore) -> Result<String, tf_cuda::Error>,
) -> (Vec<u16>, Vec<u16>, String) {
    let mut outputs = Vec::new();
    let mut tma_kernel = String::new();
    for store in [GemmStore::Direct, GemmStore::Tma] {
        let mut y = DeviceBuffer::from_slice(&g.ctx, &vec![0x7fc1u16; rows * stride]).expect("y");
        let kernel = plan(&mut y.view_mut(), store).unwrap_or_else(|e| panic!("{store:?}: {e}"));
        g.stream.synchronize().expect("synchronize");
        outputs.push(y.to_vec().expect("y back"));
        if store == GemmStore::Tma {
            tma_kernel = kernel;
        }
    }
    let tma = outputs.pop().expect("two outputs");
    let direct = outputs.pop().expect("two outputs");
    (direct, tma, tma_kernel)
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn tma_store_gemms_match_the_direct_store_bit_for_bit() {
    let Some(g) = gpu("tma_store_gemms_match_the_direct_store_bit_for_bit") else {
        return;
    };
    let sms = g.kernels.sm_count();
    // (M, N, K, y stride): one tile; partial row tiles with a tile whose second half lies past N (N = 328); a
    // strided output; a narrow N below one half; more tiles than SMs; H3's width of K; a stride that is not a
    // multiple of 8 (the direct form runs).
    for (i, &(m, n, k, stride)) in [
        (128usize, 256usize, 128usize, 256usize),
        (70, 328, 400, 336),
        (130, 512, 256, 520),
        (9, 26, 48, 32),
        (2000, 4096, 384, 4096),
        (33, 768, 5376, 768),
        (40, 512, 256, 514),
    ]
    .iter()
    .enumerate()
    {
        let shape = Int8GemmShape { m, n, k };
        let mut rng = Rng::new(8900 + i as u64);
        let case = Int8Case::random(&g, &mut rng, shape);
        let (direct, tma, kernel) = both_stores(&g, (m, stride), &|y, store| {
            case.with_inputs(|inputs| {
                let launch = plan_int8_gemm_stored(&g.ctx, sms, shape, inputs, y, stride, store)?;
                g.kernels.submit(&g.stream, &launch)?;
                Ok(launch.kernel().to_string())
            })
        });
        let want = case.host();
        assert_equals_host(
            "int8 (direct store)",
            (m, n, k, stride),
            &direct,
            &want,
            0x7fc1,
        );
        assert_equals_host("int8 (TMA store)", (m, n, k, stride), &tma, &want, 0x7fc1);
        let expected = if stride % 8 == 0 {
            "nn_gemm_int8_scaled_bf16_tma"
        } else {
            "nn_gemm_int8_scaled_bf16"
        };
        assert_eq!(
            kernel, expected,
            "the TMA form's kernel at y stride {stride}"
        );

        // The bf16 pipeline on exact operands, both forms equal to each other and to the host.
        let (xf, wf) = (eighths(&mut rng, m * k), eighths(&mut rng, n * k));
        let xb = DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&xf)).expect("x");
        let wb = DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&wf)).expect("w");
        let (xbv, wbv) = (xb.view(), wb.view());
        let (direct, tma, _) = both_stores(&g, (m, stride), &|y, store| {
            let launch =
                plan_bf16_gemm_stored(&g.ctx, sms, shape, (&xbv, &wbv), y, (stride, store))?;
            g.kernels.submit(&g.stream, &launch)?;
            Ok(launch.kernel().to_string())
        });
        let differ = direct.iter().zip(&tma).filter(|(a, b)| a != b).count();
        println!("bf16 gemm {m}x{n}x{k} (y stride {stride}): {differ} of {} elements differ between the stores", m * stride);
        assert_eq!(
            differ, 0,
            "bf16 GEMM {m}x{n}x{k}: the TMA store differs from the direct one"
        );
    }
    // The SwiGLU GEMMs, (M, hidden, K): one tile; partial row tiles and K past a slice; more tiles than SMs. INT8
    // against its direct form bit for bit (the same approximate silu), and the bf16 form likewise.
    for (i, &(m, hidden, k)) in [
        (128usize, 128usize, 128usize),
        (70, 256, 400),
        (2000, 1536, 384),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(8950 + i as u64);
        let both = 2 * hidden;
        let case = Int8Case::random(&g, &mut rng, Int8GemmShape { m, n: both, k });
        let xb = bf16_random(&g, &mut rng, m * k);
        let wb = bf16_random(&g, &mut rng, both * k);
        let (xbv, wbv) = (xb.view(), wb.view());
        for kind in ["int8", "bf16"] {
            let (direct, tma, kernel) = both_stores(&g, (m, hidden), &|y, store| {
                case.with_inputs(|inputs| {
                    let operands = match kind {
                        "int8" => EpilogueOperands::Int8(inputs),
                        _ => EpilogueOperands::Bf16 { x: &xbv, w: &wbv },
                    };
                    let launch = plan_int8_swiglu_gemm_stored(
                        &g.ctx,
                        sms,
                        (m, hidden, k),
                        SwigluOrder::GateValue,
                        operands,
                        y,
                        (hidden, store),
                    )?;
                    g.kernels.submit(&g.stream, &launch)?;
                    Ok(launch.kernel().to_string())
                })
            });
            let differ = direct.iter().zip(&tma).filter(|(a, b)| a != b).count();
            println!(
                "{kind} swiglu gemm {m}x{hidden}x{k} ({kernel}): {differ} of {} values differ between the stores",
                m * hidden
            );
            assert!(kernel.ends_with("_tma"), "{kernel}");
            assert_eq!(
                differ, 0,
                "{kind} SwiGLU GEMM {m}x{hidden}x{k}: the TMA store differs"
            );
        }
    }
}

/// A fused q|k|v GEMM's random operands on the device: INT8 codes and scales for `heads` heads of 128 (N = 3 x 128
/// heads), norm weights in 0.5..1.5 and RoPE tables of `table_cols` columns a row (f32, or bf16 with `bf16_tables`).
struct QkvOperands {
    gemm: Int8Case,
    heads: usize,
    q_weight: DeviceBuffer,
    k_weight: DeviceBuffer,
    cos: DeviceBuffer,
    sin: DeviceBuffer,
}

impl QkvOperands {
    fn random(
        g: &Gpu,
        seed: u64,
        (m, heads, k): (usize, usize, usize),
        table_cols: usize,
        bf16_tables: bool,
    ) -> QkvOperands {
        let mut rng = Rng::new(seed);
        let shape = Int8GemmShape {
            m,
            n: 3 * heads * 128,
            k,
        };
        let gemm = Int8Case::random(g, &mut rng, shape);
        let bf16_of = |v: f32| half::bf16::from_f32(v).to_bits();
        let up16 = |v: &[u16]| DeviceBuffer::from_slice(&g.ctx, v).expect("upload");
        let mut norm_weight = || -> DeviceBuffer {
            let v: Vec<u16> = (0..128)
                .map(|_| bf16_of(0.5 + (rng.next_u64() % 1000) as f32 * 1e-3))
                .collect();
            up16(&v)
        };
        let (q_weight, k_weight) = (norm_weight(), norm_weight());
        let angles: Vec<f32> = (0..m * table_cols)
            .map(|_| (rng.next_u64() % 10_000) as f32 * 1e-3)
            .collect();
        let table = |f: fn(f32) -> f32| -> DeviceBuffer {
            let values: Vec<f32> = angles.iter().map(|&a| f(a)).collect();
            if bf16_tables {
                up16(&values.iter().map(|&v| bf16_of(v)).collect::<Vec<u16>>())
            } else {
                DeviceBuffer::from_slice(&g.ctx, &values).expect("upload")
            }
        };
        let (cos, sin) = (table(f32::cos), table(f32::sin));
        QkvOperands {
            gemm,
            heads,
            q_weight,
            k_weight,
            cos,
            sin,
        }
    }

    /// Runs `f` on the GEMM's operands and the epilogue's norm and RoPE (eps 1e-6, `rope`, `table_cols` a row).
    fn with<R>(
        &self,
        rope: QkvRope,
        table_cols: usize,
        f: impl FnOnce(&Int8GemmOperands<'_, '_>, &QkvNormRope<'_, '_>) -> R,
    ) -> R {
        let (qwv, kwv, cv, sv) = (
            self.q_weight.view(),
            self.k_weight.view(),
            self.cos.view(),
            self.sin.view(),
        );
        let norm = QkvNormRope {
            heads: self.heads,
            q_weight: &qwv,
            k_weight: &kwv,
            eps: 1e-6,
            rope,
            rope_cos: &cv,
            rope_sin: &sv,
            rope_stride: table_cols,
        };
        self.gemm.with_inputs(|inputs| f(inputs, &norm))
    }

    /// The plain INT8 GEMM's q|k|v rows (dense, N columns).
    fn plain_gemm(&self, g: &Gpu) -> DeviceBuffer {
        let Int8GemmShape { m, n, .. } = self.gemm.shape;
        let mut y = DeviceBuffer::from_slice(&g.ctx, &vec![0u16; m * n]).expect("q|k|v rows");
        self.with(QkvRope::Interleaved, 64, |inputs, _| {
            let mut yv = y.view_mut();
            g.kernels
                .gemm(&g.ctx, &g.stream, self.gemm.shape, inputs, &mut yv, n)
                .expect("plain INT8 GEMM");
        });
        y
    }
}

/// Three bf16 outputs of `rows` x `stride`, filled with `sentinel`.
fn three_outputs(g: &Gpu, rows: usize, stride: usize, sentinel: u16) -> Vec<DeviceBuffer> {
    (0..3)
        .map(|_| DeviceBuffer::from_slice(&g.ctx, &vec![sentinel; rows * stride]).expect("output"))
        .collect()
}

/// Runs `f` on q, k and v outputs over `bufs` (three buffers), each of row stride `stride`.
fn with_outputs<R>(
    bufs: &mut [DeviceBuffer],
    stride: usize,
    f: impl FnOnce(&mut QkvOutputs<'_, '_>) -> R,
) -> R {
    let [q, k, v] = bufs else {
        panic!("three outputs, not {}", bufs.len())
    };
    let (mut qv, mut kv, mut vv) = (q.view_mut(), k.view_mut(), v.view_mut());
    let mut outputs = QkvOutputs::with_stride((&mut qv, &mut kv, &mut vv), stride);
    f(&mut outputs)
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn int8_qkv_gemm_matches_the_gemm_and_the_qk_norm_apart() {
    let Some(g) = gpu("int8_qkv_gemm_matches_the_gemm_and_the_qk_norm_apart") else {
        return;
    };
    let nn = NnKernels::load(&g.ctx).expect("load the shared kernel sets");
    // (M, heads, K, output stride): one tile a part; partial row tiles, K past a slice, a wider output stride;
    // Qwen-Image's width at 1024x1024 with 80 text rows (more tiles than SMs).
    for (i, &(m, heads, k, stride)) in [
        (128usize, 2usize, 128usize, 256usize),
        (300, 4, 400, 520),
        (4176, 24, 3072, 3072),
    ]
    .iter()
    .enumerate()
    {
        let ops = QkvOperands::random(&g, 8400 + i as u64, (m, heads, k), 64, false);
        let n = ops.gemm.shape.n;
        let sentinel = 0x7fc1u16;
        // Apart: the plain GEMM into q|k|v rows, then the QK norm + RoPE pass into q, k and v.
        let qkv_dev = ops.plain_gemm(&g);
        let mut apart = three_outputs(&g, m, stride, sentinel);
        ops.with(QkvRope::Interleaved, 64, |_, norm| {
            let qkv_v = qkv_dev.view();
            let pass = norm
                .interleaved_pass(&qkv_v, Matrix::dense(m, n))
                .expect("the interleaved pass");
            with_outputs(&mut apart, stride, |outputs| {
                nn.qk_norm_rope(&g.stream, &pass, outputs)
                    .expect("QK norm + RoPE pass")
            });
        });
        // Fused: one launch.
        let mut fused = three_outputs(&g, m, stride, sentinel);
        ops.with(QkvRope::Interleaved, 64, |inputs, norm| {
            with_outputs(&mut fused, stride, |outputs| {
                g.kernels
                    .gemm_qkv(
                        &g.ctx,
                        &g.stream,
                        (m, k),
                        inputs,
                        norm,
                        QkvDest::Apart(outputs),
                    )
                    .unwrap_or_else(|e| panic!("INT8 q|k|v GEMM {m}x{n}x{k}: {e}"))
            });
        });
        g.stream.synchronize().expect("synchronize");
        let parts = |bufs: &[DeviceBuffer]| -> Vec<(Vec<u16>, usize, usize)> {
            bufs.iter()
                .map(|d| (d.to_vec().expect("back"), stride, 0))
                .collect()
        };
        assert_fused_matches_apart(
            "interleaved",
            (m, heads, k),
            &parts(&apart),
            &parts(&fused),
            Some(sentinel),
        );
    }
}

/// q, k and v of the fused q|k|v GEMM (`fused`) against the GEMM and the QK norm pass apart (`apart`): each part is
/// (bf16 rows, row stride, first column); the values bit for bit, q and k within two bf16 steps (a head's sum of
/// squares adds in another order) and at most 1% of them off at all. With a sentinel, the columns past a part's width
/// up to its stride (its own rows) must still hold it.
fn assert_fused_matches_apart(
    kind: &str,
    (m, heads, k): (usize, usize, usize),
    apart: &[(Vec<u16>, usize, usize)],
    fused: &[(Vec<u16>, usize, usize)],
    sentinel: Option<u16>,
) {
    let width = heads * 128;
    for (part, ((want, stride, first), (got, _, _))) in
        ["q", "k", "v"].iter().zip(apart.iter().zip(fused))
    {
        let (stride, first) = (*stride, *first);
        let mut differ = 0usize;
        let mut worst = 0f32;
        for r in 0..m {
            let row = r * stride + first..r * stride + first + width;
            // A rounding step of the norm's intermediates moves an output by up to a step of the head's sizes,
            // however small the output: steps are counted at the row's largest magnitude.
            let floor = abs_max(&want[row.clone()]);
            for (&g, &w) in got[row.clone()].iter().zip(&want[row]) {
                worst = worst.max(bf16_steps_at(g, w, floor));
                differ += usize::from(g != w);
            }
            if let Some(sentinel) = sentinel {
                for c in width..stride {
                    assert_eq!(
                        got[r * stride + c],
                        sentinel,
                        "{part}: row {r} column {c} past the width was written"
                    );
                }
            }
        }
        println!(
            "int8 q|k|v gemm ({kind}) {m}x{}x{k} ({heads} heads, stride {stride}) {part}: {differ} of {} values differ, \
             worst {worst:.3} bf16 steps at the row's largest magnitude",
            3 * width,
            m * width,
        );
        if *part == "v" {
            assert_eq!(
                differ, 0,
                "INT8 q|k|v GEMM ({kind}) {m}x{heads}x{k}: values differ from the plain GEMM's"
            );
        } else {
            assert!(
                worst <= 2.0,
                "INT8 q|k|v GEMM ({kind}) {m}x{heads}x{k} {part}: {worst} bf16 steps from the pass"
            );
            assert!(
                differ * 100 <= m * width,
                "INT8 q|k|v GEMM ({kind}) {m}x{heads}x{k} {part}: over 1% of values differ from the pass"
            );
        }
    }
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn int8_qkv_gemm_in_place_matches_the_gemm_and_minimax_h3s_qk_norm_apart() {
    let Some(g) = gpu("int8_qkv_gemm_in_place_matches_the_gemm_and_minimax_h3s_qk_norm_apart")
    else {
        return;
    };
    let h3 = H3Kernels::load(&g.ctx).expect("load MiniMax H3's kernels");
    let table_cols = HALF96_ROTATED / 2;
    // (M, heads, K): one tile a part; partial row tiles and K past a slice; MiniMax H3's width (56 heads).
    for (i, &(m, heads, k)) in [
        (128usize, 2usize, 128usize),
        (300, 4, 400),
        (2000, 56, 1024),
    ]
    .iter()
    .enumerate()
    {
        let ops = QkvOperands::random(&g, 8500 + i as u64, (m, heads, k), table_cols, true);
        let n = ops.gemm.shape.n;
        // Apart: the plain GEMM into q|k|v rows, then H3's QK norm + RoPE in place.
        let mut apart = ops.plain_gemm(&g);
        ops.with(QkvRope::Half96, table_cols, |_, norm| {
            h3_pass_in_place(&h3, &g, &mut apart, (m, n, heads), norm);
        });
        // Fused, in place on one q|k|v matrix.
        let mut fused = DeviceBuffer::from_slice(&g.ctx, &vec![0x7fc1u16; m * n]).expect("q|k|v");
        ops.with(QkvRope::Half96, table_cols, |inputs, norm| {
            let mut qkv = fused.view_mut();
            let dest = QkvDest::Joint {
                qkv: &mut qkv,
                stride: n,
            };
            g.kernels
                .gemm_qkv(&g.ctx, &g.stream, (m, k), inputs, norm, dest)
                .unwrap_or_else(|e| panic!("INT8 q|k|v GEMM in place {m}x{n}x{k}: {e}"));
        });
        g.stream.synchronize().expect("synchronize");
        assert_in_place_matches_apart("rotate-half", (m, heads, k), &apart, &fused);
    }
}

/// MiniMax H3's QK norm + RoPE pass (`h3_qk_norm_rope`) in place on the `m` x `n` q|k|v rows `qkv` of `heads`
/// heads, with `norm`'s weights and rotate-half tables.
fn h3_pass_in_place(
    h3: &H3Kernels,
    g: &Gpu,
    qkv: &mut DeviceBuffer,
    (m, n, heads): (usize, usize, usize),
    norm: &QkvNormRope<'_, '_>,
) {
    let qkv = qkv.view_mut();
    let op = QkNormRope {
        qkv: &qkv,
        qkv_layout: Matrix::dense(m, n),
        heads,
        q_weight: norm.q_weight,
        k_weight: norm.k_weight,
        norm_dim: 128,
        eps: norm.eps,
        rope: Some((
            norm.rope_cos,
            norm.rope_sin,
            norm.rope_stride,
            HALF96_ROTATED,
        )),
    };
    h3.run(&g.stream, plan_qk_norm_rope(&op))
        .expect("H3's QK norm + RoPE pass");
}

/// [`assert_fused_matches_apart`] on two whole q|k|v matrices (`heads` heads a part, dense rows).
fn assert_in_place_matches_apart(
    kind: &str,
    (m, heads, k): (usize, usize, usize),
    apart: &DeviceBuffer,
    fused: &DeviceBuffer,
) {
    let width = heads * 128;
    let parts = |buf: &DeviceBuffer| -> Vec<(Vec<u16>, usize, usize)> {
        let rows: Vec<u16> = buf.to_vec().expect("back");
        (0..3)
            .map(|p| (rows.clone(), 3 * width, p * width))
            .collect()
    };
    assert_fused_matches_apart(kind, (m, heads, k), &parts(apart), &parts(fused), None);
}

/// Random bf16 values in -1..1 (bits), uploaded.
fn bf16_random(g: &Gpu, rng: &mut Rng, n: usize) -> DeviceBuffer {
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&v)).expect("upload bf16")
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn bf16_epilogue_gemms_match_the_bf16_gemm_and_the_passes_apart() {
    let Some(g) = gpu("bf16_epilogue_gemms_match_the_bf16_gemm_and_the_passes_apart") else {
        return;
    };
    let nn = NnKernels::load(&g.ctx).expect("load the shared kernel sets");
    let h3 = H3Kernels::load(&g.ctx).expect("load MiniMax H3's kernels");
    // SwiGLU of a [value | gate] weight, (M, hidden, K): partial tiles and K past a slice; more tiles than SMs.
    for (i, &(m, hidden, k)) in [(300usize, 384usize, 5392usize), (2000, 1536, 384)]
        .iter()
        .enumerate()
    {
        let mut rng = Rng::new(8700 + i as u64);
        let (x, w) = (
            bf16_random(&g, &mut rng, m * k),
            bf16_random(&g, &mut rng, 2 * hidden * k),
        );
        let (xv, wv) = (x.view(), w.view());
        let mut ff = DeviceBuffer::from_slice(&g.ctx, &vec![0u16; m * 2 * hidden]).expect("ff");
        let mut apart =
            DeviceBuffer::from_slice(&g.ctx, &vec![0x7fc1u16; m * hidden]).expect("act");
        let mut fused =
            DeviceBuffer::from_slice(&g.ctx, &vec![0x7fc1u16; m * hidden]).expect("act");
        let both = Int8GemmShape {
            m,
            n: 2 * hidden,
            k,
        };
        g.kernels
            .gemm_bf16(
                &g.ctx,
                &g.stream,
                both,
                (&xv, &wv),
                &mut ff.view_mut(),
                2 * hidden,
            )
            .expect("plain bf16 GEMM");
        let (ffv, actv) = (ff.view(), apart.view_mut());
        let order = SwigluOrder::ValueGate;
        let pass = plan_swiglu_ordered(order, &ffv, Matrix::dense(m, 2 * hidden), &actv, hidden)
            .expect("SwiGLU pass");
        nn.submit(&g.stream, &pass).expect("SwiGLU pass");
        let inputs = EpilogueOperands::Bf16 { x: &xv, w: &wv };
        g.kernels
            .gemm_swiglu(
                &g.ctx,
                &g.stream,
                (m, hidden, k),
                order,
                inputs,
                &mut fused.view_mut(),
                hidden,
            )
            .unwrap_or_else(|e| panic!("bf16 SwiGLU GEMM {m}x{hidden}x{k}: {e}"));
        g.stream.synchronize().expect("synchronize");
        let (want, got): (Vec<u16>, Vec<u16>) =
            (apart.to_vec().expect("back"), fused.to_vec().expect("back"));
        let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
        println!("bf16 swiglu gemm {m}x{hidden}x{k}: {differ} of {} values differ from the GEMM and pass apart", m * hidden);
        assert_eq!(
            differ, 0,
            "bf16 SwiGLU GEMM {m}x{hidden}x{k}: values differ from the GEMM and pass apart"
        );
    }
    // The rotate-half q|k|v in place, (M, heads, K): partial tiles and K past a slice; MiniMax H3's width.
    let table_cols = HALF96_ROTATED / 2;
    for (i, &(m, heads, k)) in [(300usize, 4usize, 400usize), (2000, 56, 1024)]
        .iter()
        .enumerate()
    {
        // The norm weights and tables of the INT8 test's operands; bf16 x and w of their own.
        let ops = QkvOperands::random(&g, 8800 + i as u64, (m, heads, k), table_cols, true);
        let n = ops.gemm.shape.n;
        let mut rng = Rng::new(8900 + i as u64);
        let (x, w) = (
            bf16_random(&g, &mut rng, m * k),
            bf16_random(&g, &mut rng, n * k),
        );
        let (xv, wv) = (x.view(), w.view());
        let mut apart = DeviceBuffer::from_slice(&g.ctx, &vec![0u16; m * n]).expect("q|k|v");
        g.kernels
            .gemm_bf16(
                &g.ctx,
                &g.stream,
                Int8GemmShape { m, n, k },
                (&xv, &wv),
                &mut apart.view_mut(),
                n,
            )
            .expect("plain bf16 GEMM");
        let mut fused = DeviceBuffer::from_slice(&g.ctx, &vec![0x7fc1u16; m * n]).expect("q|k|v");
        ops.with(QkvRope::Half96, table_cols, |_, norm| {
            h3_pass_in_place(&h3, &g, &mut apart, (m, n, heads), norm);
            let mut qkv = fused.view_mut();
            let dest = QkvDest::Joint {
                qkv: &mut qkv,
                stride: n,
            };
            let inputs = EpilogueOperands::Bf16 { x: &xv, w: &wv };
            g.kernels
                .gemm_qkv(&g.ctx, &g.stream, (m, k), inputs, norm, dest)
                .unwrap_or_else(|e| panic!("bf16 q|k|v GEMM in place {m}x{n}x{k}: {e}"));
        });
        g.stream.synchronize().expect("synchronize");
        assert_in_place_matches_apart("bf16 rotate-half", (m, heads, k), &apart, &fused);
    }
}

/// The host's padded 3x3 convolution of `x` ([h, w, cin]) by the tap-major `weight` ([n, 9 cin]), plus `bias` and
/// `old` (added when given), in f64: exact for the eighths operands.
fn conv3x3_host(
    (h, w, cin, n): (usize, usize, usize, usize),
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    old: Option<&[f32]>,
) -> Vec<f32> {
    let mut y = vec![0f32; h * w * n];
    for py in 0..h {
        for px in 0..w {
            let p = py * w + px;
            for o in 0..n {
                let mut sum = f64::from(bias[o]) + old.map_or(0.0, |v| f64::from(v[p * n + o]));
                for tap in 0..9 {
                    let (sy, sx) = (py + tap / 3, px + tap % 3);
                    if sy == 0 || sx == 0 || sy > h || sx > w {
                        continue;
                    }
                    let q = (sy - 1) * w + (sx - 1);
                    let wrow = &weight[o * 9 * cin + tap * cin..o * 9 * cin + (tap + 1) * cin];
                    sum += (0..cin)
                        .map(|c| f64::from(x[q * cin + c]) * f64::from(wrow[c]))
                        .sum::<f64>();
                }
                y[p * n + o] = sum as f32;
            }
        }
    }
    y
}

#[test]
#[ignore = "needs an sm_90 GPU: run on the GPU machine with --include-ignored"]
fn conv3x3_matches_the_host_bit_for_bit_on_exact_sums() {
    let Some(g) = gpu("conv3x3_matches_the_host_bit_for_bit_on_exact_sums") else {
        return;
    };
    // (h, w, cin, n, accumulate, output): a 200-wide map (a row's second tile hangs over), 64 and 32 wide (two and
    // four rows a tile, the last tile partly past the map), cin 144 and 72 (a slice partly past its tap), 1152 (18
    // slices a tap), 8; n on the 144 tile (288, 20, 400, 8: partial output tiles) and the 256 tile (256, 2); the f32
    // output of a decoder's last conv (8 channels, f32 bias), with and without adding to y.
    // Each case on every tile its shape allows: the tile for its channels 128 pixels tall; for 144-channel tiles, 256
    // tall where the width is at least 256 or divides it, and the row-reuse tile where it is at least 128.
    for (i, &(h, w, cin, n, accumulate, output)) in [
        (5, 200, 144, 288, false, ConvOutput::Bf16),
        (3, 300, 144, 288, true, ConvOutput::Bf16),
        (7, 64, 24, 20, true, ConvOutput::Bf16),
        (3, 32, 1152, 256, true, ConvOutput::Bf16),
        (2, 128, 8, 2, false, ConvOutput::Bf16),
        (9, 130, 72, 400, true, ConvOutput::Bf16),
        (5, 128, 72, 400, false, ConvOutput::Bf16),
        (4, 256, 144, 8, false, ConvOutput::F32),
        (3, 64, 16, 8, true, ConvOutput::F32),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(9100 + i as u64);
        let x = eighths(&mut rng, h * w * cin);
        let weight = eighths(&mut rng, n * 9 * cin);
        let bias = eighths(&mut rng, n);
        let old = eighths(&mut rng, h * w * n);
        let want = conv3x3_host(
            (h, w, cin, n),
            &x,
            &weight,
            &bias,
            accumulate.then_some(old.as_slice()),
        );
        let shape = Conv3x3Shape { h, w, cin, n };
        let mut tiles = vec![ConvTile::for_channels(n, false)];
        for extra in [ConvTile::for_channels(n, true), ConvTile::Rows144] {
            if tiles[0] == ConvTile::Cols144 && extra != tiles[0] && shape.check(extra).is_ok() {
                tiles.push(extra);
            }
        }
        for tile in tiles {
            let x_dev = DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&x)).expect("x");
            let w_dev = DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&weight)).expect("weight");
            let (b_dev, y_dev) = match output {
                ConvOutput::Bf16 => (
                    DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&bias)).expect("bias"),
                    DeviceBuffer::from_slice(&g.ctx, &bf16_bits(&old)).expect("y"),
                ),
                ConvOutput::F32 => (
                    DeviceBuffer::from_slice(&g.ctx, &bias).expect("bias"),
                    DeviceBuffer::from_slice(&g.ctx, &old).expect("y"),
                ),
            };
            let span = |b: &DeviceBuffer| tf_cuda::cublaslt::DeviceSpan::new(b.addr(), b.len());
            let operands = (span(&x_dev), span(&w_dev), span(&b_dev));
            let launch = plan_conv3x3_spans(
                &g.ctx,
                g.kernels.sm_count(),
                (shape, tile),
                operands,
                (span(&y_dev), output),
                accumulate,
            )
            .unwrap_or_else(|e| panic!("conv {shape:?} on {tile:?}: {e}"));
            // SAFETY: the four buffers live until after the synchronize below; nothing else uses y meanwhile.
            unsafe { g.kernels.submit_spans(&g.stream, &launch) }.expect("submit the conv");
            g.stream.synchronize().expect("synchronize");
            println!(
                "conv {h}x{w}, {cin} -> {n} channels ({tile:?} tile, {output:?}, accumulate {accumulate}):"
            );
            match output {
                ConvOutput::Bf16 => {
                    let got: Vec<u16> = y_dev.to_vec().expect("y back");
                    assert_equals_host("conv3x3", (h * w, n, 9 * cin, n), &got, &want, 0);
                }
                ConvOutput::F32 => {
                    let got: Vec<f32> = y_dev.to_vec().expect("y back");
                    let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                    println!(
                        "  {wrong} of {} f32 outputs differ from the host's",
                        want.len()
                    );
                    assert_eq!(
                        wrong, 0,
                        "f32 conv {shape:?} on {tile:?} differs from the host"
                    );
                }
            }
        }
    }
}
