//! The implicit-GEMM 3x3 convolution (kernels `nn_conv3x3_bf16_n144` / `_n256` of the `nn_gemm_int8` set, sm_90
//! only): a padded 3x3 conv over an NHWC bf16 map, computed as the GEMM of the conv's column matrix without ever
//! writing that matrix. The kernel loads each (tap, 64 channels) slice of the input straight from the map through a
//! 3-D tensor map whose zero fill is the padding, so a conv reads its input from L2 instead of a column matrix nine
//! times its size from memory.
//!
//! Invariants: `x` is `[h, w, cin]` bf16 with `cin` a multiple of 8 (16-byte pixel rows); the weights are the
//! tap-major matrix `[n, 9 cin]` (column `tap * cin + c`, `tap = 3 dy + dx`) that an im2col GEMM reads; `y` is `[h,
//! w, n]` bf16 (or f32, with an f32 bias: [`ConvOutput`]) with `n` even, `y = conv(x) + bias (+ y)`. Each output is
//! one f32 sum of bf16 products rounded once.
//! An M tile is 128 or 256 pixels ([`ConvTile`]): of one row when `w` is at least that, else whole rows, so a
//! narrower `w` must divide the tile's pixels ([`Conv3x3Shape::check`] names the rule; callers fall back to an
//! im2col GEMM).
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, k: &tf_engines::nn::gpu::gemm_int8::Int8GemmKernels,
//! #         x: tf_cuda::cublaslt::DeviceSpan, w: tf_cuda::cublaslt::DeviceSpan,
//! #         bias: tf_cuda::cublaslt::DeviceSpan, y: tf_cuda::cublaslt::DeviceSpan)
//! #         -> Result<(), tf_cuda::Error> {
//! use tf_engines::nn::gpu::conv::{plan_conv3x3_spans, Conv3x3Shape, ConvOutput, ConvTile};
//! let shape = Conv3x3Shape { h: 1024, w: 1024, cin: 144, n: 144 };
//! let tile = ConvTile::for_channels(shape.n, true);
//! let launch =
//!     plan_conv3x3_spans(ctx, k.sm_count(), (shape, tile), (x, w, bias), (y, ConvOutput::Bf16), false)?;
//! // SAFETY: the spans are live allocations of the stream's context and nothing else touches y meanwhile.
//! unsafe { k.submit_spans(stream, &launch) }?;
//! # Ok(()) }
//! ```

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::tensor_map::{encode_bf16_boxes, encode_bf16_tiles, Tiles};
use tf_cuda::Context;

use super::gemm_int8::{GEMM_INT8_KERNELS, K_SLICE, TILE_ROWS};
use super::launch::{bytes_of, check_span, invalid, to_i32, to_u32, Launch};

const OP: &str = "3x3 conv";
const BF16: usize = 2;
/// Channels of the input one K slice holds (128 bytes of bf16).
const SLICE_CHANNELS: usize = K_SLICE / BF16;
const THREADS: u32 = 384;

/// The conv kernels: tiles of 128 pixels by 144 or 256 output channels, and of 256 pixels by 144 channels (each
/// consumer warpgroup runs two 64-pixel blocks on one weight slice: a third less L2 traffic a FLOP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvTile {
    /// 128 pixels x 144 channels (channel counts of 144 times a power of two: the Qwen-Image VAE).
    Cols144,
    /// 128 pixels x 256 channels.
    Cols256,
    /// 256 pixels x 144 channels.
    Tall144,
    /// 128 pixels of one row x 144 channels, a stage holding one 130-pixel input row slice for its three horizontal
    /// taps (a third of the input loads; maps at least 128 wide).
    Rows144,
}

impl ConvTile {
    /// Output channels one tile computes.
    pub fn cols(self) -> usize {
        match self {
            ConvTile::Cols144 | ConvTile::Tall144 | ConvTile::Rows144 => 144,
            ConvTile::Cols256 => 256,
        }
    }

    /// Pixels one tile computes.
    pub fn pixels(self) -> usize {
        match self {
            ConvTile::Cols144 | ConvTile::Cols256 | ConvTile::Rows144 => TILE_ROWS,
            ConvTile::Tall144 => 2 * TILE_ROWS,
        }
    }

