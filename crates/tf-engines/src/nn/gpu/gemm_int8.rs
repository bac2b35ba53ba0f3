//! Our INT8 GEMM with a scaling epilogue (kernel set `nn_gemm_int8`, sm_90a only):
//! `y[m, n] = bf16(f32(x[m, :] . w[n, :]) * (x_scale[m] * w_scale[n]))`, with INT8 `x` (`[M, K]`, one f32 scale a row)
//! and `w` (`[N, K]`, one f32 scale an output channel), exact int32 sums and bf16 output.
//!
//! cuBLASLt 13.1 runs INT8 GEMMs on sm_90 only into int32 (no scaled form with bf16 output), which costs a round
//! trip of 4 bytes an element through memory; this kernel writes the 2-byte result the row-wise FP8 GEMM would.
//! Its layout and pipeline are described in `kernels/nn/gemm_int8.cu`; its CTAs are persistent (one an SM).
//! [`plan_int8_gemm`] checks every operand and packs one launch; [`Int8GemmKernels`] loads the set and submits it.
//! Both DiTs' default 8-bit modes (`gemm=int8`) run every block GEMM group on it: on an H100 it takes 0.88-0.97 of
//! cuBLASLt's row-wise FP8 GEMM's time at every DiT shape (docs/RESULTS.md). The set also holds the same pipeline over
//! bf16 operands ([`plan_bf16_gemm`], `TF_BF16_GEMM=ours`), which is not faster than cuBLASLt inside a step. The
//! plain and SwiGLU kernels have a second form that stores its tiles through shared memory and the TMA unit
//! ([`GemmStore`], `TF_GEMM_STORE=tma`; the same outputs).
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, x: &tf_cuda::DeviceView<'_>,
//! #         xs: &tf_cuda::DeviceView<'_>, w: &tf_cuda::DeviceView<'_>, ws: &tf_cuda::DeviceView<'_>,
//! #         y: &mut tf_cuda::DeviceViewMut<'_>) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_engines::nn::gpu::gemm_int8::{Int8GemmKernels, Int8GemmOperands, Int8GemmShape};
//! let kernels = Int8GemmKernels::load(ctx)?; // refuses a GPU that is not sm_90
//! let shape = Int8GemmShape { m: 6026, n: 21504, k: 5376 };
//! let inputs = Int8GemmOperands { x, x_scale: xs, w, w_scale: ws };
//! kernels.gemm(ctx, stream, shape, &inputs, y, shape.n)?; // y: bf16 rows of N
//! # Ok(()) }
//! ```

use std::fmt;

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::tensor_map::{encode_bf16_tiles, encode_int8_tiles, TensorMap, Tiles};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use super::act::SwigluOrder;
use super::attention::HEAD_DIM;
use super::conv::ConvTile;
use super::launch::{
    bytes_of, check_eps, check_operand, invalid, require_sm90, to_i32, to_i64, to_u32, Launch,
    LoadKernelsError, LoadedSet, Matrix, Operand,
};
use super::rope::{check_interleaved_tables, QkvInputs, QkvOutputs};

/// Name of the kernel set.
pub const GEMM_INT8_SET: &str = "nn_gemm_int8";
/// The set's kernels: the INT8 GEMM, the same pipeline over bf16 operands ([`plan_bf16_gemm`]), the INT8 GEMM of a
/// SwiGLU's two halves with the SwiGLU in its epilogue ([`plan_int8_swiglu_gemm`]), and the INT8 GEMM of a fused
/// q|k|v projection with the QK norm and RoPE in its epilogue ([`plan_int8_qkv_gemm`]), and the implicit-GEMM 3x3
/// convolutions ([`super::conv`]) over tiles of 128 x 144, 128 x 256 and 256 x 144 (pixels x channels).
pub const GEMM_INT8_KERNELS: &[&str] = &[
    "nn_gemm_int8_scaled_bf16",
    "nn_gemm_bf16",
    "nn_gemm_int8_swiglu_bf16",
    "nn_gemm_int8_qkv_bf16",
    "nn_gemm_int8_qkv_half_bf16",
    "nn_conv3x3_bf16_n144",
    "nn_conv3x3_bf16_n256",
    "nn_conv3x3_bf16_m256_n144",
    "nn_conv3x3_bf16_rows_n144",
    "nn_gemm_bf16_swiglu",
    "nn_gemm_bf16_qkv",
    "nn_gemm_bf16_qkv_half",
    "nn_gemm_int8_scaled_bf16_tma",
    "nn_gemm_bf16_tma",
    "nn_gemm_int8_swiglu_bf16_tma",
    "nn_gemm_bf16_swiglu_tma",
];

/// The TMA-store forms ([`GemmStore::Tma`]) of the INT8 GEMM, the bf16 GEMM, and the INT8 and bf16 SwiGLU GEMMs.
const TMA_STORE_KERNELS: [&str; 4] = [
    GEMM_INT8_KERNELS[12],
    GEMM_INT8_KERNELS[13],
    GEMM_INT8_KERNELS[14],
    GEMM_INT8_KERNELS[15],
];

/// The bf16 forms of the epilogue kernels ([`EpilogueOperands::Bf16`]): SwiGLU, q|k|v with interleaved RoPE,
/// q|k|v with rotate-half RoPE.
const BF16_EPILOGUE_KERNELS: [&str; 3] = [
    GEMM_INT8_KERNELS[9],
    GEMM_INT8_KERNELS[10],
    GEMM_INT8_KERNELS[11],
];
/// Hidden columns one SwiGLU tile stores (its 256 weight rows are 128 gate and 128 value rows).
pub const SWIGLU_TILE_COLS: usize = TILE_COLS / 2;
/// Rows of `y` one CTA computes.
pub const TILE_ROWS: usize = 128;
/// Columns of `y` one CTA computes (a partial last tile reads zeros past N and stores nothing there).
pub const TILE_COLS: usize = 256;
/// Bytes of K one pipeline stage holds (a partial last slice reads zeros past K).
pub const K_SLICE: usize = 128;
/// K must be a multiple: the tensor maps' rows are 16-byte aligned (16 INT8 codes; 8 bf16 for [`plan_bf16_gemm`]).
pub const K_ALIGN: usize = 16;
/// K of a bf16 GEMM must be a multiple (16-byte rows).
pub const K_ALIGN_BF16: usize = 8;
const STAGES: usize = 4;
const THREADS: u32 = 384;
/// Dynamic shared memory: the stages' x and w tiles, and 1 KiB to align them to 1024 bytes.
pub const SHARED_BYTES: u32 = (STAGES * (TILE_ROWS + TILE_COLS) * K_SLICE + 1024) as u32;
// 227 KiB is the most one block may opt in to on sm_90.
const _: () = assert!(SHARED_BYTES <= 227 * 1024);
/// Dynamic shared memory of the [`GemmStore::Tma`] kernels: [`SHARED_BYTES`] and a staging area of two boxes of 64
/// rows x 64 bf16 columns for each of the two consumer warpgroups.
pub const SHARED_BYTES_TMA: u32 = SHARED_BYTES + (2 * 64 * 128 * 2) as u32;
// With the kernels' 64 bytes of barriers, still within the 227 KiB.
const _: () = assert!(SHARED_BYTES_TMA + 64 <= 227 * 1024);

/// The environment variable that picks how the plain and SwiGLU GEMMs of this set store their tiles
/// ([`GemmStore`]): `direct` (the default) or `tma`.
pub const STORE_ENV: &str = "TF_GEMM_STORE";

/// How a GEMM of this set stores its output tiles. The values stored are the same either way (bit-equal outputs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmStore {
    /// Each consumer thread stores its 16-byte blocks of `y` itself, after a shuffle within each quad of lanes.
    #[default]
    Direct,
    /// Each consumer warpgroup writes its 64 rows in boxes of 64 columns into two staging boxes of shared memory
    /// (used in turn, 128-byte swizzle) and one thread hands each box to the TMA unit (`y` through a tensor map),
    /// so the warpgroups go on to the next box and the next tile's MMAs while the copy engine writes `y`. Needs `y`'s row stride a multiple of 8 (else the
    /// direct form runs). The plain and SwiGLU GEMMs only; the q|k|v GEMMs store directly.
    Tma,
}

impl GemmStore {
    /// Parses a [`STORE_ENV`] value (empty: the default).
    pub fn parse(value: &str) -> Result<GemmStore, String> {
        match value {
            "" | "direct" => Ok(GemmStore::Direct),
            "tma" => Ok(GemmStore::Tma),
            other => Err(format!(
                "{STORE_ENV}={other:?} is not a store form: use `direct` or `tma`"
            )),
        }
    }

