//! The Qwen-Image 2.1 DiT config (`transformer/config.json` of a diffusers folder), validated.

use serde::Deserialize;
use thiserror::Error;

use crate::nn::config::{at_most, checked_product, parse_object};
use crate::nn::weights::{TensorSpec, FLOAT_DTYPES};

/// The diffusers class name this config describes.
pub const CLASS_NAME: &str = "QwenImage21Transformer2DModel";

/// A config that cannot describe a working model.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("Qwen-Image 2.1 DiT config.json: {0}")]
pub struct ConfigError(pub String);

fn default_patch_size() -> usize {
    1
}
fn default_in_channels() -> usize {
    64
}
fn default_num_layers() -> usize {
    32
}
fn default_head_dim() -> usize {
    128
}
fn default_heads() -> usize {
    32
}
fn default_context() -> usize {
    4096
}
fn default_mlp_ratio() -> usize {
    3
}
fn default_axes() -> [usize; 3] {
    [16, 56, 56]
}
fn default_eps() -> f32 {
    1e-6
}
fn default_causal() -> bool {
    true
}

/// `QwenImage21Transformer2DModel` hyper-parameters, with the diffusers defaults for absent keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct QwenImageDitConfig {
    #[serde(rename = "_class_name", default)]
    pub class_name: Option<String>,
    #[serde(default = "default_patch_size")]
    pub patch_size: usize,
    #[serde(default = "default_in_channels")]
    pub in_channels: usize,
    /// `None` (or null) means `in_channels`.
    #[serde(default)]
    pub out_channels: Option<usize>,
    #[serde(default = "default_num_layers")]
    pub num_layers: usize,
    #[serde(default = "default_head_dim")]
    pub attention_head_dim: usize,
    #[serde(default = "default_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "default_context")]
    pub context_in_dim: usize,
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: usize,
    #[serde(default = "default_axes")]
    pub axes_dims_rope: [usize; 3],
    #[serde(default = "default_eps")]
    pub eps: f32,
    #[serde(default = "default_causal")]
    pub causal_condition: bool,
}

/// Width of the sinusoidal timestep embedding.
pub const TIMESTEP_DIM: usize = 256;
/// RoPE base.
pub const ROPE_THETA: f32 = 10000.0;
/// Latent tokens per VLM image slot (a 2x2 group).
pub const TOKENS_PER_SLOT: usize = 4;

impl QwenImageDitConfig {
    /// The diffusers default config (the released 7.1B model).
    pub fn default_full_size() -> Self {
        QwenImageDitConfig {
            class_name: Some(CLASS_NAME.to_string()),
            patch_size: 1,
            in_channels: 64,
            out_channels: Some(64),
            num_layers: 32,
            attention_head_dim: 128,
            num_attention_heads: 32,
            context_in_dim: 4096,
            mlp_ratio: 3,
            axes_dims_rope: [16, 56, 56],
            eps: 1e-6,
            causal_condition: true,
        }
    }

