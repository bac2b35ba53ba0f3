//! 8-bit weight and activation codes on the host: FP8 e4m3 (encode, decode), the per-row quantization every FP8
//! path uses, INT8 rows for weight-only layers, and the weight quantizer that runs on the upload ring.
//!
//! One rule everywhere, shared by the GPU kernels (`kernels/nn/quant.cu`) and the load-time weight quantizer:
//! a row's scale is `amax / 448` (1 for an all-zero row) and each code is `e4m3(value * (1 / scale))`, rounded to
//! nearest even and saturated to ±448 (CUDA's `satfinite`). Every step is one correctly rounded f32 operation, so
//! the host computes the same codes as the kernels from the same f32 values. The product of code and scale is
//! the value again, within e4m3's three mantissa bits; an FP8 GEMM multiplies the row scales back in
//! (`tf_cuda::cublaslt::Fp8ScaleMode::RowWise`).
//!
//! INT8 rows ([`RowCodes::Int8`], weight-only layers that never meet a tensor-core GEMM) follow the same rule with
//! 127 in place of 448 and a two's-complement integer code rounded to nearest even: a uniform grid of 255 steps
//! over the row's range, about a third of e4m3's relative error on weights spread like a Gaussian's.
//!
//! [`RowQuantizer`] is a [`ChunkTransform`]: the pinned upload ring hands it whole rows of a bf16 (or f32,
//! f16) checkpoint tensor, it writes the codes into the staging slot and keeps each row's scale; the caller
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
    RowCodes::E4m3.row_scale(amax)
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
    RowCodes::E4m3.quantize_row(values, codes)
}

/// Quantizes `values` as rows of `cols`: the codes (`values.len()` bytes) and one scale per row. A trailing
/// partial row is quantized as a row of its own.
pub fn quantize_rows(values: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    RowCodes::E4m3.quantize_rows(values, cols)
}

/// The values `codes` stand for: `decode(code) * scale` of its row (rows of `cols`).
pub fn dequantize_rows(codes: &[u8], scales: &[f32], cols: usize) -> Vec<f32> {
    RowCodes::E4m3.dequantize_rows(codes, scales, cols)
}

/// The largest INT8 code magnitude (codes are symmetric: -127..=127).
pub const INT8_MAX: f32 = 127.0;

/// The INT8 code of `v`: round to nearest even, saturating to ±127; NaN becomes 0 (CUDA's `__float2int_rn` then a
/// clamp, as `nn_quantize_rows_int8` computes it).
#[inline]
pub fn int8_encode(v: f32) -> u8 {
    // 1.5 * 2^23: adding it leaves no fraction bits in the f32 sum, so the sum rounds to the nearest integer, ties
    // to even (f32 addition's rounding); subtracting it back is exact. Written out, not `round_ties_even`, which
    // without SSE4.1 is a library call per element and kept the load's quantizer at a quarter of e4m3's speed.
    const ROUND: f32 = 12_582_912.0;
    let finite = if v.is_nan() { 0.0 } else { v };
    let rounded = (finite.clamp(-INT8_MAX, INT8_MAX) + ROUND) - ROUND;
    // In range by the clamp: the cast is exact.
    (rounded as i8) as u8
}

/// The value of INT8 code `code` (two's complement).
pub fn int8_decode(code: u8) -> f32 {
    f32::from(code as i8)
}

/// The 8-bit code format of a quantized matrix's rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RowCodes {
    /// FP8 e4m3 (the tensor cores' FP8 operands), scale `amax / 448`.
    #[default]
    E4m3,
    /// INT8 (weight-only layers), scale `amax / 127`.
    Int8,
}