    /// The form [`STORE_ENV`] asks for (the default when it is unset).
    pub fn from_env() -> Result<GemmStore, String> {
        GemmStore::parse(&std::env::var(STORE_ENV).unwrap_or_default())
    }

    /// [`GemmStore::from_env`], read once a process (every launch a planner packs asks), as a planner's error for
    /// `op`.
    fn from_env_for(op: &'static str) -> Result<GemmStore, tf_cuda::Error> {
        static ASKED: std::sync::OnceLock<Result<GemmStore, String>> = std::sync::OnceLock::new();
        ASKED
            .get_or_init(GemmStore::from_env)
            .clone()
            .map_err(|message| invalid(op, message))
    }

    /// The form a GEMM writing rows of `y_row_stride` elements takes: TMA needs 16-byte row strides.
    fn for_stride(self, y_row_stride: usize) -> GemmStore {
        if y_row_stride.is_multiple_of(8) {
            self
        } else {
            GemmStore::Direct
        }
    }
}

/// The map a [`GemmStore::Tma`] kernel writes `y` through: bf16 rows of `y_row_stride` elements (a multiple of 8), `cols`
/// of them stored in each of `m` rows, boxes of 64 columns by 64 rows (one staging box).
fn output_tiles(y_addr: u64, m: usize, cols: usize, y_row_stride: usize) -> Tiles {
    Tiles {
        base: y_addr,
        cols: cols as u64,
        rows: m as u64,
        batch: 1,
        row_stride_bytes: (y_row_stride * 2) as u64,
        batch_stride_bytes: 0,
        box_cols: 64,
        box_rows: 64,
    }
}

/// The environment variable that picks the INT8 GEMM the INT8 gate half of an e4m3 mode (`mlp_gate=int8`) runs:
/// `cublaslt` (the default: cuBLASLt's INT8 GEMM into int32 products, which the SwiGLU dequantizes) or `ours`
/// ([`Int8GemmKernels`], sm_90 only: scaled bf16 products, read by the bf16-gate SwiGLU). `gemm=int8` modes always
/// run ours.
pub const BACKEND_ENV: &str = "TF_INT8_GEMM";

/// The environment variable that picks the GEMM the DiTs' bf16 block GEMMs (no bias, weights in the model's
/// buffer) run: `cublaslt` (the default) or `ours` (this set's bf16 kernel, [`plan_bf16_gemm`]; sm_90 only).
pub const BF16_BACKEND_ENV: &str = "TF_BF16_GEMM";

/// The environment variable that places a DiT's SwiGLU where the block's MLP runs in INT8: `fused` (the default: in
/// the gate|up GEMM's epilogue, [`plan_int8_swiglu_gemm`]; the GEMM writes the activation and a row pass quantizes it)
/// or `apart` (the GEMM writes both halves and the SwiGLU kernel reads them).
pub const SWIGLU_ENV: &str = "TF_SWIGLU_GEMM";

/// The environment variable that places a DiT's per-head QK norm and RoPE where its q|k|v GEMM runs in INT8: `fused`
/// (the default: in that GEMM's epilogue, [`plan_int8_qkv_gemm`], which writes normed, rotated q and k and the
/// values where the attention reads them) or `apart` (the GEMM writes q|k|v, a row pass norms and rotates).
pub const QKV_ENV: &str = "TF_QKV_GEMM";

/// Whether a DiT `width` wide (heads of 128) runs the fused q|k|v epilogue: [`QKV_ENV`] does not ask for the passes
/// apart, our INT8 GEMM is `loaded` and `width` is a whole number of tiles.
pub fn qkv_fused_for(loaded: Option<&Int8GemmKernels>, width: usize) -> Result<bool, String> {
    let asked = match std::env::var(QKV_ENV).unwrap_or_default().as_str() {
        "" | "fused" => true,
        "apart" => false,
        other => {
            return Err(format!(
                "{QKV_ENV}={other:?} is not a QK norm placement: use `fused` or `apart`"
            ))
        }
    };
    Ok(asked && loaded.is_some() && width > 0 && width.is_multiple_of(TILE_COLS))
}

/// Whether a DiT whose MLP is `hidden` wide runs the fused SwiGLU: [`SWIGLU_ENV`] does not ask for it apart, our INT8
/// GEMM is `loaded` (its INT8 MLP groups run on it) and `hidden` is a whole number of SwiGLU tiles.
pub fn swiglu_fused_for(loaded: Option<&Int8GemmKernels>, hidden: usize) -> Result<bool, String> {
    let asked = match std::env::var(SWIGLU_ENV).unwrap_or_default().as_str() {
        "" | "fused" => true,
        "apart" => false,
        other => {
            return Err(format!(
                "{SWIGLU_ENV}={other:?} is not a SwiGLU placement: use `apart` or `fused`"
            ))
        }
    };
    Ok(asked && loaded.is_some() && hidden.is_multiple_of(SWIGLU_TILE_COLS))
}

/// The environment variable that sets the order the GEMMs of this set take their output tiles in ([`TileBand`]):
/// `off` (one band, plain M-fastest order), `auto` or a number of M tiles a band. Unset, each GEMM takes
/// [`TileBand::default_for`] its operands: `auto` for bf16 (MiniMax H3's bf16 step on our GEMM 490 -> 478 ms on the
/// H200), `off` for INT8 (the `fp8` defaults within 0.5% either way: H3 faster, Qwen-Image slower; docs/RESULTS.md).
pub const BAND_ENV: &str = "TF_GEMM_BAND";

/// Bytes of `x` up to which [`TileBand::Auto`] keeps one band: the whole of `x` then stays in L2 (50 MB on the
/// H100 and H200) while the tiles in flight sweep `w`'s columns.
pub const ONE_BAND_X_BYTES: usize = 32 << 20;

/// How the tiles of one GEMM are ordered: M-fastest within bands of M tiles (`tile_origin` in
/// `kernels/nn/gemm_int8.cu`). In plain M-fastest order every wave of CTAs reads all of `x`; once `x` outgrows L2
/// that is a read of `x` from memory each wave (H3's bf16 GEMMs: 62-165 MiB of `x`, 8-31 waves). In a band the
/// CTAs in flight share the rows of `x` of a few M tiles and the columns of `w` of a few N tiles, so both come from
/// L2 for most of the band. The products are the same in any order (each tile is computed alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileBand {
    /// One band while `x` fits in [`ONE_BAND_X_BYTES`]; else bands of about `sqrt(2 SMs)` M tiles, where the tiles
    /// in flight (one an SM) cover twice as many M tiles of 128 rows as N tiles of 256 columns, balanced.
    Auto,
    /// One band: plain M-fastest order.
    Off,
    /// Bands of at most this many M tiles (spread evenly: as few bands as that allows, each `ceil(M tiles /
    /// bands)` tiles but the last).
    Tiles(usize),
}

impl TileBand {
    /// The order a GEMM over operands of `elem_bytes` takes when [`BAND_ENV`] is unset: bands (`auto`) for bf16,
    /// one band for INT8, as measured (see [`BAND_ENV`]).
    pub fn default_for(elem_bytes: usize) -> TileBand {
        if elem_bytes >= 2 {
            TileBand::Auto
        } else {
            TileBand::Off
        }
    }

    /// Parses a [`BAND_ENV`] value (empty: `None`, each GEMM's [`TileBand::default_for`]).
    pub fn parse(value: &str) -> Result<Option<TileBand>, String> {
        match value {
            "" => Ok(None),
            "auto" => Ok(Some(TileBand::Auto)),
            "off" => Ok(Some(TileBand::Off)),
            other => match other.parse::<usize>() {
                Ok(tiles) if tiles > 0 => Ok(Some(TileBand::Tiles(tiles))),
                _ => Err(format!(
                    "{BAND_ENV}={other:?} is not a tile order: use `auto`, `off` or a positive number of M tiles"
                )),
            },
        }
    }

    /// The order [`BAND_ENV`] asks for (the default when it is unset).
    pub fn from_env() -> Result<Option<TileBand>, String> {
        TileBand::parse(&std::env::var(BAND_ENV).unwrap_or_default())
    }

    /// [`TileBand::from_env`], read once a process (every GEMM launch a planner packs asks), as a launch planner's
    /// error for `op`.
    fn from_env_for(op: &'static str) -> Result<Option<TileBand>, tf_cuda::Error> {
        static ASKED: std::sync::OnceLock<Result<Option<TileBand>, String>> =
            std::sync::OnceLock::new();
        ASKED
            .get_or_init(TileBand::from_env)
            .clone()
            .map_err(|message| invalid(op, message))
    }
}

