//! cuBLASLt's INT8 GEMMs on a GPU (`gpu_cublaslt`'s INT8 tests, split out by concern): the exact int32 product
//! against the host's, its speed beside row-wise FP8 and bf16 at MiniMax H3's block shapes, and the scaled INT8
//! GEMMs with bf16 output (row-wise scales, or the channel scales as the alpha vector) where the loaded cuBLASLt
//! offers them.

use super::*;

/// Signed 8-bit codes in `-127..=127`, drawn from `rng`.
fn int8_codes(rng: &mut Rng, len: usize) -> Vec<i8> {
    (0..len)
        .map(|_| (rng.next_f32() * 127.0).round() as i8)
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn int8_gemm_is_the_exact_integer_product() {
    let g = gpu();
    // (M, N, K): odd M, the smallest legal N and K, a DiT-like K, and an H3 row count.
    for (i, &(m, n, k)) in [
        (48, 16, 16),
        (77, 96, 256),
        (130, 256, 5376),
        (6026, 64, 1024),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng(7100 + i as u64);
        let xq = int8_codes(&mut rng, m * k);
        let wq = int8_codes(&mut rng, n * k);
        let x = DeviceBuffer::from_slice(&g.ctx, &xq).expect("X");
        let w = DeviceBuffer::from_slice(&g.ctx, &wq).expect("W");
        let y = DeviceBuffer::alloc(&g.ctx, m * n * 4).expect("Y");
        let gemm = Gemm::int8(m, n, k, (&x).into(), (&w).into(), (&y).into());
        // SAFETY: live buffers until the synchronize.
        unsafe { g.lt.matmul(&gemm, &g.stream) }
            .unwrap_or_else(|e| panic!("INT8 GEMM {m}x{n}x{k}: {e}"));
        g.stream.synchronize().expect("synchronize");
        let got: Vec<i32> = y.to_vec().expect("Y back");
        let mut wrong = 0usize;
        for r in 0..m {
            for c in 0..n {
                let want: i32 = (0..k)
                    .map(|l| i32::from(xq[r * k + l]) * i32::from(wq[c * k + l]))
                    .sum();
                if got[r * n + c] != want {
                    wrong += 1;
                }
            }
        }
        println!(
            "int8 {m}x{n}x{k}: {wrong} of {} products differ from the host's",
            m * n
        );
        assert_eq!(wrong, 0, "INT8 GEMM {m}x{n}x{k} is not exact");
    }
}

/// MiniMax H3's block GEMMs at S = 6026 (hidden 5376, attention 56 x 128 = 7168 wide, ffn 14336): (name, M, N, K).
const H3_SHAPES: [(&str, usize, usize, usize); 5] = [
    ("qkv", 6026, 21504, 5376),
    ("out", 6026, 5376, 7168),
    ("fc1", 6026, 28672, 5376),
    ("fc1 half", 6026, 14336, 5376),
    ("fc2", 6026, 5376, 14336),
];

/// Operands of one `[m, n, k]` GEMM in every format the INT8 tests time: bf16, e4m3 and INT8 rows (constant
/// patterns), row scales of 1/64, and an output wide enough for int32.
struct Operands {
    xb: DeviceBuffer,
    wb: DeviceBuffer,
    x8: DeviceBuffer,
    w8: DeviceBuffer,
    xi: DeviceBuffer,
    wi: DeviceBuffer,
    x_scale: DeviceBuffer,
    w_scale: DeviceBuffer,
    y: DeviceBuffer,
}

impl Operands {
    fn new(g: &Gpu, m: usize, n: usize, k: usize) -> Operands {
        let scales = |len: usize| {
            DeviceBuffer::from_slice(&g.ctx, &vec![1.0f32 / 64.0; len]).expect("scales")
        };
        Operands {
            xb: device_buffer_of(&g.ctx, m * k * 2, 0x3C01_3BFF),
            wb: device_buffer_of(&g.ctx, n * k * 2, 0x3C01_3BFF),
            x8: device_buffer_of(&g.ctx, m * k, 0x3838_3838),
            w8: device_buffer_of(&g.ctx, n * k, 0x3830_3038),
            xi: device_buffer_of(&g.ctx, m * k, 0x5B_C3_21_9D),
            wi: device_buffer_of(&g.ctx, n * k, 0x2F_D1_7A_E5),
            x_scale: scales(m),
            w_scale: scales(n),
            y: DeviceBuffer::alloc(&g.ctx, m * n * 4).expect("Y"),
        }
    }

    fn scales(&self) -> Fp8Scales {
        Fp8Scales {
            x_scale: (&self.x_scale).into(),
            w_scale: (&self.w_scale).into(),
        }
    }

    fn bf16(&self, (m, n, k): (usize, usize, usize)) -> Gemm {
        Gemm::bf16(
            m,
            n,
            k,
            (&self.xb).into(),
            (&self.wb).into(),
            (&self.y).into(),
        )
    }

    /// Row-wise FP8 with fast accumulation (the DiTs' FP8 GEMM).
    fn fp8(&self, (m, n, k): (usize, usize, usize)) -> Gemm {
        let (x, w, y) = ((&self.x8).into(), (&self.w8).into(), (&self.y).into());
        Gemm::fp8_e4m3_row_wise(m, n, k, x, w, y, self.scales()).with_fp8_fast_accum(true)
    }

    fn int8(&self, (m, n, k): (usize, usize, usize)) -> Gemm {
        Gemm::int8(
            m,
            n,
            k,
            (&self.xi).into(),
            (&self.wi).into(),
            (&self.y).into(),
        )
    }
}

/// `ms` per call of an `[m, n, k]` GEMM and its rate: "0.890 ms (1565)" (TFLOP/s, or TOP/s for INT8).
fn ms_and_rate((m, n, k): (usize, usize, usize), ms: f64) -> String {
    let rate = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
    format!("{ms:.3} ms ({rate:.0})")
}

/// Each of `gemms` timed over 100 back-to-back calls, the GEMMs alternated in 3 rounds (each one's best round
/// counts), so that all run at the power cap a step runs at: ms per call.
fn alternated_best_ms(g: &Gpu, lt: &CublasLt, gemms: &[Gemm]) -> Vec<f64> {
    let mut best = vec![f64::INFINITY; gemms.len()];
    for _round in 0..3 {
        for (slot, gemm) in gemms.iter().enumerate() {
            let (ms, _) = throughput_on(g, lt, gemm, 3, 100);
            best[slot] = best[slot].min(ms);
        }
    }
    best
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn int8_throughput_beside_fp8_and_bf16_at_the_h3_shapes() {
    let g = gpu();
    if !on_sm90(&g, "INT8 against row-wise FP8") {
        return;
    }
    let lt = timed_handle(&g);
    let mut plan = Vec::new();
    for &(_, m, n, k) in &H3_SHAPES {
        plan.push(GemmShape::bf16(m, n, k));
        plan.push(GemmShape::fp8_e4m3_row_wise(m, n, k).with_fp8_fast_accum());
        plan.push(GemmShape::int8(m, n, k));
    }
    prepare_and_report(&g, &lt, &plan, "bf16, row-wise FP8 and INT8 shapes");
    let mut totals = [0.0f64; 3];
    for &(name, m, n, k) in &H3_SHAPES {
        let ops = Operands::new(&g, m, n, k);
        let shape = (m, n, k);
        let best = alternated_best_ms(&g, &lt, &[ops.bf16(shape), ops.fp8(shape), ops.int8(shape)]);
        let [bf16, fp8, int8] = [best[0], best[1], best[2]].map(|ms| ms_and_rate(shape, ms));
        println!(
            "{name:>8} M={m} N={n} K={k}: bf16 {bf16} | fp8 row-wise fast {fp8} | int8 -> int32 {int8}; \
             int8 / fp8 time {:.3}",
            best[2] / best[1]
        );
        if name != "fc1 half" {
            for (total, ms) in totals.iter_mut().zip(&best) {
                *total += ms;
            }
        }
    }
    println!(
        "one H3 block's four GEMMs at S = 6026: bf16 {:.3} ms, fp8 row-wise {:.3} ms, int8 {:.3} ms (int8 / fp8 {:.3})",
        totals[0],
        totals[1],
        totals[2],
        totals[2] / totals[1]
    );
    assert!(totals.iter().all(|t| t.is_finite() && *t > 0.0));
}

/// The two scaled INT8 GEMMs with bf16 output: row-wise scales on both operands, or the W scales as the alpha
/// vector (the X scales left to the reader).
#[derive(Clone, Copy, PartialEq)]
enum ScaledInt8 {
    RowWise,
    ChannelAlpha,
}

impl ScaledInt8 {
    fn name(self) -> &'static str {
        match self {
            ScaledInt8::RowWise => "row-wise INT8 -> bf16",
            ScaledInt8::ChannelAlpha => "INT8 with channel alphas -> bf16",
        }
    }

    fn gemm(
        self,
        (m, n, k): (usize, usize, usize),
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
        scales: Fp8Scales,
    ) -> Gemm {
        match self {
            ScaledInt8::RowWise => Gemm::int8_row_wise(m, n, k, x, w, y, scales),
            ScaledInt8::ChannelAlpha => Gemm::int8_channel_alpha(m, n, k, x, w, y, scales.w_scale),
        }
    }
}

/// Runs `mode` against the host's scaled exact product where the loaded cuBLASLt offers it (reporting where it
/// does not), then times it beside row-wise FP8 and the exact int32 GEMM at MiniMax H3's shapes.
fn scaled_int8_where_offered(mode: ScaledInt8) {
    let g = gpu();
    let info = g.ctx.device_info().expect("device info");
    let (m, n, k) = (77, 96, 256);
    let mut rng = Rng(7300);
    let xq = int8_codes(&mut rng, m * k);
    let wq = int8_codes(&mut rng, n * k);
    let xs: Vec<f32> = (0..m).map(|r| 0.01 + 0.001 * r as f32).collect();
    let ws: Vec<f32> = (0..n).map(|c| 0.02 - 0.0001 * c as f32).collect();
    let x = DeviceBuffer::from_slice(&g.ctx, &xq).expect("X");
    let w = DeviceBuffer::from_slice(&g.ctx, &wq).expect("W");
    let x_scale = DeviceBuffer::from_slice(&g.ctx, &xs).expect("X scales");
    let w_scale = DeviceBuffer::from_slice(&g.ctx, &ws).expect("W scales");
    let y = DeviceBuffer::alloc(&g.ctx, m * n * 2).expect("Y");
    let scales = Fp8Scales {
        x_scale: (&x_scale).into(),
        w_scale: (&w_scale).into(),
    };
    let gemm = mode.gemm((m, n, k), (&x).into(), (&w).into(), (&y).into(), scales);
    let name = mode.name();
    // SAFETY: live buffers until the synchronize.
    match unsafe { g.lt.matmul(&gemm, &g.stream) } {
        Err(CublasLtError::NoAlgorithm { what, .. }) => {
            println!(
                "{name}: this cuBLASLt offers no algorithm on {} (sm_{}{}): {what}",
                info.name, info.compute_capability.0, info.compute_capability.1
            );
            return;
        }
        Err(e) => panic!("{name}: {e}"),
        Ok(()) => {}
    }
    g.stream.synchronize().expect("synchronize");
    let got: Vec<f32> = bf16_out(&y).into_iter().map(from_bf16).collect();
    let mut worst = 0f64;
    for r in 0..m {
        let row_scale = if mode == ScaledInt8::RowWise {
            f64::from(xs[r])
        } else {
            1.0
        };
        for c in 0..n {
            let dot: i64 = (0..k)
                .map(|l| i64::from(xq[r * k + l]) * i64::from(wq[c * k + l]))
                .sum();
            let want = dot as f64 * row_scale * f64::from(ws[c]);
            let err = (f64::from(got[r * n + c]) - want).abs() / want.abs().max(1e-3);
            worst = worst.max(err);
        }
    }
    println!("{name} {m}x{n}x{k}: offered; worst relative error against the scaled exact product {worst:.2e} (bf16 rounding 2^-8)");
    assert!(
        worst <= 1.0 / 256.0,
        "{name} off the scaled exact product: {worst:.2e}"
    );
    let lt = timed_handle(&g);
    for &(shape_name, m, n, k) in &H3_SHAPES {
        let ops = Operands::new(&g, m, n, k);
        let shape = (m, n, k);
        let scaled = mode.gemm(
            shape,
            (&ops.xi).into(),
            (&ops.wi).into(),
            (&ops.y).into(),
            ops.scales(),
        );
        let best = alternated_best_ms(&g, &lt, &[scaled, ops.fp8(shape), ops.int8(shape)]);
        let [scaled, fp8, int8] = [best[0], best[1], best[2]].map(|ms| ms_and_rate(shape, ms));
        println!(
            "{shape_name:>8} M={m} N={n} K={k}: {name} {scaled} | fp8 row-wise fast {fp8} | int8 -> int32 {int8}; \
             scaled int8 / fp8 time {:.3}",
            best[0] / best[1]
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn int8_row_wise_gemm_where_cublaslt_offers_it() {
    scaled_int8_where_offered(ScaledInt8::RowWise);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn int8_channel_alpha_gemm_where_cublaslt_offers_it() {
    scaled_int8_where_offered(ScaledInt8::ChannelAlpha);
}
