//! The GEMM precision of a GPU DiT (Qwen-Image and MiniMax H3 share it): bf16 everywhere, or FP8 e4m3 in chosen
//! groups of the transformer blocks' GEMMs.
//!
//! A block has four GEMM groups: `qkv` (the fused q|k|v projection), `out` (the attention output projection),
//! `mlp_in` (the fused gate|up, or value|gate, projection) and `mlp_out` (the MLP's down projection). `mlp_in` is
//! two halves that may be chosen apart (MiniMax H3 only): `mlp_value` (the rows SwiGLU multiplies) and `mlp_gate`
//! (the rows it passes through silu); one half alone runs the projection as two GEMMs, one FP8 and one bf16. In FP8 a
//! group's weight is quantized at load per output channel and its input per token by the kernel that produces it
//! (the norm + modulation before `qkv`, the gated residual + norm + modulation before `mlp_in`, SwiGLU before
//! `mlp_out`; the attention output, whose kernel writes bf16, by a quantizing pass of its own before `out`), and
//! the GEMM multiplies both scales back (cuBLASLt's row-wise scales). Everything outside the blocks' four groups
//! (embedders, timestep and modulation layers, output norm and heads, a token refiner) keeps its bf16 (or f32)
//! path, and so do the first and last `ends` blocks.
//!
//! A fifth group, `adaln`, is MiniMax H3's per-block modulation projection (the adaLN weights, 39% of the model)
//! stored in 8 bits with per-output-channel scales and read weight-only (its few timestep rows stay bf16): e4m3
//! codes (`adaln`, or `adaln=fp8`) or INT8 codes (`adaln=int8`, a third of e4m3's rounding error at the same bytes;
//! [`crate::nn::fp8::RowCodes`]). It is never implied by `all`, and the Qwen-Image DiT, whose modulation is not per
//! block, refuses it.
//!
//! Spelled on the command line (`--precision`) as `bf16`, `fp8` (the model's own default mode,
//! [`DitPrecision::Fp8ModelDefault`], which each model's loader resolves with [`DitPrecision::resolve`]), or
//! `fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8]` with GROUP one of `qkv`, `out`,
//! `mlp_in`, `mlp_value`, `mlp_gate`, `mlp_out`, `adaln`, `adaln=fp8|int8|bf16`, `all` (the four GEMM groups),
//! `none`.
//!
//! `attn=int8-fp8` runs the attention of the blocks inside the ends in 8 bits ([`AttentionPrecision::Int8Fp8`]:
//! INT8 Q K^T with K smoothed, FP8 P V, sm_90 only; see docs/ENGINES.md, "8-bit attention"); `bf16`, the default,
//! keeps the production attention.
//!
//! `accum` is how the FP8 GEMMs accumulate ([`Fp8Accumulation`]): `exact` promotes the tensor cores' partial sums to
//! f32 at intervals along `k` (cuBLASLt's default), `fast` lets them accumulate in the tensor cores' own, narrower
//! accumulator (cuBLASLt's fast-accumulation mode: fewer instructions, a larger rounding error at large `k`). `fast`
//! is the default of every FP8 mode: on the H200 it made the Qwen-Image step 5% and the H3 step 3% faster for an
//! error change within measurement (0.722x -> 0.741x and 3.09x -> 3.10x the bf16 floor; docs/RESULTS.md).

use std::fmt;
use std::str::FromStr;

use crate::nn::fp8::RowCodes;

/// Which of a block's GEMM groups run in FP8.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Fp8Groups {
    pub qkv: bool,
    pub out: bool,
    /// The value half of `mlp_in` (the rows SwiGLU multiplies by silu of the gate).
    pub mlp_value: bool,
    /// The gate half of `mlp_in` (the rows SwiGLU passes through silu).
    pub mlp_gate: bool,
    pub mlp_out: bool,
    /// The gate half of `mlp_in` as an INT8 GEMM instead (`mlp_gate=int8`; `mlp_gate` is then off): INT8 weight
    /// rows and per-token INT8 activation codes (a third of e4m3's rounding error at the same bytes), exact int32
    /// products dequantized by the SwiGLU that reads them. Needs `mlp_value` and `mlp_out` in FP8: the activation
    /// codes come from the norm that writes the value half's e4m3 rows, and the SwiGLU writes e4m3 rows.
    pub mlp_gate_int8: bool,
    /// The block's adaLN projection, weight-only (MiniMax H3): its codes (`None`: bf16).
    pub adaln: Option<RowCodes>,
    /// The 8-bit format of the GEMM groups above (`gemm=e4m3|int8`): e4m3 (cuBLASLt's row-wise FP8 GEMM) or INT8
    /// (INT8 weight rows with per-output-channel scales, per-token INT8 activation codes written by the same
    /// kernels, our INT8 GEMM with a scaling epilogue: sm_90, MiniMax H3). In INT8 `mlp_gate=int8` is the same
    /// as `mlp_gate`.
    pub gemm_codes: RowCodes,
}

