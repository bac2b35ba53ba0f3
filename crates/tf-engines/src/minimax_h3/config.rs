//! The MiniMax H3 DiT config (`transformer/config.json` of a diffusers folder, class
//! `MiniMaxH3Transformer3DModel`), bounded and validated before anything is sized from it, and the tensor list of
//! the diffusers layout.
//!
//! Absent keys take the diffusers defaults (the released 33.1B model). Every size is bounded from above and every
//! product the model allocates is computed with checked arithmetic in [`MiniMaxH3Config::validate`], so a hostile
//! `config.json` gives an error naming the file and the key, never an overflow or a huge allocation. The original
//! release layout of the weights (fused `qkv_proj`, `mlp.fc1` as `[gate; value]`, other names) is described in
//! [`super::checkpoint`].

use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

use crate::nn::config::{at_most, checked_product, in_range, parse_object};
use crate::nn::weights::{TensorSpec, FLOAT_DTYPES};

/// The diffusers class name this config describes.
pub const CLASS_NAME: &str = "MiniMaxH3Transformer3DModel";

/// Rows of the adaLN table per timestep: one per modality tag (video 0, text 1, audio 2).
pub const MODALITIES: usize = 3;
/// Modulation vectors per adaLN row: shift, scale and gate for attention, then for the feed-forward.
pub const MODULATION_CHUNKS: usize = 6;

// Upper bounds. Each is far above the released model (shown in the comment) and low enough that the products
// the model allocates stay small multiples of what a real checkpoint holds.
const MAX_HIDDEN: usize = 1 << 16; // 5376
const MAX_HEADS: usize = 1024; // 56
const MAX_HEAD_DIM: usize = 1024; // 128
const MAX_FFN: usize = 1 << 18; // 14336
const MAX_LAYERS: usize = 1024; // 50
const MAX_REFINER_LAYERS: usize = 64; // 2
const MAX_CHANNELS: usize = 1 << 14; // 24 video, 32 audio
const MAX_PATCH: usize = 16; // (1, 2, 2)
const MAX_TEXT_DIM: usize = 1 << 16; // 5120
const MAX_FREQ_DIM: usize = 1 << 14; // 256
const MAX_TIME_DIM: usize = 1 << 16; // 5376 / 2688
/// Parameters of the whole model, at most (the released model has 3.3e10).
const MAX_PARAMETERS: usize = 1 << 40;

/// A config that cannot describe a model this crate runs. The message names the file and the key.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{file}: MiniMax H3 DiT config: {why}")]
pub struct ConfigError {
    /// The config file (or `config.json` when it was parsed from a value).
    pub file: String,
    /// What is wrong, naming the key, and what would fix it.
    pub why: String,
}

fn d_heads() -> usize {
    56
}
fn d_head_dim() -> usize {
    128
}
fn d_hidden() -> usize {
    5376
}
fn d_layers() -> usize {
    50
}
fn d_refiner_layers() -> usize {
    2
}
fn d_ffn() -> usize {
    14336
}
fn d_in_channels() -> usize {
    24
}
fn d_audio_in_channels() -> usize {
    32
}
fn d_patch() -> [usize; 3] {
    [1, 2, 2]
}
fn d_text_dim() -> usize {
    5120
}
fn d_freq_dim() -> usize {
    256
}
fn d_time_hidden() -> usize {
    5376
}
fn d_time_embed() -> usize {
    2688
}
fn d_rope_freq_dim() -> usize {
    16
}
fn d_rope_theta() -> f64 {
    10000.0
}
fn d_eps() -> f64 {
    1e-5
}

