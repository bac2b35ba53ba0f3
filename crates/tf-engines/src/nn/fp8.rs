//! FP8 e4m3 on the host: the format (encode, decode), the per-row quantization every FP8 path uses, and the
//! weight quantizer that runs on the upload ring.
//!
//! One rule everywhere, shared by the GPU kernels (`kernels/nn/quant.cu`) and the load-time weight quantizer:
//! a row's scale is `amax / 448` (1 for an all-zero row) and each code is `e4m3(value * (1 / scale))`, rounded to
//! nearest even and saturated to ±448 (CUDA's `satfinite`). Every step is one correctly rounded f32 operation, so
//! the host computes the same codes as the kernels from the same f32 values. The product of code and scale is
//! the value again, within e4m3's three mantissa bits; an FP8 GEMM multiplies the row scales back in
//! (`tf_cuda::cublaslt::Fp8ScaleMode::RowWise`).
//!
//! [`Fp8RowQuantizer`] is a [`ChunkTransform`]: the pinned upload ring hands it whole rows of a bf16 (or f32,
//! f16) checkpoint tensor, it writes the e4m3 codes into the staging slot and keeps each row's scale; the caller
//! uploads the scales once the ring is done. No second host copy of the model is made.

use std::sync::Mutex;

use crate::nn::upload::{ChunkTransform, UploadError};
use crate::nn::weights::Dtype;

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The code of the largest finite positive value (448); its negative is `0xfe`.
const MAX_CODE: u8 = 0x7e;

/// The e4m3 code of `v`: round to nearest even, saturating to ±448; NaN becomes `0x7f` (CUDA's
/// `cvt.rn.satfinite.e4m3x2.f32`).
///
/// Written without branches (every case computed, one selected), so that a loop over a row vectorizes: the
/// load-time weight quantizer runs this for every weight of an FP8 model.
#[inline]
pub fn e4m3_encode(v: f32) -> u8 {
    const SMALLEST_NORMAL_BITS: u32 = 0x3c80_0000; // 2^-6, code 8
    const MAX_BITS: u32 = 0x43e0_0000; // 448
    const INFINITY_BITS: u32 = 0x7f80_0000;
    let bits = v.to_bits();
    let sign = (bits >> 24) & 0x80;
    let magnitude = bits & 0x7fff_ffff;
    // Normal: keep 3 of f32's 23 mantissa bits, rounding to nearest even on the exponent|mantissa field (a carry
    // moves into the exponent), then rebias the exponent from 127 to 7. No overflow: magnitude < 2^31.
    let round = (1u32 << 19) - 1 + ((magnitude >> 20) & 1);
    let normal = ((magnitude + round) >> 20).wrapping_sub((127 - 7) << 3);
    // Subnormal codes count steps of 2^-9 (code 8, 2^-6, is the smallest normal: the same number). Scaling by a
    // power of two is exact, and adding 2^23 rounds a value below 2^22 to an integer, ties to even (f32
    // arithmetic rounds to nearest even), which the sum's low mantissa bits then hold: the subnormal code.
    let scaled = f32::from_bits(magnitude.min(SMALLEST_NORMAL_BITS)) * 512.0;
    let subnormal = (scaled + 8_388_608.0).to_bits().wrapping_sub(0x4b00_0000);
    let magnitude_code = if magnitude >= MAX_BITS {
        u32::from(MAX_CODE)
    } else if magnitude < SMALLEST_NORMAL_BITS {
        subnormal
    } else {
        normal
    };
    let code = if magnitude > INFINITY_BITS {
        0x7f
    } else {
        sign | magnitude_code
    };
    code as u8
}

/// The value of e4m3 code `code` (`0x7f` and `0xff` are NaN).
pub fn e4m3_decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((code >> 3) & 0x0f);
    let mantissa = f32::from(code & 0x07);
    if exponent == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exponent == 0 {
        mantissa * 2f32.powi(-9)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    sign * magnitude
}

