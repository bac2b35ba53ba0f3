//! The Qwen3-VL text path, host reference, shared by every engine that conditions on it.
//!
//! [`HostTextEncoder::features_at`] returns `hidden_states[layer]` (0 = the embeddings, `k` = decoder layer `k`'s
//! output, never the final RMSNorm) and computes no layer past it. Qwen-Image 2.1 reads the **last** layer and
//! drops its template's leading system rows itself; MiniMax H3 reads layer 50. Prompt templates live with each
//! engine, not here. Each decoder layer is:
//!
//! ```text
//! h = x + o_proj(attn(rope(q_norm(q_proj(rms(x)))), rope(k_norm(k_proj(rms(x)))), v_proj(rms(x))))
//! y = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
//! ```
//!
//! with causal grouped-query attention (scale `1/sqrt(head_dim)`), per-head RMSNorm on q and k, and RoPE in the
//! rotate-half layout with `inv_freq = 1 / theta^(2i / head_dim)`. Qwen3-VL's interleaved M-RoPE assigns frequency
//! slots to the (time, height, width) position axes; for text all three axes carry the same position, so it reduces
//! to standard RoPE on text rows. Positions start at `position_offset` (a left-padded batch row starts at its
//! padding count in the reference; rotary attention only sees position differences, so 0 gives the same result up
//! to rounding).
//!
//! Weights are read as f32 from a transformers folder (`config.json` with a `text_config`, or a text-only Qwen3
//! config). The vision tower is not loaded. [`LoadOptions::layers`] caps the decoder layers kept: an engine that
//! reads `hidden_states[n]` loads with a cap of `n`, and the tensors of layers `n..` and the final norm are never
//! read (MiniMax H3 reads layer 50 of 64).
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen3_vl::text_encoder::HostTextEncoder;
//! use tf_engines::nn::weights::ModelDir;
//!
//! let encoder = HostTextEncoder::load(&ModelDir::open(Path::new("text_encoder"))?)?;
//! let features = encoder.prompt_features(&[151644u32, 8948, 198], 0)?;
//! println!("{:?}", features.shape());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

use crate::nn::backend_error::GpuError;
use crate::nn::config::{checked_product, in_range, parse_object};
use crate::nn::host::{self, rope_rotate_half, rotate_half_tables};
use crate::nn::tensor::{rows_after_drop, ShapeError, Tensor, TensorF32};
use crate::nn::weights::{ModelDir, WeightsError};

/// Errors of the text encoder.
#[derive(Debug, Error)]
pub enum TextEncoderError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error("text encoder config.json: {0}")]
    Config(String),
    #[error("text encoder input: {0}")]
    Input(String),
    /// A GPU call failed; the cause stays in the source chain (a lost context is visible there).
    #[error("text encoder GPU backend: {0}")]
    Gpu(#[from] GpuError),
    /// A backend condition with no underlying error (an unsupported shape, a missing workspace).
    #[error("text encoder backend: {0}")]
    Backend(String),
    /// A hidden state past the decoder layers this encoder was loaded with ([`LoadOptions::layers`]).
    #[error(
        "hidden_states[{layer}] is past this encoder's cap: it was loaded with decoder layers 0..{cap} of the \
         model's {layers} (LoadOptions::layers = {cap}), so hidden states 0..={cap} are reachable; load it with a \
         cap of at least {layer}"
    )]
    BeyondCap {
        layer: usize,
        cap: usize,
        layers: usize,
    },
}

fn config_err(why: impl Into<String>) -> TextEncoderError {
    TextEncoderError::Config(why.into())
}

/// Upper bounds of a config this crate loads (the released Qwen3-VL models are far inside them: vocabulary
/// 151936, hidden 5120, 64 layers, 64 heads of 128). They keep every product of config values, and every
/// per-layer allocation, far from overflow before any weight is read.
pub mod limits {
    pub const VOCAB: usize = 1 << 22;
    pub const HIDDEN: usize = 1 << 16;
    pub const INTERMEDIATE: usize = 1 << 18;
    pub const LAYERS: usize = 1024;
    pub const HEADS: usize = 1024;
    pub const HEAD_DIM: usize = 1024;
    /// `num_attention_heads * head_dim`.
    pub const ATTENTION_WIDTH: usize = 1 << 18;
}