impl Fp8Groups {
    /// Every group in bf16.
    pub const NONE: Fp8Groups = Fp8Groups {
        qkv: false,
        out: false,
        mlp_value: false,
        mlp_gate: false,
        mlp_out: false,
        mlp_gate_int8: false,
        adaln: None,
        gemm_codes: RowCodes::E4m3,
    };
    /// The four GEMM groups in FP8 (not `adaln`, which is named on its own).
    pub const ALL: Fp8Groups = Fp8Groups {
        qkv: true,
        out: true,
        mlp_value: true,
        mlp_gate: true,
        mlp_out: true,
        mlp_gate_int8: false,
        adaln: None,
        gemm_codes: RowCodes::E4m3,
    };

    /// True when some group runs in FP8.
    pub fn any(self) -> bool {
        self.any_gemm() || self.adaln.is_some()
    }

    /// True when one of the four GEMM groups (or a half of `mlp_in`) runs in FP8 (their activations are quantized
    /// too).
    pub fn any_gemm(self) -> bool {
        self.qkv
            || self.out
            || self.mlp_value
            || self.mlp_gate
            || self.mlp_out
            || self.mlp_gate_int8
    }

    /// Both halves of `mlp_in` in FP8: the projection is one FP8 GEMM.
    pub fn mlp_in(self) -> bool {
        self.mlp_value && self.mlp_gate
    }

    /// The 8-bit codes of the GEMM group `on` selects (`gemm_codes`), or `None` when that group runs in bf16.
    pub fn codes_of(self, on: impl FnOnce(Fp8Groups) -> bool) -> Option<RowCodes> {
        on(self).then_some(self.gemm_codes)
    }

    /// Exactly one half of `mlp_in` in FP8 (the other in bf16, or the gate in INT8): the projection runs as two
    /// GEMMs, one per half.
    pub fn mlp_in_split(self) -> bool {
        self.mlp_value != self.mlp_gate
    }

    /// The groups' names, in block order (`mlp_in` when both of its halves are named), the adaLN item last.
    pub fn names(self) -> Vec<&'static str> {
        let mut names = self.gemm_names();
        match self.adaln {
            Some(RowCodes::E4m3) => names.push("adaln"),
            Some(RowCodes::Int8) => names.push("adaln=int8"),
            None => {}
        }
        names
    }

    /// The names of the GEMM groups in FP8 (activations quantized too), in block order.
    pub fn gemm_names(self) -> Vec<&'static str> {
        [
            ("qkv", self.qkv),
            ("out", self.out),
            ("mlp_in", self.mlp_in()),
            ("mlp_value", self.mlp_in_split() && self.mlp_value),
            ("mlp_gate", self.mlp_in_split() && self.mlp_gate),
            ("mlp_gate=int8", self.mlp_gate_int8),
            ("mlp_out", self.mlp_out),
        ]
        .into_iter()
        .filter_map(|(name, on)| on.then_some(name))
        .collect()
    }
}

/// How an FP8 GEMM accumulates its products along `k` (cuBLASLt's `FAST_ACCUM` attribute).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp8Accumulation {
    /// Partial sums promoted to f32 at intervals (cuBLASLt's default for FP8).
    Exact,
    /// Partial sums kept in the tensor cores' accumulator for the whole of `k` (the FP8 modes' default).
    #[default]
    Fast,
}

impl Fp8Accumulation {
    /// The spelling in a precision spec (`accum=...`).
    pub fn name(self) -> &'static str {
        match self {
            Fp8Accumulation::Exact => "exact",
            Fp8Accumulation::Fast => "fast",
        }
    }

    /// True for [`Fp8Accumulation::Fast`].
    pub fn is_fast(self) -> bool {
        self == Fp8Accumulation::Fast
    }
}

/// The precision of the attention kernels an engine runs: bf16 (the default, `NnKernels::attention`) or the 8-bit
/// option of `nn::gpu::attention_8bit`. Spelled `bf16` and `int8-fp8`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionPrecision {
    /// bf16 Q, K, V and P (the production kernels).
    #[default]
    Bf16,
    /// INT8 Q and smoothed K, FP8 e4m3 P and V (sm_90 only).
    Int8Fp8,
}

impl fmt::Display for AttentionPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttentionPrecision::Bf16 => "bf16",
            AttentionPrecision::Int8Fp8 => "int8-fp8",
        })
    }
}

