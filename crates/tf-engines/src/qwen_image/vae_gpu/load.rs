//! The decoder's weights: each tensor of a diffusers VAE folder read, shape-checked and packed into one device image
//! ([`Packer`]): convolutions as tap-major GEMM matrices with zero-padded channels, biases, norm gammas; and the
//! network they make ([`Net`]), which the decoder walks.

use super::F32;
use crate::nn::upload::Piece;
use crate::nn::weights::{le_bytes, Dtype, LayoutPlanner, ModelDir, WeightsError, BF16};
use crate::qwen_image::vae::{VaeConfig, VaeError};
use crate::qwen_image::vae_ops::{padded_channels, DupUpShape};

/// A convolution's GEMM matrix and bias in the weight buffer.
#[derive(Clone, Copy, Debug)]
pub(super) struct ConvW {
    pub(super) weight: usize,
    pub(super) bias: usize,
    pub(super) in_cp: usize,
    pub(super) out_cp: usize,
    /// 1 or 9.
    pub(super) taps: usize,
}

impl ConvW {
    pub(super) fn k(&self) -> usize {
        self.taps * self.in_cp
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct NormW {
    pub(super) gamma: usize,
    pub(super) channels: usize,
    pub(super) cp: usize,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct ResnetW {
    pub(super) norm1: NormW,
    pub(super) conv1: ConvW,
    pub(super) norm2: NormW,
    pub(super) conv2: ConvW,
    pub(super) shortcut: Option<ConvW>,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct AttentionW {
    pub(super) norm: NormW,
    pub(super) q: ConvW,
    pub(super) k: ConvW,
    pub(super) v: ConvW,
    pub(super) proj: ConvW,
}

#[derive(Clone, Debug)]
pub(super) struct UpBlockW {
    pub(super) resnets: Vec<ResnetW>,
    /// The upsample conv and the DupUp shortcut `(in_c, out_c, factor_t)`; absent on the last block.
    pub(super) upsample: Option<(ConvW, usize, usize, usize)>,
}

#[derive(Clone, Debug)]
pub(super) struct Net {
    pub(super) mean: usize,
    pub(super) std: usize,
    pub(super) post_quant: ConvW,
    pub(super) conv_in: ConvW,
    pub(super) mid: [ResnetW; 2],
    pub(super) attention: AttentionW,
    pub(super) blocks: Vec<UpBlockW>,
    pub(super) norm_out: NormW,
    pub(super) conv_out: ConvW,
}

/// The weight buffer, planned tensor by tensor: each tensor's host values (f32, little-endian) and where its
/// device image goes. The upload ring converts the bf16 ones on the way; the f32 ones are copied as they are.
pub(super) struct Packer {
    pub(super) planner: LayoutPlanner,
    /// (device offset, f32 bytes, stored as bf16).
    pub(super) parts: Vec<(usize, Vec<u8>, bool)>,
}

impl Packer {
    pub(super) fn new() -> Packer {
        Packer {
            planner: LayoutPlanner::default(),
            parts: Vec::new(),
        }
    }

    pub(super) fn place(&mut self, values: &[f32], bf16: bool) -> Result<usize, VaeError> {
        let elem = if bf16 { BF16 } else { F32 };
        let bytes = values.len().checked_mul(elem).ok_or_else(|| {
            VaeError::Config(format!("a tensor of {} values is too large", values.len()))
        })?;
        let offset = self.planner.one(bytes)?;
        self.parts
            .push((offset, le_bytes(values, f32::to_le_bytes), bf16));
        Ok(offset)
    }

    pub(super) fn bf16(&mut self, values: &[f32]) -> Result<usize, VaeError> {
        self.place(values, true)
    }

    pub(super) fn f32(&mut self, values: &[f32]) -> Result<usize, VaeError> {
        self.place(values, false)
    }

    /// Bytes of the device buffer: up to the end of the last tensor.
    pub(super) fn bytes(&self) -> usize {
        self.planner.end()
    }

    pub(super) fn pieces(&self) -> Vec<Piece<'_>> {
        self.parts
            .iter()
            .map(|(offset, bytes, bf16)| {
                if *bf16 {
                    Piece::bf16(bytes, Dtype::F32, *offset)
                } else {
                    Piece::copy(bytes, *offset)
                }
            })
            .collect()
    }

    /// The device image the upload writes, built on the host (zeros between tensors).
    #[cfg(test)]
    pub(super) fn host_image(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes()];
        crate::nn::upload::fill_host(&mut out, &self.pieces(), 1 << 16, 2).unwrap();
        out
    }
}

/// A PyTorch conv weight `[out, in, taps]` (rows `row0..row0 + out` of a larger one) as the padded GEMM matrix
/// `[out_cp, taps * in_cp]`, tap-major.
pub(super) fn gemm_matrix(
    weight: &[f32],
    row0: usize,
    out_c: usize,
    in_c: usize,
    taps: usize,
) -> Vec<f32> {
    let (out_cp, in_cp) = (padded_channels(out_c), padded_channels(in_c));
    let k = taps * in_cp;
    let mut m = vec![0f32; out_cp * k];
    for o in 0..out_c {
        let src = &weight[(row0 + o) * in_c * taps..(row0 + o + 1) * in_c * taps];
        for ci in 0..in_c {
            for t in 0..taps {
                m[o * k + t * in_cp + ci] = src[ci * taps + t];
            }
        }
    }
    m
}

pub(super) fn padded(values: &[f32], len: usize) -> Vec<f32> {
    let mut v = values.to_vec();
    v.resize(len.max(values.len()), 0.0);
    v
}

/// Reads the decoder's tensors, checks their shapes and packs them.
pub(super) struct Loader<'m> {
    pub(super) model: &'m ModelDir,
    pub(super) packer: Packer,
}

impl Loader<'_> {
    pub(super) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, VaeError> {
        let t = self.model.to_f32(name)?;
        if t.shape() != shape {
            return Err(VaeError::Weights(WeightsError::ShapeMismatch {
                path: self.model.dir().to_path_buf(),
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: t.shape().to_vec(),
            }));
        }
        Ok(t.into_data())
    }

