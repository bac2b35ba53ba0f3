//! `tf bench int8-gemm --qkv`: both DiTs' q|k|v GEMM in INT8 followed by their QK norm + RoPE pass (Qwen-Image's
//! interleaved pass into q, k and v; MiniMax H3's rotate-half pass in place), against the GEMM with both in its
//! epilogue (`plan_int8_qkv_gemm`), sustained, and how far apart the two outputs are.

use tf_cuda::{Context, DeviceBuffer, Stream};
use tf_engines::minimax_h3::dit_gpu::kernels::{plan_qk_norm_rope, H3Kernels, QkNormRope};
use tf_engines::nn::gpu::gemm::GemmRunner;
use tf_engines::nn::gpu::gemm_int8::{
    Int8GemmKernels, Int8GemmOperands, Int8GemmShape, QkvDest, QkvNormRope, QkvRope, HALF96_ROTATED,
};
use tf_engines::nn::gpu::{Matrix, NnKernels, QkvOutputs};
use tf_engines::nn::sampling::seeded::SplitMix64;
use tf_engines::nn::tensor::relative_l2;

use super::{best_apart_and_fused, random_bytes, scales, write_json, BoxError, Int8GemmArgs};

/// (name, M, heads of 128, K, RoPE form): Qwen-Image at 1024x1024 with 80 text rows, MiniMax H3 at S = 6026.
const QKV_SHAPES: &[(&str, usize, usize, usize, QkvRope)] = &[
    ("qwen_qkv", 4176, 32, 4096, QkvRope::Interleaved),
    ("h3_qkv", 6026, 56, 5376, QkvRope::Half96),
];

/// bf16 bits of values read back as f32.
fn bf16_values(buf: &DeviceBuffer) -> Result<Vec<f32>, BoxError> {
    Ok(buf
        .to_vec::<u16>()?
        .into_iter()
        .map(|b| half::bf16::from_bits(b).to_f32())
        .collect())
}