/// The Qwen3(-VL) text-model hyper-parameters the forward needs.
#[derive(Debug, Clone, PartialEq)]
pub struct TextEncoderConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
}

/// The outer `config.json`: a Qwen3-VL config nests the text model under `text_config`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Outer {
    text_config: Option<Value>,
}

/// `rope_parameters` (transformers 5) or `rope_scaling` (4.x).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawRope {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// The text model's keys as the file spells them; `None` = absent or null.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawText {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RawRope>,
    rope_scaling: Option<RawRope>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
}

impl TextEncoderConfig {
    /// The Qwen3-VL-8B text path (the encoder Qwen-Image 2.1 uses): 36 layers of 4096, 32 query and 8 KV heads of
    /// 128, MLP 12288.
    pub fn qwen3_vl_8b() -> TextEncoderConfig {
        TextEncoderConfig {
            vocab_size: 151_936,
            hidden_size: 4096,
            intermediate_size: 12_288,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 5_000_000.0,
        }
    }

    /// Parses a transformers `config.json`: the `text_config` of a Qwen3-VL config, or a text-only config. Every
    /// value is bounded ([`limits`]) before anything is allocated; an error names the key.
    pub fn from_json(value: &Value) -> Result<Self, TextEncoderError> {
        let outer: Outer = parse_object(value).map_err(config_err)?;
        let (text, prefix) = match &outer.text_config {
            Some(t) => (t, "text_config."),
            None => (value, ""),
        };
        let raw: RawText = parse_object(text).map_err(|e| config_err(format!("{prefix}{e}")))?;
        let key = |k: &str| format!("{prefix}{k}");
        let required = |k: &str, v: Option<usize>| {
            v.ok_or_else(|| config_err(format!("`{}` is missing", key(k))))
        };
        let hidden_size = required("hidden_size", raw.hidden_size)?;
        let num_attention_heads = required("num_attention_heads", raw.num_attention_heads)?;
        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(num_attention_heads);
        let head_dim = raw
            .head_dim
            .unwrap_or(hidden_size / num_attention_heads.max(1));
        // transformers 5 keeps theta in rope_parameters; 4.x configs have rope_theta at the top level.
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(raw.rope_theta)
            .ok_or_else(|| {
                config_err(format!(
                    "`{}` not found (rope_parameters.rope_theta or rope_theta)",
                    key("rope_theta")
                ))
            })?;
        let rope_type = raw
            .rope_parameters
            .as_ref()
            .or(raw.rope_scaling.as_ref())
            .and_then(|p| p.rope_type.as_deref().or(p.kind.as_deref()))
            .unwrap_or("default");
        if rope_type != "default" && rope_type != "mrope" {
            return Err(config_err(format!(
                "rope_type {rope_type:?} is not supported (only the default rotary embedding)"
            )));
        }
        if raw.attention_bias == Some(true) {
            return Err(config_err(format!(
                "`{}` = true is not supported (Qwen3 has no attention biases)",
                key("attention_bias")
            )));
        }
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(config_err(format!(
                    "`{}` {act:?} is not supported (expected \"silu\")",
                    key("hidden_act")
                )));
            }
        }
        let config = TextEncoderConfig {
            vocab_size: required("vocab_size", raw.vocab_size)?,
            hidden_size,
            intermediate_size: required("intermediate_size", raw.intermediate_size)?,
            num_hidden_layers: required("num_hidden_layers", raw.num_hidden_layers)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
        };
        config.validate().map_err(|e| match e {
            TextEncoderError::Config(why) if !prefix.is_empty() => {
                TextEncoderError::Config(why.replacen('`', &format!("`{prefix}"), 1))
            }
            other => other,
        })?;
        Ok(config)
    }

    /// Checks that the numbers describe a model this crate can run, within [`limits`].
    pub fn validate(&self) -> Result<(), TextEncoderError> {
        let bounds = [
            ("vocab_size", self.vocab_size, limits::VOCAB),
            ("hidden_size", self.hidden_size, limits::HIDDEN),
            (
                "intermediate_size",
                self.intermediate_size,
                limits::INTERMEDIATE,
            ),
            ("num_hidden_layers", self.num_hidden_layers, limits::LAYERS),
            (
                "num_attention_heads",
                self.num_attention_heads,
                limits::HEADS,
            ),
            (
                "num_key_value_heads",
                self.num_key_value_heads,
                limits::HEADS,
            ),
            ("head_dim", self.head_dim, limits::HEAD_DIM),
        ];
        for (key, value, max) in bounds {
            in_range(key, value, max).map_err(config_err)?;
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(config_err(format!(
                "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(config_err(format!(
                "`head_dim` {} must be even",
                self.head_dim
            )));
        }
        let width = checked_product(
            "num_attention_heads x head_dim",
            &[self.num_attention_heads, self.head_dim],
        )
        .map_err(config_err)?;
        in_range(
            "num_attention_heads x head_dim",
            width,
            limits::ATTENTION_WIDTH,
        )
        .map_err(config_err)?;
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(config_err(format!(
                "`rms_norm_eps` {} must be a finite number >= 0",
                self.rms_norm_eps
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(config_err(format!(
                "`rope_theta` {} must be a positive number",
                self.rope_theta
            )));
        }
        Ok(())
    }
}

/// What a load keeps of the checkpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Keep only decoder layers `0..n`, so `hidden_states[0..=n]` stay reachable: the tensors of later layers and
    /// the final norm are neither read nor held. `None` (the default) keeps every layer, and the host encoder the
    /// final norm too. `n` may not exceed `num_hidden_layers`.
    pub layers: Option<usize>,
}

