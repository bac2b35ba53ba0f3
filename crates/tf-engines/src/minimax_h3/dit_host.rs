//! The MiniMax H3 DiT on the host: f32, built from [`crate::nn::host`], the reference every other backend is
//! checked against.
//!
//! The forward follows `MiniMaxH3Transformer3DModel` (diffusers 0.42.1):
//! - input projections (with bias) of the video rows, the audio rows and the text rows; the text then goes
//!   through the token refiner (pre-norm blocks `x += Attn(RMSNorm(x))`, `x += SwiGLU(RMSNorm(x))`, no RoPE, no
//!   modulation) and its final RMSNorm; the three are scattered into one packed sequence;
//! - the time embedder on the distinct timesteps (sinusoid `[cos | sin]` of the unscaled `t`, linear, SiLU,
//!   linear), and per block an adaLN table `Linear(SiLU(temb))` viewed as `[T * 3, 6 * hidden]` whose row
//!   `timestep_index * 3 + tag` modulates each row: `RMSNorm(x) * w * (1 + scale) + shift`, plain gates;
//! - attention: q/k/v without bias, per-head RMSNorm of q and k, rotate-half RoPE on the first
//!   `6 * rope_freq_dim` channels of each head (the rest pass through), full attention with no mask;
//! - SwiGLU with the fused projection in `[value | gate]` order;
//! - `norm_out`: `RMSNorm(x) * w * (1 + scale) + shift`, `[shift | scale]` from `Linear(SiLU(temb))` indexed by
//!   the row's timestep only; then the video head on the video rows and the audio head on the audio rows.
//!
//! RoPE tables are computed in f32 (`f32(position) * inv_freq`). By default they are used as they are, as a
//! float32 run of the reference uses them; with [`RopeTables::Bf16`] they are rounded to bf16 before use, as a
//! bfloat16 run of the reference does (it casts cos/sin to the activation dtype). Both run the shared
//! [`ops::rope_rotate_half_partial`].

use std::collections::BTreeMap;

use super::checkpoint::{self, CheckpointLayout, QkvLayout};
use super::config::{MiniMaxH3Config, MODALITIES, MODULATION_CHUNKS};
use super::dit::{H3DitBackend, H3Error, H3Inputs, H3Output, H3Rows};
use crate::nn::host as ops;
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::weights::{LoadStats, ModelDir, WeightsError};

/// Precision of the RoPE cos/sin tables: f32 as a float32 run of the reference, or rounded to bf16 as a bfloat16
/// run does.
pub use crate::nn::host::RopeTableRounding as RopeTables;

/// How to read a folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// Row order of the fused `qkv_proj` of an original-layout folder (ignored for diffusers folders).
    pub qkv: QkvLayout,
}

struct AttnBlock {
    norm1: Vec<f32>,
    to_q: Vec<f32>,
    to_k: Vec<f32>,
    to_v: Vec<f32>,
    norm_q: Vec<f32>,
    norm_k: Vec<f32>,
    to_out: Vec<f32>,
    norm2: Vec<f32>,
    ff_in: Vec<f32>,
    ff_out: Vec<f32>,
}

struct Block {
    attn: AttnBlock,
    adaln_w: Vec<f32>,
    adaln_b: Vec<f32>,
}

struct Linear {
    w: Vec<f32>,
    b: Vec<f32>,
}

struct HostWeights {
    proj_in: Linear,
    audio_proj_in: Linear,
    context_embedder: Linear,
    time_1: Linear,
    time_2: Linear,
    refiner: Vec<AttnBlock>,
    refiner_norm: Vec<f32>,
    blocks: Vec<Block>,
    norm_out_w: Vec<f32>,
    norm_out: Linear,
    proj_out: Linear,
    audio_proj_out: Linear,
}

/// The host reference DiT: weights converted to f32 in memory.
pub struct HostH3Dit {
    config: MiniMaxH3Config,
    layout: CheckpointLayout,
    weights: HostWeights,
    rope_tables: RopeTables,
    load_stats: LoadStats,
}

