//! The library side of the plan choice ([`super::prepare::Planner`]): builds plans through a
//! [`CublasLt`] handle, for the first call of a shape (its own operands) or for a prepared
//! shape (placeholder addresses to build, scratch operands to time).

use std::collections::HashMap;

use super::ffi::{HeuristicResult, MatmulAlgo};
use super::plan::{AlgoSelection, ColumnMajorCall, PlanKey, TimingData};
use super::prepare::{GemmShape, OperandBases, Planner};
use super::{ffi, in_context, set_pointers, ChosenBy, CublasLt, CublasLtError, Plan};
use crate::memory::DeviceBuffer;
use crate::stream::Stream;

/// A plan built but not yet given its algorithm.
struct Building {
    plan: Plan,
    candidates: Vec<HeuristicResult>,
    call: ColumnMajorCall,
}

/// Builds plans through `lt`. Plans it finished are taken with [`LivePlanner::finish`]; what
/// is left when it drops (after an error) is destroyed.
pub(super) struct LivePlanner<'a> {
    lt: &'a CublasLt,
    stream: &'a Stream,
    /// The call whose first use builds the plan; `None` for prepared shapes.
    call: Option<&'a ColumnMajorCall>,
    /// Prepared shapes by key.
    pub(super) shapes: HashMap<PlanKey, GemmShape>,
    repeats: usize,
    next_order: u64,
    current: Option<Building>,
    done: Vec<Plan>,
    scratch: Scratch,
}

impl<'a> LivePlanner<'a> {
    pub(super) fn new(
        lt: &'a CublasLt,
        stream: &'a Stream,
        call: Option<&'a ColumnMajorCall>,
        selection: AlgoSelection,
        first_order: u64,
    ) -> LivePlanner<'a> {
        let repeats = match selection {
            AlgoSelection::Timed { repeats, .. } => repeats,
            AlgoSelection::Heuristic => 0,
        };
        LivePlanner {
            lt,
            stream,
            call,
            shapes: HashMap::new(),
            repeats,
            next_order: first_order,
            current: None,
            done: Vec::new(),
            scratch: Scratch {
                data: lt.timing_data(),
                fill: true,
                ..Scratch::default()
            },
        }
    }

    /// Runs once, on scratch operands, every finished plan whose kernel has not run through the handle yet (so
    /// that the kernel is loaded now, not inside a request's step); returns how many ran. A plan whose scratch
    /// cannot be had, that the library refuses on it, or any plan while the stream is being captured, is left to
    /// load on its first real call.
    pub(super) fn prime_new_kernels(&mut self) -> Result<usize, CublasLtError> {
        // A launch while the stream is captured would land in the graph: left to the first real call then.
        if self.stream.is_capturing()? {
            return Ok(0);
        }
        // The operands' values do not matter here: nothing reads the output.
        self.scratch.fill = false;
        let mut primed = 0;
        let mut done = std::mem::take(&mut self.done);
        let result = (|| -> Result<(), CublasLtError> {
            for plan in &mut done {
                if self.lt.kernel_has_run(plan) {
                    plan.ran = true;
                    continue;
                }
                let shape = self.shape(&plan.choice.key)?;
                let Some(bases) = self.scratch.bases_for(self.lt, &shape, self.stream)? else {
                    continue;
                };
                let call = shape.gemm_at(Some(&bases))?.plan()?;
                set_pointers(&self.lt.lib, plan, &call)?;
                // SAFETY: every address lies in this planner's scratch buffers, sized by `bases_for` for this shape
                // (C = D = the scratch output) and freed only after the device is done with them (a device
                // buffer's drop waits for its context); the algorithm is the plan's own.
                let code = unsafe {
                    self.lt.enqueue(
                        plan,
                        &plan.algo,
                        &call,
                        call.d_addr,
                        call.d_addr,
                        self.stream,
                    )?
                };
                if code == ffi::status::SUCCESS {
                    plan.ran = true;
                    self.lt.note_kernel_run(&plan.choice.key, &plan.algo);
                    primed += 1;
                }
            }
            Ok(())
        })();
        self.done = done;
        result.map(|()| primed)
    }

    /// The finished plans, in build order.
    pub(super) fn finish(mut self) -> Vec<Plan> {
        std::mem::take(&mut self.done)
    }

    fn shape(&self, key: &PlanKey) -> Result<GemmShape, CublasLtError> {
        self.shapes
            .get(key)
            .copied()
            .ok_or_else(|| CublasLtError::Invalid {
                what: "internal: a prepared key has no shape".into(),
            })
    }

    fn destroy(&self, plan: Plan) {
        let api = self.lt.lib.api();
        if !self.lt.ctx.is_lost() {
            let _ = in_context(&self.lt.ctx, "cuBLASLt plan cleanup", || plan.destroy(api));
        }
    }

    fn take_current(&mut self) -> Result<Building, CublasLtError> {
        self.current.take().ok_or_else(|| CublasLtError::Invalid {
            what: "internal: no plan is being built".into(),
        })
    }
}