/// An attention precision that is not `bf16` or `int8-fp8`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown attention precision {0:?}: expected `bf16` or `int8-fp8`")]
pub struct ParseAttentionPrecisionError(pub String);

impl FromStr for AttentionPrecision {
    type Err = ParseAttentionPrecisionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(AttentionPrecision::Bf16),
            "int8-fp8" | "int8_fp8" => Ok(AttentionPrecision::Int8Fp8),
            other => Err(ParseAttentionPrecisionError(other.to_string())),
        }
    }
}

/// Where FP8 runs: the groups, in every block but the first and last `bf16_ends`, how its GEMMs accumulate, and
/// the precision of those blocks' attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Layers {
    pub groups: Fp8Groups,
    /// Blocks kept in bf16 at each end of the stack.
    pub bf16_ends: usize,
    pub accumulation: Fp8Accumulation,
    /// The attention of the blocks inside the ends (`attn=...`; bf16 unless asked).
    pub attention: AttentionPrecision,
}

impl Fp8Layers {
    /// The default FP8 mode: all four groups, the first and the last block in bf16 (the blocks other FP8 DiT
    /// deployments keep in bf16; see docs/ENGINES.md for the measured error per group).
    pub const DEFAULT: Fp8Layers = Fp8Layers {
        groups: Fp8Groups::ALL,
        bf16_ends: 1,
        accumulation: Fp8Accumulation::Fast,
        attention: AttentionPrecision::Bf16,
    };

    /// True when block `layer` of `layers` is inside the bf16 ends.
    fn inside(&self, layer: usize, layers: usize) -> bool {
        layer >= self.bf16_ends && layer + self.bf16_ends < layers
    }

    /// The groups block `layer` of `layers` runs in FP8.
    pub fn groups_of(&self, layer: usize, layers: usize) -> Fp8Groups {
        if self.inside(layer, layers) {
            self.groups
        } else {
            Fp8Groups::NONE
        }
    }

    /// The precision of block `layer`'s attention.
    pub fn attention_of(&self, layer: usize, layers: usize) -> AttentionPrecision {
        if self.inside(layer, layers) {
            self.attention
        } else {
            AttentionPrecision::Bf16
        }
    }
}

/// The GEMM precision of the GPU DiT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DitPrecision {
    /// bf16 weights and activations everywhere (f32 accumulation).
    #[default]
    Bf16,
    /// FP8 e4m3 in the given blocks' groups, bf16 elsewhere.
    Fp8(Fp8Layers),
    /// `fp8` as typed: the model's default FP8 mode, chosen per model from its measured error per group (Qwen-Image:
    /// [`Fp8Layers::DEFAULT`]; MiniMax H3 keeps the gate half of its sensitive `mlp_in` group in bf16). A loader turns it into
    /// [`DitPrecision::Fp8`] with [`DitPrecision::resolve`]; unresolved, it reads as [`Fp8Layers::DEFAULT`].
    Fp8ModelDefault,
}

impl DitPrecision {
    /// `fp8` as typed: the model's default FP8 mode.
    pub const FP8: DitPrecision = DitPrecision::Fp8ModelDefault;

    /// This precision with `fp8` (the model default) replaced by `model_default`.
    pub fn resolve(self, model_default: Fp8Layers) -> DitPrecision {
        match self {
            DitPrecision::Fp8ModelDefault => DitPrecision::Fp8(model_default),
            other => other,
        }
    }

    /// The groups block `layer` of `layers` runs in FP8 ([`Fp8Groups::NONE`] in bf16).
    pub fn groups_of(&self, layer: usize, layers: usize) -> Fp8Groups {
        match self {
            DitPrecision::Bf16 => Fp8Groups::NONE,
            DitPrecision::Fp8(l) => l.groups_of(layer, layers),
            DitPrecision::Fp8ModelDefault => Fp8Layers::DEFAULT.groups_of(layer, layers),
        }
    }

    /// How the FP8 GEMMs accumulate (meaningless, and [`Fp8Accumulation::Exact`], in bf16).
    pub fn fp8_accumulation(&self) -> Fp8Accumulation {
        match self {
            DitPrecision::Bf16 => Fp8Accumulation::Exact,
            DitPrecision::Fp8(l) => l.accumulation,
            DitPrecision::Fp8ModelDefault => Fp8Layers::DEFAULT.accumulation,
        }
    }

    /// The precision of block `layer`'s attention (bf16 unless an FP8 mode names `attn=int8-fp8`).
    pub fn attention_of(&self, layer: usize, layers: usize) -> AttentionPrecision {
        match self {
            DitPrecision::Fp8(l) => l.attention_of(layer, layers),
            DitPrecision::Bf16 | DitPrecision::Fp8ModelDefault => AttentionPrecision::Bf16,
        }
    }