    /// Parses and validates a `config.json` value.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, ConfigError> {
        let config: QwenImageDitConfig = parse_object(value).map_err(ConfigError)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks that the numbers describe a model this crate can run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(name) = &self.class_name {
            if name != CLASS_NAME {
                return Err(ConfigError(format!(
                    "`_class_name` is {name:?}; this loader is for {CLASS_NAME} (the transformer/ folder of a Qwen-Image 2.1 model)"
                )));
            }
        }
        if self.patch_size != 1 {
            return Err(ConfigError(format!(
                "`patch_size` {} is not supported: Qwen-Image 2.1 feeds unpatched latents (patch_size 1)",
                self.patch_size
            )));
        }
        let positive = [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels()),
            ("num_layers", self.num_layers),
            ("attention_head_dim", self.attention_head_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("context_in_dim", self.context_in_dim),
            ("mlp_ratio", self.mlp_ratio),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(ConfigError(format!("`{name}` must be positive, found 0")));
            }
        }
        let bounds = [
            ("context_in_dim", self.context_in_dim, 1 << 20),
            ("in_channels", self.in_channels, 1 << 20),
            ("out_channels", self.out_channels(), 1 << 20),
            ("num_layers", self.num_layers, 1024),
            ("mlp_ratio", self.mlp_ratio, 64),
            ("attention_head_dim", self.attention_head_dim, 1 << 16),
            ("num_attention_heads", self.num_attention_heads, 1 << 16),
        ];
        for (key, value, max) in bounds {
            at_most(key, value, max).map_err(ConfigError)?;
        }
        let inner = checked_product(
            "num_attention_heads x attention_head_dim",
            &[self.num_attention_heads, self.attention_head_dim],
        )
        .map_err(ConfigError)?;
        at_most("num_attention_heads x attention_head_dim", inner, 1 << 20).map_err(ConfigError)?;
        if self.axes_dims_rope.iter().any(|d| d % 2 != 0) {
            return Err(ConfigError(format!(
                "`axes_dims_rope` {:?} must all be even",
                self.axes_dims_rope
            )));
        }
        let axes_sum = self
            .axes_dims_rope
            .iter()
            .try_fold(0usize, |acc, &d| acc.checked_add(d));
        if axes_sum != Some(self.attention_head_dim) {
            return Err(ConfigError(format!(
                "`axes_dims_rope` {:?} must sum to `attention_head_dim` {}",
                self.axes_dims_rope, self.attention_head_dim
            )));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(ConfigError(format!(
                "`eps` {} must be a positive number",
                self.eps
            )));
        }
        Ok(())
    }

    /// Output channels (`out_channels`, or `in_channels` when absent).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Hidden size = heads x head_dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// SwiGLU hidden size.
    pub fn mlp_hidden(&self) -> usize {
        self.inner_dim() * self.mlp_ratio
    }

    /// Every tensor of the model with its shape, in diffusers names; stored as f32, bf16 or f16.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let d = self.inner_dim();
        let f = self.mlp_hidden();
        let hd = self.attention_head_dim;
        let spec = |name: String, shape: Vec<usize>| TensorSpec {
            name,
            shape,
            dtypes: FLOAT_DTYPES.to_vec(),
        };
        let mut specs = vec![
            spec("img_in.weight".into(), vec![d, self.in_channels]),
            spec("txt_in.text_norm.weight".into(), vec![self.context_in_dim]),
            spec(
                "txt_in.in_layer.weight".into(),
                vec![d, self.context_in_dim],
            ),
            spec("txt_in.out_layer.weight".into(), vec![d, d]),
            spec(
                "time_text_embed.timestep_embedder.linear_1.weight".into(),
                vec![d, TIMESTEP_DIM],
            ),
            spec(
                "time_text_embed.timestep_embedder.linear_2.weight".into(),
                vec![d, d],
            ),
            spec("modulation.1.weight".into(), vec![4 * d, d]),
            spec("norm_out.linear.weight".into(), vec![d, d]),
            spec("proj_out.weight".into(), vec![self.out_channels(), d]),
        ];
        for i in 0..self.num_layers {
            let p = format!("transformer_blocks.{i}.");
            specs.push(spec(format!("{p}attn.to_q.weight"), vec![d, d]));
            specs.push(spec(format!("{p}attn.to_k.weight"), vec![d, d]));
            specs.push(spec(format!("{p}attn.to_v.weight"), vec![d, d]));
            specs.push(spec(format!("{p}attn.to_out.0.weight"), vec![d, d]));
            specs.push(spec(format!("{p}attn.norm_q.weight"), vec![hd]));
            specs.push(spec(format!("{p}attn.norm_k.weight"), vec![hd]));
            specs.push(spec(format!("{p}img_mlp.proj.weight"), vec![f, d]));
            specs.push(spec(format!("{p}img_mlp.gate_layer.weight"), vec![f, d]));
            specs.push(spec(format!("{p}img_mlp.out.weight"), vec![d, f]));
        }
        specs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_absent_keys() {
        let c = QwenImageDitConfig::from_json(&serde_json::json!({})).unwrap();
        assert_eq!(
            c,
            QwenImageDitConfig {
                class_name: None,
                out_channels: None,
                ..QwenImageDitConfig::default_full_size()
            }
        );
        assert_eq!(c.inner_dim(), 4096);
        assert_eq!(c.out_channels(), 64);
        // 9 global + 9 per block.
        assert_eq!(c.tensor_specs().len(), 9 + 9 * 32);
    }

    #[test]
    fn full_size_parameter_count_matches_the_reference() {
        let c = QwenImageDitConfig::default_full_size();
        let params: usize = c
            .tensor_specs()
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert_eq!(params, 7_115_124_736);
    }

    #[test]
    fn refuses_inconsistent_configs() {
        for bad in [
            serde_json::json!({"axes_dims_rope": [16, 56, 54]}),
            serde_json::json!({"axes_dims_rope": [15, 57, 56]}),
            serde_json::json!({"patch_size": 2}),
            serde_json::json!({"num_layers": 0}),
            serde_json::json!({"_class_name": "QwenImageTransformer2DModel"}),
            serde_json::json!({"eps": -1.0}),
            serde_json::json!({"num_layers": "two"}),
        ] {
            assert!(QwenImageDitConfig::from_json(&bad).is_err(), "{bad}");
        }
    }
}