/// `MiniMaxH3Transformer3DModel` hyper-parameters, with the diffusers defaults for absent keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct MiniMaxH3Config {
    #[serde(rename = "_class_name", default)]
    pub class_name: Option<String>,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_head_dim")]
    pub attention_head_dim: usize,
    /// Width of the residual stream (smaller than heads x head_dim in the release).
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_layers")]
    pub num_layers: usize,
    #[serde(default = "d_refiner_layers")]
    pub num_refiner_layers: usize,
    #[serde(default = "d_ffn")]
    pub ffn_dim: usize,
    /// Video latent channels.
    #[serde(default = "d_in_channels")]
    pub in_channels: usize,
    #[serde(default = "d_audio_in_channels")]
    pub audio_in_channels: usize,
    /// `(t, h, w)` patch of the video rows.
    #[serde(default = "d_patch")]
    pub patch_size: [usize; 3],
    #[serde(default = "d_text_dim")]
    pub text_dim: usize,
    /// Width of the sinusoidal timestep embedding.
    #[serde(default = "d_freq_dim")]
    pub freq_dim: usize,
    #[serde(default = "d_time_hidden")]
    pub time_embed_hidden_dim: usize,
    /// Width of `temb`, the input of every adaLN projection.
    #[serde(default = "d_time_embed")]
    pub time_embed_dim: usize,
    /// Rotary frequencies per axis; `6 * rope_freq_dim` channels of each head are rotated.
    #[serde(default = "d_rope_freq_dim")]
    pub rope_freq_dim: usize,
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "d_eps")]
    pub norm_eps: f64,
    #[serde(default = "d_eps")]
    pub qk_norm_eps: f64,
    /// Epsilon of the refiner's final norm and of `norm_out`.
    #[serde(default = "d_eps")]
    pub final_norm_eps: f64,
}

/// Whether a parsed `config.json` names this class (`_class_name`), so a front end can pick the model.
pub fn names_this_class(config_json: &serde_json::Value) -> bool {
    config_json.get("_class_name").and_then(|v| v.as_str()) == Some(CLASS_NAME)
}

impl Default for MiniMaxH3Config {
    fn default() -> Self {
        Self::default_full_size()
    }
}

impl MiniMaxH3Config {
    /// The diffusers default config (the released 33.1B model).
    pub fn default_full_size() -> Self {
        MiniMaxH3Config {
            class_name: Some(CLASS_NAME.to_string()),
            num_attention_heads: d_heads(),
            attention_head_dim: d_head_dim(),
            hidden_size: d_hidden(),
            num_layers: d_layers(),
            num_refiner_layers: d_refiner_layers(),
            ffn_dim: d_ffn(),
            in_channels: d_in_channels(),
            audio_in_channels: d_audio_in_channels(),
            patch_size: d_patch(),
            text_dim: d_text_dim(),
            freq_dim: d_freq_dim(),
            time_embed_hidden_dim: d_time_hidden(),
            time_embed_dim: d_time_embed(),
            rope_freq_dim: d_rope_freq_dim(),
            rope_theta: d_rope_theta(),
            norm_eps: d_eps(),
            qk_norm_eps: d_eps(),
            final_norm_eps: d_eps(),
        }
    }