    /// True when some block of `layers` runs its attention in 8 bits.
    pub fn uses_8bit_attention(&self, layers: usize) -> bool {
        (0..layers).any(|l| self.attention_of(l, layers) == AttentionPrecision::Int8Fp8)
    }

    /// True when some block of `layers` runs a GEMM in FP8.
    pub fn uses_fp8(&self, layers: usize) -> bool {
        (0..layers).any(|l| self.groups_of(l, layers).any())
    }

    /// What a load report says: the precision and, for FP8, where it runs in a stack of `layers` blocks.
    pub fn describe(&self, layers: usize) -> String {
        match self.resolve(Fp8Layers::DEFAULT) {
            DitPrecision::Bf16 | DitPrecision::Fp8ModelDefault => "bf16".into(),
            DitPrecision::Fp8(l) => {
                let fp8_blocks = (0..layers)
                    .filter(|&b| {
                        l.groups_of(b, layers).any()
                            || l.attention_of(b, layers) != AttentionPrecision::Bf16
                    })
                    .count();
                if fp8_blocks == 0 {
                    return format!(
                        "bf16 (fp8 asked for, but no block of {layers} is inside the {} bf16 blocks kept at each end)",
                        l.bf16_ends
                    );
                }
                let gemm_groups = l.groups.gemm_names();
                format!(
                    "{} ({}){} in {fp8_blocks} of {layers} blocks ({}); \
                     per-output-channel weight scales, per-token activation scales, {} accumulation; \
                     {}every layer outside those groups as in bf16 mode",
                    match l.groups.gemm_codes {
                        RowCodes::E4m3 => "fp8 e4m3",
                        RowCodes::Int8 => "int8 GEMMs (our scaled INT8 GEMM)",
                    },
                    if gemm_groups.is_empty() {
                        "no GEMM group".to_string()
                    } else {
                        gemm_groups.join(", ")
                    },
                    match l.groups.adaln {
                        Some(RowCodes::E4m3) => " and the adaLN projections weight-only in e4m3",
                        Some(RowCodes::Int8) => " and the adaLN projections weight-only in int8",
                        None => "",
                    },
                    match l.bf16_ends {
                        0 => "no block kept in bf16".to_string(),
                        n => format!("the first and last {n} in bf16"),
                    },
                    match l.groups.gemm_codes {
                        RowCodes::E4m3 => l.accumulation.name(),
                        RowCodes::Int8 => "exact int32",
                    },
                    if l.attention == AttentionPrecision::Int8Fp8 {
                        "attention in 8 bits (INT8 Q K^T, FP8 P V) in those blocks; "
                    } else {
                        ""
                    }
                )
            }
        }
    }
}

impl fmt::Display for DitPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DitPrecision::Bf16 => f.write_str("bf16"),
            DitPrecision::Fp8ModelDefault => f.write_str("fp8"),
            DitPrecision::Fp8(l) => {
                let names = l.groups.names();
                let groups = if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(",")
                };
                write!(f, "fp8:{groups},ends={}", l.bf16_ends)?;
                if l.groups.gemm_codes == RowCodes::Int8 {
                    f.write_str(",gemm=int8")?;
                }
                if l.accumulation != Fp8Layers::DEFAULT.accumulation {
                    write!(f, ",accum={}", l.accumulation.name())?;
                }
                if l.attention != AttentionPrecision::Bf16 {
                    write!(f, ",attn={}", l.attention)?;
                }
                Ok(())
            }
        }
    }
}

/// Most blocks kept in bf16 at each end a spec may ask for (far above any real model's depth).
const MAX_ENDS: usize = 1 << 16;

impl FromStr for DitPrecision {
    type Err = String;