impl Planner for LivePlanner<'_> {
    fn build(&mut self, key: &PlanKey, requested: usize) -> Result<Vec<MatmulAlgo>, CublasLtError> {
        if let Some(left) = self.current.take() {
            self.destroy(left.plan);
        }
        let call = match self.call {
            Some(call) => *call,
            None => self.shape(key)?.gemm_at(None)?.plan()?,
        };
        if call.key != *key {
            return Err(CublasLtError::Invalid {
                what: "internal: the call's key differs from the key planned".into(),
            });
        }
        let order = self.next_order;
        let lt = self.lt;
        let (plan, candidates) = in_context(&lt.ctx, "cuBLASLt plan", || {
            lt.build_plan(&call, requested, order)
        })??;
        self.next_order += 1;
        let algos = candidates.iter().map(|c| c.algo).collect();
        self.current = Some(Building {
            plan,
            candidates,
            call,
        });
        Ok(algos)
    }

    fn time(&mut self, key: &PlanKey) -> Result<(ChosenBy, usize), CublasLtError> {
        let mut building = self.take_current()?;
        let call = match self.call {
            Some(_) => building.call,
            None => {
                let shape = self.shape(key)?;
                match self.scratch.bases_for(self.lt, &shape, self.stream) {
                    Ok(Some(bases)) => shape.gemm_at(Some(&bases))?.plan()?,
                    Ok(None) => {
                        building.plan.choice.chosen_by = ChosenBy::NoScratch;
                        self.done.push(building.plan);
                        return Ok((ChosenBy::NoScratch, 0));
                    }
                    Err(error) => {
                        self.destroy(building.plan);
                        return Err(error);
                    }
                }
            }
        };
        // SAFETY: for a first call, the addresses are the caller's promise (`matmul`'s
        // contract); for a prepared shape they lie in this planner's scratch buffers, sized by
        // `bases_for` for this shape and alive until after the timing synchronized the stream.
        let timed = unsafe {
            self.lt.choose_by_timing(
                &mut building.plan,
                &building.candidates,
                &call,
                self.repeats,
                self.stream,
            )
        };
        if let Err(error) = timed {
            self.destroy(building.plan);
            return Err(error);
        }
        let outcome = (building.plan.choice.chosen_by, building.plan.choice.chosen);
        self.done.push(building.plan);
        Ok(outcome)
    }

    fn adopt(&mut self, _key: &PlanKey, index: usize, chosen_by: ChosenBy) {
        let Ok(mut building) = self.take_current() else {
            return;
        };
        if let Some(candidate) = building.candidates.get(index) {
            building.plan.algo = candidate.algo;
            building.plan.choice.chosen = index;
        }
        building.plan.choice.chosen_by = chosen_by;
        self.done.push(building.plan);
    }
}

impl Drop for LivePlanner<'_> {
    fn drop(&mut self) {
        if let Some(left) = self.current.take() {
            self.destroy(left.plan);
        }
        for plan in std::mem::take(&mut self.done) {
            self.destroy(plan);
        }
    }
}