    /// Parses and validates a `config.json` value; errors name `config.json`.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, ConfigError> {
        Self::from_json_file(value, Path::new("config.json"))
    }

    /// Parses and validates the value read from `file` (named in every error).
    pub fn from_json_file(value: &serde_json::Value, file: &Path) -> Result<Self, ConfigError> {
        let file = file.display().to_string();
        let config: MiniMaxH3Config = parse_object(value).map_err(|why| ConfigError {
            file: file.clone(),
            why: format!("{why} (fix the key or remove it to take the diffusers default)"),
        })?;
        config.validate().map_err(|why| ConfigError { file, why })?;
        Ok(config)
    }

    /// Checks that the numbers describe a model this crate can run: class name, positive sizes under the upper
    /// bounds, the rotary width inside a head, positive finite epsilons, and every product the model allocates
    /// (including the total parameter count) without overflow. The error names the key and the rule.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(name) = &self.class_name {
            if name != CLASS_NAME {
                return Err(format!(
                    "`_class_name` is {name:?}; this loader is for {CLASS_NAME} (the transformer/ folder of a MiniMax H3 model)"
                ));
            }
        }
        let bounded = [
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("attention_head_dim", self.attention_head_dim, MAX_HEAD_DIM),
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("ffn_dim", self.ffn_dim, MAX_FFN),
            ("in_channels", self.in_channels, MAX_CHANNELS),
            ("audio_in_channels", self.audio_in_channels, MAX_CHANNELS),
            ("text_dim", self.text_dim, MAX_TEXT_DIM),
            ("freq_dim", self.freq_dim, MAX_FREQ_DIM),
            (
                "time_embed_hidden_dim",
                self.time_embed_hidden_dim,
                MAX_TIME_DIM,
            ),
            ("time_embed_dim", self.time_embed_dim, MAX_TIME_DIM),
            ("rope_freq_dim", self.rope_freq_dim, MAX_HEAD_DIM),
        ];
        for (key, value, max) in bounded {
            in_range(key, value, max)?;
        }
        at_most(
            "num_refiner_layers",
            self.num_refiner_layers,
            MAX_REFINER_LAYERS,
        )?;
        for (axis, &p) in ["t", "h", "w"].iter().zip(&self.patch_size) {
            in_range(&format!("patch_size[{axis}]"), p, MAX_PATCH)?;
        }
        if self.patch_size[0] != 1 {
            return Err(format!(
                "`patch_size` {:?}: the packed layout holds one latent frame per row group, so the temporal patch must be 1",
                self.patch_size
            ));
        }
        if !self.attention_head_dim.is_multiple_of(2) {
            return Err(format!(
                "`attention_head_dim` = {} must be even (rotate-half RoPE pairs channel j with j + half)",
                self.attention_head_dim
            ));
        }
        if !self.freq_dim.is_multiple_of(2) {
            return Err(format!(
                "`freq_dim` = {} must be even ([cos | sin] halves of the timestep embedding)",
                self.freq_dim
            ));
        }
        let rotary = self.rotary_dim_checked()?;
        if rotary > self.attention_head_dim {
            return Err(format!(
                "`rope_freq_dim` = {}: 6 x rope_freq_dim = {rotary} rotated channels exceed `attention_head_dim` = {}",
                self.rope_freq_dim, self.attention_head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0 && self.rope_theta <= 1e12) {
            return Err(format!(
                "`rope_theta` = {} must be a finite number in (1, 1e12]",
                self.rope_theta
            ));
        }
        for (key, eps) in [
            ("norm_eps", self.norm_eps),
            ("qk_norm_eps", self.qk_norm_eps),
            ("final_norm_eps", self.final_norm_eps),
        ] {
            if !(eps.is_finite() && eps > 0.0 && eps <= 1.0) {
                return Err(format!("`{key}` = {eps} must be a finite number in (0, 1]"));
            }
        }
        checked_product(
            "`num_attention_heads` x `attention_head_dim`",
            &[self.num_attention_heads, self.attention_head_dim],
        )?;
        checked_product(
            "video patch width (`in_channels` x `patch_size`)",
            &[
                self.in_channels,
                self.patch_size[0],
                self.patch_size[1],
                self.patch_size[2],
            ],
        )?;
        let params = self.parameter_count_checked()?;
        if params > MAX_PARAMETERS {
            return Err(format!(
                "the config describes {params} parameters, above the supported {MAX_PARAMETERS} (check `num_layers`, `hidden_size`, `ffn_dim`)"
            ));
        }
        Ok(())
    }

    fn rotary_dim_checked(&self) -> Result<usize, String> {
        checked_product(
            "rotary width (6 x `rope_freq_dim`)",
            &[6, self.rope_freq_dim],
        )
    }

    fn parameter_count_checked(&self) -> Result<usize, String> {
        crate::nn::weights::element_total(&self.tensor_specs())
    }

    /// Number of parameters (a validated config never overflows).
    pub fn parameter_count(&self) -> usize {
        self.parameter_count_checked().unwrap_or(usize::MAX)
    }

    /// Query/key/value width: heads x head_dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Channels of one video row: `in_channels * prod(patch_size)`.
    pub fn video_patch_dim(&self) -> usize {
        self.in_channels * self.patch_size[0] * self.patch_size[1] * self.patch_size[2]
    }

    /// Rotated channels of each head: `2 * 3 * rope_freq_dim` (the rest pass through).
    pub fn rotary_dim(&self) -> usize {
        6 * self.rope_freq_dim
    }

    /// Output width of one block's adaLN projection: 3 modalities x 6 chunks x hidden.
    pub fn adaln_width(&self) -> usize {
        MODALITIES * MODULATION_CHUNKS * self.hidden_size
    }

    fn attention_specs(&self, p: &str, specs: &mut Vec<TensorSpec>) {
        let (h, inner, hd, f) = (
            self.hidden_size,
            self.inner_dim(),
            self.attention_head_dim,
            self.ffn_dim,
        );
        specs.push(spec(format!("{p}norm1.weight"), vec![h]));
        specs.push(spec(format!("{p}attn.to_q.weight"), vec![inner, h]));
        specs.push(spec(format!("{p}attn.to_k.weight"), vec![inner, h]));
        specs.push(spec(format!("{p}attn.to_v.weight"), vec![inner, h]));
        specs.push(spec(format!("{p}attn.norm_q.weight"), vec![hd]));
        specs.push(spec(format!("{p}attn.norm_k.weight"), vec![hd]));
        specs.push(spec(format!("{p}attn.to_out.0.weight"), vec![h, inner]));
        specs.push(spec(format!("{p}norm2.weight"), vec![h]));
        specs.push(spec(format!("{p}ff.net.0.proj.weight"), vec![2 * f, h]));
        specs.push(spec(format!("{p}ff.net.2.weight"), vec![h, f]));
    }

    /// Every tensor of the model with its shape, in diffusers names; stored as f32, bf16 or f16.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let h = self.hidden_size;
        let (te, th) = (self.time_embed_dim, self.time_embed_hidden_dim);
        let (vp, ca) = (self.video_patch_dim(), self.audio_in_channels);
        let mut specs = vec![
            spec("proj_in.weight".into(), vec![h, vp]),
            spec("proj_in.bias".into(), vec![h]),
            spec("audio_proj_in.weight".into(), vec![h, ca]),
            spec("audio_proj_in.bias".into(), vec![h]),
            spec("context_embedder.weight".into(), vec![h, self.text_dim]),
            spec("context_embedder.bias".into(), vec![h]),
            spec(
                "time_embedder.linear_1.weight".into(),
                vec![th, self.freq_dim],
            ),
            spec("time_embedder.linear_1.bias".into(), vec![th]),
            spec("time_embedder.linear_2.weight".into(), vec![te, th]),
            spec("time_embedder.linear_2.bias".into(), vec![te]),
            spec("token_refiner.final_norm.weight".into(), vec![h]),
            spec("norm_out.norm.weight".into(), vec![h]),
            spec("norm_out.linear.weight".into(), vec![2 * h, te]),
            spec("norm_out.linear.bias".into(), vec![2 * h]),
            spec("proj_out.weight".into(), vec![vp, h]),
            spec("proj_out.bias".into(), vec![vp]),
            spec("audio_proj_out.weight".into(), vec![ca, h]),
            spec("audio_proj_out.bias".into(), vec![ca]),
        ];
        for j in 0..self.num_refiner_layers {
            self.attention_specs(&format!("token_refiner.refiner_blocks.{j}."), &mut specs);
        }
        for i in 0..self.num_layers {
            let p = format!("transformer_blocks.{i}.");
            self.attention_specs(&p, &mut specs);
            specs.push(spec(
                format!("{p}adaln_proj.linear.weight"),
                vec![self.adaln_width(), te],
            ));
            specs.push(spec(
                format!("{p}adaln_proj.linear.bias"),
                vec![self.adaln_width()],
            ));
        }
        specs
    }
}