pub(super) fn run_qkv(
    args: &Int8GemmArgs,
    (ctx, stream): (&Context, &Stream),
    kernels: &Int8GemmKernels,
    gemms: &GemmRunner,
) -> Result<(), BoxError> {
    let nn = NnKernels::load(ctx)?;
    let h3 = H3Kernels::load(ctx)?;
    println!(
        "INT8 q|k|v GEMM then the QK norm + RoPE pass, against the GEMM with both in its epilogue; {} calls back to \
         back, best of {} rounds",
        args.iters, args.rounds
    );
    let mut rows = Vec::new();
    for &(name, m, heads, k, rope) in QKV_SHAPES {
        let mut rng = SplitMix64::new(0x9c7_0000 + m as u64 * 31 + heads as u64);
        let width = heads * 128;
        let n = 3 * width;
        let x = DeviceBuffer::from_slice(ctx, &random_bytes(&mut rng, m * k, false))?;
        let w = DeviceBuffer::from_slice(ctx, &random_bytes(&mut rng, n * k, false))?;
        let xs = DeviceBuffer::from_slice(ctx, &scales(&mut rng, m))?;
        let ws = DeviceBuffer::from_slice(ctx, &scales(&mut rng, n))?;
        let norm_weights: Vec<u16> = (0..256)
            .map(|_| half::bf16::from_f32(0.5 + (rng.next_u64() % 1000) as f32 * 1e-3).to_bits())
            .collect();
        let nw = DeviceBuffer::from_slice(ctx, &norm_weights)?;
        let table_cols = match rope {
            QkvRope::Interleaved => 64,
            QkvRope::Half96 => HALF96_ROTATED / 2,
        };
        let angles: Vec<f32> = (0..m * table_cols)
            .map(|_| (rng.next_u64() % 10_000) as f32 * 1e-3)
            .collect();
        let table = |f: fn(f32) -> f32| -> Result<DeviceBuffer, BoxError> {
            let values = angles.iter().map(|&a| f(a));
            Ok(match rope {
                QkvRope::Interleaved => {
                    DeviceBuffer::from_slice(ctx, &values.collect::<Vec<f32>>())?
                }
                QkvRope::Half96 => DeviceBuffer::from_slice(
                    ctx,
                    &values
                        .map(|v| half::bf16::from_f32(v).to_bits())
                        .collect::<Vec<u16>>(),
                )?,
            })
        };
        let (cos, sin) = (table(f32::cos)?, table(f32::sin)?);
        // Apart: the GEMM's q|k|v rows, then (Qwen-Image) q, k and v apart or (H3) the same rows in place.
        let mut qkv_rows = DeviceBuffer::alloc(ctx, m * n * 2)?;
        let mut parts_apart: Vec<DeviceBuffer> = (0..3)
            .map(|_| DeviceBuffer::alloc(ctx, m * width * 2))
            .collect::<Result<_, _>>()?;
        let mut parts_fused: Vec<DeviceBuffer> = (0..3)
            .map(|_| DeviceBuffer::alloc(ctx, m * width * 2))
            .collect::<Result<_, _>>()?;
        let mut joint_fused = DeviceBuffer::alloc(ctx, m * n * 2)?;
        let (xv, wv, xsv, wsv) = (x.view(), w.view(), xs.view(), ws.view());
        let qw = nw.slice(0, 256)?;
        let kw = nw.slice(256, 256)?;
        let (cv, sv) = (cos.view(), sin.view());
        let inputs = Int8GemmOperands {
            x: &xv,
            x_scale: &xsv,
            w: &wv,
            w_scale: &wsv,
        };
        let norm = QkvNormRope {
            heads,
            q_weight: &qw,
            k_weight: &kw,
            eps: 1e-6,
            rope,
            rope_cos: &cv,
            rope_sin: &sv,
            rope_stride: table_cols,
        };
        // Runs `f` on q, k and v outputs over three buffers.
        fn with_parts<R>(
            bufs: &mut [DeviceBuffer],
            width: usize,
            f: impl FnOnce(&mut QkvOutputs<'_, '_>) -> R,
        ) -> Result<R, BoxError> {
            let [q, k, v] = bufs else {
                return Err("three output buffers".into());
            };
            let (mut qv, mut kv, mut vv) = (q.view_mut(), k.view_mut(), v.view_mut());
            let mut outputs = QkvOutputs::with_stride((&mut qv, &mut kv, &mut vv), width);
            Ok(f(&mut outputs))
        }
        let mut apart = || -> Result<(), BoxError> {
            {
                let mut yv = qkv_rows.view_mut();
                kernels.gemm(ctx, stream, Int8GemmShape { m, n, k }, &inputs, &mut yv, n)?;
            }
            match rope {
                QkvRope::Interleaved => {
                    let rows_v = qkv_rows.view();
                    let pass = norm.interleaved_pass(&rows_v, Matrix::dense(m, n))?;
                    with_parts(&mut parts_apart, width, |outputs| {
                        nn.qk_norm_rope(stream, &pass, outputs)
                    })??;
                }
                QkvRope::Half96 => {
                    let rows_v = qkv_rows.view_mut();
                    let op = QkNormRope {
                        qkv: &rows_v,
                        qkv_layout: Matrix::dense(m, n),
                        heads,
                        q_weight: &qw,
                        k_weight: &kw,
                        norm_dim: 128,
                        eps: 1e-6,
                        rope: Some((&cv, &sv, table_cols, HALF96_ROTATED)),
                    };
                    h3.run(stream, plan_qk_norm_rope(&op))?;
                }
            }
            Ok(())
        };
        let mut fused = || -> Result<(), BoxError> {
            match rope {
                QkvRope::Interleaved => with_parts(&mut parts_fused, width, |outputs| {
                    kernels.gemm_qkv(ctx, stream, (m, k), &inputs, &norm, QkvDest::Apart(outputs))
                })??,
                QkvRope::Half96 => {
                    let mut jv = joint_fused.view_mut();
                    let dest = QkvDest::Joint {
                        qkv: &mut jv,
                        stride: n,
                    };
                    kernels.gemm_qkv(ctx, stream, (m, k), &inputs, &norm, dest)?;
                }
            }
            Ok(())
        };
        let best = best_apart_and_fused(args, (ctx, stream), &mut apart, &mut fused)?;
        stream.synchronize()?;
        // Both outputs as q | k | v rows.
        let (want, got) = match rope {
            QkvRope::Interleaved => {
                let rows_of = |parts: &[DeviceBuffer]| -> Result<Vec<f32>, BoxError> {
                    let p: Vec<Vec<f32>> =
                        parts.iter().map(bf16_values).collect::<Result<_, _>>()?;
                    Ok((0..m)
                        .flat_map(|r| {
                            p.iter()
                                .flat_map(move |part| part[r * width..(r + 1) * width].to_vec())
                        })
                        .collect())
                };
                (rows_of(&parts_apart)?, rows_of(&parts_fused)?)
            }
            QkvRope::Half96 => (bf16_values(&qkv_rows)?, bf16_values(&joint_fused)?),
        };
        let rel_l2 = relative_l2(&got, &want).ok_or("an empty output")?;
        let [apart_ms, fused_ms] = best;
        println!(
            "  {name:<9} {m:>5} x {n:>5} x {k:>5} ({rope:?}): apart {apart_ms:.4} ms, fused {fused_ms:.4} ms; fused / \
             apart {:.3} (< 1 means fused is faster); outputs {rel_l2:.2e} apart (relative L2)",
            fused_ms / apart_ms
        );
        if rel_l2.is_nan() || rel_l2 >= 1e-3 {
            return Err(format!(
                "{name}: the fused q|k|v GEMM's outputs are {rel_l2:.3e} (relative L2) from the GEMM and pass apart: \
                 wrong, not just rounding"
            )
            .into());
        }
        rows.push(serde_json::json!({
            "shape": name, "m": m, "n": n, "k": k, "rope": format!("{rope:?}"),
            "apart_ms": apart_ms, "fused_ms": fused_ms, "fused_over_apart": fused_ms / apart_ms, "rel_l2": rel_l2,
        }));
    }
    write_json(args, gemms, rows)
}