impl std::fmt::Debug for HostH3Dit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostH3Dit")
            .field("config", &self.config)
            .field("layout", &self.layout)
            .field("rope_tables", &self.rope_tables)
            .finish_non_exhaustive()
    }
}

/// Converts every tensor of `model` to f32 under its diffusers name, checking the folder first. Weights stored in
/// FP8 with their scales are dequantized (`decode(code) * scale` of their row).
fn load_tensors(
    model: &ModelDir,
    config: &MiniMaxH3Config,
    layout: CheckpointLayout,
) -> Result<(BTreeMap<String, TensorF32>, LoadStats), H3Error> {
    if let CheckpointLayout::Original(_) = layout {
        if let Ok(info) = model.info(checkpoint::PRUNED_TABLE) {
            return Err(H3Error::Checkpoint {
                file: model.dir().display().to_string(),
                tensor: checkpoint::PRUNED_TABLE.into(),
                why: format!(
                    "a pruned checkpoint (shape {:?} instead of the time embedder) is not supported; use the unpruned release",
                    info.shape
                ),
            });
        }
    }
    let fp8 = checkpoint::check_folder(model, config, layout)?;
    let specs = checkpoint::folder_specs(model, config, layout);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let (loaded, stats) = fp8.load_f32(model, &names)?;
    let CheckpointLayout::Original(qkv) = layout else {
        return Ok((loaded, stats));
    };
    let mut out = BTreeMap::new();
    for (name, tensor) in loaded {
        let file = model.file_of(&name)?.path().display().to_string();
        let mapped = checkpoint::to_diffusers(config, qkv, &name, tensor).map_err(|e| {
            H3Error::Checkpoint {
                file: file.clone(),
                tensor: e.tensor,
                why: e.why,
            }
        })?;
        out.extend(mapped);
    }
    Ok((out, stats))
}

/// Per-row `(1 + scale) + shift` from `[n_mod, hidden]` tables, row `r` reading table row `row_mod[r]`.
#[derive(Clone, Copy)]
struct RowModulation<'a> {
    shift: &'a [f32],
    scale: &'a [f32],
    n_mod: usize,
    row_mod: &'a [usize],
}

/// Moves converted tensors out of the loaded map by diffusers name.
struct Take<'a> {
    tensors: &'a mut BTreeMap<String, TensorF32>,
    place: String,
}

impl Take<'_> {
    fn take(&mut self, name: &str) -> Result<Vec<f32>, H3Error> {
        self.tensors
            .remove(name)
            .map(Tensor::into_data)
            .ok_or_else(|| {
                H3Error::Weights(WeightsError::MissingTensor {
                    name: name.to_string(),
                    place: self.place.clone(),
                })
            })
    }

    fn linear(&mut self, p: &str) -> Result<Linear, H3Error> {
        Ok(Linear {
            w: self.take(&format!("{p}.weight"))?,
            b: self.take(&format!("{p}.bias"))?,
        })
    }

    fn attn_block(&mut self, p: &str) -> Result<AttnBlock, H3Error> {
        Ok(AttnBlock {
            norm1: self.take(&format!("{p}norm1.weight"))?,
            to_q: self.take(&format!("{p}attn.to_q.weight"))?,
            to_k: self.take(&format!("{p}attn.to_k.weight"))?,
            to_v: self.take(&format!("{p}attn.to_v.weight"))?,
            norm_q: self.take(&format!("{p}attn.norm_q.weight"))?,
            norm_k: self.take(&format!("{p}attn.norm_k.weight"))?,
            to_out: self.take(&format!("{p}attn.to_out.0.weight"))?,
            norm2: self.take(&format!("{p}norm2.weight"))?,
            ff_in: self.take(&format!("{p}ff.net.0.proj.weight"))?,
            ff_out: self.take(&format!("{p}ff.net.2.weight"))?,
        })
    }
}

impl HostH3Dit {
    /// Validates the folder against its config and converts the weights to f32: a diffusers folder, or an
    /// original release folder (mapped at load, fused qkv interleaved per head).
    pub fn load(model: &ModelDir) -> Result<HostH3Dit, H3Error> {
        Self::load_with(model, LoadOptions::default())
    }

