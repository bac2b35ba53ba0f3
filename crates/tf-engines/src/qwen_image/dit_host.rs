//! The Qwen-Image 2.1 DiT on the host: f32, built from [`crate::nn::host`], the reference every other backend
//! is checked against.
//!
//! The forward follows `QwenImage21Transformer2DModel` (diffusers 0.42.1): `img_in` on the latents, `txt_in`
//! (zero-centred RMSNorm, linear, GELU-tanh, linear) on the text rows, the joint sequence in VLM order
//! ([`JointLayout`]), one shared modulation `[scale1 | gate1 | scale2 | gate2]` from the timestep embedding (plus a
//! `t = 0` row for prefix tokens with `causal_condition`), single-stream blocks (LayerNorm x (1 + scale), QK
//! RMSNorm, 3-axis RoPE, block-causal attention, tanh-gated residuals, SwiGLU), and the scale-only output norm.

use super::config::{QwenImageDitConfig, ROPE_THETA, TIMESTEP_DIM};
use super::dit::{
    check_folder, DitBackend, DitError, DitInputs, DitOutput, HostKvCache, JointLayout, KvStep,
    TokenSource,
};
use crate::nn::host as ops;
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::weights::{LoadStats, ModelDir};

struct BlockWeights {
    to_q: Vec<f32>,
    to_k: Vec<f32>,
    to_v: Vec<f32>,
    to_out: Vec<f32>,
    norm_q: Vec<f32>,
    norm_k: Vec<f32>,
    mlp_proj: Vec<f32>,
    mlp_gate: Vec<f32>,
    mlp_out: Vec<f32>,
}

struct HostWeights {
    img_in: Vec<f32>,
    txt_norm: Vec<f32>,
    txt_in_layer: Vec<f32>,
    txt_out_layer: Vec<f32>,
    time_linear_1: Vec<f32>,
    time_linear_2: Vec<f32>,
    modulation: Vec<f32>,
    norm_out: Vec<f32>,
    proj_out: Vec<f32>,
    blocks: Vec<BlockWeights>,
}

/// The host reference DiT: weights converted to f32 in memory.
pub struct HostDit {
    config: QwenImageDitConfig,
    weights: HostWeights,
    load_stats: LoadStats,
}

