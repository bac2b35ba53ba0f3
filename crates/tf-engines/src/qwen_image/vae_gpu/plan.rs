//! The decoder's device buffers for one latent size ([`BufferPlan`], within a [`GpuVaeBudget`]) and the choice of
//! conv path ([`ConvPath`], [`implicit_tile`]): which 3x3 convs run as implicit GEMMs and which go through a column
//! matrix, decided in one place for the plan and the launches alike.

use super::{F32, POOL};
use crate::nn::gpu::conv::{Conv3x3Shape, ConvTile};
use crate::nn::weights::BF16;
use crate::qwen_image::vae::{VaeConfig, VaeError};
use crate::qwen_image::vae_ops::padded_channels;

/// Device memory limits of the scratch buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuVaeBudget {
    /// Most bytes of the 3x3 convolution column buffer (it grows to hold at least one output row).
    pub cols_bytes: usize,
    /// Most bytes of one chunk of attention scores (f32) and probabilities (bf16).
    pub scores_bytes: usize,
}

impl Default for GpuVaeBudget {
    fn default() -> Self {
        GpuVaeBudget {
            cols_bytes: 512 << 20,
            scores_bytes: 256 << 20,
        }
    }
}

/// The device buffers one latent size needs, in elements (see [`BufferPlan::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferPlan {
    pub latent_h: usize,
    pub latent_w: usize,
    /// Elements (bf16) of each of the four (`POOL`) activation buffers: the largest channels-last map.
    pub pool_elems: usize,
    /// Elements (bf16) of the column buffer: only the 3x3 convs the implicit GEMM does not take read one.
    pub cols_elems: usize,
    /// The conv path the plan was made for (`None`: every 3x3 conv through columns).
    pub implicit: Option<ConvPath>,
    /// Attention tokens (latent pixels) and padded width.
    pub tokens: usize,
    pub attention_cp: usize,
    /// Query rows per chunk of scores.
    pub score_rows: usize,
    /// Output pixels and padded output channels (the f32 conv_out result).
    pub out_pixels: usize,
    pub out_cp: usize,
    pub out_channels: usize,
    pub z: usize,
}

/// One 3x3 convolution of the decode: output size and padded channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ConvSite {
    pub(super) out_h: usize,
    pub(super) out_w: usize,
    pub(super) in_cp: usize,
    pub(super) out_cp: usize,
}

/// The implicit-GEMM tile that runs a 3x3 conv of `shape` on `path`, or `None` when the conv goes through columns
/// (no implicit path, or a map width no tile covers). The decoder and its [`BufferPlan`] decide by this one function.
pub(super) fn implicit_tile(path: Option<ConvPath>, shape: Conv3x3Shape) -> Option<ConvTile> {
    let path = path.filter(|p| *p != ConvPath::Im2col)?;
    let short = ConvTile::for_channels(shape.n, false);
    let tall = ConvTile::for_channels(shape.n, true);
    let tile = if path == ConvPath::Implicit
        && short == ConvTile::Cols144
        && shape.check(ConvTile::Rows144).is_ok()
    {
        ConvTile::Rows144
    } else if path != ConvPath::Implicit128 && shape.check(tall).is_ok() {
        tall
    } else {
        short
    };
    shape.check(tile).is_ok().then_some(tile)
}