    /// Bytes of one pipeline stage: the input slice (1024-byte aligned) and the weight slices of its taps.
    fn stage_bytes(self) -> usize {
        let (rows, taps) = match self {
            ConvTile::Rows144 => (self.pixels() + 2, 3),
            _ => (self.pixels(), 1),
        };
        (rows * K_SLICE).div_ceil(1024) * 1024 + taps * self.cols() * K_SLICE
    }

    /// Pipeline stages: as many as fit in 227 KiB with the alignment slack, at most six (the kernel's rule).
    fn stages(self) -> usize {
        ((227 * 1024 - 1024) / self.stage_bytes()).min(6)
    }

    /// The kernel's name in the set.
    pub fn kernel(self) -> &'static str {
        match self {
            ConvTile::Cols144 => GEMM_INT8_KERNELS[5],
            ConvTile::Cols256 => GEMM_INT8_KERNELS[6],
            ConvTile::Tall144 => GEMM_INT8_KERNELS[7],
            ConvTile::Rows144 => GEMM_INT8_KERNELS[8],
        }
    }

    /// Every tile, for loading.
    pub const ALL: [ConvTile; 4] = [
        ConvTile::Cols144,
        ConvTile::Cols256,
        ConvTile::Tall144,
        ConvTile::Rows144,
    ];

    /// Dynamic shared memory: the stages' input and weight tiles, and 1 KiB to align them to 1024 bytes.
    pub fn shared_bytes(self) -> u32 {
        // Small constants: at most 227 KiB.
        (self.stage_bytes() * self.stages() + 1024) as u32
    }

    /// The tile for `n` output channels: of the two widths the one that computes the fewest padding channels (the
    /// wider one on a tie), 256 pixels tall when `tall` and the width is 144.
    pub fn for_channels(n: usize, tall: bool) -> ConvTile {
        let padded = |t: ConvTile| n.div_ceil(t.cols()) * t.cols();
        if padded(ConvTile::Cols144) < padded(ConvTile::Cols256) {
            if tall {
                ConvTile::Tall144
            } else {
                ConvTile::Cols144
            }
        } else {
            ConvTile::Cols256
        }
    }
}

// 227 KiB is the most one block may opt in to on sm_90.
const _: () = assert!((TILE_ROWS + 144) * K_SLICE * 6 + 1024 <= 227 * 1024);
const _: () = assert!((TILE_ROWS + 256) * K_SLICE * 4 + 1024 <= 227 * 1024);
const _: () = assert!((2 * TILE_ROWS + 144) * K_SLICE * 4 + 1024 <= 227 * 1024);
const _: () = assert!((17 * 1024 + 3 * 144 * K_SLICE) * 3 + 1024 <= 227 * 1024);

/// The element type of a conv's output and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvOutput {
    /// bf16 output and bias.
    Bf16,
    /// f32 output and bias (a decoder's last conv).
    F32,
}

impl ConvOutput {
    fn bytes(self) -> usize {
        match self {
            ConvOutput::Bf16 => 2,
            ConvOutput::F32 => 4,
        }
    }
}

/// The kernel's `flags` bits.
const FLAG_ACCUMULATE: i32 = 1;
const FLAG_F32: i32 = 2;

/// A conv's sizes: an `h` x `w` map of `cin` input and `n` output channels (stride 1, padding 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv3x3Shape {
    pub h: usize,
    pub w: usize,
    pub cin: usize,
    pub n: usize,
}

impl Conv3x3Shape {
    /// Refuses a shape the kernel of `tile` does not tile, naming the rule.
    pub fn check(&self, tile: ConvTile) -> Result<(), tf_cuda::Error> {
        let pixels_a_tile = tile.pixels();
        if tile == ConvTile::Rows144 && self.w < pixels_a_tile {
            return Err(invalid(
                OP,
                format!(
                    "a map {} pixels wide: the row-reuse tile needs at least {pixels_a_tile}",
                    self.w
                ),
            ));
        }
        if self.h == 0 || self.w == 0 || self.cin == 0 || self.n == 0 {
            return Err(invalid(OP, format!("empty conv {self:?}")));
        }
        if !self.cin.is_multiple_of(8) {
            return Err(invalid(
                OP,
                format!(
                    "cin = {} is not a multiple of 8 (16-byte pixel rows): pad the channels",
                    self.cin
                ),
            ));
        }
        if !self.n.is_multiple_of(2) {
            return Err(invalid(
                OP,
                format!("n = {} is odd: the kernel stores pairs of channels", self.n),
            ));
        }
        if self.w < pixels_a_tile && !pixels_a_tile.is_multiple_of(self.w) {
            return Err(invalid(
                OP,
                format!(
                    "a map {} pixels wide: below {pixels_a_tile} the width must divide {pixels_a_tile} (a tile of \
                     {tile:?} is whole rows); use the im2col GEMM",
                    self.w
                ),
            ));
        }
        // The kernel indexes pixels, weight columns and tiles in 32-bit ints.
        let pixels = self
            .h
            .checked_mul(self.w)
            .ok_or_else(|| invalid(OP, "pixel count overflows"))?;
        to_i32(OP, "pixels", pixels)?;
        let k = self
            .cin
            .checked_mul(9)
            .ok_or_else(|| invalid(OP, "9 cin overflows"))?;
        to_i32(OP, "9 cin", k)?;
        to_i32(OP, "n", self.n)?;
        let tiles = self
            .m_tiles(tile)
            .checked_mul(self.n.div_ceil(tile.cols()))
            .ok_or_else(|| invalid(OP, "tile count overflows"))?;
        to_i32(OP, "tiles", tiles)?;
        Ok(())
    }