fn spec(name: String, shape: Vec<usize>) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        dtypes: FLOAT_DTYPES.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: serde_json::Value) -> Result<MiniMaxH3Config, ConfigError> {
        MiniMaxH3Config::from_json(&value)
    }

    #[test]
    fn defaults_fill_absent_keys() {
        let c = parse(serde_json::json!({})).unwrap();
        assert_eq!(
            c,
            MiniMaxH3Config {
                class_name: None,
                ..MiniMaxH3Config::default_full_size()
            }
        );
        assert_eq!(c.inner_dim(), 7168);
        assert_eq!(c.video_patch_dim(), 96);
        assert_eq!(c.rotary_dim(), 96);
        assert_eq!(c.adaln_width(), 96768);
        // 18 global tensors, 10 per refiner block, 12 per block.
        assert_eq!(c.tensor_specs().len(), 18 + 10 * 2 + 12 * 50);
    }

    #[test]
    fn full_size_parameter_count_matches_the_reference() {
        assert_eq!(
            MiniMaxH3Config::default_full_size().parameter_count(),
            33_122_992_896
        );
    }

    #[test]
    fn a_diffusers_config_file_parses() {
        let c = parse(serde_json::json!({
            "_class_name": "MiniMaxH3Transformer3DModel",
            "_diffusers_version": "0.42.1",
            "num_attention_heads": 2, "attention_head_dim": 16, "hidden_size": 24, "num_layers": 2,
            "num_refiner_layers": 1, "ffn_dim": 40, "in_channels": 4, "audio_in_channels": 6,
            "patch_size": [1, 2, 2], "text_dim": 20, "freq_dim": 16, "time_embed_hidden_dim": 32,
            "time_embed_dim": 12, "rope_freq_dim": 2, "rope_theta": 10000.0,
            "norm_eps": 1e-5, "qk_norm_eps": 1e-5, "final_norm_eps": 1e-5
        }))
        .unwrap();
        assert_eq!(
            (c.inner_dim(), c.video_patch_dim(), c.rotary_dim()),
            (32, 16, 12)
        );
    }

    #[test]
    fn hostile_configs_name_the_key() {
        for (bad, key) in [
            (serde_json::json!({"num_layers": 0}), "num_layers"),
            (serde_json::json!({"num_layers": 1_000_000}), "num_layers"),
            (serde_json::json!({"hidden_size": "wide"}), "hidden_size"),
            (serde_json::json!({"hidden_size": -1}), "hidden_size"),
            (serde_json::json!({"hidden_size": 1e30}), "hidden_size"),
            (serde_json::json!({"ffn_dim": u64::MAX}), "ffn_dim"),
            (serde_json::json!({"patch_size": [1, 2]}), "patch_size"),
            (serde_json::json!({"patch_size": [2, 2, 2]}), "patch_size"),
            (
                serde_json::json!({"patch_size": [1, 0, 2]}),
                "patch_size[h]",
            ),
            (
                serde_json::json!({"attention_head_dim": 15}),
                "attention_head_dim",
            ),
            (serde_json::json!({"rope_freq_dim": 32}), "rope_freq_dim"),
            (serde_json::json!({"rope_theta": -1.0}), "rope_theta"),
            (serde_json::json!({"norm_eps": 0.0}), "norm_eps"),
            (serde_json::json!({"qk_norm_eps": "tiny"}), "qk_norm_eps"),
            (serde_json::json!({"freq_dim": 15}), "freq_dim"),
            (
                serde_json::json!({"_class_name": "WanTransformer3DModel"}),
                "_class_name",
            ),
        ] {
            let err = parse(bad.clone()).unwrap_err().to_string();
            assert!(err.contains(&format!("`{key}`")), "{bad}: {err}");
            assert!(err.starts_with("config.json: "), "{err}");
        }
        assert!(names_this_class(
            &serde_json::json!({"_class_name": CLASS_NAME})
        ));
        assert!(!names_this_class(
            &serde_json::json!({"_class_name": "QwenImage21Transformer2DModel"})
        ));
        let err = MiniMaxH3Config::from_json(&serde_json::json!([1])).unwrap_err();
        assert!(err.to_string().contains("JSON object"), "{err}");
    }

    #[test]
    fn every_key_under_hostile_values_parses_or_fails_cleanly() {
        let keys = [
            "num_attention_heads",
            "attention_head_dim",
            "hidden_size",
            "num_layers",
            "num_refiner_layers",
            "ffn_dim",
            "in_channels",
            "audio_in_channels",
            "patch_size",
            "text_dim",
            "freq_dim",
            "time_embed_hidden_dim",
            "time_embed_dim",
            "rope_freq_dim",
            "rope_theta",
            "norm_eps",
            "qk_norm_eps",
            "final_norm_eps",
            "_class_name",
        ];
        let values = [
            serde_json::json!(0),
            serde_json::json!(1),
            serde_json::json!(-1),
            serde_json::json!(u64::MAX),
            serde_json::json!(1u64 << 40),
            serde_json::json!(1e308),
            serde_json::json!(f64::MIN_POSITIVE),
            serde_json::json!(null),
            serde_json::json!("7"),
            serde_json::json!([1, 2, 2]),
            serde_json::json!([0, 0, 0]),
            serde_json::json!([1, 65535, 65535]),
            serde_json::json!({}),
        ];
        for key in keys {
            for value in &values {
                let mut c = serde_json::Map::new();
                c.insert(key.to_string(), value.clone());
                match parse(serde_json::Value::Object(c)) {
                    Ok(config) => {
                        assert!(config.parameter_count() <= MAX_PARAMETERS, "{key}={value}")
                    }
                    Err(e) => assert!(e.to_string().contains(key), "{key}={value}: {e}"),
                }
            }
        }
    }

    #[test]
    fn products_are_bounded_before_allocation() {
        // Each key within its own bound, the model as a whole far beyond anything real.
        let err = parse(serde_json::json!({
            "num_layers": 1024, "hidden_size": 65536, "ffn_dim": 262144, "time_embed_dim": 65536
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("parameters"), "{err}");
    }
}