/// Which INT8 GEMM runs ([`BACKEND_ENV`]), or which bf16 GEMM ([`BF16_BACKEND_ENV`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Int8GemmBackend {
    #[default]
    Cublaslt,
    Ours,
}

impl Int8GemmBackend {
    /// Parses a [`BACKEND_ENV`] value (empty: the default).
    pub fn parse(value: &str) -> Result<Int8GemmBackend, String> {
        Int8GemmBackend::parse_for(BACKEND_ENV, value)
    }

    fn parse_for(var: &str, value: &str) -> Result<Int8GemmBackend, String> {
        match value {
            "" | "cublaslt" => Ok(Int8GemmBackend::Cublaslt),
            "ours" => Ok(Int8GemmBackend::Ours),
            other => Err(format!(
                "{var}={other:?} is not a GEMM backend: use `cublaslt` or `ours`"
            )),
        }
    }

    /// The backend [`BACKEND_ENV`] asks for (the default when it is unset).
    pub fn from_env() -> Result<Int8GemmBackend, String> {
        Int8GemmBackend::parse(&std::env::var(BACKEND_ENV).unwrap_or_default())
    }

    /// The backend [`BF16_BACKEND_ENV`] asks for the DiTs' bf16 block GEMMs (the default when it is unset).
    pub fn bf16_from_env() -> Result<Int8GemmBackend, String> {
        Int8GemmBackend::parse_for(
            BF16_BACKEND_ENV,
            &std::env::var(BF16_BACKEND_ENV).unwrap_or_default(),
        )
    }
}

/// The GEMM's sizes: `y` is `m` x `n`, the sums run over `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Int8GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Int8GemmShape {
    /// Refuses a shape the INT8 kernel does not tile, naming the rule.
    pub fn check(&self) -> Result<(), tf_cuda::Error> {
        self.check_aligned("INT8 GEMM", K_ALIGN)
    }

    /// Refuses a shape the bf16 kernel does not tile ([`plan_bf16_gemm`]), naming the rule.
    pub fn check_bf16(&self) -> Result<(), tf_cuda::Error> {
        self.check_aligned("bf16 GEMM", K_ALIGN_BF16)
    }

    fn check_aligned(&self, op: &'static str, k_align: usize) -> Result<(), tf_cuda::Error> {
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return Err(invalid(op, format!("empty GEMM {self:?}")));
        }
        if !self.n.is_multiple_of(2) {
            return Err(invalid(
                op,
                format!(
                    "N = {} is odd: the kernel stores pairs of columns; use cuBLASLt",
                    self.n
                ),
            ));
        }
        if !self.k.is_multiple_of(k_align) {
            return Err(invalid(
                op,
                format!(
                    "K = {} is not a multiple of {k_align} (the tensor maps' rows are 16-byte aligned); use cuBLASLt",
                    self.k
                ),
            ));
        }
        Ok(())
    }

    /// Output tiles: (M tiles, N tiles).
    pub fn tiles(&self) -> (usize, usize) {
        (self.m.div_ceil(TILE_ROWS), self.n.div_ceil(TILE_COLS))
    }

    /// The M tiles of one band of the tile order ([`TileBand`]) for `x` of `elem_bytes` an element on `sm_count`
    /// SMs; the kernel's `band` argument. `m_tiles` (one band) unless `band` splits M; then as few bands as its
    /// largest band allows, of `ceil(M tiles / bands)` tiles each but the last (so the last is never a sliver: it
    /// is short by fewer M tiles than there are bands).
    pub fn band_tiles(&self, elem_bytes: usize, sm_count: usize, band: TileBand) -> usize {
        let (m_tiles, _) = self.tiles();
        let most = match band {
            TileBand::Off => return m_tiles,
            TileBand::Tiles(tiles) => tiles,
            TileBand::Auto => {
                let x_bytes = self.m.saturating_mul(self.k).saturating_mul(elem_bytes);
                if x_bytes <= ONE_BAND_X_BYTES {
                    return m_tiles;
                }
                // a x b tiles in flight with a b = SMs and 128 a = 256 b: a = sqrt(2 SMs).
                sm_count.max(1).saturating_mul(2).isqrt()
            }
        };
        let most = most.clamp(1, m_tiles.max(1));
        let bands = m_tiles.div_ceil(most);
        m_tiles.div_ceil(bands.max(1))
    }

    /// [`Int8GemmShape::band_tiles`] as the kernel's `int` argument, with the order [`BAND_ENV`] asks for.
    fn band_arg(
        &self,
        op: &'static str,
        elem_bytes: usize,
        sm_count: usize,
    ) -> Result<i32, tf_cuda::Error> {
        let band = TileBand::from_env_for(op)?.unwrap_or(TileBand::default_for(elem_bytes));
        to_i32(op, "band", self.band_tiles(elem_bytes, sm_count, band))
    }

    /// The persistent launch grid on `sm_count` SMs: one CTA an SM, never more CTAs than tiles.
    pub fn grid(&self, sm_count: usize) -> Result<u32, tf_cuda::Error> {
        // Shared by the INT8 and bf16 GEMMs, which tile alike.
        const OP: &str = "GEMM (128 x 256 tiles)";
        let (m_tiles, n_tiles) = self.tiles();
        let tiles = m_tiles
            .checked_mul(n_tiles)
            .ok_or_else(|| invalid(OP, "tile count overflows"))?;
        // The kernel counts tiles in a 32-bit int.
        to_i32(OP, "tiles", tiles)?;
        to_u32(OP, "CTAs", tiles.min(sm_count.max(1)))
    }
}

/// The operands of one call: `x` INT8 `[m, k]` dense, `x_scale` f32 `[m]`, `w` INT8 `[n, k]` dense, `w_scale` f32
/// `[n]`; `y` bf16 rows of `y_row_stride` elements.
pub struct Int8GemmOperands<'v, 'a> {
    pub x: &'v DeviceView<'a>,
    pub x_scale: &'v DeviceView<'a>,
    pub w: &'v DeviceView<'a>,
    pub w_scale: &'v DeviceView<'a>,
}

/// The operands of an epilogue GEMM ([`plan_int8_swiglu_gemm`], [`plan_int8_qkv_gemm`]): INT8 codes with their
/// scales, or bf16 `x` (`[m, k]`) and `w` (`[n, k]`), both dense, whose f32 sums are rounded to bf16 as
/// [`plan_bf16_gemm`] stores them before the epilogue's arithmetic (no scales).
#[derive(Clone, Copy)]
pub enum EpilogueOperands<'v, 'a> {
    Int8(&'v Int8GemmOperands<'v, 'a>),
    Bf16 {
        x: &'v DeviceView<'a>,
        w: &'v DeviceView<'a>,
    },
}

impl<'v, 'a> From<&'v Int8GemmOperands<'v, 'a>> for EpilogueOperands<'v, 'a> {
    fn from(inputs: &'v Int8GemmOperands<'v, 'a>) -> Self {
        EpilogueOperands::Int8(inputs)
    }
}

impl EpilogueOperands<'_, '_> {
    /// Bytes an element of `x` and `w`.
    fn elem_bytes(&self) -> usize {
        match self {
            EpilogueOperands::Int8(_) => 1,
            EpilogueOperands::Bf16 { .. } => 2,
        }
    }

    /// Refuses a shape this operand kind's kernel does not tile.
    fn check_shape(&self, shape: Int8GemmShape) -> Result<(), tf_cuda::Error> {
        match self {
            EpilogueOperands::Int8(_) => shape.check(),
            EpilogueOperands::Bf16 { .. } => shape.check_bf16(),
        }
    }

    /// Checks `x` (`[m, k]`), `w` (`[n, k]`) and, for INT8, their scales (`[m]`, `[n]` f32), each `align`-byte
    /// aligned; `x` and `w` 16-byte aligned in any case (the tensor maps).
    fn check(
        &self,
        op: &str,
        (m, n, k): (usize, usize, usize),
        align: u64,
    ) -> Result<(), tf_cuda::Error> {
        let e = self.elem_bytes();
        let (x, w) = self.views();
        let mut operands = vec![
            ("x", x, bytes_of(op, "x", &[m, k, e])?),
            ("w", w, bytes_of(op, "w", &[n, k, e])?),
        ];
        if let EpilogueOperands::Int8(inputs) = self {
            operands.push(("x_scale", inputs.x_scale, bytes_of(op, "x_scale", &[m, 4])?));
            operands.push(("w_scale", inputs.w_scale, bytes_of(op, "w_scale", &[n, 4])?));
        }
        for (name, view, needed) in operands {
            check_operand(op, name, Operand::of(view), needed, align)?;
        }
        for (name, view) in [("x", x), ("w", w)] {
            check_operand(op, name, Operand::of(view), 0, 16)?;
        }
        Ok(())
    }