    /// Pixels of one row a tile of `tile` covers: all its pixels, or the whole row when the map is narrower.
    pub fn box_w(&self, tile: ConvTile) -> usize {
        self.w.min(tile.pixels())
    }

    /// Tiles of `tile` over the pixels (after [`Self::check`]).
    pub fn m_tiles(&self, tile: ConvTile) -> usize {
        let box_w = self.box_w(tile).max(1);
        let rows_per_tile = tile.pixels() / box_w;
        self.h.div_ceil(rows_per_tile.max(1)) * self.w.div_ceil(box_w)
    }
}

/// Checks `shape` (for `tile`, which [`ConvTile::for_channels`] picks) and the operands (`x` bf16 `[h, w, cin]`,
/// `weight` bf16 `[n, 9 cin]`, `bias` `[n]` and `y` `[h, w, n]` of the `output` type, `y` added to when `accumulate`)
/// and packs the launch for a GPU of `sm_count` SMs. The launch borrows nothing: only
/// [`super::gemm_int8::Int8GemmKernels::submit_spans`], which is `unsafe`, submits it.
pub fn plan_conv3x3_spans(
    ctx: &Context,
    sm_count: usize,
    (shape, tile): (Conv3x3Shape, ConvTile),
    (x, weight, bias): (DeviceSpan, DeviceSpan, DeviceSpan),
    (y, output): (DeviceSpan, ConvOutput),
    accumulate: bool,
) -> Result<Launch<'static>, tf_cuda::Error> {
    shape.check(tile)?;
    let Conv3x3Shape { h, w, cin, n } = shape;
    let pixels = h * w;
    let k = 9 * cin;
    check_span(OP, "x", x, bytes_of(OP, "x", &[pixels, cin, BF16])?, 16)?;
    check_span(
        OP,
        "weight",
        weight,
        bytes_of(OP, "weight", &[n, k, BF16])?,
        16,
    )?;
    // The epilogue moves pairs of channels: 4-byte (bf16) or 8-byte (f32) accesses.
    let size = output.bytes();
    check_span(
        OP,
        "bias",
        bias,
        bytes_of(OP, "bias", &[n, size])?,
        2 * size as u64,
    )?;
    check_span(
        OP,
        "y",
        y,
        bytes_of(OP, "y", &[pixels, n, size])?,
        2 * size as u64,
    )?;
    let box_w = shape.box_w(tile);
    let tm_x = encode_bf16_boxes(
        ctx,
        &Tiles {
            base: x.addr,
            cols: cin as u64,
            rows: w as u64,
            batch: h as u64,
            row_stride_bytes: (cin * BF16) as u64,
            batch_stride_bytes: (w * cin * BF16) as u64,
            box_cols: SLICE_CHANNELS as u32,
            // Row reuse loads the tile's pixels and one each side.
            box_rows: if tile == ConvTile::Rows144 {
                box_w + 2
            } else {
                box_w
            } as u32,
        },
        (tile.pixels() / box_w) as u32,
    )?;
    let tm_w = encode_bf16_tiles(
        ctx,
        &Tiles {
            base: weight.addr,
            cols: k as u64,
            rows: n as u64,
            batch: 1,
            row_stride_bytes: (k * BF16) as u64,
            batch_stride_bytes: 0,
            box_cols: SLICE_CHANNELS as u32,
            box_rows: tile.cols() as u32,
        },
    )?;
    let mut args = Args::new();
    args.push(tm_x.words())
        .push(tm_w.words())
        .push_addr(bias.addr)
        .push_addr(y.addr)
        .push(to_i32(OP, "h", h)?)
        .push(to_i32(OP, "w", w)?)
        .push(to_i32(OP, "cin", cin)?)
        .push(to_i32(OP, "n", n)?)
        .push(to_i32(OP, "box_w", box_w)?)
        .push(
            if accumulate { FLAG_ACCUMULATE } else { 0 }
                | if output == ConvOutput::F32 {
                    FLAG_F32
                } else {
                    0
                },
        );
    let tiles = shape.m_tiles(tile) * n.div_ceil(tile.cols());
    let grid = to_u32(OP, "CTAs", tiles.min(sm_count.max(1)))?;
    let config = LaunchConfig::new(grid, THREADS).with_shared(tile.shared_bytes());
    Ok(Launch::from_spans(tile.kernel(), config, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(h: usize, w: usize, cin: usize, n: usize) -> Conv3x3Shape {
        Conv3x3Shape { h, w, cin, n }
    }

    #[test]
    fn picks_the_tile_with_the_least_padding() {
        for (n, want) in [
            (144, ConvTile::Cols144),
            (288, ConvTile::Cols144),
            (1152, ConvTile::Cols144),
            (256, ConvTile::Cols256),
            (384, ConvTile::Cols144),
            (96, ConvTile::Cols144),
            (200, ConvTile::Cols256),
        ] {
            assert_eq!(ConvTile::for_channels(n, false), want, "n = {n}");
            let tall = if want == ConvTile::Cols144 {
                ConvTile::Tall144
            } else {
                want
            };
            assert_eq!(ConvTile::for_channels(n, true), tall, "n = {n}, tall");
        }
        assert_eq!(ConvTile::Cols144.shared_bytes(), 6 * 34 * 1024 + 1024);
        assert_eq!(ConvTile::Cols256.shared_bytes(), 4 * 48 * 1024 + 1024);
        assert_eq!(ConvTile::Tall144.shared_bytes(), 4 * 50 * 1024 + 1024);
        assert_eq!(
            ConvTile::Rows144.shared_bytes(),
            3 * (17 + 54) * 1024 + 1024
        );
    }

    #[test]
    fn tiles_cover_the_pixels() {
        // 1024 wide: 8 tiles a row; 64 wide: two rows a tile; 200 wide: a row's second tile hangs over.
        let (short, tall) = (ConvTile::Cols144, ConvTile::Tall144);
        assert_eq!(shape(1024, 1024, 144, 144).m_tiles(short), 1024 * 8);
        assert_eq!(shape(1024, 1024, 144, 144).m_tiles(tall), 1024 * 4);
        assert_eq!(shape(64, 64, 1152, 1152).m_tiles(short), 32);
        assert_eq!(shape(64, 64, 1152, 1152).m_tiles(tall), 16);
        assert_eq!(shape(5, 200, 16, 16).m_tiles(short), 10);
        assert_eq!(shape(5, 200, 16, 16).m_tiles(tall), 5);
        assert_eq!(shape(3, 64, 16, 16).m_tiles(short), 2);
        assert_eq!(shape(3, 64, 16, 16).box_w(short), 64);
        assert_eq!(shape(3, 128, 16, 16).box_w(tall), 128);
    }

    #[test]
    fn refuses_what_the_kernel_does_not_tile() {
        let (short, tall) = (ConvTile::Cols144, ConvTile::Tall144);
        for (bad, tile, rule) in [
            (shape(0, 64, 16, 16), short, "empty conv"),
            (shape(8, 64, 12, 16), short, "multiple of 8"),
            (shape(8, 64, 16, 15), short, "odd"),
            (shape(8, 96, 16, 16), short, "must divide 128"),
            (shape(8, 192, 16, 16), tall, "must divide 256"),
            (shape(8, 64, 16, 16), ConvTile::Rows144, "at least 128"),
            (shape(1 << 16, 1 << 16, 16, 16), short, "pixels"),
        ] {
            let err = bad.check(tile).expect_err(rule);
            assert!(err.to_string().contains(rule), "{bad:?}: {err}");
        }
        assert!(shape(8, 96 * 2, 16, 16).check(short).is_ok());
        assert!(shape(8, 1, 16, 16).check(tall).is_ok());
    }
}