    /// [`HostH3Dit::load`] with options (the qkv order of an original folder).
    pub fn load_with(model: &ModelDir, options: LoadOptions) -> Result<HostH3Dit, H3Error> {
        let config =
            MiniMaxH3Config::from_json_file(model.config_json(), &model.dir().join("config.json"))?;
        let layout = checkpoint::detect(model, options.qkv);
        let (mut tensors, load_stats) = load_tensors(model, &config, layout)?;
        let mut t = Take {
            tensors: &mut tensors,
            place: model.dir().display().to_string(),
        };
        let mut refiner = Vec::with_capacity(config.num_refiner_layers);
        for j in 0..config.num_refiner_layers {
            refiner.push(t.attn_block(&format!("token_refiner.refiner_blocks.{j}."))?);
        }
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("transformer_blocks.{i}.");
            blocks.push(Block {
                attn: t.attn_block(&p)?,
                adaln_w: t.take(&format!("{p}adaln_proj.linear.weight"))?,
                adaln_b: t.take(&format!("{p}adaln_proj.linear.bias"))?,
            });
        }
        let weights = HostWeights {
            proj_in: t.linear("proj_in")?,
            audio_proj_in: t.linear("audio_proj_in")?,
            context_embedder: t.linear("context_embedder")?,
            time_1: t.linear("time_embedder.linear_1")?,
            time_2: t.linear("time_embedder.linear_2")?,
            refiner,
            refiner_norm: t.take("token_refiner.final_norm.weight")?,
            blocks,
            norm_out_w: t.take("norm_out.norm.weight")?,
            norm_out: t.linear("norm_out.linear")?,
            proj_out: t.linear("proj_out")?,
            audio_proj_out: t.linear("audio_proj_out")?,
        };
        Ok(HostH3Dit {
            config,
            layout,
            weights,
            rope_tables: RopeTables::default(),
            load_stats,
        })
    }

    /// Which layout the folder held.
    pub fn checkpoint_layout(&self) -> CheckpointLayout {
        self.layout
    }

    /// Bytes read and time taken to convert the weights.
    pub fn load_stats(&self) -> LoadStats {
        self.load_stats
    }

    /// Sets the precision of the RoPE tables (f32 unless changed).
    pub fn set_rope_tables(&mut self, tables: RopeTables) {
        self.rope_tables = tables;
    }

    /// `x W^T + b` for `rows` rows.
    fn affine(
        &self,
        x: &[f32],
        rows: usize,
        in_features: usize,
        l: &Linear,
        out_features: usize,
    ) -> Result<Vec<f32>, H3Error> {
        let mut out = vec![0f32; rows * out_features];
        ops::linear(x, rows, in_features, &l.w, out_features, &mut out)?;
        ops::add_bias(&mut out, rows, out_features, &l.b)?;
        Ok(out)
    }

    /// `temb` `[T, time_embed_dim]`: sinusoid of the unscaled timesteps -> linear_1 -> SiLU -> linear_2.
    fn time_embedding(&self, timesteps: &[f32]) -> Result<Vec<f32>, H3Error> {
        let c = &self.config;
        let n = timesteps.len();
        let mut sinusoid = vec![0f32; n * c.freq_dim];
        ops::sinusoidal_embedding(timesteps, c.freq_dim, &mut sinusoid)?;
        let mut hidden = self.affine(
            &sinusoid,
            n,
            c.freq_dim,
            &self.weights.time_1,
            c.time_embed_hidden_dim,
        )?;
        ops::silu_inplace(&mut hidden);
        self.affine(
            &hidden,
            n,
            c.time_embed_hidden_dim,
            &self.weights.time_2,
            c.time_embed_dim,
        )
    }

    /// cos/sin `[S, 3 * rope_freq_dim]`: for axis `a` and frequency `j`, `pos[a] * inv_freq[j]` in f32 (the
    /// rotated half; the other half repeats it).
    fn rope_tables(&self, positions: &[[f32; 3]]) -> (Vec<f32>, Vec<f32>) {
        let f = self.config.rope_freq_dim;
        let inv = ops::rope_inverse_frequencies(2 * f, self.config.rope_theta as f32);
        let mut cos = Vec::with_capacity(positions.len() * 3 * f);
        let mut sin = Vec::with_capacity(positions.len() * 3 * f);
        for p in positions {
            for &axis in p {
                for &w in &inv {
                    let angle = f64::from(axis * w);
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        (cos, sin)
    }

    /// Self-attention of one block on the normed rows `h` `[rows, hidden]`: q/k/v, per-head QK RMSNorm, RoPE
    /// when tables are given, full attention, output projection.
    fn attention(
        &self,
        w: &AttnBlock,
        h: &[f32],
        rows: usize,
        rope: Option<(&[f32], &[f32])>,
    ) -> Result<Vec<f32>, H3Error> {
        let c = &self.config;
        let (hidden, inner, heads, hd) = (
            c.hidden_size,
            c.inner_dim(),
            c.num_attention_heads,
            c.attention_head_dim,
        );
        let eps = c.qk_norm_eps as f32;
        let mut q = vec![0f32; rows * inner];
        let mut k = vec![0f32; rows * inner];
        let mut v = vec![0f32; rows * inner];
        ops::linear(h, rows, hidden, &w.to_q, inner, &mut q)?;
        ops::linear(h, rows, hidden, &w.to_k, inner, &mut k)?;
        ops::linear(h, rows, hidden, &w.to_v, inner, &mut v)?;
        let mut normed = vec![0f32; rows * inner];
        ops::rms_norm(&q, rows * heads, hd, &w.norm_q, eps, &mut normed)?;
        std::mem::swap(&mut q, &mut normed);
        ops::rms_norm(&k, rows * heads, hd, &w.norm_k, eps, &mut normed)?;
        std::mem::swap(&mut k, &mut normed);
        if let Some((cos, sin)) = rope {
            let rotated = c.rotary_dim();
            for x in [&mut q, &mut k] {
                ops::rope_rotate_half_partial(
                    x,
                    rows,
                    heads,
                    hd,
                    rotated,
                    cos,
                    sin,
                    self.rope_tables,
                )?;
            }
        }
        let block_ids = vec![0i32; rows];
        let key_valid = vec![true; rows];
        let mask = ops::AttentionMask {
            q_offset: 0,
            block_ids: &block_ids,
            key_valid: &key_valid,
        };
        let mut attn = vec![0f32; rows * inner];
        ops::attention(&q, &k, &v, rows, rows, heads, hd, mask, &mut attn)?;
        let mut out = vec![0f32; rows * hidden];
        ops::linear(&attn, rows, inner, &w.to_out, hidden, &mut out)?;
        Ok(out)
    }

    /// The SwiGLU feed-forward on the normed rows `h`: fused `[value | gate]` projection, `value * silu(gate)`,
    /// down projection.
    fn feed_forward(&self, w: &AttnBlock, h: &[f32], rows: usize) -> Result<Vec<f32>, H3Error> {
        let (hidden, ffn) = (self.config.hidden_size, self.config.ffn_dim);
        let mut fused = vec![0f32; rows * 2 * ffn];
        ops::linear(h, rows, hidden, &w.ff_in, 2 * ffn, &mut fused)?;
        let mut act = vec![0f32; rows * ffn];
        ops::swiglu_fused(&fused, rows, ffn, false, &mut act)?;
        let mut out = vec![0f32; rows * hidden];
        ops::linear(&act, rows, ffn, &w.ff_out, hidden, &mut out)?;
        Ok(out)
    }

    /// RMSNorm with its weight, then optional per-row `(1 + scale) + shift` from `[n_mod, hidden]` tables.
    fn norm(
        &self,
        x: &[f32],
        rows: usize,
        weight: &[f32],
        modulation: Option<RowModulation<'_>>,
        eps: f64,
    ) -> Result<Vec<f32>, H3Error> {
        let cols = self.config.hidden_size;
        let mut out = vec![0f32; rows * cols];
        let (shift, scale, n_mod, row_mod) = match modulation {
            Some(m) => (Some(m.shift), Some(m.scale), m.n_mod, m.row_mod),
            None => (None, None, 0, &[][..]),
        };
        let parts = ops::NormModulation {
            weight: Some(weight),
            bias: None,
            scale,
            shift,
            n_mod,
            row_mod,
        };
        ops::norm_modulate(
            x,
            rows,
            cols,
            ops::NormKind::RmsNorm,
            parts,
            eps as f32,
            &mut out,
        )?;
        Ok(out)
    }

    /// The token refiner on the projected text rows `[rows, hidden]`, in place.
    fn refine_text(&self, x: &mut [f32], rows: usize) -> Result<(), H3Error> {
        let eps = self.config.norm_eps;
        for w in &self.weights.refiner {
            let h = self.norm(x, rows, &w.norm1, None, eps)?;
            let a = self.attention(w, &h, rows, None)?;
            x.iter_mut().zip(&a).for_each(|(xv, av)| *xv += av);
            let h = self.norm(x, rows, &w.norm2, None, eps)?;
            let f = self.feed_forward(w, &h, rows)?;
            x.iter_mut().zip(&f).for_each(|(xv, fv)| *xv += fv);
        }
        let out = self.norm(
            x,
            rows,
            &self.weights.refiner_norm,
            None,
            self.config.final_norm_eps,
        )?;
        x.copy_from_slice(&out);
        Ok(())
    }
}

/// Columns `[chunk * width, (chunk + 1) * width)` of every row of a `[rows, stride]` table, as `[rows, width]`.
fn chunk_table(table: &[f32], stride: usize, chunk: usize, width: usize) -> Vec<f32> {
    table
        .chunks_exact(stride)
        .flat_map(|row| row[chunk * width..(chunk + 1) * width].iter().copied())
        .collect()
}

/// Rows `rows` of `x` (`[S, cols]`), in that order.
fn gather(x: &[f32], cols: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| x[r * cols..(r + 1) * cols].iter().copied())
        .collect()
}

impl H3DitBackend for HostH3Dit {
    fn config(&self) -> &MiniMaxH3Config {
        &self.config
    }

    fn forward(&mut self, inputs: &H3Inputs) -> Result<H3Output, H3Error> {
        let c = &self.config;
        let rows = H3Rows::build(c, inputs)?;
        let (batch, s, hidden) = (rows.batch, rows.seq_len, c.hidden_size);
        let (nv, na, nt) = (
            rows.video_rows.len(),
            rows.audio_rows.len(),
            rows.text_rows.len(),
        );
        let (vp, ca, td) = (c.video_patch_dim(), c.audio_in_channels, c.text_dim);
        let n_t = rows.timesteps.len();

        // Timestep embedding, its SiLU (the input of every adaLN projection), the output modulation.
        let temb = self.time_embedding(&rows.timesteps)?;
        let mut silu_temb = temb;
        ops::silu_inplace(&mut silu_temb);
        let out_mod = self.affine(
            &silu_temb,
            n_t,
            c.time_embed_dim,
            &self.weights.norm_out,
            2 * hidden,
        )?;
        let (out_shift, out_scale) = (
            chunk_table(&out_mod, 2 * hidden, 0, hidden),
            chunk_table(&out_mod, 2 * hidden, 1, hidden),
        );
        let (cos, sin) = self.rope_tables(&rows.positions);
        let n_mod = n_t * MODALITIES;
        let stride = MODULATION_CHUNKS * hidden;

        // Per block, the adaLN table [T, 3 * 6 * hidden] (the same for every batch item).
        let mut adaln = Vec::with_capacity(self.weights.blocks.len());
        for w in &self.weights.blocks {
            let mut t = vec![0f32; n_t * MODALITIES * stride];
            ops::linear(
                &silu_temb,
                n_t,
                c.time_embed_dim,
                &w.adaln_w,
                MODALITIES * stride,
                &mut t,
            )?;
            ops::add_bias(&mut t, n_t, MODALITIES * stride, &w.adaln_b)?;
            adaln.push(t);
        }

        let mut sample = Vec::with_capacity(batch * nv * vp);
        let mut audio_sample = Vec::with_capacity(batch * na * ca);
        for b in 0..batch {
            let video_in = &inputs.hidden_states.data()[b * nv * vp..(b + 1) * nv * vp];
            let audio_in = &inputs.audio_hidden_states.data()[b * na * ca..(b + 1) * na * ca];
            let text_in = &inputs.encoder_hidden_states.data()[b * nt * td..(b + 1) * nt * td];
            let video = self.affine(video_in, nv, vp, &self.weights.proj_in, hidden)?;
            let audio = self.affine(audio_in, na, ca, &self.weights.audio_proj_in, hidden)?;
            let mut text = self.affine(text_in, nt, td, &self.weights.context_embedder, hidden)?;
            self.refine_text(&mut text, nt)?;
            let mut x = vec![0f32; s * hidden];
            for (src, dst_rows) in [
                (&text, &rows.text_rows),
                (&video, &rows.video_rows),
                (&audio, &rows.audio_rows),
            ] {
                for (row, &r) in src.chunks_exact(hidden).zip(dst_rows.iter()) {
                    x[r * hidden..(r + 1) * hidden].copy_from_slice(row);
                }
            }

            for (w, ada) in self.weights.blocks.iter().zip(&adaln) {
                // [T, 3 * 6 * hidden] viewed as [T * 3, 6 * hidden]: row = t_index * 3 + tag.
                let table = |chunk: usize| chunk_table(ada, stride, chunk, hidden);
                let (shift1, scale1, gate1) = (table(0), table(1), table(2));
                let (shift2, scale2, gate2) = (table(3), table(4), table(5));
                let m = &rows.adaln_rows;
                let h = self.norm(
                    &x,
                    s,
                    &w.attn.norm1,
                    Some(RowModulation {
                        shift: &shift1,
                        scale: &scale1,
                        n_mod,
                        row_mod: m,
                    }),
                    c.norm_eps,
                )?;
                let a = self.attention(&w.attn, &h, s, Some((&cos, &sin)))?;
                ops::gate_residual(&mut x, s, hidden, &a, &gate1, n_mod, m)?;
                let h = self.norm(
                    &x,
                    s,
                    &w.attn.norm2,
                    Some(RowModulation {
                        shift: &shift2,
                        scale: &scale2,
                        n_mod,
                        row_mod: m,
                    }),
                    c.norm_eps,
                )?;
                let f = self.feed_forward(&w.attn, &h, s)?;
                ops::gate_residual(&mut x, s, hidden, &f, &gate2, n_mod, m)?;
            }

            let h = self.norm(
                &x,
                s,
                &self.weights.norm_out_w,
                Some(RowModulation {
                    shift: &out_shift,
                    scale: &out_scale,
                    n_mod: n_t,
                    row_mod: &rows.timestep_rows,
                }),
                c.final_norm_eps,
            )?;
            let video_h = gather(&h, hidden, &rows.video_rows);
            sample.extend(self.affine(&video_h, nv, hidden, &self.weights.proj_out, vp)?);
            let audio_h = gather(&h, hidden, &rows.audio_rows);
            audio_sample.extend(self.affine(
                &audio_h,
                na,
                hidden,
                &self.weights.audio_proj_out,
                ca,
            )?);
        }
        Ok(H3Output {
            sample: Tensor::new(vec![batch, nv, vp], sample)?,
            audio_sample: Tensor::new(vec![batch, na, ca], audio_sample)?,
        })
    }
}

/// What [`forward_files`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardReport {
    /// The weights pass of the load.
    pub load: LoadStats,
    /// Which layout the folder held.
    pub layout: CheckpointLayout,
    pub sample_shape: Vec<usize>,
    pub audio_sample_shape: Vec<usize>,
    /// Seconds of the forward itself.
    pub forward_seconds: f64,
}