    /// Rows `part * out_c..(part + 1) * out_c` of a conv stored with `parts * out_c` output channels.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv_part(
        &mut self,
        name: &str,
        in_c: usize,
        out_c: usize,
        kernel: usize,
        part: usize,
        parts: usize,
        f32_bias: bool,
    ) -> Result<ConvW, VaeError> {
        let taps = kernel * kernel;
        let weight = self.tensor(
            &format!("{name}.weight"),
            &[out_c * parts, in_c, kernel, kernel],
        )?;
        let bias = self.tensor(&format!("{name}.bias"), &[out_c * parts])?;
        let out_cp = padded_channels(out_c);
        let matrix = gemm_matrix(&weight, part * out_c, out_c, in_c, taps);
        let bias = padded(&bias[part * out_c..(part + 1) * out_c], out_cp);
        let weight = self.packer.bf16(&matrix)?;
        let bias = if f32_bias {
            self.packer.f32(&bias)?
        } else {
            self.packer.bf16(&bias)?
        };
        Ok(ConvW {
            weight,
            bias,
            in_cp: padded_channels(in_c),
            out_cp,
            taps,
        })
    }

    pub(super) fn conv(
        &mut self,
        name: &str,
        in_c: usize,
        out_c: usize,
        kernel: usize,
    ) -> Result<ConvW, VaeError> {
        self.conv_part(name, in_c, out_c, kernel, 0, 1, false)
    }

    pub(super) fn norm(
        &mut self,
        name: &str,
        channels: usize,
        shape: &[usize],
    ) -> Result<NormW, VaeError> {
        let gamma = self.tensor(name, shape)?;
        let cp = padded_channels(channels);
        Ok(NormW {
            gamma: self.packer.f32(&padded(&gamma, cp))?,
            channels,
            cp,
        })
    }

    pub(super) fn resnet(
        &mut self,
        name: &str,
        in_c: usize,
        out_c: usize,
    ) -> Result<ResnetW, VaeError> {
        Ok(ResnetW {
            norm1: self.norm(&format!("{name}.norm1.gamma"), in_c, &[in_c, 1, 1, 1])?,
            conv1: self.conv(&format!("{name}.conv1"), in_c, out_c, 3)?,
            norm2: self.norm(&format!("{name}.norm2.gamma"), out_c, &[out_c, 1, 1, 1])?,
            conv2: self.conv(&format!("{name}.conv2"), out_c, out_c, 3)?,
            shortcut: if in_c != out_c {
                Some(self.conv(&format!("{name}.conv_shortcut"), in_c, out_c, 1)?)
            } else {
                None
            },
        })
    }

    pub(super) fn net(&mut self, config: &VaeConfig) -> Result<Net, VaeError> {
        let z = config.z_dim;
        let dims = config.decoder_dims();
        let mid = dims[0];
        let levels = config.dim_mult.len();
        let temporal_up: Vec<bool> = config.temperal_downsample.iter().rev().copied().collect();
        let mean = self.packer.f32(&config.latents_mean)?;
        let std = self.packer.f32(&config.latents_std)?;
        let post_quant = self.conv("post_quant_conv", z, z, 1)?;
        let conv_in = self.conv("decoder.conv_in", z, mid, 3)?;
        let mid_resnets = [
            self.resnet("decoder.mid_block.resnets.0", mid, mid)?,
            self.resnet("decoder.mid_block.resnets.1", mid, mid)?,
        ];
        let a = "decoder.mid_block.attentions.0";
        let attention = AttentionW {
            norm: self.norm(&format!("{a}.norm.gamma"), mid, &[mid, 1, 1])?,
            q: self.conv_part(&format!("{a}.to_qkv"), mid, mid, 1, 0, 3, false)?,
            k: self.conv_part(&format!("{a}.to_qkv"), mid, mid, 1, 1, 3, false)?,
            v: self.conv_part(&format!("{a}.to_qkv"), mid, mid, 1, 2, 3, false)?,
            proj: self.conv(&format!("{a}.proj"), mid, mid, 1)?,
        };
        let mut blocks = Vec::with_capacity(levels);
        for (i, pair) in dims.windows(2).enumerate() {
            let (in_c, out_c) = (pair[0], pair[1]);
            let up = i + 1 != levels;
            let factor_t = if up && temporal_up.get(i).copied().unwrap_or(false) {
                2
            } else {
                1
            };
            let mut resnets = Vec::with_capacity(config.num_res_blocks + 1);
            for r in 0..=config.num_res_blocks {
                let from = if r == 0 { in_c } else { out_c };
                resnets.push(self.resnet(
                    &format!("decoder.up_blocks.{i}.resnets.{r}"),
                    from,
                    out_c,
                )?);
            }
            let upsample = if up {
                let shape = DupUpShape {
                    h: 1,
                    w: 1,
                    in_c,
                    out_c,
                    factor_t,
                };
                if shape.repeats().is_none() {
                    return Err(VaeError::Config(format!(
                        "up block {i}: {out_c} x {} sub-positions is not a multiple of {in_c} input channels",
                        factor_t * 4
                    )));
                }
                let conv = self.conv(
                    &format!("decoder.up_blocks.{i}.upsampler.resample.1"),
                    out_c,
                    out_c,
                    3,
                )?;
                Some((conv, in_c, out_c, factor_t))
            } else {
                None
            };
            blocks.push(UpBlockW { resnets, upsample });
        }
        let last = dims.last().copied().unwrap_or(mid);
        let norm_out = self.norm("decoder.norm_out.gamma", last, &[last, 1, 1, 1])?;
        let conv_out =
            self.conv_part("decoder.conv_out", last, config.out_channels, 3, 0, 1, true)?;
        Ok(Net {
            mean,
            std,
            post_quant,
            conv_in,
            mid: mid_resnets,
            attention,
            blocks,
            norm_out,
            conv_out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_matrix_is_tap_major_and_zero_padded() {
        // 2 out x 3 in x 9 taps: element (o, ci, t) = 100 o + 10 ci + t.
        let w: Vec<f32> = (0..2 * 3 * 9)
            .map(|i| (100 * (i / 27) + 10 * (i / 9 % 3) + i % 9) as f32)
            .collect();
        let m = gemm_matrix(&w, 0, 2, 3, 9);
        assert_eq!(m.len(), 8 * 9 * 8);
        let k = 9 * 8;
        assert_eq!(m[k + 4 * 8 + 2], 124.0); // o = 1, tap 4, ci 2
        assert_eq!(m[3], 0.0); // padding input channel
        assert!(m[2 * k..].iter().all(|&v| v == 0.0)); // padding output rows
                                                       // Rows 1.. of a fused [3, 1, 1, 1] weight: part 1 of 3 with one output.
        let fused = [5.0, 6.0, 7.0];
        assert_eq!(gemm_matrix(&fused, 1, 1, 1, 1)[0], 6.0);
    }

    #[test]
    fn fixture_weights_pack_into_the_decoder_layout() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen_vae/model");
        let model = ModelDir::open(&dir).unwrap();
        let config = VaeConfig::from_json(model.config_json()).unwrap();
        let mut loader = Loader {
            model: &model,
            packer: Packer::new(),
        };
        let net = loader.net(&config).unwrap();
        // Five up blocks of three resnets; DupUp on the first four, temporal factor 2 except the last one.
        assert_eq!(net.blocks.len(), 5);
        assert!(net.blocks.iter().all(|b| b.resnets.len() == 3));
        let factors: Vec<Option<usize>> = net
            .blocks
            .iter()
            .map(|b| b.upsample.map(|(_, _, _, ft)| ft))
            .collect();
        assert_eq!(factors, vec![Some(2), Some(2), Some(2), Some(1), None]);
        // Width changes (16 -> 8 -> 4 -> 2) get 1x1 shortcuts, nothing else does.
        let shortcuts: Vec<bool> = net
            .blocks
            .iter()
            .map(|b| b.resnets[0].shortcut.is_some())
            .collect();
        assert_eq!(shortcuts, vec![false, false, true, true, true]);
        assert_eq!((net.conv_out.out_cp, net.conv_out.k()), (8, 9 * 8));
        assert_eq!(
            (
                net.attention.q.in_cp,
                net.attention.q.out_cp,
                net.attention.q.taps
            ),
            (16, 16, 1)
        );
        // The q, k and v parts are distinct rows of to_qkv: packed apart and all different.
        let image = loader.packer.host_image();
        let bytes = &image;
        let part = |c: &ConvW| bytes[c.weight..c.weight + 16 * 16 * BF16].to_vec();
        assert_ne!(part(&net.attention.q), part(&net.attention.k));
        assert_ne!(part(&net.attention.k), part(&net.attention.v));
        // The first q row equals row 0 of the stored to_qkv weight, rounded to bf16.
        let stored = model
            .to_f32("decoder.mid_block.attentions.0.to_qkv.weight")
            .unwrap();
        let first = half::bf16::from_le_bytes([
            bytes[net.attention.q.weight],
            bytes[net.attention.q.weight + 1],
        ]);
        assert_eq!(
            first.to_f32(),
            half::bf16::from_f32(stored.data()[0]).to_f32()
        );
        // A missing tensor is a weights error naming it.
        let err = Loader {
            model: &model,
            packer: Packer::new(),
        }
        .conv("decoder.no_such_conv", 2, 2, 3)
        .unwrap_err()
        .to_string();
        assert!(err.contains("decoder.no_such_conv"), "{err}");
    }
}