    fn views(&self) -> (&DeviceView<'_>, &DeviceView<'_>) {
        match self {
            EpilogueOperands::Int8(inputs) => (inputs.x, inputs.w),
            EpilogueOperands::Bf16 { x, w } => (x, w),
        }
    }

    /// Pushes the kernel's first four arguments: the maps of `x` (`m` rows in boxes of 128) and `w` (`w_rows` rows
    /// in boxes of `w_box_rows`), then the scales' addresses (null for bf16, which the kernels do not read).
    fn push_maps_and_scales(
        &self,
        ctx: &Context,
        args: &mut Args,
        shape: Int8GemmShape,
        (w_rows, w_box_rows): (usize, usize),
        tm_y: Option<TensorMap>,
    ) -> Result<(), tf_cuda::Error> {
        let e = self.elem_bytes();
        let (x, w) = self.views();
        let x_tiles = operand_tiles(x.addr(), shape, e, shape.m, TILE_ROWS);
        let w_tiles = operand_tiles(w.addr(), shape, e, w_rows, w_box_rows);
        let (tm_x, tm_w) = match self {
            EpilogueOperands::Int8(_) => (
                encode_int8_tiles(ctx, &x_tiles)?,
                encode_int8_tiles(ctx, &w_tiles)?,
            ),
            EpilogueOperands::Bf16 { .. } => (
                encode_bf16_tiles(ctx, &x_tiles)?,
                encode_bf16_tiles(ctx, &w_tiles)?,
            ),
        };
        args.push(tm_x.words()).push(tm_w.words());
        if let Some(tm_y) = tm_y {
            args.push(tm_y.words());
        }
        match self {
            EpilogueOperands::Int8(inputs) => args
                .push_addr(inputs.x_scale.addr())
                .push_addr(inputs.w_scale.addr()),
            EpilogueOperands::Bf16 { .. } => args.push_addr(0).push_addr(0),
        };
        Ok(())
    }

    /// `int8` or, for bf16 operands, the bf16 form of the same epilogue kernel (`bf16_index` into
    /// [`BF16_EPILOGUE_KERNELS`]).
    fn kernel(&self, int8: &'static str, bf16_index: usize) -> &'static str {
        match self {
            EpilogueOperands::Int8(_) => int8,
            EpilogueOperands::Bf16 { .. } => BF16_EPILOGUE_KERNELS[bf16_index],
        }
    }
}

/// Checks `shape` and every operand and packs the launch for a GPU of `sm_count` SMs (its tensor maps encoded
/// through `ctx`'s driver), in the store form [`STORE_ENV`] names.
pub fn plan_int8_gemm<'a>(
    ctx: &Context,
    sm_count: usize,
    shape: Int8GemmShape,
    inputs: &Int8GemmOperands<'_, 'a>,
    y: &'a mut DeviceViewMut<'_>,
    y_row_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    let store = GemmStore::from_env_for("INT8 GEMM")?;
    plan_int8_gemm_stored(ctx, sm_count, shape, inputs, y, y_row_stride, store)
}

/// [`plan_int8_gemm`] with the store form given instead of read from [`STORE_ENV`].
pub fn plan_int8_gemm_stored<'a>(
    ctx: &Context,
    sm_count: usize,
    shape: Int8GemmShape,
    inputs: &Int8GemmOperands<'_, 'a>,
    y: &'a mut DeviceViewMut<'_>,
    y_row_stride: usize,
    store: GemmStore,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "INT8 GEMM";
    shape.check()?;
    let Int8GemmShape { m, n, k } = shape;
    for (name, view, needed) in [
        ("x", inputs.x, bytes_of(OP, "x", &[m, k])?),
        ("w", inputs.w, bytes_of(OP, "w", &[n, k])?),
        ("x_scale", inputs.x_scale, bytes_of(OP, "x_scale", &[m, 4])?),
        ("w_scale", inputs.w_scale, bytes_of(OP, "w_scale", &[n, 4])?),
    ] {
        check_operand(OP, name, Operand::of(view), needed, 16)?;
    }
    check_y(OP, shape, Operand::of_mut(y), y_row_stride)?;
    let tm_x = encode_int8_tiles(ctx, &operand_tiles(inputs.x.addr(), shape, 1, m, TILE_ROWS))?;
    let tm_w = encode_int8_tiles(ctx, &operand_tiles(inputs.w.addr(), shape, 1, n, TILE_COLS))?;
    let store = store.for_stride(y_row_stride);
    let mut args = Args::new();
    args.push(tm_x.words()).push(tm_w.words());
    if store == GemmStore::Tma {
        args.push(encode_bf16_tiles(ctx, &output_tiles(y.addr(), m, n, y_row_stride))?.words());
    }
    args.push_addr(inputs.x_scale.addr())
        .push_addr(inputs.w_scale.addr());
    push_output(&mut args, OP, shape, y.addr(), y_row_stride)?;
    args.push(shape.band_arg(OP, 1, sm_count)?);
    let (kernel, shared) = match store {
        GemmStore::Direct => (GEMM_INT8_KERNELS[0], SHARED_BYTES),
        GemmStore::Tma => (TMA_STORE_KERNELS[0], SHARED_BYTES_TMA),
    };
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(shape.grid(sm_count)?, THREADS).with_shared(shared),
        args,
    ))
}

/// The INT8 GEMM of a SwiGLU's two halves with the SwiGLU in its epilogue (kernel `nn_gemm_int8_swiglu_bf16`):
/// `y[m, c] = bf16(silu(g) * v)`, `g` and `v` the bf16 products [`plan_int8_gemm`] would store for weight rows
/// `c` of the gate half and of the value half. `inputs.w` is one INT8 weight `[2 hidden, K]` holding both halves in
/// `order` (`w_scale` `[2 hidden]`); `y` bf16 rows of `y_row_stride` (a multiple of 8) elements, `hidden` of them
/// written. `hidden` must be a multiple of 128 and K of 16. This writes `hidden` columns where the plain GEMM
/// writes `2 hidden`, and a row quantizer then reads those instead of a SwiGLU pass reading both halves.
///
/// With [`EpilogueOperands::Bf16`] the bf16 kernel runs (`nn_gemm_bf16_swiglu`): K a multiple of 8, the products
/// rounded to bf16 as [`plan_bf16_gemm`] stores them, then nn_act's SwiGLU arithmetic.
pub fn plan_int8_swiglu_gemm<'a>(
    ctx: &Context,
    sm_count: usize,
    (m, hidden, k): (usize, usize, usize),
    order: SwigluOrder,
    inputs: EpilogueOperands<'_, 'a>,
    y: &'a mut DeviceViewMut<'_>,
    y_row_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    let store = GemmStore::from_env_for("SwiGLU GEMM")?;
    plan_int8_swiglu_gemm_stored(
        ctx,
        sm_count,
        (m, hidden, k),
        order,
        inputs,
        y,
        (y_row_stride, store),
    )
}

/// [`plan_int8_swiglu_gemm`] with the store form given instead of read from [`STORE_ENV`].
pub fn plan_int8_swiglu_gemm_stored<'a>(
    ctx: &Context,
    sm_count: usize,
    (m, hidden, k): (usize, usize, usize),
    order: SwigluOrder,
    inputs: EpilogueOperands<'_, 'a>,
    y: &'a mut DeviceViewMut<'_>,
    (y_row_stride, store): (usize, GemmStore),
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "SwiGLU GEMM";
    if hidden == 0 || !hidden.is_multiple_of(SWIGLU_TILE_COLS) {
        return Err(invalid(
            OP,
            format!("hidden width {hidden} is not a positive multiple of {SWIGLU_TILE_COLS}; run the GEMM and SwiGLU apart"),
        ));
    }
    if !y_row_stride.is_multiple_of(8) {
        return Err(invalid(
            OP,
            format!("y row stride {y_row_stride} is not a multiple of 8 (16-byte stores)"),
        ));
    }
    // The whole weight as the GEMM it is: N = 2 hidden rows, 256 of them (128 a half) a tile.
    let both = Int8GemmShape {
        m,
        n: hidden
            .checked_mul(2)
            .ok_or_else(|| invalid(OP, "2 x hidden overflows"))?,
        k,
    };
    inputs.check_shape(both)?;
    inputs.check(OP, (m, both.n, k), 16)?;
    let out = Int8GemmShape { m, n: hidden, k };
    check_y(OP, out, Operand::of_mut(y), y_row_stride)?;
    let (gate_base, value_base) = match order {
        SwigluOrder::GateValue => (0, hidden),
        SwigluOrder::ValueGate => (hidden, 0),
    };
    let tm_y = match store {
        GemmStore::Direct => None,
        GemmStore::Tma => Some(encode_bf16_tiles(
            ctx,
            &output_tiles(y.addr(), m, hidden, y_row_stride),
        )?),
    };
    let mut args = Args::new();
    inputs.push_maps_and_scales(ctx, &mut args, both, (both.n, SWIGLU_TILE_COLS), tm_y)?;
    push_output(&mut args, OP, out, y.addr(), y_row_stride)?;
    args.push(to_i32(OP, "gate base", gate_base)?)
        .push(to_i32(OP, "value base", value_base)?)
        .push(out.band_arg(OP, inputs.elem_bytes(), sm_count)?);
    let (kernel, shared) = match (store, &inputs) {
        (GemmStore::Direct, _) => (inputs.kernel(GEMM_INT8_KERNELS[2], 0), SHARED_BYTES),
        (GemmStore::Tma, EpilogueOperands::Int8(_)) => (TMA_STORE_KERNELS[2], SHARED_BYTES_TMA),
        (GemmStore::Tma, EpilogueOperands::Bf16 { .. }) => (TMA_STORE_KERNELS[3], SHARED_BYTES_TMA),
    };
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(both.grid(sm_count)?, THREADS).with_shared(shared),
        args,
    ))
}