impl BufferPlan {
    /// Sizes every buffer of a decode of an `h` x `w` latent whose 3x3 convs run on `implicit` (`None`: all through
    /// columns): walks the decoder as [`super::GpuVaeDecoder`] runs it. The column buffer serves only the convs the implicit
    /// GEMM does not take; when it takes them all, the buffer is empty.
    pub fn new(
        config: &VaeConfig,
        h: usize,
        w: usize,
        budget: GpuVaeBudget,
        implicit: Option<ConvPath>,
    ) -> Result<BufferPlan, VaeError> {
        if h == 0 || w == 0 {
            return Err(VaeError::Input(format!("a {h} x {w} latent is empty")));
        }
        let overflow = || VaeError::Input(format!("a {h} x {w} latent is too large to plan"));
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        let dims = config.decoder_dims();
        let levels = config.dim_mult.len();
        let zp = padded_channels(config.z_dim);
        let mid_cp = padded_channels(dims.first().copied().unwrap_or(1));
        let p0 = mul(h, w)?;
        let mut pool = mul(p0, zp.max(mid_cp))?;
        let mut sites = vec![ConvSite {
            out_h: h,
            out_w: w,
            in_cp: zp,
            out_cp: mid_cp,
        }];
        // Mid block: two resnets at the mid width.
        sites.push(ConvSite {
            out_h: h,
            out_w: w,
            in_cp: mid_cp,
            out_cp: mid_cp,
        });
        let (mut hh, mut ww) = (h, w);
        for (i, pair) in dims.windows(2).enumerate() {
            let (in_cp, out_cp) = (padded_channels(pair[0]), padded_channels(pair[1]));
            let pixels = mul(hh, ww)?;
            pool = pool.max(mul(pixels, in_cp.max(out_cp))?);
            for cp in [in_cp, out_cp] {
                sites.push(ConvSite {
                    out_h: hh,
                    out_w: ww,
                    in_cp: cp,
                    out_cp,
                });
            }
            if i + 1 != levels {
                hh = mul(hh, 2)?;
                ww = mul(ww, 2)?;
                pool = pool.max(mul(mul(hh, ww)?, out_cp)?);
                sites.push(ConvSite {
                    out_h: hh,
                    out_w: ww,
                    in_cp: out_cp,
                    out_cp,
                });
            }
        }
        let last_cp = padded_channels(dims.last().copied().unwrap_or(1));
        let out_cp = padded_channels(config.out_channels);
        sites.push(ConvSite {
            out_h: hh,
            out_w: ww,
            in_cp: last_cp,
            out_cp,
        });
        let mut one_row = 0usize;
        let mut whole = 0usize;
        let through_columns = sites.iter().filter(|s| {
            let shape = Conv3x3Shape {
                h: s.out_h,
                w: s.out_w,
                cin: s.in_cp,
                n: s.out_cp,
            };
            implicit_tile(implicit, shape).is_none()
        });
        for s in through_columns {
            let row = mul(mul(s.out_w, 9)?, s.in_cp)?;
            one_row = one_row.max(row);
            whole = whole.max(mul(row, s.out_h)?);
        }
        // No conv through columns: one_row and whole stay 0, and so does the buffer.
        let cols_elems = (budget.cols_bytes / BF16).clamp(one_row, whole.max(one_row));
        // Scores f32 plus probabilities bf16 per query row.
        let score_row_bytes = mul(p0, F32 + BF16)?;
        let score_rows = (budget.scores_bytes / score_row_bytes).clamp(1, p0);
        Ok(BufferPlan {
            latent_h: h,
            latent_w: w,
            pool_elems: pool,
            cols_elems,
            implicit,
            tokens: p0,
            attention_cp: mid_cp,
            score_rows,
            out_pixels: mul(hh, ww)?,
            out_cp,
            out_channels: config.out_channels,
            z: config.z_dim,
        })
    }

    /// Output rows per band of a 3x3 convolution writing `out_h` rows of `out_w` pixels from `in_cp` channels.
    pub fn band_rows(&self, out_h: usize, out_w: usize, in_cp: usize) -> usize {
        let row = out_w.saturating_mul(9).saturating_mul(in_cp).max(1);
        (self.cols_elems / row).clamp(1, out_h.max(1))
    }

    /// Bytes of every buffer of a decoder workspace with this plan.
    pub fn bytes(&self) -> usize {
        let sizes = self.sizes();
        sizes.iter().sum()
    }

    /// Bytes of each buffer, in the order the decoder's workspace allocates them.
    pub(super) fn sizes(&self) -> [usize; 8] {
        let act = self.pool_elems * BF16;
        let attn = self.tokens * self.attention_cp * BF16;
        [
            POOL * act,
            self.cols_elems * BF16,
            4 * attn,
            self.score_rows * self.tokens * F32,
            self.score_rows * self.tokens * BF16,
            self.tokens * self.z * F32,
            self.out_pixels * self.out_cp * F32,
            self.out_pixels * self.out_channels * (F32 + 1),
        ]
    }
}

/// The environment variable that picks how the decoder runs its 3x3 convolutions ([`ConvPath`]): `implicit` (the
/// default on sm_90), `implicit-tall`, `implicit128` or `im2col` (the only path on other GPUs).
pub const CONV_ENV: &str = "TF_VAE_CONV";

