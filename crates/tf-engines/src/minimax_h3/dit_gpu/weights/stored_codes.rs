//! What a checkpoint that stores weights in FP8 with their scales does to the plan: how many of them went to the
//! device as stored ([`CheckpointFp8Use`]), and which INT8 matrices keep the file's e4m3 codes instead
//! ([`keep_stored_codes`], [`KeptCodes`]).

use super::{Device, WeightPlan};
use crate::nn::fp8::RowCodes;
use crate::nn::fp8_checkpoint::Fp8Checkpoint;
use crate::nn::precision::Fp8Groups;

/// How many weights the folder stored in FP8 with their scales, and how many of those went to the device as the
/// file's codes (the rest were dequantized: to bf16 on the ring, or through f32 on the host where a placement
/// splits a row or lands in an f32 module).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointFp8Use {
    pub stored: usize,
    pub as_stored: usize,
    /// Blocks whose INT8 matrices the precision asked for were kept off the file's e4m3 codes
    /// ([`keep_stored_codes`]).
    pub kept: KeptCodes,
}

/// What [`keep_stored_codes`] changed: blocks whose adaLN projection stays e4m3 instead of INT8, blocks whose `fc1`
/// gate half runs in bf16 instead of INT8, and blocks whose GEMM groups run in e4m3 instead of INT8.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptCodes {
    pub adaln_e4m3: usize,
    pub gate_bf16: usize,
    /// Blocks whose GEMM groups run in e4m3 instead of `gemm=int8` (the file stores some of them in e4m3).
    pub gemm_e4m3: usize,
}

impl KeptCodes {
    /// Whether some block changed.
    pub fn any(&self) -> bool {
        self.adaln_e4m3 + self.gate_bf16 + self.gemm_e4m3 > 0
    }
}

impl CheckpointFp8Use {
    /// Weights dequantized.
    pub fn dequantized(&self) -> usize {
        self.stored - self.as_stored
    }

    /// A phrase for load reports (empty when the checkpoint stores nothing in FP8).
    pub fn describe(&self) -> String {
        if self.stored == 0 {
            return String::new();
        }
        let mut text = format!(
            "FP8 checkpoint: {} weights stored in e4m3, {} used as stored, {} dequantized",
            self.stored,
            self.as_stored,
            self.dequantized()
        );
        let kept = [
            (self.kept.adaln_e4m3, "the adaLN projections stay e4m3"),
            (self.kept.gate_bf16, "fc1's gate half runs in bf16"),
            (
                self.kept.gemm_e4m3,
                "the GEMM groups run in e4m3 (cuBLASLt) instead of gemm=int8",
            ),
        ];
        for (blocks, what) in kept.iter().filter(|(blocks, _)| *blocks > 0) {
            text.push_str(&format!(
                "; INT8 asked for, but the file's e4m3 codes are kept: {what} in {blocks} block(s)"
            ));
        }
        text
    }
}

/// Keeps the e4m3 codes a checkpoint stores out of the INT8 matrices of `groups` (one entry per block; `plan` is
/// their plan), since re-quantizing them to INT8 would add INT8's rounding to the e4m3 rounding already in the file
/// and read the model through f32 on the host: an INT8 adaLN projection the file stores in e4m3 becomes e4m3 (the
/// file's codes and scales go to the device as they are), a block of `gemm=int8` whose GEMM groups it stores in e4m3
/// runs them in e4m3 (the file's codes, cuBLASLt's FP8 GEMM), and an INT8 `fc1` gate half of an e4m3 block it stores
/// in e4m3 goes back to bf16 (the file's codes dequantized, as a bf16 gate half reads them: the gate in e4m3 would put
/// that mode past its error criterion). Says how many blocks changed (the caller plans again when any did).
pub(in crate::minimax_h3::dit_gpu) fn keep_stored_codes(
    groups: &mut [Fp8Groups],
    plan: &WeightPlan,
    checkpoint: &Fp8Checkpoint,
) -> KeptCodes {
    // Whether some weight placed in the 8-bit matrix at `codes` is stored in the checkpoint.
    let stored = |codes: usize| {
        let Some(matrix) = plan.fp8.iter().position(|m| m.codes == codes) else {
            return false;
        };
        plan.placements.iter().any(|pl| {
            pl.device == (Device::Coded { matrix })
                && plan
                    .names
                    .get(pl.tensor)
                    .is_some_and(|name| checkpoint.get(name).is_some())
        })
    };
    let mut kept = KeptCodes::default();
    for (layer, block) in plan.offsets.blocks.iter().enumerate() {
        let Some(g) = groups.get_mut(layer) else {
            continue;
        };
        if block.ada_scales.is_some() && block.ada_codes == RowCodes::Int8 && stored(block.ada_w) {
            g.adaln = Some(RowCodes::E4m3);
            kept.adaln_e4m3 += 1;
        }
        let attn = &block.attn;
        let groups_stored = [
            attn.fp8.qkv.map(|_| attn.qkv),
            attn.fp8.to_out.map(|_| attn.to_out),
            attn.fp8.fc1.map(|_| attn.fc1),
            attn.fp8.fc1_gate.and(attn.fc1_gate),
            attn.fp8.fc2.map(|_| attn.fc2),
        ]
        .into_iter()
        .flatten()
        .any(stored);
        if attn.fp8.codes == RowCodes::Int8 && groups_stored {
            g.gemm_codes = RowCodes::E4m3;
            kept.gemm_e4m3 += 1;
        }
        if let (true, Some(gate)) = (attn.fp8.fc1_gate_int8, attn.fc1_gate) {
            if stored(gate) {
                g.mlp_gate_int8 = false;
                kept.gate_bf16 += 1;
            }
        }
    }
    kept
}