/// Scratch operands for timing prepared shapes, grown to the largest shape timed.
#[derive(Default)]
struct Scratch {
    /// What the operands hold.
    data: TimingData,
    /// Whether buffers allocated from now on are filled ([`Scratch::data`]); priming leaves them as allocated.
    fill: bool,
    x: Option<DeviceBuffer>,
    w: Option<DeviceBuffer>,
    y: Option<DeviceBuffer>,
    bias: Option<DeviceBuffer>,
    scales: Option<DeviceBuffer>,
}

/// bf16 0.0078125 twice, or e4m3 1.5 four times: small finite values, like real weights.
const INPUT_FILL: u32 = 0x3c00_3c00;
/// f32 1.0: unit FP8 scales.
const SCALE_FILL: u32 = 0x3f80_0000;

/// Bytes of the pattern [`fill_random_operand`] repeats: larger than the L2, so no tile of an operand repeats in it.
const RANDOM_PATTERN_BYTES: usize = 64 << 20;

/// The 16-bit word made from two random bytes: a bf16 of magnitude 2^-9 up to 2^-5 with a random
/// sign and mantissa whose two bytes are also finite e4m3 codes (magnitudes 1.375 and 1.5 for the high byte, any
/// non-NaN code for the low one), so one pattern serves bf16 and FP8 shapes as [`INPUT_FILL`] does.
fn random_operand_word(low: u8, high: u8) -> u16 {
    // e4m3's NaN codes are 0x7f and 0xff.
    let low = if low & 0x7f == 0x7f { low ^ 1 } else { low };
    let high = (high & 0x80) | if high & 1 == 0 { 0x3b } else { 0x3c };
    u16::from_le_bytes([low, high])
}

/// The pseudo-random pattern of [`TimingData::Random`] (splitmix64 from a fixed seed: the same bytes in every process).
fn random_operand_pattern(bytes: usize) -> Vec<u8> {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        for pair in z.to_le_bytes().chunks_exact(2) {
            out.extend_from_slice(&random_operand_word(pair[0], pair[1]).to_le_bytes());
        }
    }
    out.truncate(bytes);
    out
}

/// Fills `buffer` with the repeated [`random_operand_pattern`] (a synchronous upload: done before any timing).
fn fill_random_operand(buffer: &mut DeviceBuffer) -> Result<(), CublasLtError> {
    let pattern = random_operand_pattern(RANDOM_PATTERN_BYTES.min(buffer.len()));
    let mut offset = 0;
    while offset < buffer.len() {
        let take = pattern.len().min(buffer.len() - offset);
        buffer.upload(offset, &pattern[..take])?;
        offset += take;
    }
    Ok(())
}

/// Bytes of the X scales and where the W scales start in one scales buffer (X at 0), for `shape`:
/// `(w_offset, total)`, both multiples of 256; `(0, 0)` for a shape without scales.
pub(super) fn scale_layout(shape: &GemmShape) -> Option<(usize, usize)> {
    if !shape.scaled() {
        return Some((0, 0));
    }
    let (x, w) = shape.fp8_scale_mode.scale_counts(shape.m, shape.n);
    let x_bytes = x.checked_mul(4)?.checked_next_multiple_of(256)?.max(4096);
    let w_bytes = w.checked_mul(4)?.checked_next_multiple_of(256)?.max(4096);
    Some((x_bytes, x_bytes.checked_add(w_bytes)?))
}