/// `tf forward` for a MiniMax H3 folder on the host reference: loads `model`, reads the forward arguments by name
/// from the bundle `inputs` ([`H3Inputs::from_bundle`]), runs one forward and writes `sample` and
/// `audio_sample` to `out`.
pub fn forward_files(
    model: &ModelDir,
    inputs: &std::path::Path,
    out: &std::path::Path,
) -> Result<ForwardReport, H3Error> {
    let mut dit = HostH3Dit::load(model)?;
    let inputs = H3Inputs::from_bundle(&crate::nn::weights::SafetensorsFile::open(inputs)?)?;
    let start = std::time::Instant::now();
    let output = dit.forward(&inputs)?;
    let forward_seconds = start.elapsed().as_secs_f64();
    crate::nn::weights::write_safetensors(
        out,
        &[
            ("sample", crate::nn::weights::AnyTensor::F32(&output.sample)),
            (
                "audio_sample",
                crate::nn::weights::AnyTensor::F32(&output.audio_sample),
            ),
        ],
    )?;
    Ok(ForwardReport {
        load: dit.load_stats(),
        layout: dit.checkpoint_layout(),
        sample_shape: output.sample.shape().to_vec(),
        audio_sample_shape: output.audio_sample.shape().to_vec(),
        forward_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rope_passes_the_tail_through_and_rounds_tables_as_asked() {
        // 2 tokens, 1 head of 6 channels, 4 rotated.
        let x: Vec<f32> = (0..12).map(|v| v as f32 * 0.25 - 1.0).collect();
        let cos = vec![0.5, 0.75, 1.0, 0.0];
        let sin = vec![0.75, -0.5, 0.0, 1.0];
        let mut a = x.clone();
        ops::rope_rotate_half_partial(&mut a, 2, 1, 6, 4, &cos, &sin, RopeTables::F32).unwrap();
        assert_eq!(a[4..6], x[4..6]);
        assert_eq!(a[10..12], x[10..12]);
        // Token 0, pair (0, 2): (x0, x2) by cos 0.5, sin 0.75.
        assert!((a[0] - (x[0] * 0.5 - x[2] * 0.75)).abs() < 1e-6);
        assert!((a[2] - (x[2] * 0.5 + x[0] * 0.75)).abs() < 1e-6);
        // These tables are exact in bf16, so both roundings give the same bits.
        let mut b = x.clone();
        ops::rope_rotate_half_partial(&mut b, 2, 1, 6, 4, &cos, &sin, RopeTables::Bf16).unwrap();
        assert_eq!(a, b);
        // A table value that bf16 cannot hold gives another result once rounded.
        let odd = vec![0.1f32, 0.75, 1.0, 0.0];
        let (mut f, mut h) = (x.clone(), x.clone());
        ops::rope_rotate_half_partial(&mut f, 2, 1, 6, 4, &odd, &sin, RopeTables::F32).unwrap();
        ops::rope_rotate_half_partial(&mut h, 2, 1, 6, 4, &odd, &sin, RopeTables::Bf16).unwrap();
        assert_ne!(f, h);
        // Full width is the plain rotate-half.
        let mut c = x[..4].to_vec();
        ops::rope_rotate_half(&mut c, 1, 1, 4, &cos[..2], &sin[..2]).unwrap();
        assert_eq!(c, a[..4]);
        assert!(ops::rope_rotate_half_partial(
            &mut a,
            2,
            1,
            6,
            4,
            &cos[..3],
            &sin,
            RopeTables::F32
        )
        .is_err());
    }

    #[test]
    fn tables_split_into_chunks_and_rows_gather() {
        // Two rows of [a0 a1 | b0 b1 | c0 c1].
        let t: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(chunk_table(&t, 6, 1, 2), vec![2.0, 3.0, 8.0, 9.0]);
        assert_eq!(gather(&t, 3, &[3, 0]), vec![9.0, 10.0, 11.0, 0.0, 1.0, 2.0]);
    }
}