impl std::fmt::Debug for HostDit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDit")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl HostDit {
    /// Validates the folder against its config (every tensor, shape and dtype) and converts the weights to f32.
    pub fn load(model: &ModelDir) -> Result<HostDit, DitError> {
        let config = QwenImageDitConfig::from_json(model.config_json())?;
        let checkpoint = check_folder(model, &config)?;
        let specs = config.tensor_specs();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        // Weights stored in FP8 are dequantized (code times the scale of its row).
        let (mut tensors, load_stats) = checkpoint.load_f32(model, &names)?;
        let mut take = |name: &str| -> Result<Vec<f32>, DitError> {
            tensors.remove(name).map(Tensor::into_data).ok_or_else(|| {
                DitError::Weights(crate::nn::weights::WeightsError::MissingTensor {
                    name: name.to_string(),
                    place: model.dir().display().to_string(),
                })
            })
        };
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("transformer_blocks.{i}.");
            blocks.push(BlockWeights {
                to_q: take(&format!("{p}attn.to_q.weight"))?,
                to_k: take(&format!("{p}attn.to_k.weight"))?,
                to_v: take(&format!("{p}attn.to_v.weight"))?,
                to_out: take(&format!("{p}attn.to_out.0.weight"))?,
                norm_q: take(&format!("{p}attn.norm_q.weight"))?,
                norm_k: take(&format!("{p}attn.norm_k.weight"))?,
                mlp_proj: take(&format!("{p}img_mlp.proj.weight"))?,
                mlp_gate: take(&format!("{p}img_mlp.gate_layer.weight"))?,
                mlp_out: take(&format!("{p}img_mlp.out.weight"))?,
            });
        }
        let weights = HostWeights {
            img_in: take("img_in.weight")?,
            txt_norm: take("txt_in.text_norm.weight")?,
            txt_in_layer: take("txt_in.in_layer.weight")?,
            txt_out_layer: take("txt_in.out_layer.weight")?,
            time_linear_1: take("time_text_embed.timestep_embedder.linear_1.weight")?,
            time_linear_2: take("time_text_embed.timestep_embedder.linear_2.weight")?,
            modulation: take("modulation.1.weight")?,
            norm_out: take("norm_out.linear.weight")?,
            proj_out: take("proj_out.weight")?,
            blocks,
        };
        Ok(HostDit {
            config,
            weights,
            load_stats,
        })
    }

    /// Bytes read and time taken to convert the weights.
    pub fn load_stats(&self) -> LoadStats {
        self.load_stats
    }

    /// `temb` rows for `timesteps`: sinusoid -> linear_1 -> SiLU -> linear_2.
    fn time_embedding(&self, timesteps: &[f32]) -> Result<Vec<f32>, DitError> {
        let d = self.config.inner_dim();
        let n = timesteps.len();
        let mut sinusoid = vec![0f32; n * TIMESTEP_DIM];
        ops::timestep_embedding(timesteps, TIMESTEP_DIM, &mut sinusoid)?;
        let mut hidden = vec![0f32; n * d];
        ops::linear(
            &sinusoid,
            n,
            TIMESTEP_DIM,
            &self.weights.time_linear_1,
            d,
            &mut hidden,
        )?;
        ops::silu_inplace(&mut hidden);
        let mut temb = vec![0f32; n * d];
        ops::linear(&hidden, n, d, &self.weights.time_linear_2, d, &mut temb)?;
        Ok(temb)
    }

    /// `txt_in` on `rows` text rows.
    fn text_projection(&self, text: &[f32], rows: usize) -> Result<Vec<f32>, DitError> {
        let (ctx, d, eps) = (
            self.config.context_in_dim,
            self.config.inner_dim(),
            self.config.eps,
        );
        let mut normed = vec![0f32; rows * ctx];
        ops::rms_norm_zero_centred(text, rows, ctx, &self.weights.txt_norm, eps, &mut normed)?;
        let mut hidden = vec![0f32; rows * d];
        ops::linear(
            &normed,
            rows,
            ctx,
            &self.weights.txt_in_layer,
            d,
            &mut hidden,
        )?;
        ops::gelu_tanh_inplace(&mut hidden);
        let mut out = vec![0f32; rows * d];
        ops::linear(&hidden, rows, d, &self.weights.txt_out_layer, d, &mut out)?;
        Ok(out)
    }
}

/// Per-sample modulation tables, each `[n_mod, D]`: row 0 the sample's timestep, row 1 (if any) `t = 0`.
struct Modulation {
    scale1: Vec<f32>,
    gate1: Vec<f32>,
    scale2: Vec<f32>,
    gate2: Vec<f32>,
    out_scale: Vec<f32>,
}

impl DitBackend for HostDit {
    type KvCache = HostKvCache;

    fn config(&self) -> &QwenImageDitConfig {
        &self.config
    }