    /// Parses `bf16`, `fp8` or `fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8]`.
    fn from_str(text: &str) -> Result<DitPrecision, String> {
        let usage = "use bf16, fp8, or fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8] with GROUP one of qkv, out, mlp_in, mlp_value, mlp_gate, mlp_gate=int8, mlp_out, adaln, adaln=int8, all, none";
        let text = text.trim();
        match text {
            "bf16" => return Ok(DitPrecision::Bf16),
            "fp8" => return Ok(DitPrecision::FP8),
            _ => {}
        }
        let Some(spec) = text.strip_prefix("fp8:") else {
            return Err(format!("precision {text:?}: {usage}"));
        };
        let mut groups = Fp8Groups::NONE;
        let mut named = false;
        let mut ends = Fp8Layers::DEFAULT.bf16_ends;
        let mut accumulation = Fp8Layers::DEFAULT.accumulation;
        let mut attention = Fp8Layers::DEFAULT.attention;
        let mut gemm_codes = RowCodes::E4m3;
        for item in spec.split(',').map(str::trim) {
            if let Some(c) = item.strip_prefix("gemm=") {
                gemm_codes = match c {
                    "e4m3" | "fp8" => RowCodes::E4m3,
                    "int8" => RowCodes::Int8,
                    _ => {
                        return Err(format!(
                            "precision {text:?}: gemm={c} is neither `e4m3` nor `int8`"
                        ))
                    }
                };
                continue;
            }
            if let Some(a) = item.strip_prefix("attn=") {
                attention = a
                    .parse()
                    .map_err(|e| format!("precision {text:?}: attn={a}: {e}"))?;
                continue;
            }
            if let Some(a) = item.strip_prefix("accum=") {
                accumulation = match a {
                    "fast" => Fp8Accumulation::Fast,
                    "exact" => Fp8Accumulation::Exact,
                    _ => {
                        return Err(format!(
                            "precision {text:?}: accum={a} is neither `fast` nor `exact`"
                        ))
                    }
                };
                continue;
            }
            if let Some(n) = item.strip_prefix("ends=") {
                ends = n
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n <= MAX_ENDS)
                    .ok_or_else(|| {
                        format!(
                            "precision {text:?}: ends={n} is not a block count (0..={MAX_ENDS})"
                        )
                    })?;
                continue;
            }
            named = true;
            if let Some(codes) = item.strip_prefix("adaln=") {
                groups.adaln = match codes {
                    "bf16" => None,
                    "fp8" | "e4m3" => Some(RowCodes::E4m3),
                    "int8" => Some(RowCodes::Int8),
                    _ => {
                        return Err(format!(
                            "precision {text:?}: adaln={codes} is not `bf16`, `fp8` or `int8`"
                        ))
                    }
                };
                continue;
            }
            if let Some(codes) = item.strip_prefix("mlp_gate=") {
                (groups.mlp_gate, groups.mlp_gate_int8) = match codes {
                    "bf16" => (false, false),
                    "fp8" | "e4m3" => (true, false),
                    "int8" => (false, true),
                    _ => {
                        return Err(format!(
                            "precision {text:?}: mlp_gate={codes} is not `bf16`, `fp8` or `int8`"
                        ))
                    }
                };
                continue;
            }
            match item {
                "qkv" => groups.qkv = true,
                "out" => groups.out = true,
                "mlp_in" => {
                    groups.mlp_value = true;
                    groups.mlp_gate = true;
                    groups.mlp_gate_int8 = false;
                }
                "mlp_value" => groups.mlp_value = true,
                "mlp_gate" => {
                    groups.mlp_gate = true;
                    groups.mlp_gate_int8 = false;
                }
                "mlp_out" => groups.mlp_out = true,
                "adaln" => groups.adaln = Some(RowCodes::E4m3),
                "all" => {
                    groups = Fp8Groups {
                        adaln: groups.adaln,
                        ..Fp8Groups::ALL
                    }
                }
                "none" => {}
                other => {
                    return Err(format!(
                        "precision {text:?}: unknown group {other:?}; {usage}"
                    ))
                }
            }
        }
        if !named {
            groups = Fp8Layers::DEFAULT.groups;
        }
        groups.gemm_codes = gemm_codes;
        if gemm_codes == RowCodes::Int8 {
            // Every GEMM group is INT8 already: an INT8 gate is the gate group.
            if groups.mlp_gate_int8 {
                groups.mlp_gate = true;
                groups.mlp_gate_int8 = false;
            }
            if groups.mlp_in_split() {
                return Err(format!(
                    "precision {text:?}: gemm=int8 runs mlp_in whole or not at all (name mlp_in, or neither half): \
                     no kernel writes INT8 rows beside bf16 ones"
                ));
            }
        }
        if groups.mlp_gate_int8 && !(groups.mlp_value && groups.mlp_out) {
            return Err(format!(
                "precision {text:?}: mlp_gate=int8 needs mlp_value and mlp_out too (the gate's INT8 rows are written \
                 beside the value half's e4m3 rows, and its SwiGLU writes e4m3 rows for mlp_out)"
            ));
        }
        Ok(DitPrecision::Fp8(Fp8Layers {
            groups,
            bf16_ends: ends,
            accumulation,
            attention,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_precision_is_named_and_kept_inside_the_ends() {
        let p: DitPrecision = "fp8:attn=int8-fp8".parse().unwrap();
        let DitPrecision::Fp8(l) = p else {
            panic!("{p:?}")
        };
        assert_eq!(
            l.groups,
            Fp8Layers::DEFAULT.groups,
            "no group named: the default groups"
        );
        assert_eq!(l.attention, AttentionPrecision::Int8Fp8);
        assert_eq!(
            p.to_string(),
            "fp8:qkv,out,mlp_in,mlp_out,ends=1,attn=int8-fp8"
        );
        let layers = 4;
        let per_block: Vec<_> = (0..layers).map(|b| p.attention_of(b, layers)).collect();
        assert_eq!(
            per_block,
            [
                AttentionPrecision::Bf16,
                AttentionPrecision::Int8Fp8,
                AttentionPrecision::Int8Fp8,
                AttentionPrecision::Bf16
            ]
        );
        assert!(p.uses_8bit_attention(layers));
        assert!(!p.uses_8bit_attention(2), "both blocks of two are ends");
        assert!(p.describe(layers).contains("attention in 8 bits"));
        assert!(!DitPrecision::FP8.uses_8bit_attention(layers));
        assert!(!DitPrecision::Bf16.uses_8bit_attention(layers));
        assert_eq!(
            "fp8:all,attn=bf16".parse::<DitPrecision>(),
            "fp8:all".parse::<DitPrecision>()
        );
        let only_attention: DitPrecision = "fp8:none,ends=0,attn=int8-fp8".parse().unwrap();
        assert!(!only_attention.uses_fp8(layers));
        let text = only_attention.describe(layers);
        assert!(text.contains("(no GEMM group) in 4 of 4 blocks"), "{text}");
        let int8_adaln: DitPrecision = "fp8:qkv,adaln=int8,ends=1".parse().unwrap();
        let text = int8_adaln.describe(layers);
        assert!(
            text.contains(
                "fp8 e4m3 (qkv) and the adaLN projections weight-only in int8 in 2 of 4 blocks"
            ),
            "{text}"
        );
        let adaln_only: DitPrecision = "fp8:adaln,ends=0".parse().unwrap();
        assert!(adaln_only
            .describe(layers)
            .contains("(no GEMM group) and the adaLN projections weight-only in e4m3 in 4 of 4"));
        let err = "fp8:all,attn=fp16".parse::<DitPrecision>().unwrap_err();
        assert!(
            err.contains("attn=fp16") && err.contains("int8-fp8"),
            "{err}"
        );
    }

    #[test]
    fn specs_parse_and_print_back() {
        assert_eq!("bf16".parse::<DitPrecision>(), Ok(DitPrecision::Bf16));
        assert_eq!("fp8".parse::<DitPrecision>(), Ok(DitPrecision::FP8));
        assert_eq!(
            "fp8:qkv,mlp_in,ends=0".parse::<DitPrecision>(),
            Ok(DitPrecision::Fp8(Fp8Layers {
                groups: Fp8Groups {
                    qkv: true,
                    mlp_value: true,
                    mlp_gate: true,
                    ..Fp8Groups::NONE
                },
                bf16_ends: 0,
                accumulation: Fp8Accumulation::Fast,
                attention: AttentionPrecision::Bf16,
            }))
        );
        assert_eq!(
            "fp8:ends=3".parse::<DitPrecision>(),
            Ok(DitPrecision::Fp8(Fp8Layers {
                groups: Fp8Groups::ALL,
                bf16_ends: 3,
                accumulation: Fp8Accumulation::Fast,
                attention: AttentionPrecision::Bf16,
            }))
        );
        assert_eq!(
            "fp8:adaln,all".parse::<DitPrecision>(),
            "fp8:all,adaln".parse::<DitPrecision>()
        );
        assert_eq!(
            "fp8:all,adaln,ends=2".parse::<DitPrecision>(),
            Ok(DitPrecision::Fp8(Fp8Layers {
                groups: Fp8Groups {
                    adaln: Some(RowCodes::E4m3),
                    ..Fp8Groups::ALL
                },
                bf16_ends: 2,
                accumulation: Fp8Accumulation::Fast,
                attention: AttentionPrecision::Bf16,
            }))
        );
        for codes in [RowCodes::E4m3, RowCodes::Int8] {
            let adaln_only = Fp8Groups {
                adaln: Some(codes),
                ..Fp8Groups::NONE
            };
            assert!(!adaln_only.any_gemm());
            assert!(adaln_only.any());
        }
        let int8: DitPrecision = "fp8:qkv,adaln=int8,ends=1".parse().unwrap();
        assert_eq!(int8.groups_of(1, 4).adaln, Some(RowCodes::Int8));
        assert_eq!(
            int8.groups_of(0, 4).adaln,
            None,
            "the ends keep their adaLN in bf16"
        );
        assert_eq!(
            "fp8:adaln=fp8,all".parse::<DitPrecision>(),
            "fp8:all,adaln".parse::<DitPrecision>()
        );
        assert_eq!(
            "fp8:adaln,adaln=bf16,qkv".parse::<DitPrecision>(),
            "fp8:qkv".parse::<DitPrecision>(),
            "the last adaln item wins"
        );
        let refused = "fp8:adaln=int4".parse::<DitPrecision>().unwrap_err();
        assert!(refused.contains("adaln=int4"), "{refused}");
        for spec in [
            "bf16",
            "fp8:qkv,out,mlp_in,mlp_out,adaln,ends=1",
            "fp8:adaln,ends=0",
            "fp8:adaln=int8,ends=0",
            "fp8:qkv,out,mlp_value,mlp_out,adaln=int8,ends=1",
            "fp8:qkv,out,mlp_value,mlp_gate=int8,mlp_out,adaln=int8,ends=1",
            "fp8:qkv,out,mlp_in,mlp_out,ends=1",
            "fp8:out,ends=0",
            "fp8:none,ends=2",
            "fp8:qkv,out,mlp_out,ends=1,accum=exact",
            "fp8:qkv,out,mlp_value,mlp_out,ends=1",
            "fp8:mlp_gate,ends=0",
            "fp8:qkv,out,mlp_in,mlp_out,ends=1,attn=int8-fp8",
            "fp8:none,ends=0,attn=int8-fp8",
            "fp8:out,ends=2,accum=exact,attn=int8-fp8",
        ] {
            let p: DitPrecision = spec.parse().unwrap();
            assert_eq!(p.to_string(), spec);
            assert_eq!(p.to_string().parse::<DitPrecision>(), Ok(p));
        }
        assert_eq!(DitPrecision::FP8.to_string(), "fp8");
        assert_eq!(
            DitPrecision::FP8.resolve(Fp8Layers::DEFAULT).to_string(),
            "fp8:qkv,out,mlp_in,mlp_out,ends=1"
        );
        let keep_mlp_in = Fp8Layers {
            groups: Fp8Groups {
                mlp_value: false,
                mlp_gate: false,
                ..Fp8Groups::ALL
            },
            bf16_ends: 1,
            accumulation: Fp8Accumulation::Fast,
            attention: AttentionPrecision::Bf16,
        };
        assert_eq!(
            DitPrecision::FP8.resolve(keep_mlp_in).to_string(),
            "fp8:qkv,out,mlp_out,ends=1"
        );
        // Both halves named apart are `mlp_in`; one half alone splits the projection.
        let halves: DitPrecision = "fp8:mlp_value,mlp_gate,ends=0".parse().unwrap();
        assert_eq!(halves.to_string(), "fp8:mlp_in,ends=0");
        let value = "fp8:mlp_value".parse::<DitPrecision>().unwrap();
        let g = value.groups_of(1, 3);
        assert!(g.mlp_in_split() && !g.mlp_in() && g.any_gemm());
        assert!(!Fp8Groups::ALL.mlp_in_split() && Fp8Groups::ALL.mlp_in());
        // The gate half in INT8: a split projection whose gate is no FP8 group, beside the FP8 value and fc2.
        let int8_gate: DitPrecision = "fp8:mlp_value,mlp_gate=int8,mlp_out,ends=0"
            .parse()
            .unwrap();
        let g = int8_gate.groups_of(0, 2);
        assert!(g.mlp_gate_int8 && !g.mlp_gate && g.mlp_in_split() && !g.mlp_in() && g.any_gemm());
        assert_eq!(g.gemm_names(), ["mlp_value", "mlp_gate=int8", "mlp_out"]);
        assert!("fp8:mlp_value,mlp_gate=fp8,mlp_out"
            .parse::<DitPrecision>()
            .unwrap()
            .groups_of(1, 3)
            .mlp_in());
        let back = "fp8:mlp_value,mlp_gate=int8,mlp_gate,mlp_out"
            .parse::<DitPrecision>()
            .unwrap();
        assert!(
            !back.groups_of(1, 3).mlp_gate_int8,
            "a later `mlp_gate` names FP8 again"
        );
        for needs in [
            "fp8:mlp_gate=int8",
            "fp8:mlp_value,mlp_gate=int8",
            "fp8:mlp_gate=int8,mlp_out",
        ] {
            let err = needs.parse::<DitPrecision>().unwrap_err();
            assert!(
                err.contains("needs mlp_value and mlp_out"),
                "{needs}: {err}"
            );
        }
        let err = "fp8:mlp_gate=int4".parse::<DitPrecision>().unwrap_err();
        assert!(err.contains("mlp_gate=int4 is not"), "{err}");
        // An explicit spec is never replaced by a model's default.
        let explicit: DitPrecision = "fp8:all,ends=1".parse().unwrap();
        assert_eq!(explicit.resolve(keep_mlp_in), explicit);
        assert_eq!(DitPrecision::Bf16.resolve(keep_mlp_in), DitPrecision::Bf16);
        for bad in [
            "fp16",
            "fp8:",
            "fp8:qkv,attn",
            "fp8:ends=-1",
            "fp8:ends=x",
            "fp8:ends=99999999",
            "fp8:all,accum=slow",
        ] {
            let err = bad.parse::<DitPrecision>().unwrap_err();
            assert!(err.contains("precision"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_ends_stay_bf16() {
        let p = DitPrecision::FP8;
        let per_block: Vec<bool> = (0..5).map(|l| p.groups_of(l, 5).any()).collect();
        assert_eq!(per_block, [false, true, true, true, false]);
        assert!(p.uses_fp8(5));
        // Two blocks with one kept at each end: nothing runs in FP8, and the report says so.
        assert!(!p.uses_fp8(2));
        assert!(p.describe(2).starts_with("bf16 (fp8 asked for"));
        let all = DitPrecision::Fp8(Fp8Layers {
            groups: Fp8Groups::ALL,
            bf16_ends: 0,
            accumulation: Fp8Accumulation::Fast,
            attention: AttentionPrecision::Bf16,
        });
        assert!(all.uses_fp8(2));
        assert!(all.describe(32).contains("in 32 of 32 blocks"));
        assert!(all.describe(32).contains("fast accumulation"));
        assert_eq!(all.fp8_accumulation(), Fp8Accumulation::Fast);
        assert_eq!(
            "fp8:accum=fast"
                .parse::<DitPrecision>()
                .map(|p| p.fp8_accumulation()),
            Ok(Fp8Accumulation::Fast)
        );
        assert_eq!(DitPrecision::Bf16.groups_of(3, 5), Fp8Groups::NONE);
        assert_eq!(DitPrecision::Bf16.describe(32), "bf16");
        assert!(DitPrecision::FP8
            .describe(32)
            .contains("in 30 of 32 blocks"));
    }

    #[test]
    fn int8_gemm_codes_parse_print_back_and_fold_the_int8_gate() {
        let p: DitPrecision = "fp8:all,adaln=int8,gemm=int8".parse().unwrap();
        let DitPrecision::Fp8(l) = p else {
            panic!("{p:?}")
        };
        assert_eq!(l.groups.gemm_codes, RowCodes::Int8);
        assert!(l.groups.mlp_in());
        assert_eq!(
            p.to_string(),
            "fp8:qkv,out,mlp_in,mlp_out,adaln=int8,ends=1,gemm=int8"
        );
        assert_eq!(p.to_string().parse::<DitPrecision>(), Ok(p));
        assert!(p.describe(8).starts_with("int8 GEMMs"), "{}", p.describe(8));
        assert!(
            p.describe(8).contains("exact int32 accumulation"),
            "{}",
            p.describe(8)
        );
        let DitPrecision::Fp8(mut every) = p else {
            panic!("{p:?}")
        };
        every.bf16_ends = 0;
        let every = DitPrecision::Fp8(every).describe(8);
        assert!(
            every.contains("in 8 of 8 blocks (no block kept in bf16)"),
            "{every}"
        );
        // In INT8 every group is INT8 already: an INT8 gate is the gate group, so mlp_in runs whole.
        let folded: DitPrecision = "fp8:qkv,out,mlp_value,mlp_gate=int8,mlp_out,gemm=int8"
            .parse()
            .unwrap();
        assert_eq!(folded, p_without_adaln(p));
        // No group named: the default groups, in INT8.
        let DitPrecision::Fp8(bare) = "fp8:gemm=int8".parse::<DitPrecision>().unwrap() else {
            panic!("not fp8")
        };
        assert_eq!(
            bare.groups,
            Fp8Groups {
                gemm_codes: RowCodes::Int8,
                ..Fp8Layers::DEFAULT.groups
            }
        );
        assert_eq!(
            "fp8:all,gemm=e4m3".parse::<DitPrecision>(),
            "fp8:all".parse::<DitPrecision>()
        );
        for (spec, needle) in [
            ("fp8:mlp_value,mlp_out,gemm=int8", "mlp_in whole"),
            ("fp8:all,gemm=int4", "gemm=int4 is neither"),
        ] {
            let err = spec.parse::<DitPrecision>().unwrap_err();
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }

    fn p_without_adaln(p: DitPrecision) -> DitPrecision {
        match p {
            DitPrecision::Fp8(mut l) => {
                l.groups.adaln = None;
                DitPrecision::Fp8(l)
            }
            other => other,
        }
    }
}