/// The scale of a row whose largest magnitude is `amax`: `amax / 448`, or 1 for an all-zero row.
pub fn row_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// The largest magnitude of `values` (NaN ignored, as the kernels' `fmaxf` does).
pub fn amax(values: &[f32]) -> f32 {
    // On magnitudes' bits (sign cleared, so non-negative as i32) the integer order is the order of the values,
    // infinity included; NaN's bits lie above infinity's and count as 0. Signed integer maxima vectorize (4x
    // faster than the float fold); the result is the same value.
    let largest = values
        .iter()
        .map(|v| {
            let magnitude = (v.to_bits() & 0x7fff_ffff) as i32;
            if magnitude > 0x7f80_0000 {
                0
            } else {
                magnitude
            }
        })
        .fold(0i32, i32::max);
    f32::from_bits(largest as u32)
}

/// Quantizes one row into `codes` (same length) and returns its scale.
pub fn quantize_row(values: &[f32], codes: &mut [u8]) -> f32 {
    let scale = row_scale(amax(values));
    let inv = 1.0 / scale;
    for (code, &v) in codes.iter_mut().zip(values) {
        *code = e4m3_encode(v * inv);
    }
    scale
}

/// Quantizes `values` as rows of `cols`: the codes (`values.len()` bytes) and one scale per row. A trailing
/// partial row is quantized as a row of its own.
pub fn quantize_rows(values: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let cols = cols.max(1);
    let mut codes = vec![0u8; values.len()];
    let scales = values
        .chunks(cols)
        .zip(codes.chunks_mut(cols))
        .map(|(row, out)| quantize_row(row, out))
        .collect();
    (codes, scales)
}

/// The values `codes` stand for: `decode(code) * scale` of its row (rows of `cols`).
pub fn dequantize_rows(codes: &[u8], scales: &[f32], cols: usize) -> Vec<f32> {
    let cols = cols.max(1);
    codes
        .chunks(cols)
        .zip(scales)
        .flat_map(|(row, &scale)| row.iter().map(move |&c| e4m3_decode(c) * scale))
        .collect()
}

/// Per-output-channel FP8 quantization of a weight `[rows, cols]` on the upload ring: the ring hands it whole
/// rows (its granule is one row), it writes their e4m3 codes into the staging slot and records each row's scale,
/// read with [`Fp8RowQuantizer::scales`] once the upload is done.
pub struct Fp8RowQuantizer {
    from: Dtype,
    rows: usize,
    cols: usize,
    scales: Mutex<Vec<f32>>,
}