    fn forward(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, HostKvCache>,
    ) -> Result<DitOutput<HostKvCache>, DitError> {
        let cfg = &self.config;
        let layout = JointLayout::build(cfg, inputs)?;
        if !matches!(kv, KvStep::None) && !cfg.causal_condition {
            return Err(DitError::KvCache(
                "a KV cache needs causal_condition = true (prefix tokens must not depend on the timestep)".into(),
            ));
        }
        if let KvStep::Cached(cache) = kv {
            cache.check(cfg, layout.batch, layout.prefix_len)?;
        }
        let (batch, seq) = (layout.batch, layout.seq_len);
        let (d, heads, head_dim, ffn, eps) = (
            cfg.inner_dim(),
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            cfg.mlp_hidden(),
            cfg.eps,
        );
        let (in_ch, ctx, out_ch) = (cfg.in_channels, cfg.context_in_dim, cfg.out_channels());
        let cached = matches!(kv, KvStep::Cached(_));
        let first_row = if cached { layout.prefix_len } else { 0 };
        let rows = seq - first_row;
        let n_img = inputs.hidden_states.shape()[1];
        let l_vlm = inputs.encoder_hidden_states.shape()[1];

        // Timestep rows [t_0 .. t_{B-1}, (0)] -> temb -> shared modulation and output scale.
        let mut timesteps = inputs.timestep.data().to_vec();
        if cfg.causal_condition {
            timesteps.push(0.0);
        }
        let n_t = timesteps.len();
        let temb = self.time_embedding(&timesteps)?;
        let mut silu_temb = temb.clone();
        ops::silu_inplace(&mut silu_temb);
        let mut modulation = vec![0f32; n_t * 4 * d];
        ops::linear(
            &silu_temb,
            n_t,
            d,
            &self.weights.modulation,
            4 * d,
            &mut modulation,
        )?;
        let mut out_scale = vec![0f32; n_t * d];
        ops::linear(
            &silu_temb,
            n_t,
            d,
            &self.weights.norm_out,
            d,
            &mut out_scale,
        )?;
        let tables = |b: usize| -> Modulation {
            let mod_rows: Vec<usize> = if cfg.causal_condition {
                vec![b, batch]
            } else {
                vec![b]
            };
            let pick = |chunk: usize| -> Vec<f32> {
                mod_rows
                    .iter()
                    .flat_map(|&r| {
                        modulation[r * 4 * d + chunk * d..r * 4 * d + (chunk + 1) * d]
                            .iter()
                            .copied()
                    })
                    .collect()
            };
            Modulation {
                scale1: pick(0),
                gate1: pick(1),
                scale2: pick(2),
                gate2: pick(3),
                out_scale: mod_rows
                    .iter()
                    .flat_map(|&r| out_scale[r * d..(r + 1) * d].iter().copied())
                    .collect(),
            }
        };

        let row_mod = &layout.row_mod[first_row..];
        let n_mod = layout.n_mod;
        let (cos, sin) = ops::rope_tables(
            &layout.positions[first_row..],
            cfg.axes_dims_rope,
            ROPE_THETA,
        );

        let mut extracted = if matches!(kv, KvStep::Extract) {
            let shape = vec![batch, layout.prefix_len, heads, head_dim];
            let mut layers = Vec::with_capacity(cfg.num_layers);
            for _ in 0..cfg.num_layers {
                layers.push((
                    TensorF32::zeros(shape.clone())?,
                    TensorF32::zeros(shape.clone())?,
                ));
            }
            Some(HostKvCache {
                batch,
                prefix_len: layout.prefix_len,
                heads,
                head_dim,
                layers,
            })
        } else {
            None
        };

        let mut sample = vec![0f32; batch * rows * out_ch];
        let kv_row = heads * head_dim;
        let prefix_elems = layout.prefix_len * kv_row;
        for b in 0..batch {
            let m = tables(b);
            // Inputs of this sample: image tokens through img_in, text rows through txt_in (not needed when cached).
            let latents = &inputs.hidden_states.data()[b * n_img * in_ch..(b + 1) * n_img * in_ch];
            let mut image = vec![0f32; n_img * d];
            ops::linear(latents, n_img, in_ch, &self.weights.img_in, d, &mut image)?;
            let text = if cached {
                Vec::new()
            } else {
                let rows_in =
                    &inputs.encoder_hidden_states.data()[b * l_vlm * ctx..(b + 1) * l_vlm * ctx];
                self.text_projection(rows_in, l_vlm)?
            };
            let mut x = vec![0f32; rows * d];
            for (dst, src) in x.chunks_exact_mut(d).zip(&layout.sources[first_row..]) {
                let row = match *src {
                    TokenSource::Image(n) => &image[n * d..(n + 1) * d],
                    TokenSource::Text(t) => &text[t * d..(t + 1) * d],
                };
                dst.copy_from_slice(row);
            }

            let mask = ops::AttentionMask {
                q_offset: first_row,
                block_ids: &layout.block_ids,
                key_valid: &layout.key_valid[b],
            };
            let mut normed = vec![0f32; rows * d];
            let mut q = vec![0f32; rows * d];
            let mut k = vec![0f32; rows * d];
            let mut v = vec![0f32; rows * d];
            let mut attn = vec![0f32; rows * d];
            let mut proj = vec![0f32; rows * d];
            let mut gate = vec![0f32; rows * ffn];
            let mut up = vec![0f32; rows * ffn];
            for (layer, w) in self.weights.blocks.iter().enumerate() {
                ops::layer_norm_modulate(&x, rows, d, &m.scale1, n_mod, row_mod, eps, &mut normed)?;
                ops::linear(&normed, rows, d, &w.to_q, d, &mut q)?;
                ops::linear(&normed, rows, d, &w.to_k, d, &mut k)?;
                ops::linear(&normed, rows, d, &w.to_v, d, &mut v)?;
                let mut tmp = vec![0f32; rows * d];
                ops::rms_norm(&q, rows * heads, head_dim, &w.norm_q, eps, &mut tmp)?;
                std::mem::swap(&mut q, &mut tmp);
                ops::rms_norm(&k, rows * heads, head_dim, &w.norm_k, eps, &mut tmp)?;
                std::mem::swap(&mut k, &mut tmp);
                ops::rope_interleaved(&mut q, rows, heads, head_dim, &cos, &sin)?;
                ops::rope_interleaved(&mut k, rows, heads, head_dim, &cos, &sin)?;

                if let Some(cache) = extracted.as_mut() {
                    let (ck, cv) = &mut cache.layers[layer];
                    ck.data_mut()[b * prefix_elems..(b + 1) * prefix_elems]
                        .copy_from_slice(&k[..prefix_elems]);
                    cv.data_mut()[b * prefix_elems..(b + 1) * prefix_elems]
                        .copy_from_slice(&v[..prefix_elems]);
                }
                if let KvStep::Cached(cache) = kv {
                    let (ck, cv) = &cache.layers[layer];
                    let mut keys = ck.data()[b * prefix_elems..(b + 1) * prefix_elems].to_vec();
                    keys.extend_from_slice(&k);
                    let mut values = cv.data()[b * prefix_elems..(b + 1) * prefix_elems].to_vec();
                    values.extend_from_slice(&v);
                    ops::attention(
                        &q, &keys, &values, rows, seq, heads, head_dim, mask, &mut attn,
                    )?;
                } else {
                    ops::attention(&q, &k, &v, rows, seq, heads, head_dim, mask, &mut attn)?;
                }
                ops::linear(&attn, rows, d, &w.to_out, d, &mut proj)?;
                ops::gated_residual(&mut x, rows, d, &proj, &m.gate1, n_mod, row_mod)?;

                ops::layer_norm_modulate(&x, rows, d, &m.scale2, n_mod, row_mod, eps, &mut normed)?;
                ops::linear(&normed, rows, d, &w.mlp_gate, ffn, &mut gate)?;
                ops::linear(&normed, rows, d, &w.mlp_proj, ffn, &mut up)?;
                let mut hidden = vec![0f32; rows * ffn];
                ops::swiglu(&gate, &up, &mut hidden)?;
                ops::linear(&hidden, rows, ffn, &w.mlp_out, d, &mut proj)?;
                ops::gated_residual(&mut x, rows, d, &proj, &m.gate2, n_mod, row_mod)?;
            }
            ops::layer_norm_modulate(&x, rows, d, &m.out_scale, n_mod, row_mod, eps, &mut normed)?;
            let out = &mut sample[b * rows * out_ch..(b + 1) * rows * out_ch];
            ops::linear(&normed, rows, d, &self.weights.proj_out, out_ch, out)?;
        }
        Ok(DitOutput {
            sample: Tensor::new(vec![batch, rows, out_ch], sample)?,
            kv_cache: extracted,
        })
    }

    fn kv_to_host(&self, cache: &HostKvCache) -> Result<HostKvCache, DitError> {
        Ok(cache.clone())
    }

    fn kv_from_host(&mut self, cache: HostKvCache) -> Result<HostKvCache, DitError> {
        Ok(cache)
    }
}