/// Which RoPE (and which QK norm arithmetic) [`plan_int8_qkv_gemm`]'s epilogue runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvRope {
    /// Qwen-Image's ([`super::rope::plan_qk_norm_rope`]): f32 tables, slot `j` turning channels `2 j` and `2 j + 1`;
    /// the norm rounds to bf16 after the RMS and after the weight.
    Interleaved,
    /// MiniMax H3's (`h3_qk_norm_rope`): bf16 tables, slot `j < 48` turning channels `j` and `j + 48` (the first 96
    /// of each head's 128); the norm in f32.
    Half96,
}

/// Channels of a head the [`QkvRope::Half96`] RoPE turns.
pub const HALF96_ROTATED: usize = 96;

/// The per-head QK RMSNorm and RoPE [`plan_int8_qkv_gemm`] runs in its epilogue: `heads` heads of 128 channels, norm
/// weights `q_weight` / `k_weight` (bf16 `[128]`), rotation tables `[M, rope_stride]` (f32 or bf16 by `rope`).
#[derive(Clone, Copy, Debug)]
pub struct QkvNormRope<'v, 'a> {
    pub heads: usize,
    pub q_weight: &'v DeviceView<'a>,
    pub k_weight: &'v DeviceView<'a>,
    pub eps: f32,
    pub rope: QkvRope,
    pub rope_cos: &'v DeviceView<'a>,
    pub rope_sin: &'v DeviceView<'a>,
    pub rope_stride: usize,
}

impl<'v, 'a> QkvNormRope<'v, 'a> {
    /// The separate pass's operands for the same norm and tables (`nn_qk_norm_rope_interleaved` over the q|k|v rows
    /// `qkv` laid out as `layout`): where the q|k|v GEMM does not run ours, the pass does what the epilogue would.
    /// Only the interleaved RoPE has that pass here; [`QkvRope::Half96`] is refused, naming it.
    pub fn interleaved_pass(
        &self,
        qkv: &'v DeviceView<'a>,
        layout: Matrix,
    ) -> Result<QkvInputs<'v, 'a>, tf_cuda::Error> {
        if self.rope != QkvRope::Interleaved {
            return Err(invalid(
                "QK norm + RoPE pass",
                format!("{:?} RoPE has no interleaved pass", self.rope),
            ));
        }
        Ok(QkvInputs {
            qkv,
            qkv_layout: layout,
            heads: self.heads,
            q_weight: self.q_weight,
            k_weight: self.k_weight,
            eps: self.eps,
            rope_cos: self.rope_cos,
            rope_sin: self.rope_sin,
            rope_stride: self.rope_stride,
        })
    }
}

/// Where [`plan_int8_qkv_gemm`] writes: q, k and v apart (bf16 rows of one stride for the three), or one q|k|v
/// matrix (rows of `stride`, at least `3 width`), the three parts normed and rotated in place.
#[derive(Debug)]
pub enum QkvDest<'d, 'a> {
    Apart(&'d QkvOutputs<'d, 'a>),
    Joint {
        qkv: &'d mut DeviceViewMut<'a>,
        stride: usize,
    },
}

/// The INT8 GEMM of a fused q|k|v projection with the QK norm and RoPE in its epilogue (kernels
/// `nn_gemm_int8_qkv_bf16` and `nn_gemm_int8_qkv_half_bf16`, by `norm.rope`): the products [`plan_int8_gemm`] would
/// store for `w`'s `3 width` rows (`width = heads * 128`, a multiple of 256), rounded to bf16, then q and k normed and
/// rotated as the separate pass does, the values as they are, into `dest` (strides multiples of 8). This saves the
/// pass that reads the GEMM's output and writes q and k (or all three) again.
///
/// With [`EpilogueOperands::Bf16`] the bf16 kernels run (`nn_gemm_bf16_qkv`, `nn_gemm_bf16_qkv_half`): K a multiple
/// of 8, the products rounded to bf16 as [`plan_bf16_gemm`] stores them, then the same norm and rotation.
pub fn plan_int8_qkv_gemm<'a>(
    ctx: &Context,
    sm_count: usize,
    (m, k): (usize, usize),
    inputs: EpilogueOperands<'_, 'a>,
    norm: &QkvNormRope<'a, '_>,
    dest: QkvDest<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "q|k|v GEMM";
    let width = norm
        .heads
        .checked_mul(HEAD_DIM)
        .ok_or_else(|| invalid(OP, "heads overflow"))?;
    if width == 0 || !width.is_multiple_of(TILE_COLS) {
        return Err(invalid(
            OP,
            format!(
                "{} heads of {HEAD_DIM} ({width} columns) are not a positive multiple of {TILE_COLS} columns; run the GEMM and the QK norm apart",
                norm.heads
            ),
        ));
    }
    let shape = Int8GemmShape {
        m,
        n: width
            .checked_mul(3)
            .ok_or_else(|| invalid(OP, "3 x width overflows"))?,
        k,
    };
    inputs.check_shape(shape)?;
    check_eps(OP, norm.eps)?;
    let (addrs, stride) = match dest {
        QkvDest::Apart(outputs) => {
            let stride = outputs.q_stride;
            if outputs.k_stride != stride || outputs.v_stride != stride || !stride.is_multiple_of(8)
            {
                return Err(invalid(
                    OP,
                    format!(
                        "q, k and v row strides {}, {}, {} must be one multiple of 8 (16-byte stores)",
                        outputs.q_stride, outputs.k_stride, outputs.v_stride
                    ),
                ));
            }
            let each = Int8GemmShape { n: width, ..shape };
            for (name, view) in [("q", &*outputs.q), ("k", &*outputs.k), ("v", &*outputs.v)] {
                check_y_named(OP, name, each, Operand::of_mut(view), stride)?;
            }
            (
                [outputs.q.addr(), outputs.k.addr(), outputs.v.addr()],
                stride,
            )
        }
        QkvDest::Joint { qkv, stride } => {
            if !stride.is_multiple_of(8) {
                return Err(invalid(
                    OP,
                    format!("qkv row stride {stride} is not a multiple of 8 (16-byte stores)"),
                ));
            }
            check_y_named(OP, "qkv", shape, Operand::of_mut(&*qkv), stride)?;
            // Inside the view (checked above): its k and v columns start one and two parts in.
            let part = bytes_of(OP, "q part", &[width, 2])? as u64;
            let base = qkv.addr();
            (
                [
                    base,
                    base.checked_add(part)
                        .ok_or_else(|| invalid(OP, "k's address overflows"))?,
                    part.checked_mul(2)
                        .and_then(|two| base.checked_add(two))
                        .ok_or_else(|| invalid(OP, "v's address overflows"))?,
                ],
                stride,
            )
        }
    };
    inputs.check(OP, (m, shape.n, k), 4)?;
    for (name, view) in [("q_weight", norm.q_weight), ("k_weight", norm.k_weight)] {
        check_operand(OP, name, Operand::of(view), HEAD_DIM * 2, 4)?;
    }
    let kernel = match norm.rope {
        QkvRope::Interleaved => {
            check_interleaved_tables(OP, m, (norm.rope_cos, norm.rope_sin), norm.rope_stride)?;
            inputs.kernel(GEMM_INT8_KERNELS[3], 1)
        }
        QkvRope::Half96 => {
            check_half96_tables(OP, m, (norm.rope_cos, norm.rope_sin), norm.rope_stride)?;
            inputs.kernel(GEMM_INT8_KERNELS[4], 2)
        }
    };
    let mut args = Args::new();
    inputs.push_maps_and_scales(ctx, &mut args, shape, (shape.n, TILE_COLS), None)?;
    args.push(qkv_words(
        [
            addrs[0],
            addrs[1],
            addrs[2],
            norm.q_weight.addr(),
            norm.k_weight.addr(),
            norm.rope_cos.addr(),
            norm.rope_sin.addr(),
        ],
        to_i64(OP, "row stride", stride)?,
        to_i32(OP, "width", width)?,
        norm.eps,
        to_i32(OP, "rope stride", norm.rope_stride)?,
    ))
    .push(to_i32(OP, "M", m)?)
    .push(to_i32(OP, "K", k)?)
    .push(shape.band_arg(OP, inputs.elem_bytes(), sm_count)?);
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(shape.grid(sm_count)?, THREADS).with_shared(SHARED_BYTES),
        args,
    ))
}