/// How the decoder runs its 3x3 convolutions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// One implicit-GEMM launch a conv ([`crate::nn::gpu::conv`]); where the channel count suits the 144-channel
    /// tile, the row-reuse tile on maps at least 128 wide and 256-pixel tiles on narrower ones (`implicit`, the
    /// default).
    Implicit,
    /// The same without the row-reuse tile: 256-pixel tiles wherever they fit (`implicit-tall`).
    ImplicitTall,
    /// The same with tiles of 128 pixels only, no row reuse (`implicit128`).
    Implicit128,
    /// A column matrix gathered per band of rows, then a cuBLASLt GEMM (`im2col`).
    Im2col,
}

impl ConvPath {
    /// The path [`CONV_ENV`]'s value names (the default when unset).
    pub fn parse(value: Option<&str>) -> Result<ConvPath, VaeError> {
        match value {
            None | Some("implicit") => Ok(ConvPath::Implicit),
            Some("implicit128") => Ok(ConvPath::Implicit128),
            Some("implicit-tall") => Ok(ConvPath::ImplicitTall),
            Some("im2col") => Ok(ConvPath::Im2col),
            Some(other) => Err(VaeError::Config(format!(
                "{CONV_ENV}={other:?} is not a conv path: use `implicit`, `implicit-tall`, `implicit128` or `im2col`"
            ))),
        }
    }

    /// The name [`Self::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            ConvPath::Implicit => "implicit",
            ConvPath::Implicit128 => "implicit128",
            ConvPath::ImplicitTall => "implicit-tall",
            ConvPath::Im2col => "im2col",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config(base: usize, z: usize) -> VaeConfig {
        let v = serde_json::json!({"_class_name": "AutoencoderKLQwenImage21", "decoder_base_dim": base,
            "z_dim": z, "latents_mean": vec![0.0; z], "latents_std": vec![1.0; z]});
        VaeConfig::from_json(&v).unwrap()
    }

    #[test]
    fn released_plan_at_1024_fits_the_largest_map() {
        let plan =
            BufferPlan::new(&config(144, 64), 64, 64, GpuVaeBudget::default(), None).unwrap();
        // Largest map: the 1024 x 1024 x 288 output of up block 3's upsample conv.
        assert_eq!(plan.pool_elems, 1024 * 1024 * 288);
        assert_eq!(plan.out_pixels, 1024 * 1024);
        assert_eq!((plan.out_cp, plan.out_channels), (8, 4));
        assert_eq!((plan.tokens, plan.attention_cp), (4096, 1152));
        assert_eq!(plan.cols_elems, (512 << 20) / 2);
        // All 4096 query rows' scores fit 256 MiB in one chunk.
        assert_eq!(plan.score_rows, 4096);
        // The widest row of columns: 1024 pixels x 9 taps x 288 channels.
        assert_eq!(
            plan.band_rows(1024, 1024, 288),
            (512 << 20) / 2 / (1024 * 9 * 288)
        );
        let gib = plan.bytes() as f64 / f64::from(1u32 << 30);
        assert!(gib > 2.0 && gib < 3.5, "{gib} GiB");
    }