impl RowCodes {
    /// The name a precision spec and a load line use: `fp8` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            RowCodes::E4m3 => "fp8",
            RowCodes::Int8 => "int8",
        }
    }

    /// The largest code magnitude, which a row's largest value maps to.
    pub fn max(self) -> f32 {
        match self {
            RowCodes::E4m3 => E4M3_MAX,
            RowCodes::Int8 => INT8_MAX,
        }
    }

    /// The scale of a row whose largest magnitude is `amax`: `amax / max`, or 1 for an all-zero row.
    pub fn row_scale(self, amax: f32) -> f32 {
        if amax > 0.0 {
            amax / self.max()
        } else {
            1.0
        }
    }

    /// The code of `v` (already divided by its row's scale).
    #[inline]
    pub fn encode(self, v: f32) -> u8 {
        match self {
            RowCodes::E4m3 => e4m3_encode(v),
            RowCodes::Int8 => int8_encode(v),
        }
    }

    /// The value of `code`, before its row's scale.
    pub fn decode(self, code: u8) -> f32 {
        match self {
            RowCodes::E4m3 => e4m3_decode(code),
            RowCodes::Int8 => int8_decode(code),
        }
    }

    /// Quantizes one row into `codes` (same length) and returns its scale.
    pub fn quantize_row(self, values: &[f32], codes: &mut [u8]) -> f32 {
        let scale = self.row_scale(amax(values));
        let inv = 1.0 / scale;
        match self {
            // One loop per format keeps each free of a per-element branch (and vectorizable).
            RowCodes::E4m3 => {
                for (code, &v) in codes.iter_mut().zip(values) {
                    *code = e4m3_encode(v * inv);
                }
            }
            RowCodes::Int8 => {
                for (code, &v) in codes.iter_mut().zip(values) {
                    *code = int8_encode(v * inv);
                }
            }
        }
        scale
    }

    /// [`quantize_rows`] in this format.
    pub fn quantize_rows(self, values: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
        let cols = cols.max(1);
        let mut codes = vec![0u8; values.len()];
        let scales = values
            .chunks(cols)
            .zip(codes.chunks_mut(cols))
            .map(|(row, out)| self.quantize_row(row, out))
            .collect();
        (codes, scales)
    }

    /// [`dequantize_rows`] in this format.
    pub fn dequantize_rows(self, codes: &[u8], scales: &[f32], cols: usize) -> Vec<f32> {
        let cols = cols.max(1);
        codes
            .chunks(cols)
            .zip(scales)
            .flat_map(|(row, &scale)| row.iter().map(move |&c| self.decode(c) * scale))
            .collect()
    }
}

/// Per-output-channel 8-bit quantization of a weight `[rows, cols]` on the upload ring: the ring hands it whole
/// rows (its granule is one row), it writes their codes (e4m3, or INT8 with [`RowQuantizer::with_codes`]) into the
/// staging slot and records each row's scale, read with [`RowQuantizer::scales`] once the upload is done.
pub struct RowQuantizer {
    from: Dtype,
    rows: usize,
    cols: usize,
    codes: RowCodes,
    scales: Mutex<Vec<f32>>,
}

impl std::fmt::Debug for RowQuantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowQuantizer")
            .field("from", &self.from)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("codes", &self.codes)
            .finish_non_exhaustive()
    }
}

impl RowQuantizer {
    /// An e4m3 quantizer of a `[rows, cols]` tensor stored as `from` (F32, BF16 or F16).
    pub fn new(from: Dtype, rows: usize, cols: usize) -> Result<RowQuantizer, UploadError> {
        RowQuantizer::with_codes(from, rows, cols, RowCodes::E4m3)
    }

    /// A quantizer of a `[rows, cols]` tensor stored as `from` (F32, BF16 or F16) into `codes`.
    pub fn with_codes(
        from: Dtype,
        rows: usize,
        cols: usize,
        codes: RowCodes,
    ) -> Result<RowQuantizer, UploadError> {
        let transform = transform_name(codes);
        if !matches!(from, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(UploadError::Dtype {
                dtype: from,
                transform,
                accepts: "F32, BF16 or F16",
            });
        }
        if cols == 0 {
            return Err(UploadError::Transform {
                transform,
                why: "a weight of 0 columns has no rows to quantize".into(),
            });
        }
        Ok(RowQuantizer {
            from,
            rows,
            cols,
            codes,
            scales: Mutex::new(vec![f32::NAN; rows]),
        })
    }

    /// Each row's scale (`amax / 448`, or `amax / 127` for INT8), in row order. A row the ring never handed over (an upload that failed
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

/// The transform's name in upload errors.
fn transform_name(codes: RowCodes) -> &'static str {
    match codes {
        RowCodes::E4m3 => "fp8-row",
        RowCodes::Int8 => "int8-row",
    }
}

