//! The FP8 norm kernels of the H3 step (`gpu_h3_dit`'s FP8 norms, split out by concern): the gated residual +
//! RMSNorm + modulation with an FP8 output, with and without its bf16 rows, against `h3_residual_norm` and the
//! host quantization.

use super::*;

/// The host `RMSNorm(v) * weight * (1 + scale) + shift` of rows of `cols` padded past `width` (the mean square
/// over `width`), row `r` taking table row `index[r]` of `table` (rows of `stride`, scale and shift at columns
/// `scale_at`, `shift_at`).
#[allow(clippy::too_many_arguments)]
fn host_h3_norm(
    v: &[f32],
    cols: usize,
    width: usize,
    weight: &[f32],
    table: &[f32],
    stride: usize,
    (scale_at, shift_at): (usize, usize),
    index: &[i32],
    eps: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for (r, (row, o)) in v
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let ms: f64 = row
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            / width as f64;
        let rstd = 1.0 / (ms + f64::from(eps)).sqrt();
        let t = &table[index[r] as usize * stride..];
        for c in 0..cols {
            let n = f64::from(row[c]) * rstd * f64::from(weight[c]);
            o[c] = (n * (1.0 + f64::from(t[scale_at + c])) + f64::from(t[shift_at + c])) as f32;
        }
    }
    out
}