impl LoadOptions {
    /// Keeps decoder layers `0..n`: enough for `hidden_states[n]`.
    pub fn up_to_layer(n: usize) -> LoadOptions {
        LoadOptions { layers: Some(n) }
    }

    /// The decoder layers a load of `config` keeps; a cap above the model's layer count is refused, naming both.
    pub fn kept_layers(&self, config: &TextEncoderConfig) -> Result<usize, TextEncoderError> {
        let total = config.num_hidden_layers;
        match self.layers {
            None => Ok(total),
            Some(cap) if cap <= total => Ok(cap),
            Some(cap) => Err(config_err(format!(
                "LoadOptions::layers = {cap} exceeds the model's {total} decoder layers (`num_hidden_layers`); \
                 cap at {total} or below"
            ))),
        }
    }
}

/// Checks that `hidden_states[layer]` is reachable with `kept` of the model's `total` decoder layers loaded.
pub(crate) fn check_reachable(
    layer: usize,
    kept: usize,
    total: usize,
) -> Result<(), TextEncoderError> {
    if layer > total {
        return Err(TextEncoderError::Input(format!(
            "layer {layer} does not exist: hidden states run from 0 (the embeddings) to {total} (the last decoder \
             layer)"
        )));
    }
    if layer > kept {
        return Err(TextEncoderError::BeyondCap {
            layer,
            cap: kept,
            layers: total,
        });
    }
    Ok(())
}

struct Layer {
    input_norm: Vec<f32>,
    q_proj: Vec<f32>,
    k_proj: Vec<f32>,
    v_proj: Vec<f32>,
    o_proj: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_norm: Vec<f32>,
    gate_proj: Vec<f32>,
    up_proj: Vec<f32>,
    down_proj: Vec<f32>,
}

/// Tensor name prefixes of the language model, tried in order: Qwen3-VL saved by transformers, an older VL
/// layout, a text-only Qwen3.
const PREFIXES: [&str; 3] = ["model.language_model.", "language_model.model.", "model."];