/// Checks [`QkvRope::Half96`]'s tables: bf16 `[rows, rope_stride]`, 4-byte aligned with an even stride (the kernel
/// reads pairs), 48 used columns a row.
fn check_half96_tables(
    op: &str,
    rows: usize,
    (rope_cos, rope_sin): (&DeviceView<'_>, &DeviceView<'_>),
    rope_stride: usize,
) -> Result<(), tf_cuda::Error> {
    let half = HALF96_ROTATED / 2;
    if rope_stride < half || !rope_stride.is_multiple_of(2) {
        return Err(invalid(
            op,
            format!("rope stride {rope_stride} must be even and at least {half}"),
        ));
    }
    let bytes = match rows.checked_sub(1) {
        None => 0,
        Some(last) => last
            .checked_mul(rope_stride)
            .and_then(|e| e.checked_add(half))
            .and_then(|e| e.checked_mul(2))
            .ok_or_else(|| invalid(op, "rope table span overflows"))?,
    };
    for (name, table) in [("rope_cos", rope_cos), ("rope_sin", rope_sin)] {
        check_operand(op, name, Operand::of(table), bytes, 4)?;
    }
    Ok(())
}

/// The kernel's `G8Qkv` argument as its ten 8-byte words: seven addresses (q, k, v, q_weight, k_weight, rope_cos,
/// rope_sin), the row stride, then `width` and `eps`, then `rope_stride` and a zero word half.
fn qkv_words(addrs: [u64; 7], stride: i64, width: i32, eps: f32, rope_stride: i32) -> [u64; 10] {
    let mut words = [0u64; 10];
    words[..7].copy_from_slice(&addrs);
    words[7] = stride as u64;
    words[8] = u64::from(width as u32) | (u64::from(eps.to_bits()) << 32);
    words[9] = u64::from(rope_stride as u32);
    words
}

/// The same pipeline over bf16 operands (kernel `nn_gemm_bf16`): `y = bf16(x . w^T)` with f32 sums, `x` bf16
/// `[m, k]` dense, `w` bf16 `[n, k]` dense, `y` bf16 rows of `y_row_stride` elements; K a multiple of 8.
pub fn plan_bf16_gemm<'a>(
    ctx: &Context,
    sm_count: usize,
    shape: Int8GemmShape,
    (x, w): (&'a DeviceView<'_>, &'a DeviceView<'_>),
    y: &'a mut DeviceViewMut<'_>,
    y_row_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    let store = GemmStore::from_env_for("bf16 GEMM")?;
    plan_bf16_gemm_stored(ctx, sm_count, shape, (x, w), y, (y_row_stride, store))
}

/// [`plan_bf16_gemm`] with the store form given instead of read from [`STORE_ENV`].
pub fn plan_bf16_gemm_stored<'a>(
    ctx: &Context,
    sm_count: usize,
    shape: Int8GemmShape,
    (x, w): (&'a DeviceView<'_>, &'a DeviceView<'_>),
    y: &'a mut DeviceViewMut<'_>,
    (y_row_stride, store): (usize, GemmStore),
) -> Result<Launch<'a>, tf_cuda::Error> {
    let operands = (Operand::of(x), Operand::of(w), Operand::of_mut(y));
    let (kernel, config, args) = pack_bf16(ctx, sm_count, shape, operands, (y_row_stride, store))?;
    Ok(Launch::new(kernel, config, args))
}

/// [`plan_bf16_gemm`] over raw device spans (a step's operands at offsets of buffers it also borrows elsewhere):
/// the launch borrows nothing, so only [`Int8GemmKernels::gemm_bf16_spans`], which is `unsafe`, submits it.
pub fn plan_bf16_gemm_spans(
    ctx: &Context,
    sm_count: usize,
    shape: Int8GemmShape,
    (x, w): (DeviceSpan, DeviceSpan),
    y: DeviceSpan,
    y_row_stride: usize,
) -> Result<Launch<'static>, tf_cuda::Error> {
    let store = GemmStore::from_env_for("bf16 GEMM")?;
    let (kernel, config, args) = pack_bf16(
        ctx,
        sm_count,
        shape,
        (
            Operand::of_span(x),
            Operand::of_span(w),
            Operand::of_span(y),
        ),
        (y_row_stride, store),
    )?;
    Ok(Launch::from_spans(kernel, config, args))
}

/// Checks a bf16 GEMM's shape and operands (x, w, y) and packs its launch: the kernel of `store`, its
/// configuration and arguments.
fn pack_bf16(
    ctx: &Context,
    sm_count: usize,
    shape: Int8GemmShape,
    (x, w, y): (Operand, Operand, Operand),
    (y_row_stride, store): (usize, GemmStore),
) -> Result<(&'static str, LaunchConfig, Args), tf_cuda::Error> {
    const OP: &str = "bf16 GEMM";
    shape.check_bf16()?;
    let Int8GemmShape { m, n, k } = shape;
    check_operand(OP, "x", x, bytes_of(OP, "x", &[m, k, 2])?, 16)?;
    check_operand(OP, "w", w, bytes_of(OP, "w", &[n, k, 2])?, 16)?;
    check_y(OP, shape, y, y_row_stride)?;
    let tm_x = encode_bf16_tiles(ctx, &operand_tiles(x.addr, shape, 2, m, TILE_ROWS))?;
    let tm_w = encode_bf16_tiles(ctx, &operand_tiles(w.addr, shape, 2, n, TILE_COLS))?;
    let store = store.for_stride(y_row_stride);
    let mut args = Args::new();
    args.push(tm_x.words()).push(tm_w.words());
    if store == GemmStore::Tma {
        args.push(encode_bf16_tiles(ctx, &output_tiles(y.addr, m, n, y_row_stride))?.words());
    }
    push_output(&mut args, OP, shape, y.addr, y_row_stride)?;
    args.push(shape.band_arg(OP, 2, sm_count)?);
    let (kernel, shared) = match store {
        GemmStore::Direct => (GEMM_INT8_KERNELS[1], SHARED_BYTES),
        GemmStore::Tma => (TMA_STORE_KERNELS[1], SHARED_BYTES_TMA),
    };
    let config = LaunchConfig::new(shape.grid(sm_count)?, THREADS).with_shared(shared);
    Ok((kernel, config, args))
}

/// The map of a dense operand of `rows` rows of K elements of `elem_bytes`, in boxes of one 128-byte slice of K
/// by `box_rows` rows.
fn operand_tiles(
    base: u64,
    shape: Int8GemmShape,
    elem_bytes: usize,
    rows: usize,
    box_rows: usize,
) -> Tiles {
    Tiles {
        base,
        cols: shape.k as u64,
        rows: rows as u64,
        batch: 1,
        row_stride_bytes: (shape.k * elem_bytes) as u64,
        batch_stride_bytes: 0,
        box_cols: (K_SLICE / elem_bytes) as u32,
        box_rows: box_rows as u32,
    }
}

/// Checks `y`: bf16 rows of `y_row_stride` (even, at least N) elements, 16-byte aligned, spanning M rows.
fn check_y(
    op: &str,
    shape: Int8GemmShape,
    y: Operand,
    y_row_stride: usize,
) -> Result<(), tf_cuda::Error> {
    check_y_named(op, "y", shape, y, y_row_stride)
}