impl ChunkTransform for RowQuantizer {
    fn name(&self) -> &'static str {
        transform_name(self.codes)
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
                transform: self.name(),
                why: format!(
                    "a chunk of {elements} elements at element {first} is not whole rows of {cols} (or its source is not {unit} bytes each)"
                ),
            });
        }
        let first_row = first / cols;
        if first_row + elements / cols > self.rows {
            return Err(UploadError::Transform {
                transform: self.name(),
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
            found.push(self.codes.quantize_row(&row_values, out));
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
        let quantizer = RowQuantizer::new(Dtype::BF16, rows, cols).unwrap();
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
        let q32 = RowQuantizer::new(Dtype::F32, rows, cols).unwrap();
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
        assert!(RowQuantizer::new(Dtype::I64, 2, 2).is_err());
        let q = RowQuantizer::new(Dtype::BF16, 2, 4).unwrap();
        let mut dst = [0u8; 4];
        assert!(q.apply(2, &[0u8; 8], &mut dst).is_err());
        assert!(q.apply(8, &[0u8; 8], &mut dst).is_err());
        assert!(q.apply(0, &[0u8; 8], &mut dst).is_ok());
        let scales = q.scales();
        assert_eq!(scales[0], 1.0);
        assert!(scales[1].is_nan(), "a row never quantized reads NaN");
    }

    #[test]
    fn int8_codes_round_to_even_and_saturate() {
        assert_eq!(int8_encode(0.0), 0);
        assert_eq!(int8_encode(0.5), 0);
        assert_eq!(int8_encode(1.5), 2);
        assert_eq!(int8_encode(2.5), 2);
        assert_eq!(int8_encode(-2.5), (-2i8) as u8);
        assert_eq!(int8_encode(126.6), 127);
        assert_eq!(int8_encode(1e9), 127);
        assert_eq!(int8_encode(-1e9), (-127i8) as u8);
        assert_eq!(int8_encode(f32::NEG_INFINITY), (-127i8) as u8);
        assert_eq!(int8_encode(f32::NAN), 0);
        for code in -127i8..=127 {
            assert_eq!(int8_encode(int8_decode(code as u8)), code as u8);
        }
    }

    proptest! {
        #[test]
        fn int8_codes_are_the_library_rounding_of_any_value(bits in any::<u32>()) {
            let v = f32::from_bits(bits);
            let want = if v.is_nan() {
                0
            } else {
                (v.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8) as u8
            };
            prop_assert_eq!(int8_encode(v), want, "{}", v);
        }

        #[test]
        fn int8_codes_round_like_the_library_near_the_code_range(v in -200f32..200f32, half in any::<bool>()) {
            // Half-way values too: the ties.
            let v = if half { v.trunc() + 0.5 } else { v };
            let want = (v.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8) as u8;
            prop_assert_eq!(int8_encode(v), want, "{}", v);
        }

        #[test]
        fn int8_rows_dequantize_within_half_a_step(values in proptest::collection::vec(-1e3f32..1e3, 1..200), cols in 1usize..40) {
            let (codes, scales) = RowCodes::Int8.quantize_rows(&values, cols);
            let back = RowCodes::Int8.dequantize_rows(&codes, &scales, cols);
            for (r, row) in values.chunks(cols).enumerate() {
                let a = amax(row);
                prop_assert!(scales[r] > 0.0);
                for (c, &v) in row.iter().enumerate() {
                    let got = back[r * cols + c];
                    // A uniform grid of the row's scale: within half a step (and f32 rounding of v / scale).
                    let tol = scales[r] * 0.5 + a * 1e-6;
                    prop_assert!((got - v).abs() <= tol, "row {} col {}: {} -> {}", r, c, v, got);
                    prop_assert!(codes[r * cols + c] as i8 != i8::MIN, "code -128 is never used");
                }
                if a > 0.0 {
                    let top = row.iter().position(|v| v.abs() == a).unwrap_or(0);
                    prop_assert_eq!((codes[r * cols + top] as i8).unsigned_abs(), 127);
                }
            }
        }
    }

    #[test]
    fn the_ring_quantizes_int8_rows_as_the_host_rule() {
        let (rows, cols) = (9, 40);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| half::bf16::from_f32(((i * 7919 % 211) as f32 - 105.0) / 17.0).to_f32())
            .collect();
        let bf16: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let quantizer = RowQuantizer::with_codes(Dtype::BF16, rows, cols, RowCodes::Int8).unwrap();
        assert_eq!(quantizer.name(), "int8-row");
        let mut device = vec![0u8; rows * cols];
        fill_host(
            &mut device,
            &[Piece {
                src: &bf16,
                transform: Transform::Custom(&quantizer),
                dst_offset: 0,
            }],
            2 * cols,
            2,
        )
        .unwrap();
        let (want_codes, want_scales) = RowCodes::Int8.quantize_rows(&values, cols);
        assert_eq!(device, want_codes);
        assert_eq!(quantizer.scales(), want_scales);
        // INT8's error on a Gaussian-like row is a fraction of e4m3's.
        let err = |codes: RowCodes| {
            let (c, s) = codes.quantize_rows(&values, cols);
            let back = codes.dequantize_rows(&c, &s, cols);
            let num: f32 = back
                .iter()
                .zip(&values)
                .map(|(a, b)| (a - b) * (a - b))
                .sum();
            let den: f32 = values.iter().map(|v| v * v).sum();
            (num / den).sqrt()
        };
        assert!(err(RowCodes::Int8) < 0.5 * err(RowCodes::E4m3));
    }
}