/// The text encoder on the host, f32 weights.
pub struct HostTextEncoder {
    config: TextEncoderConfig,
    embed_tokens: Vec<f32>,
    /// Decoder layers `0..layers.len()` (all of them unless the load was capped).
    layers: Vec<Layer>,
    /// `None` when the load was capped.
    final_norm: Option<Vec<f32>>,
    /// Checkpoint tensors read at load.
    tensors_read: usize,
}

impl std::fmt::Debug for HostTextEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTextEncoder")
            .field("config", &self.config)
            .field("loaded_layers", &self.layers.len())
            .finish_non_exhaustive()
    }
}

impl HostTextEncoder {
    /// Loads the language model of a transformers folder (its config and weights, every layer and the final
    /// norm), checking every shape.
    pub fn load(model: &ModelDir) -> Result<Self, TextEncoderError> {
        HostTextEncoder::load_with(model, LoadOptions::default())
    }

    /// [`Self::load`] keeping what `options` says: with a cap of `n`, only the embeddings and decoder layers
    /// `0..n` are read (no final norm), and [`Self::features_at`] refuses a layer past `n`.
    pub fn load_with(model: &ModelDir, options: LoadOptions) -> Result<Self, TextEncoderError> {
        let config = TextEncoderConfig::from_json(model.config_json())?;
        let kept = options.kept_layers(&config)?;
        let prefix = PREFIXES
            .iter()
            .find(|p| model.info(&format!("{p}embed_tokens.weight")).is_ok())
            .ok_or_else(|| {
                config_err(format!(
                    "no embed_tokens.weight under any of the prefixes {PREFIXES:?}: not a Qwen3(-VL) checkpoint?"
                ))
            })?;
        let c = &config;
        let (h, q_out, kv_out) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let tensors_read = std::cell::Cell::new(0usize);
        let load = |name: &str, shape: &[usize]| -> Result<Vec<f32>, TextEncoderError> {
            let full = format!("{prefix}{name}");
            tensors_read.set(tensors_read.get() + 1);
            let t = model.to_f32(&full)?;
            if t.shape() != shape {
                return Err(TextEncoderError::Weights(WeightsError::ShapeMismatch {
                    path: model.dir().to_path_buf(),
                    name: full,
                    expected: shape.to_vec(),
                    actual: t.shape().to_vec(),
                }));
            }
            Ok(t.into_data())
        };
        let mut layers = Vec::with_capacity(kept);
        for i in 0..kept {
            let l = |n: &str| format!("layers.{i}.{n}");
            layers.push(Layer {
                input_norm: load(&l("input_layernorm.weight"), &[h])?,
                q_proj: load(&l("self_attn.q_proj.weight"), &[q_out, h])?,
                k_proj: load(&l("self_attn.k_proj.weight"), &[kv_out, h])?,
                v_proj: load(&l("self_attn.v_proj.weight"), &[kv_out, h])?,
                o_proj: load(&l("self_attn.o_proj.weight"), &[h, q_out])?,
                q_norm: load(&l("self_attn.q_norm.weight"), &[c.head_dim])?,
                k_norm: load(&l("self_attn.k_norm.weight"), &[c.head_dim])?,
                post_norm: load(&l("post_attention_layernorm.weight"), &[h])?,
                gate_proj: load(&l("mlp.gate_proj.weight"), &[c.intermediate_size, h])?,
                up_proj: load(&l("mlp.up_proj.weight"), &[c.intermediate_size, h])?,
                down_proj: load(&l("mlp.down_proj.weight"), &[h, c.intermediate_size])?,
            });
        }
        let embed_tokens = load("embed_tokens.weight", &[c.vocab_size, h])?;
        let final_norm = match options.layers {
            None => Some(load("norm.weight", &[h])?),
            Some(_) => None,
        };
        Ok(HostTextEncoder {
            embed_tokens,
            final_norm,
            layers,
            tensors_read: tensors_read.get(),
            config,
        })
    }