impl Scratch {
    /// Device addresses for `shape`'s operands (each 256-byte aligned with 256 spare bytes for
    /// the shape's alignment offset), or `None` when the memory cannot be had.
    fn bases_for(
        &mut self,
        lt: &CublasLt,
        shape: &GemmShape,
        stream: &Stream,
    ) -> Result<Option<OperandBases>, CublasLtError> {
        let (ib, ob) = (shape.input.size_bytes(), shape.output.size_bytes());
        let bytes = |rows: usize, cols: usize, elem: usize| {
            rows.checked_mul(cols)
                .and_then(|n| n.checked_mul(elem))
                .and_then(|n| n.checked_add(256))
                .and_then(|n| n.checked_next_multiple_of(256))
        };
        let (Some(x), Some(w), Some(y), Some(bias), Some((w_scale_offset, scale_bytes))) = (
            bytes(shape.m, shape.k, ib),
            bytes(shape.n, shape.k, ib),
            bytes(shape.m, shape.n, ob),
            bytes(1, shape.n, ob),
            scale_layout(shape),
        ) else {
            return Ok(None);
        };
        let wanted = [
            (&mut self.x, x, Some(INPUT_FILL)),
            (&mut self.w, w, Some(INPUT_FILL)),
            (&mut self.y, y, None),
            (&mut self.bias, if shape.bias { bias } else { 0 }, Some(0)),
            (&mut self.scales, scale_bytes, Some(SCALE_FILL)),
        ];
        for (slot, len, fill) in wanted {
            if len == 0 || slot.as_ref().is_some_and(|b| b.len() >= len) {
                continue;
            }
            // The old buffer goes first, so the two never need room together.
            *slot = None;
            let Ok(mut buffer) = DeviceBuffer::alloc(&lt.ctx, len) else {
                return Ok(None);
            };
            match (fill.filter(|_| self.fill), self.data) {
                (Some(INPUT_FILL), TimingData::Random) => fill_random_operand(&mut buffer)?,
                (Some(value), _) => buffer.fill_u32(value, Some(stream))?,
                (None, _) => {}
            }
            *slot = Some(buffer);
        }
        let addr = |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, DeviceBuffer::addr);
        let scales = addr(&self.scales);
        Ok(Some(OperandBases {
            x: addr(&self.x),
            w: addr(&self.w),
            y: addr(&self.y),
            bias: addr(&self.bias),
            x_scale: scales,
            w_scale: if scales == 0 {
                0
            } else {
                scales + w_scale_offset as u64
            },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_to_f32(bits: u16) -> f32 {
        f32::from_bits(u32::from(bits) << 16)
    }

    #[test]
    fn every_random_operand_word_is_a_small_bf16_and_two_finite_e4m3_codes() {
        for low in 0..=255u8 {
            for high in 0..=255u8 {
                let word = random_operand_word(low, high);
                let value = bf16_to_f32(word).abs();
                assert!(
                    (2f32.powi(-9)..2f32.powi(-5)).contains(&value),
                    "{low:#x} {high:#x} -> {word:#06x} = {value}"
                );
                for byte in word.to_le_bytes() {
                    assert_ne!(byte & 0x7f, 0x7f, "e4m3 NaN code from {low:#x} {high:#x}");
                }
            }
        }
    }

    #[test]
    fn the_random_pattern_is_fixed_and_toggles_its_bits() {
        let a = random_operand_pattern(1 << 16);
        assert_eq!(a, random_operand_pattern(1 << 16));
        assert_eq!(random_operand_pattern(7).len(), 7);
        // Both signs, and words that differ from their neighbours almost always.
        let words: Vec<u16> = a
            .chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]))
            .collect();
        assert!(words.iter().any(|w| w & 0x8000 != 0) && words.iter().any(|w| w & 0x8000 == 0));
        let same = words.windows(2).filter(|w| w[0] == w[1]).count();
        assert!(same < words.len() / 100, "{same} repeated neighbours");
    }

    #[test]
    fn scratch_scales_hold_every_vector_of_a_row_wise_shape() {
        assert_eq!(
            scale_layout(&GemmShape::bf16(4096, 12288, 4096)),
            Some((0, 0))
        );
        // Per tensor: one f32 each, in 4 KiB slots as before.
        assert_eq!(
            scale_layout(&GemmShape::fp8_e4m3(4096, 12288, 4096)),
            Some((4096, 8192))
        );
        // Row-wise: M then N f32, each rounded up to 256 bytes (4 KiB at least).
        let (w_at, total) =
            scale_layout(&GemmShape::fp8_e4m3_row_wise(4176, 24576, 4096)).expect("fits");
        assert_eq!(w_at, 16896); // 4176 * 4 = 16704, rounded up to 66 * 256
        assert_eq!(total, w_at + 24576 * 4);
        assert!(w_at % 256 == 0 && total % 256 == 0);
        assert_eq!(
            scale_layout(&GemmShape::fp8_e4m3_row_wise(usize::MAX, 16, 16)),
            None
        );
    }
}