impl std::fmt::Debug for Fp8RowQuantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fp8RowQuantizer")
            .field("from", &self.from)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl Fp8RowQuantizer {
    /// A quantizer of a `[rows, cols]` tensor stored as `from` (F32, BF16 or F16).
    pub fn new(from: Dtype, rows: usize, cols: usize) -> Result<Fp8RowQuantizer, UploadError> {
        if !matches!(from, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(UploadError::Dtype {
                dtype: from,
                transform: "fp8-row",
                accepts: "F32, BF16 or F16",
            });
        }
        if cols == 0 {
            return Err(UploadError::Transform {
                transform: "fp8-row",
                why: "a weight of 0 columns has no rows to quantize".into(),
            });
        }
        Ok(Fp8RowQuantizer {
            from,
            rows,
            cols,
            scales: Mutex::new(vec![f32::NAN; rows]),
        })
    }

    /// Each row's scale (`amax / 448`), in row order. A row the ring never handed over (an upload that failed
    /// part-way) is NaN.
    pub fn scales(&self) -> Vec<f32> {
        match self.scales.lock() {
            Ok(s) => s.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// `out.len()` source values of this tensor's dtype from `src`, as f32 (exact for all three). One dtype per
    /// call keeps the loop free of per-element branches.
    fn widen(&self, src: &[u8], out: &mut [f32]) {
        match self.from {
            Dtype::F32 => {
                for (v, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::BF16 => {
                // bf16 is f32's upper half.
                for (v, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            _ => {
                for (v, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *v = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
        }
    }
}

impl ChunkTransform for Fp8RowQuantizer {
    fn name(&self) -> &'static str {
        "fp8-row"
    }

    fn src_elem_bytes(&self) -> usize {
        self.from.size_bytes()
    }

    fn dst_elem_bytes(&self) -> usize {
        1
    }

    fn granule(&self) -> usize {
        self.cols
    }

    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        let cols = self.cols;
        let unit = self.src_elem_bytes();
        let elements = dst.len();
        if !first.is_multiple_of(cols)
            || !elements.is_multiple_of(cols)
            || src.len() != elements * unit
        {
            return Err(UploadError::Transform {
                transform: "fp8-row",
                why: format!(
                    "a chunk of {elements} elements at element {first} is not whole rows of {cols} (or its source is not {unit} bytes each)"
                ),
            });
        }
        let first_row = first / cols;
        if first_row + elements / cols > self.rows {
            return Err(UploadError::Transform {
                transform: "fp8-row",
                why: format!(
                    "rows {first_row}..{} run past the weight's {} rows",
                    first_row + elements / cols,
                    self.rows
                ),
            });
        }
        let mut row_values = vec![0f32; cols];
        let mut found = Vec::with_capacity(elements / cols);
        let row_bytes = cols * unit;
        for (row_src, out) in src.chunks_exact(row_bytes).zip(dst.chunks_exact_mut(cols)) {
            self.widen(row_src, &mut row_values);
            found.push(quantize_row(&row_values, out));
        }
        let mut scales = self.scales.lock().map_err(|_| UploadError::Worker)?;
        scales[first_row..first_row + found.len()].copy_from_slice(&found);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::upload::{fill_host, Piece, Transform};
    use proptest::prelude::*;

    /// The e4m3 code nearest `v` by exhaustive search over the finite codes (ties to the even code), clamped to
    /// ±448: the definition the bit-twiddling encoder must meet.
    fn nearest_code(v: f32) -> u8 {
        let a = v.abs().min(E4M3_MAX);
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let mut best = (f32::INFINITY, 0u8);
        for code in 0u8..=MAX_CODE {
            let d = (e4m3_decode(code) - a).abs();
            if d < best.0 || (d == best.0 && code % 2 == 0 && best.1 % 2 == 1) {
                best = (d, code);
            }
        }
        sign | best.1
    }

    #[test]
    fn every_code_round_trips_and_the_edges_saturate() {
        for code in 0u8..=255 {
            let v = e4m3_decode(code);
            if v.is_nan() {
                assert!(code & 0x7f == 0x7f);
                continue;
            }
            assert_eq!(e4m3_encode(v), code, "code {code:#04x} = {v}");
        }
        assert_eq!(e4m3_decode(MAX_CODE), 448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_encode(1e9), MAX_CODE);
        assert_eq!(e4m3_encode(f32::INFINITY), MAX_CODE);
        assert_eq!(e4m3_encode(f32::NEG_INFINITY), 0x80 | MAX_CODE);
        assert_eq!(e4m3_encode(449.0), MAX_CODE);
        assert_eq!(e4m3_encode(f32::NAN), 0x7f);
        // Ties go to the even code: 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39).
        assert_eq!(e4m3_encode(1.0625), 0x38);
        assert_eq!(e4m3_encode(1.1875), 0x3a);
        // The smallest subnormal's half rounds to 0 (even), anything above it to the subnormal.
        assert_eq!(e4m3_encode(2f32.powi(-10)), 0);
        assert_eq!(e4m3_encode(2f32.powi(-10) * 1.001), 1);
        assert_eq!(e4m3_encode(-0.0), 0x80);
    }

    #[test]
    fn encoding_matches_the_nearest_code_at_every_bf16_value_and_between() {
        // Every bf16 pattern as an f32, and the f32s just below, at and just above the midpoint to the next bf16:
        // all the rounding boundaries of e4m3 (3 mantissa bits) lie among these.
        for high in 0u32..=0xffff {
            for low in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let v = f32::from_bits((high << 16) | low);
                let want = if v.is_nan() { 0x7f } else { nearest_code(v) };
                assert_eq!(e4m3_encode(v), want, "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    #[test]
    fn amax_ignores_nan_and_sign() {
        assert_eq!(amax(&[]), 0.0);
        assert_eq!(amax(&[-0.0, 0.0]), 0.0);
        assert_eq!(amax(&[1.0, -3.5, f32::NAN, 2.0]), 3.5);
        assert_eq!(amax(&[f32::NEG_INFINITY, 7.0]), f32::INFINITY);
        assert_eq!(amax(&[f32::NAN]), 0.0);
    }

    proptest! {
        #[test]
        fn encoding_picks_the_nearest_code(bits in any::<u32>()) {
            let v = f32::from_bits(bits);
            prop_assume!(v.is_finite());
            // Keep the search meaningful: values far beyond 448 all saturate.
            let v = v.clamp(-1000.0, 1000.0);
            prop_assert_eq!(e4m3_encode(v), nearest_code(v), "{}", v);
        }

        #[test]
        fn encoding_picks_the_nearest_code_in_range(v in -500f32..500.0, small in -0.03f32..0.03) {
            prop_assert_eq!(e4m3_encode(v), nearest_code(v), "{}", v);
            prop_assert_eq!(e4m3_encode(small), nearest_code(small), "{}", small);
        }

        #[test]
        fn rows_dequantize_within_half_a_step(values in proptest::collection::vec(-1e3f32..1e3, 1..200), cols in 1usize..40) {
            let (codes, scales) = quantize_rows(&values, cols);
            prop_assert_eq!(scales.len(), values.len().div_ceil(cols));
            let back = dequantize_rows(&codes, &scales, cols);
            for (r, row) in values.chunks(cols).enumerate() {
                let a = amax(row);
                prop_assert!(scales[r] > 0.0);
                for (c, &v) in row.iter().enumerate() {
                    let got = back[r * cols + c];
                    // Three mantissa bits: within 1/16 of the value, or of a subnormal step of the row's scale.
                    let tol = v.abs() / 16.0 + scales[r] * 2f32.powi(-9) + a * 1e-6;
                    prop_assert!((got - v).abs() <= tol, "row {} col {}: {} -> {}", r, c, v, got);
                }
                // The largest magnitude maps to +-448 exactly.
                if a > 0.0 {
                    let top = row.iter().position(|v| v.abs() == a).unwrap_or(0);
                    prop_assert_eq!(codes[r * cols + top] & 0x7f, MAX_CODE);
                }
            }
        }
    }

    #[test]
    fn zero_rows_get_a_unit_scale_and_zero_codes() {
        let (codes, scales) = quantize_rows(&[0.0; 16], 8);
        assert_eq!(scales, [1.0, 1.0]);
        assert!(codes.iter().all(|&c| c == 0));
    }

    #[test]
    fn the_ring_quantizes_whole_rows_and_keeps_their_scales() {
        // 37 rows of 24 bf16 values with row magnitudes spanning 2^-8 .. 2^8, packed into slots of 5 rows.
        let (rows, cols) = (37, 24);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let r = i / cols;
                ((i * 7919 % 101) as f32 - 50.0) / 50.0 * 2f32.powi((r % 17) as i32 - 8)
            })
            .collect();
        let bf16: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let exact: Vec<f32> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let quantizer = Fp8RowQuantizer::new(Dtype::BF16, rows, cols).unwrap();
        let pieces = [Piece {
            src: &bf16,
            transform: Transform::Custom(&quantizer),
            dst_offset: 64,
        }];
        let mut device = vec![0xaau8; 64 + rows * cols];
        fill_host(&mut device, &pieces, 5 * cols, 3).unwrap();
        let (want_codes, want_scales) = quantize_rows(&exact, cols);
        assert_eq!(&device[64..], &want_codes[..]);
        assert!(device[..64].iter().all(|&b| b == 0xaa));
        assert_eq!(quantizer.scales(), want_scales);
        // f32 and f16 sources read the same way.
        let f32_bytes: Vec<u8> = exact.iter().flat_map(|v| v.to_le_bytes()).collect();
        let q32 = Fp8RowQuantizer::new(Dtype::F32, rows, cols).unwrap();
        let mut out = vec![0u8; rows * cols];
        fill_host(
            &mut out,
            &[Piece {
                src: &f32_bytes,
                transform: Transform::Custom(&q32),
                dst_offset: 0,
            }],
            1 << 16,
            1,
        )
        .unwrap();
        assert_eq!(out, want_codes);
        assert_eq!(q32.scales(), want_scales);
        // Refused: a non-float source, a chunk that is not whole rows, rows past the end.
        assert!(Fp8RowQuantizer::new(Dtype::I64, 2, 2).is_err());
        let q = Fp8RowQuantizer::new(Dtype::BF16, 2, 4).unwrap();
        let mut dst = [0u8; 4];
        assert!(q.apply(2, &[0u8; 8], &mut dst).is_err());
        assert!(q.apply(8, &[0u8; 8], &mut dst).is_err());
        assert!(q.apply(0, &[0u8; 8], &mut dst).is_ok());
        let scales = q.scales();
        assert_eq!(scales[0], 1.0);
        assert!(scales[1].is_nan(), "a row never quantized reads NaN");
    }
}