    /// Decoder layers held: `num_hidden_layers`, or the cap of a capped load. `hidden_states[0..=loaded_layers()]`
    /// are reachable.
    pub fn loaded_layers(&self) -> usize {
        self.layers.len()
    }

    /// Checkpoint tensors the load read.
    pub fn tensors_read(&self) -> usize {
        self.tensors_read
    }

    /// Bytes of the f32 weights held.
    pub fn weight_bytes(&self) -> usize {
        let layer_values = |l: &Layer| {
            [
                &l.input_norm,
                &l.q_proj,
                &l.k_proj,
                &l.v_proj,
                &l.o_proj,
                &l.q_norm,
                &l.k_norm,
                &l.post_norm,
                &l.gate_proj,
                &l.up_proj,
                &l.down_proj,
            ]
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
        };
        let values = self.embed_tokens.len()
            + self.final_norm.as_ref().map_or(0, Vec::len)
            + self.layers.iter().map(layer_values).sum::<usize>();
        values * std::mem::size_of::<f32>()
    }

    /// The parsed config.
    pub fn config(&self) -> &TextEncoderConfig {
        &self.config
    }

    /// Hidden states `[ids.len(), hidden]` after the last decoder layer, before the final norm. Token `i` sits at
    /// rotary position `position_offset + i`. The same as [`Self::features_at_offset`] at the last layer (so a
    /// capped encoder refuses it).
    pub fn forward<I: Copy + Into<i64>>(
        &self,
        ids: &[I],
        position_offset: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        self.features_at_offset(ids, position_offset, self.config.num_hidden_layers)
    }

    /// `hidden_states[layer]` `[ids.len(), hidden]` from position 0: 0 = the embedding rows, `k` = the output of
    /// decoder layer `k` (so `num_hidden_layers` is the last layer's output), never the final norm. No layer past
    /// `layer` is computed. Qwen-Image reads the last layer; MiniMax H3 reads layer 50. A layer past the cap of a
    /// capped load is refused ([`TextEncoderError::BeyondCap`], naming both).
    pub fn features_at<I: Copy + Into<i64>>(
        &self,
        ids: &[I],
        layer: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        self.features_at_offset(ids, 0, layer)
    }

    /// [`Self::features_at`] with token `i` at rotary position `position_offset + i` (a left-padded batch row).
    pub fn features_at_offset<I: Copy + Into<i64>>(
        &self,
        ids: &[I],
        position_offset: usize,
        layer: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        check_reachable(layer, self.layers.len(), self.config.num_hidden_layers)?;
        let mut x = self.embed(ids)?;
        self.run_layers(&mut x, ids.len(), position_offset, layer, &mut |_, _| {})?;
        Ok(Tensor::new(vec![ids.len(), self.config.hidden_size], x)?)
    }

    /// Every hidden state, as transformers' `output_hidden_states` minus the final norm: entry `k` is
    /// [`Self::features_at_offset`] at layer `k`, for `k` in `0..=num_hidden_layers` (`0..=cap` when capped).
    pub fn hidden_states<I: Copy + Into<i64>>(
        &self,
        ids: &[I],
        position_offset: usize,
    ) -> Result<Vec<TensorF32>, TextEncoderError> {
        let (rows, h) = (ids.len(), self.config.hidden_size);
        let mut x = self.embed(ids)?;
        let mut states = vec![Tensor::new(vec![rows, h], x.clone())?];
        let mut shape_error = None;
        self.run_layers(
            &mut x,
            rows,
            position_offset,
            self.layers.len(),
            &mut |_, state| match Tensor::new(vec![rows, h], state.to_vec()) {
                Ok(t) => states.push(t),
                Err(e) => shape_error = Some(e),
            },
        )?;
        if let Some(e) = shape_error {
            return Err(e.into());
        }
        Ok(states)
    }