/// Holds FP8 rows (codes and scales) against the host quantization of `want`: scales within 1e-5, at most 0.5%
/// of the codes one step away (f32 rounding of the norm on a boundary), dequantized within 3.5% relative L2.
fn check_fp8_rows(what: &str, codes: &[u8], scales: &[f32], want: &[f32], cols: usize) {
    let (want_codes, want_scales) = fp8::quantize_rows(want, cols);
    for (r, (&s, &w)) in scales.iter().zip(&want_scales).enumerate() {
        let e = (f64::from(s) - f64::from(w)).abs() / f64::from(w).abs().max(1e-30);
        assert!(e <= 1e-5, "{what}: row {r} scale {s} vs host {w}");
    }
    let mut differing = 0;
    for (i, (&c, &w)) in codes.iter().zip(&want_codes).enumerate() {
        if c != w {
            differing += 1;
            let step = |c: u8| i32::from(c & 0x7f) * if c & 0x80 != 0 { -1 } else { 1 };
            assert!(
                step(c).abs_diff(step(w)) <= 1,
                "{what}: code {i} {c:#04x} vs host {w:#04x}"
            );
        }
    }
    let deq = fp8::dequantize_rows(codes, scales, cols);
    let err = relative_l2(&deq, want).unwrap();
    println!(
        "{what}: {differing} of {} codes one step from the host's; dequantized vs host f32 rel L2 {err:.3e}",
        codes.len()
    );
    assert!(
        differing * 200 <= codes.len(),
        "{what}: {differing} codes differ"
    );
    assert!(err <= 0.035, "{what}: dequantized rel L2 {err:.3e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fp8_norms_match_h3_residual_norm_and_the_host() {
    let ctx = context();
    let kernels = H3Kernels::load(&ctx).unwrap();
    let quant = QuantKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut rng = SplitMix64::new(21);
    // 37 rows of width 20 padded to 32 (FP8 rows are multiples of 16 bytes), and 5376 columns (the release);
    // two timesteps x three modalities of [shift|scale|gate|shift|scale|gate], rows picked per row by an index.
    for (rows, width, cols) in [(37usize, 20usize, 32usize), (9, 5376, 5376)] {
        let table_rows = 6;
        let stride = 6 * cols;
        let eps = 1e-5f32;
        let x = padded(&mut rng, rows, width, cols, -2.0, 2.0);
        let y = padded(&mut rng, rows, width, cols, -1.0, 1.0);
        let table = padded(&mut rng, table_rows * 6, width, cols, -0.5, 0.5);
        let weight = padded(&mut rng, 1, width, cols, 0.8, 1.2);
        let index: Vec<i32> = (0..rows).map(|_| rng.below(table_rows) as i32).collect();
        let (scale_at, shift_at, gate_at) = (4 * cols, 3 * cols, 2 * cols);
        let yd = device(&ctx, &bf16_bytes(&y));
        let td = device(&ctx, &bf16_bytes(&table));
        let wd = device(&ctx, &bf16_bytes(&weight));
        let id = device(&ctx, &i32_bytes(&index));
        let mut x_bf16 = device(&ctx, &bf16_bytes(&x));
        let mut x_fp8 = device(&ctx, &bf16_bytes(&x));
        // The same pass also writing its normed rows in bf16 (fc1 with one half in FP8).
        let mut x_both = device(&ctx, &bf16_bytes(&x));
        let mut h_both = device(&ctx, &bf16_bytes(&vec![0f32; rows * cols]));
        let mut codes_both = device(&ctx, &vec![0u8; rows * cols]);
        let mut scales_both = device(&ctx, &f32_bytes(&vec![0f32; rows]));
        // And writing INT8 rows beside the e4m3 ones instead (fc1's gate half in INT8).
        let mut x_i8 = device(&ctx, &bf16_bytes(&x));
        let mut codes_i8_pass = device(&ctx, &vec![0u8; rows * cols]);
        let mut scales_i8_pass = device(&ctx, &f32_bytes(&vec![0f32; rows]));
        let mut int8_codes = device(&ctx, &vec![0u8; rows * cols]);
        let mut int8_scales = device(&ctx, &f32_bytes(&vec![0f32; rows]));
        let mut normed = device(&ctx, &bf16_bytes(&vec![0f32; rows * cols]));
        let mut codes = device(&ctx, &vec![0u8; rows * cols]);
        let mut scales = device(&ctx, &f32_bytes(&vec![0f32; rows]));
        let mut codes_plain = device(&ctx, &vec![0u8; rows * cols]);
        let mut scales_plain = device(&ctx, &f32_bytes(&vec![0f32; rows]));
        {
            let (yv, tv, wv, iv) = (yd.view(), td.view(), wd.view(), id.view());
            let gate_view = tv.slice(gate_at * 2, tv.len() - gate_at * 2).unwrap();
            let (xv, ov) = (x_bf16.view_mut(), normed.view_mut());
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
                eps,
                weight: &wv,
                modulation: Some(NormModulation {
                    table: RowTable {
                        data: &tv,
                        rows: table_rows,
                        stride,
                        index: &iv,
                    },
                    scale_offset: scale_at,
                    shift_offset: Some(shift_at),
                }),
                out: &ov,
                out_stride: cols,
                out_index: None,
            };
            kernels.run(&stream, plan_residual_norm(&op)).unwrap();
            let select = ModulationRows::targets_only(1);
            let norm = NormModulate {
                kind: NormKind::RmsNorm,
                weight: Some(&wv),
                bias: None,
                eps,
                modulation: Some(RowModulation {
                    data: &tv,
                    rows: table_rows,
                    stride,
                    scale_offset: scale_at,
                    shift_offset: Some(shift_at),
                    select,
                    row_index: Some(&iv),
                }),
            };
            let gate = ResidualGate {
                data: &tv,
                rows: table_rows,
                stride,
                offset: gate_at,
                tanh: false,
                select,
                row_index: Some(&iv),
            };
            let (xf, cv, sv) = (x_fp8.view_mut(), codes.view_mut(), scales.view_mut());
            let out = Fp8Rows {
                codes: &cv,
                stride: cols,
                scales: &sv,
            };
            quant
                .run(
                    &stream,
                    plan_gated_residual_norm_modulate_with(
                        &xf,
                        Matrix::dense(rows, cols),
                        width,
                        (&yv, cols),
                        &gate,
                        (&out, RowCodes::E4m3),
                        &norm,
                        None,
                    ),
                )
                .unwrap();
            let (xb, hb) = (x_both.view_mut(), h_both.view_mut());
            let (cb, sb) = (codes_both.view_mut(), scales_both.view_mut());
            let both_out = Fp8Rows {
                codes: &cb,
                stride: cols,
                scales: &sb,
            };
            quant
                .run(
                    &stream,
                    plan_gated_residual_norm_modulate_with(
                        &xb,
                        Matrix::dense(rows, cols),
                        width,
                        (&yv, cols),
                        &gate,
                        (&both_out, RowCodes::E4m3),
                        &norm,
                        Some(SecondRows::Bf16 {
                            h: &hb,
                            stride: cols,
                        }),
                    ),
                )
                .unwrap();
            let (xi, ci, si) = (
                x_i8.view_mut(),
                codes_i8_pass.view_mut(),
                scales_i8_pass.view_mut(),
            );
            let (ic, is) = (int8_codes.view_mut(), int8_scales.view_mut());
            let i8_pass_out = Fp8Rows {
                codes: &ci,
                stride: cols,
                scales: &si,
            };
            let int8_rows = Fp8Rows {
                codes: &ic,
                stride: cols,
                scales: &is,
            };
            quant
                .run(
                    &stream,
                    plan_gated_residual_norm_modulate_with(
                        &xi,
                        Matrix::dense(rows, cols),
                        width,
                        (&yv, cols),
                        &gate,
                        (&i8_pass_out, RowCodes::E4m3),
                        &norm,
                        Some(SecondRows::Int8(&int8_rows)),
                    ),
                )
                .unwrap();
            // No residual (the first block's norm): the input as it is.
            let x0 = device(&ctx, &bf16_bytes(&x));
            let x0v = x0.view();
            let (cp, sp) = (codes_plain.view_mut(), scales_plain.view_mut());
            let plain_out = Fp8Rows {
                codes: &cp,
                stride: cols,
                scales: &sp,
            };
            quant
                .run(
                    &stream,
                    plan_norm_modulate_codes(
                        &x0v,
                        Matrix::dense(rows, cols),
                        width,
                        (&plain_out, RowCodes::E4m3),
                        &norm,
                    ),
                )
                .unwrap();
            stream.synchronize().unwrap();
        }
        let case = format!("{rows}x{width} (padded to {cols})");
        // Writing the bf16 rows too changes nothing else; those rows are h3_residual_norm's within bf16 rounding.
        assert_eq!(read_bf16(&x_both), read_bf16(&x_fp8), "{case}: residual");
        assert_eq!(
            codes_both.to_vec::<u8>().unwrap(),
            codes.to_vec::<u8>().unwrap(),
            "{case}: codes"
        );
        assert_eq!(
            scales_both.to_vec::<f32>().unwrap(),
            scales.to_vec::<f32>().unwrap(),
            "{case}: scales"
        );
        // Writing INT8 rows instead changes nothing else either; they quantize the same values with the same row
        // max (scale amax / 127 against amax / 448) and sit where h3_residual_norm's bf16 rows do.
        assert_eq!(
            read_bf16(&x_i8),
            read_bf16(&x_fp8),
            "{case}: residual (INT8 pass)"
        );
        assert_eq!(
            codes_i8_pass.to_vec::<u8>().unwrap(),
            codes.to_vec::<u8>().unwrap(),
            "{case}: e4m3 codes (INT8 pass)"
        );
        let fp8_scales = scales.to_vec::<f32>().unwrap();
        let i8_scales = int8_scales.to_vec::<f32>().unwrap();
        for (r, (&e, &i)) in fp8_scales.iter().zip(&i8_scales).enumerate() {
            let (amax_e, amax_i) = (f64::from(e) * 448.0, f64::from(i) * 127.0);
            assert!(
                (amax_e - amax_i).abs() <= 1e-6 * amax_e.abs(),
                "{case}: row {r}: INT8 scale {i} and e4m3 scale {e} are not of one row max"
            );
        }
        let i8_codes = int8_codes.to_vec::<u8>().unwrap();
        let i8_deq = RowCodes::Int8.dequantize_rows(&i8_codes, &i8_scales, cols);
        let i8_err = relative_l2(&i8_deq, &read_bf16(&normed)).unwrap();
        let fp8_deq = fp8::dequantize_rows(&codes.to_vec::<u8>().unwrap(), &fp8_scales, cols);
        let fp8_err = relative_l2(&fp8_deq, &read_bf16(&normed)).unwrap();
        println!(
            "{case}: INT8 rows vs h3_residual_norm's bf16 rows: rel L2 {i8_err:.3e} (the e4m3 rows: {fp8_err:.3e})"
        );
        assert!(
            i8_err <= 0.015 && i8_err < fp8_err,
            "{case}: INT8 rows {i8_err:.3e}, e4m3 {fp8_err:.3e}"
        );
        let h_err = relative_l2(&read_bf16(&h_both), &read_bf16(&normed)).unwrap();
        println!("{case}: the pass's bf16 rows vs h3_residual_norm's: rel L2 {h_err:.3e}");
        assert!(h_err <= 4e-3, "{case}: {h_err:.3e}");
        // The residual stream: the same f32 fma rounded once to bf16 as h3_residual_norm's, so equal to it (one
        // bf16 step is allowed where a compiler did not contract h3_residual_norm's `x + g * y`; the count is
        // printed, and more than 0.1% of the values or more than one step fails).
        let stored_bf16 = read_bf16(&x_bf16);
        let stored_fp8 = read_bf16(&x_fp8);
        let mut differing = 0usize;
        for (i, (&a, &b)) in stored_fp8.iter().zip(&stored_bf16).enumerate() {
            if a.to_bits() != b.to_bits() {
                differing += 1;
                let step = |v: f32| i64::from(half::bf16::from_f32(v).to_bits() as i16);
                assert!(
                    (step(a) - step(b)).abs() <= 1,
                    "{case}: residual value {i} is {a}, h3_residual_norm's {b}"
                );
            }
        }
        println!(
            "{case}: residual values differing from h3_residual_norm's: {differing} of {}",
            stored_fp8.len()
        );
        assert!(
            differing * 1000 <= stored_fp8.len(),
            "{case}: {differing} residual values differ"
        );
        let codes_of = |buf: &DeviceBuffer| buf.to_vec::<u8>().unwrap();
        let scales_of = |buf: &DeviceBuffer| buf.to_vec::<f32>().unwrap();
        for (what, v, c, s) in [
            (
                "gated residual + RMSNorm + modulation",
                &stored_fp8,
                &codes,
                &scales,
            ),
            ("RMSNorm + modulation", &x, &codes_plain, &scales_plain),
        ] {
            let want = host_h3_norm(
                v,
                cols,
                width,
                &weight,
                &table,
                stride,
                (scale_at, shift_at),
                &index,
                eps,
            );
            let codes = codes_of(c);
            // The padding columns are zero codes.
            for r in 0..rows {
                assert!(codes[r * cols + width..(r + 1) * cols]
                    .iter()
                    .all(|&b| b == 0));
            }
            check_fp8_rows(
                &format!("{what} [{case}]"),
                &codes,
                &scales_of(s),
                &want,
                cols,
            );
        }
        // And the dequantized FP8 rows sit where h3_residual_norm's bf16 rows do.
        let deq = fp8::dequantize_rows(&codes_of(&codes), &scales_of(&scales), cols);
        let err = relative_l2(&deq, &read_bf16(&normed)).unwrap();
        println!("{case}: FP8 rows vs h3_residual_norm's bf16 rows: rel L2 {err:.3e}");
        assert!(err <= 0.035, "{case}: {err:.3e}");
    }
}