    #[test]
    fn implicit_convs_need_columns_only_where_no_tile_covers_the_map() {
        let cfg = config(144, 64);
        let budget = GpuVaeBudget::default();
        // 1024x1024: every map is 64 wide (two rows a 256-pixel tile) or at least 128 (row reuse): no columns.
        for path in [
            ConvPath::Implicit,
            ConvPath::ImplicitTall,
            ConvPath::Implicit128,
        ] {
            let plan = BufferPlan::new(&cfg, 64, 64, budget, Some(path)).unwrap();
            assert_eq!(plan.cols_elems, 0, "{path:?}");
            assert_eq!(plan.implicit, Some(path));
        }
        let im2col = BufferPlan::new(&cfg, 64, 64, budget, Some(ConvPath::Im2col)).unwrap();
        assert_eq!(im2col.cols_elems, (512 << 20) / 2);
        // A 41 x 41 latent: the 41- and 82-pixel-wide maps fit no tile and go through columns (their widest row: 82
        // pixels x 9 taps x 1152 channels); the maps from 164 pixels on run on the row-reuse tile.
        let odd = BufferPlan::new(&cfg, 41, 41, budget, Some(ConvPath::Implicit)).unwrap();
        let all = BufferPlan::new(&cfg, 41, 41, budget, None).unwrap();
        assert_eq!(odd.band_rows(82, 82, 1152), 82);
        assert_eq!(odd.cols_elems, 82 * 82 * 9 * 1152);
        assert!(odd.cols_elems < all.cols_elems);
        // The decoder's choice and the plan's agree, by one function: the widths the plan sends to columns are
        // exactly those no tile takes.
        for (w, n, taken) in [
            (41, 1152, false),
            (82, 1152, false),
            (164, 1152, true),
            (64, 1152, true),
        ] {
            let shape = Conv3x3Shape {
                h: w,
                w,
                cin: 1152,
                n,
            };
            assert_eq!(
                implicit_tile(Some(ConvPath::Implicit), shape).is_some(),
                taken,
                "{w}"
            );
        }
        assert_eq!(
            implicit_tile(
                Some(ConvPath::Implicit),
                Conv3x3Shape {
                    h: 4,
                    w: 300,
                    cin: 144,
                    n: 144
                }
            ),
            Some(ConvTile::Rows144)
        );
        assert_eq!(
            implicit_tile(
                Some(ConvPath::ImplicitTall),
                Conv3x3Shape {
                    h: 4,
                    w: 64,
                    cin: 144,
                    n: 144
                }
            ),
            Some(ConvTile::Tall144)
        );
        assert_eq!(
            implicit_tile(
                Some(ConvPath::Implicit128),
                Conv3x3Shape {
                    h: 4,
                    w: 300,
                    cin: 144,
                    n: 256
                }
            ),
            Some(ConvTile::Cols256)
        );
        assert_eq!(
            implicit_tile(
                None,
                Conv3x3Shape {
                    h: 4,
                    w: 300,
                    cin: 144,
                    n: 144
                }
            ),
            None
        );
    }

    #[test]
    fn tiny_plan_covers_padded_channels() {
        // The fixture's widths 16, 16, 16, 8, 4, 2 pad to 16, 16, 16, 8, 8, 8; z 4 to 8.
        let plan = BufferPlan::new(&config(2, 4), 4, 6, GpuVaeBudget::default(), None).unwrap();
        assert_eq!(plan.out_pixels, 64 * 96);
        // Largest map: the 64 x 96 output at 8 (padded) channels, larger than 16 x 24 at 16.
        assert_eq!(plan.pool_elems, 64 * 96 * 8);
        // A small budget still holds one full row of the widest conv.
        let tight = BufferPlan::new(
            &config(2, 4),
            4,
            6,
            GpuVaeBudget {
                cols_bytes: 1,
                scores_bytes: 1,
            },
            None,
        )
        .unwrap();
        assert_eq!(tight.score_rows, 1);
        assert!(tight.cols_elems >= 96 * 9 * 8);
        assert_eq!(tight.band_rows(64, 96, 8), 1);
        assert!(BufferPlan::new(&config(2, 4), 0, 6, GpuVaeBudget::default(), None).is_err());
    }

    #[test]
    fn conv_path_names() {
        assert_eq!(ConvPath::parse(None).unwrap(), ConvPath::Implicit);
        for path in [
            ConvPath::Implicit,
            ConvPath::ImplicitTall,
            ConvPath::Implicit128,
            ConvPath::Im2col,
        ] {
            assert_eq!(ConvPath::parse(Some(path.name())).unwrap(), path);
        }
        let err = ConvPath::parse(Some("direct")).unwrap_err().to_string();
        assert!(
            err.contains("TF_VAE_CONV") && err.contains("im2col"),
            "{err}"
        );
    }

    proptest! {
        /// Bands tile the output rows exactly and each band's columns fit the column buffer.
        #[test]
        fn bands_fit_the_column_buffer(h in 1usize..9, w in 1usize..9, budget in 1usize..1 << 22, cp8 in 1usize..40) {
            let plan = BufferPlan::new(&config(8, 16), h, w, GpuVaeBudget { cols_bytes: budget, scores_bytes: budget }, None)
                .unwrap();
            let f = 16;
            let (oh, ow, cp) = (h * f, w * f, (cp8 * 8).min(64));
            let rows = plan.band_rows(oh, ow, cp);
            prop_assert!(rows >= 1 && rows <= oh);
            prop_assert!(rows * ow * 9 * cp <= plan.cols_elems.max(ow * 9 * cp));
            prop_assert!(plan.score_rows >= 1 && plan.score_rows <= plan.tokens);
        }
    }
}