/// [`check_y`] for an output called `name`.
fn check_y_named(
    op: &str,
    name: &str,
    shape: Int8GemmShape,
    y: Operand,
    y_row_stride: usize,
) -> Result<(), tf_cuda::Error> {
    if y_row_stride < shape.n || !y_row_stride.is_multiple_of(2) {
        return Err(invalid(
            op,
            format!(
                "{name} row stride {y_row_stride} must be even and at least N = {}",
                shape.n
            ),
        ));
    }
    let y_span = Matrix::dense(shape.m, shape.n)
        .with_stride(y_row_stride)
        .span_bytes()
        .ok_or_else(|| invalid(op, format!("{name}'s span overflows")))?;
    check_operand(op, name, y, y_span, 16)
}

/// Pushes the arguments both kernels end with: y, its row stride, M, N, K.
fn push_output(
    args: &mut Args,
    op: &str,
    shape: Int8GemmShape,
    y_addr: u64,
    y_row_stride: usize,
) -> Result<(), tf_cuda::Error> {
    args.push_addr(y_addr)
        .push(to_i64(op, "y row stride", y_row_stride)?)
        .push(to_i32(op, "M", shape.m)?)
        .push(to_i32(op, "N", shape.n)?)
        .push(to_i32(op, "K", shape.k)?);
    Ok(())
}

/// The loaded `nn_gemm_int8` set (sm_90 only) and the SM count its persistent grid is sized by.
pub struct Int8GemmKernels {
    set: LoadedSet,
    sm_count: usize,
}

impl fmt::Debug for Int8GemmKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Int8GemmKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl Int8GemmKernels {
    /// Loads the set into `ctx` and opts the kernel in to its shared memory. The set holds sm_90a code only: on
    /// any other GPU this fails with [`LoadKernelsError::Missing`] saying so.
    pub fn load(ctx: &Context) -> Result<Int8GemmKernels, LoadKernelsError> {
        let sm_count = require_sm90(ctx, GEMM_INT8_SET, "the INT8 GEMM")?;
        let mut set = LoadedSet::empty();
        set.add(ctx, GEMM_INT8_SET, GEMM_INT8_KERNELS, |name, function| {
            let shared = if TMA_STORE_KERNELS.contains(&name) {
                SHARED_BYTES_TMA
            } else {
                ConvTile::ALL
                    .into_iter()
                    .find(|t| t.kernel() == name)
                    .map_or(SHARED_BYTES, ConvTile::shared_bytes)
            };
            function.set_max_dynamic_shared(shared)?;
            Ok(true)
        })?;
        Ok(Int8GemmKernels { set, sm_count })
    }

    /// The SM count launches are planned for (pass it to [`plan_int8_gemm`]).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Submits a launch of [`plan_int8_gemm`] (benchmarks plan once and submit it repeatedly).
    pub fn submit(&self, stream: &Stream, launch: &Launch<'_>) -> Result<(), tf_cuda::Error> {
        self.set.submit(stream, launch)
    }

    /// Submits a launch planned over raw device spans ([`plan_bf16_gemm_spans`], [`super::conv::plan_conv3x3_spans`]).
    ///
    /// # Safety
    ///
    /// Every span of the launch lies in device memory of `stream`'s context that is allocated now and stays
    /// allocated until the work on `stream` is done, and the spans it writes are not read or written by other work
    /// meanwhile.
    pub unsafe fn submit_spans(
        &self,
        stream: &Stream,
        launch: &Launch<'_>,
    ) -> Result<(), tf_cuda::Error> {
        // SAFETY: forwarded contract: live spans of the stream's context, checked by the plan against what the kernel
        // addresses.
        unsafe { self.set.submit_spans(stream, launch) }
    }

    /// Runs the INT8 GEMM of a SwiGLU's two halves with the SwiGLU in its epilogue on `stream`; see
    /// [`plan_int8_swiglu_gemm`].
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_swiglu<'v, 'a: 'v>(
        &self,
        ctx: &Context,
        stream: &Stream,
        (m, hidden, k): (usize, usize, usize),
        order: SwigluOrder,
        inputs: impl Into<EpilogueOperands<'v, 'a>>,
        y: &mut DeviceViewMut<'_>,
        y_row_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_int8_swiglu_gemm(
            ctx,
            self.sm_count,
            (m, hidden, k),
            order,
            inputs.into(),
            y,
            y_row_stride,
        )?;
        self.set.submit(stream, &launch)
    }

    /// Runs the INT8 q|k|v GEMM with the QK norm and RoPE in its epilogue on `stream`; see [`plan_int8_qkv_gemm`].
    pub fn gemm_qkv<'v, 'a: 'v>(
        &self,
        ctx: &Context,
        stream: &Stream,
        (m, k): (usize, usize),
        inputs: impl Into<EpilogueOperands<'v, 'a>>,
        norm: &QkvNormRope<'_, '_>,
        dest: QkvDest<'_, '_>,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_int8_qkv_gemm(ctx, self.sm_count, (m, k), inputs.into(), norm, dest)?;
        self.set.submit(stream, &launch)
    }

    /// Runs `y = bf16(x . w^T)` over bf16 operands on `stream`; see [`plan_bf16_gemm`].
    pub fn gemm_bf16(
        &self,
        ctx: &Context,
        stream: &Stream,
        shape: Int8GemmShape,
        (x, w): (&DeviceView<'_>, &DeviceView<'_>),
        y: &mut DeviceViewMut<'_>,
        y_row_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_bf16_gemm(ctx, self.sm_count, shape, (x, w), y, y_row_stride)?;
        self.set.submit(stream, &launch)
    }

    /// [`Int8GemmKernels::gemm_bf16`] over raw device spans; see [`plan_bf16_gemm_spans`].
    ///
    /// # Safety
    ///
    /// Every span lies in device memory of `stream`'s context that is allocated now and stays allocated until the
    /// work on `stream` is done (a `DeviceBuffer`'s `Drop` waits for the context), and `y` is not read or written
    /// by other work meanwhile.
    pub unsafe fn gemm_bf16_spans(
        &self,
        ctx: &Context,
        stream: &Stream,
        shape: Int8GemmShape,
        (x, w): (DeviceSpan, DeviceSpan),
        y: DeviceSpan,
        y_row_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_bf16_gemm_spans(ctx, self.sm_count, shape, (x, w), y, y_row_stride)?;
        // SAFETY: the spans are live allocations of the stream's context (this function's contract); the plan
        // checked their extents against what the kernel addresses.
        unsafe { self.set.submit_spans(stream, &launch) }
    }

    /// Runs `y = bf16(x . w^T * x_scale * w_scale)` on `stream`; see [`plan_int8_gemm`].
    pub fn gemm(
        &self,
        ctx: &Context,
        stream: &Stream,
        shape: Int8GemmShape,
        inputs: &Int8GemmOperands<'_, '_>,
        y: &mut DeviceViewMut<'_>,
        y_row_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_int8_gemm(ctx, self.sm_count, shape, inputs, y, y_row_stride)?;
        self.set.submit(stream, &launch)
    }
}