    /// The embedding rows of `ids`, `[ids.len() * hidden]`.
    fn embed<I: Copy + Into<i64>>(&self, ids: &[I]) -> Result<Vec<f32>, TextEncoderError> {
        let c = &self.config;
        let (rows, h) = (ids.len(), c.hidden_size);
        let mut x = Vec::with_capacity(rows.saturating_mul(h));
        for id in ids.iter().map(|&id| id.into()) {
            let row = usize::try_from(id)
                .ok()
                .filter(|&r| r < c.vocab_size)
                .ok_or_else(|| {
                    TextEncoderError::Input(format!(
                        "token id {id} is outside the vocabulary (0..{})",
                        c.vocab_size
                    ))
                })?;
            x.extend_from_slice(&self.embed_tokens[row * h..(row + 1) * h]);
        }
        Ok(x)
    }

    /// Runs decoder layers `1..=last` over `x` (`[rows, hidden]`, in place); `after(k, x)` sees the output of
    /// layer `k`.
    fn run_layers(
        &self,
        x: &mut [f32],
        rows: usize,
        position_offset: usize,
        last: usize,
        after: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), TextEncoderError> {
        if last == 0 || rows == 0 {
            return Ok(());
        }
        let c = &self.config;
        let h = c.hidden_size;
        let (cos, sin) = rotate_half_tables(rows, position_offset, c.head_dim, c.rope_theta as f32);
        let block_ids = vec![-1i32; rows];
        let key_valid = vec![true; rows];
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let group = heads / kv_heads;
        let mut normed = vec![0f32; rows * h];
        let mut q = vec![0f32; rows * heads * hd];
        let mut k = vec![0f32; rows * kv_heads * hd];
        let mut v = vec![0f32; rows * kv_heads * hd];
        let mut k_full = vec![0f32; rows * heads * hd];
        let mut v_full = vec![0f32; rows * heads * hd];
        let mut attn = vec![0f32; rows * heads * hd];
        let mut proj = vec![0f32; rows * h];
        let mut gate = vec![0f32; rows * c.intermediate_size];
        let mut up = vec![0f32; rows * c.intermediate_size];
        for (index, layer) in self.layers.iter().take(last).enumerate() {
            host::rms_norm(x, rows, h, &layer.input_norm, c.rms_norm_eps, &mut normed)?;
            host::linear(&normed, rows, h, &layer.q_proj, heads * hd, &mut q)?;
            host::linear(&normed, rows, h, &layer.k_proj, kv_heads * hd, &mut k)?;
            host::linear(&normed, rows, h, &layer.v_proj, kv_heads * hd, &mut v)?;
            let q_in = q.clone();
            host::rms_norm(
                &q_in,
                rows * heads,
                hd,
                &layer.q_norm,
                c.rms_norm_eps,
                &mut q,
            )?;
            let k_in = k.clone();
            host::rms_norm(
                &k_in,
                rows * kv_heads,
                hd,
                &layer.k_norm,
                c.rms_norm_eps,
                &mut k,
            )?;
            rope_rotate_half(&mut q, rows, heads, hd, &cos, &sin)?;
            rope_rotate_half(&mut k, rows, kv_heads, hd, &cos, &sin)?;
            // Grouped-query attention: query head `j` reads key/value head `j / group`.
            for t in 0..rows {
                for j in 0..heads {
                    let src = (t * kv_heads + j / group) * hd;
                    let dst = (t * heads + j) * hd;
                    k_full[dst..dst + hd].copy_from_slice(&k[src..src + hd]);
                    v_full[dst..dst + hd].copy_from_slice(&v[src..src + hd]);
                }
            }
            let mask = host::AttentionMask {
                q_offset: 0,
                block_ids: &block_ids,
                key_valid: &key_valid,
            };
            host::attention(&q, &k_full, &v_full, rows, rows, heads, hd, mask, &mut attn)?;
            host::linear(&attn, rows, heads * hd, &layer.o_proj, h, &mut proj)?;
            add_in_place(x, &proj);
            host::rms_norm(x, rows, h, &layer.post_norm, c.rms_norm_eps, &mut normed)?;
            host::linear(
                &normed,
                rows,
                h,
                &layer.gate_proj,
                c.intermediate_size,
                &mut gate,
            )?;
            host::linear(
                &normed,
                rows,
                h,
                &layer.up_proj,
                c.intermediate_size,
                &mut up,
            )?;
            let gate_in = gate.clone();
            host::swiglu(&gate_in, &up, &mut gate)?;
            host::linear(
                &gate,
                rows,
                c.intermediate_size,
                &layer.down_proj,
                h,
                &mut proj,
            )?;
            add_in_place(x, &proj);
            after(index + 1, x);
        }
        Ok(())
    }