/// The product on the host, as the kernel computes it: exact integer sums, one conversion to f32, times the product
/// of the two scales (the order `nn_swiglu_i32gate_fp8` dequantizes cuBLASLt's int32 products in), rounded to bf16
/// (returned as f32 values). `y` is `m` x `n`, dense.
pub fn int8_gemm_host(
    shape: Int8GemmShape,
    x: &[i8],
    x_scale: &[f32],
    w: &[i8],
    w_scale: &[f32],
) -> Vec<f32> {
    let Int8GemmShape { m, n, k } = shape;
    let mut y = Vec::with_capacity(m * n);
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            let wr = &w[c * k..(c + 1) * k];
            let sum: i64 = xr
                .iter()
                .zip(wr)
                .map(|(&a, &b)| i64::from(a) * i64::from(b))
                .sum();
            let v = (sum as i32) as f32 * (x_scale[r] * w_scale[c]);
            y.push(half::bf16::from_f32(v).to_f32());
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn gemm(m: usize, n: usize, k: usize) -> Int8GemmShape {
        Int8GemmShape { m, n, k }
    }

    #[test]
    fn the_tile_order_bands_x_that_outgrows_l2_at_the_dit_shapes() {
        let sms = 132;
        // MiniMax H3 at S = 6026 (48 M tiles): bf16 x of 62-165 MiB in three bands of 16; INT8 x of the q|k|v and
        // fc1 GEMMs (K = 5376, 30.9 MiB) fits, the out and fc2 ones (41, 82 MiB) do not.
        for k in [5376, 7168, 14336] {
            assert_eq!(
                gemm(6026, 5376, k).band_tiles(2, sms, TileBand::Auto),
                16,
                "bf16 K = {k}"
            );
        }
        assert_eq!(
            gemm(6026, 21504, 5376).band_tiles(1, sms, TileBand::Auto),
            48
        );
        assert_eq!(
            gemm(6026, 5376, 7168).band_tiles(1, sms, TileBand::Auto),
            16
        );
        assert_eq!(
            gemm(6026, 5376, 14336).band_tiles(1, sms, TileBand::Auto),
            16
        );
        // Qwen-Image at 1024 x 1024 (32 M tiles): bf16 x of K = 4096 is 32 MiB, one band; K = 12288 two bands.
        assert_eq!(
            gemm(4096, 12288, 4096).band_tiles(2, sms, TileBand::Auto),
            32
        );
        assert_eq!(
            gemm(4096, 4096, 12288).band_tiles(2, sms, TileBand::Auto),
            16
        );
        // Asked for: off is one band; a count is balanced over M (18 of 48: three bands of 16; 5: ten of 4-5).
        let h3 = gemm(6026, 5376, 14336);
        assert_eq!(h3.band_tiles(2, sms, TileBand::Off), 48);
        assert_eq!(h3.band_tiles(2, sms, TileBand::Tiles(18)), 16);
        assert_eq!(h3.band_tiles(2, sms, TileBand::Tiles(5)), 5);
        assert_eq!(h3.band_tiles(2, sms, TileBand::Tiles(1000)), 48);
        // No SM count (a test driver) still gives a band of at least one tile.
        assert_eq!(h3.band_tiles(2, 0, TileBand::Auto), 1);
    }

    #[test]
    fn the_band_variable_names_what_it_takes() {
        assert_eq!(TileBand::parse(""), Ok(None));
        assert_eq!(TileBand::parse("auto"), Ok(Some(TileBand::Auto)));
        assert_eq!(TileBand::parse("off"), Ok(Some(TileBand::Off)));
        assert_eq!(TileBand::parse("12"), Ok(Some(TileBand::Tiles(12))));
        assert_eq!(TileBand::default_for(2), TileBand::Auto);
        assert_eq!(TileBand::default_for(1), TileBand::Off);
        for bad in ["0", "-3", "many", "1.5"] {
            let err = TileBand::parse(bad).expect_err(bad);
            assert!(
                err.contains(BAND_ENV) && err.contains("positive number of M tiles"),
                "{err}"
            );
        }
    }

    /// The kernel's `tile_origin` (kernels/nn/gemm_int8.cu) in tile units: (M tile, N tile) of tile `tile`.
    fn kernel_tile_order(
        tile: usize,
        m_tiles: usize,
        n_tiles: usize,
        band: usize,
    ) -> (usize, usize) {
        let rows = if band > 0 && band < m_tiles {
            band
        } else {
            m_tiles
        };
        let per_band = rows * n_tiles;
        let b = tile / per_band;
        let first = b * rows;
        let in_band = rows.min(m_tiles - first);
        let local = tile - b * per_band;
        (first + local % in_band, local / in_band)
    }

    proptest! {
        /// Whatever band the host picks, the kernel's order visits every output tile exactly once, and the last
        /// band is short by fewer M tiles than there are bands.
        #[test]
        fn every_band_covers_each_tile_once(
            m in 1usize..3000,
            n_tiles in 1usize..40,
            k in prop::sample::select(vec![64usize, 4096, 5376, 14336]),
            asked in prop::option::of(1usize..60),
            sms in 0usize..200,
        ) {
            let shape = gemm(m, n_tiles * TILE_COLS, k);
            let (m_tiles, _) = shape.tiles();
            let band = shape.band_tiles(2, sms, asked.map_or(TileBand::Auto, TileBand::Tiles));
            prop_assert!((1..=m_tiles).contains(&band));
            let bands = m_tiles.div_ceil(band);
            prop_assert!(m_tiles - (bands - 1) * band + bands > band);
            let mut seen = vec![false; m_tiles * n_tiles];
            for tile in 0..m_tiles * n_tiles {
                let (mi, ni) = kernel_tile_order(tile, m_tiles, n_tiles, band);
                prop_assert!(mi < m_tiles && ni < n_tiles);
                prop_assert!(!std::mem::replace(&mut seen[mi * n_tiles + ni], true), "tile {} twice", tile);
            }
        }
    }

    #[test]
    fn shapes_the_kernel_tiles_and_those_it_refuses() {
        let h3_qkv = Int8GemmShape {
            m: 6026,
            n: 21504,
            k: 5376,
        };
        assert!(h3_qkv.check().is_ok());
        assert_eq!(h3_qkv.tiles(), (48, 84));
        // Persistent: one CTA an SM, or one a tile where there are fewer tiles.
        assert_eq!(h3_qkv.grid(132).ok(), Some(132));
        let small = Int8GemmShape {
            m: 5,
            n: 512,
            k: 128,
        };
        assert_eq!(small.grid(132).ok(), Some(2));
        assert_eq!(small.grid(0).ok(), Some(1));
        // Partial column tiles and K not a whole number of slices are tiled too.
        let ragged = Int8GemmShape {
            m: 300,
            n: 1000,
            k: 5392,
        };
        assert!(ragged.check().is_ok());
        assert_eq!(ragged.tiles(), (3, 4));
        for (shape, needle) in [
            (Int8GemmShape { n: 5001, ..h3_qkv }, "N = 5001 is odd"),
            (
                Int8GemmShape { k: 5300, ..h3_qkv },
                "K = 5300 is not a multiple of 16",
            ),
            (Int8GemmShape { m: 0, ..h3_qkv }, "empty GEMM"),
        ] {
            let err = shape.check().expect_err(needle).to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }

    #[test]
    fn backend_names() {
        assert_eq!(Int8GemmBackend::parse(""), Ok(Int8GemmBackend::Cublaslt));
        assert_eq!(
            Int8GemmBackend::parse("cublaslt"),
            Ok(Int8GemmBackend::Cublaslt)
        );
        assert_eq!(Int8GemmBackend::parse("ours"), Ok(Int8GemmBackend::Ours));
        let err = Int8GemmBackend::parse("cutlass").expect_err("unknown");
        assert!(
            err.contains("TF_INT8_GEMM=\"cutlass\"") && err.contains("`ours`"),
            "{err}"
        );
    }

    proptest::proptest! {
        /// The q|k|v kernels' `G8Qkv` argument (kernels/nn/gemm_int8.cu: seven pointers, an int64 stride, then
        /// int width, float eps, int rope_stride and a zero int, 80 bytes) reads back field for field from the ten
        /// words the launcher packs.
        #[test]
        fn qkv_words_lay_out_the_kernels_struct(
            addrs in proptest::array::uniform7(proptest::num::u64::ANY),
            stride in 0i64..i64::MAX,
            width in 0i32..i32::MAX,
            eps_bits in proptest::num::u32::ANY,
            rope_stride in 0i32..i32::MAX,
        ) {
            let eps = f32::from_bits(eps_bits);
            let words = qkv_words(addrs, stride, width, eps, rope_stride);
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            proptest::prop_assert_eq!(bytes.len(), 80);
            let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
            let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap_or([0; 4]));
            for (i, &a) in addrs.iter().enumerate() {
                proptest::prop_assert_eq!(u64_at(8 * i), a);
            }
            proptest::prop_assert_eq!(u64_at(56) as i64, stride);
            proptest::prop_assert_eq!(u32_at(64) as i32, width);
            proptest::prop_assert_eq!(u32_at(68), eps_bits);
            proptest::prop_assert_eq!(u32_at(72) as i32, rope_stride);
            proptest::prop_assert_eq!(u32_at(76), 0);
        }
    }

    #[test]
    fn shared_memory_holds_four_stages_and_the_alignment_slack() {
        assert_eq!(SHARED_BYTES, 4 * 48 * 1024 + 1024);
    }

    #[test]
    fn host_product_scales_exact_sums() {
        let shape = Int8GemmShape { m: 2, n: 2, k: 3 };
        let x = [1i8, -2, 3, 127, 127, 127];
        let w = [1i8, 1, 1, -127, 0, 2];
        let y = int8_gemm_host(shape, &x, &[0.5, 1.0], &w, &[1.0, 0.25]);
        // Row 0: (1 - 2 + 3) * 0.5 = 1; (-127 + 0 + 6) * 0.5 * 0.25 = -15.125.
        assert_eq!(y[0], 1.0);
        assert_eq!(y[1], -15.125);
        // Row 1: 381 rounds to bf16 as 380; (-16129 + 254) * 0.25 = -3968.75 rounds to -3968.
        assert_eq!(y[2], 380.0);
        assert_eq!(y[3], -3968.0);
    }
}