    /// The DiT's text context for one templated prompt: [`Self::forward`] from position 0 with the first
    /// `drop_rows` rows (the template's system block) removed. With `tf_tokenizer`'s Qwen-Image 2.1 template that
    /// is `prompt_features(&encoded.ids, encoded.drop)`.
    pub fn prompt_features<I: Copy + Into<i64>>(
        &self,
        ids: &[I],
        drop_rows: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        rows_after_drop(ids.len(), drop_rows)
            .map_err(|e| TextEncoderError::Input(e.to_string()))?;
        Ok(self.forward(ids, 0)?.skip_rows(drop_rows)?)
    }

    /// Applies the model's final RMSNorm to `[rows, hidden]` states (what a plain `last_hidden_state` holds; the
    /// pipeline does NOT use it). A capped load has no final norm: refused.
    pub fn final_norm(&self, hidden: &TensorF32) -> Result<TensorF32, TextEncoderError> {
        let Some(norm) = self.final_norm.as_ref() else {
            return Err(TextEncoderError::Input(format!(
                "this encoder was loaded with LoadOptions::layers = {} and holds no final norm; load it uncapped",
                self.layers.len()
            )));
        };
        let [rows, h] = hidden.dims::<2>("text encoder hidden states")?;
        let mut out = vec![0f32; rows * h];
        host::rms_norm(
            hidden.data(),
            rows,
            h,
            norm,
            self.config.rms_norm_eps,
            &mut out,
        )?;
        Ok(Tensor::new(vec![rows, h], out)?)
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotate_half_rotates_split_pairs() {
        // head_dim 4: pairs (0, 2) and (1, 3). Rotate pair 0 by 90 degrees, pair 1 by 0.
        let mut x = [1.0, 5.0, 0.0, 7.0];
        rope_rotate_half(&mut x, 1, 1, 4, &[0.0, 1.0], &[1.0, 0.0]).unwrap();
        assert_eq!(x, [0.0, 5.0, 1.0, 7.0]);
        assert!(rope_rotate_half(&mut x, 1, 1, 3, &[0.0], &[1.0]).is_err());
    }

    #[test]
    fn tables_start_at_the_offset() {
        let (c0, s0) = rotate_half_tables(3, 2, 4, 10000.0);
        let (c1, s1) = rotate_half_tables(5, 0, 4, 10000.0);
        assert_eq!(&c0[..], &c1[4..]);
        assert_eq!(&s0[..], &s1[4..]);
    }

    #[test]
    fn config_reads_text_config_and_refuses_unknowns() {
        let v = serde_json::json!({"text_config": {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}});
        let c = TextEncoderConfig::from_json(&v).unwrap();
        assert_eq!(
            (c.head_dim, c.num_key_value_heads, c.rope_theta),
            (4, 1, 100.0)
        );
        let bad = serde_json::json!({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2, "rope_theta": 1.0});
        assert!(TextEncoderConfig::from_json(&bad).is_err());
        let yarn = serde_json::json!({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1.0,
            "rope_scaling": {"rope_type": "yarn"}});
        assert!(TextEncoderConfig::from_json(&yarn).is_err());
    }
}
