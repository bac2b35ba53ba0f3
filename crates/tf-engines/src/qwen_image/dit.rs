//! The backend-neutral Qwen-Image 2.1 DiT interface.
//!
//! - [`DitInputs`]: one forward's inputs, named and shaped like the diffusers forward arguments.
//! - [`JointLayout`]: everything about the joint text/image sequence that does not depend on weights (token
//!   sources, image blocks, RoPE positions, modulation rows, key padding), built once per forward and shared by
//!   every backend.
//! - [`DitBackend`]: a forward with an optional prefix KV cache owned by the backend ([`KvStep`]); caches convert
//!   to and from [`HostKvCache`] so they can be saved between processes (`tf forward --kv-file`).
//!
//! The host reference ([`super::dit_host::HostDit`]) implements the trait; the GPU backend implements the same.

use std::path::Path;

use thiserror::Error;

use super::config::{ConfigError, QwenImageDitConfig, TOKENS_PER_SLOT};
use crate::nn::backend_error::GpuError;
use crate::nn::fp8_checkpoint::{Fp8Checkpoint, Fp8CheckpointError};
use crate::nn::tensor::{ShapeError, Tensor, TensorF32};
use crate::nn::weights::{write_safetensors, AnyTensor, ModelDir, SafetensorsFile, WeightsError};

/// Errors of a DiT forward.
#[derive(Debug, Error)]
pub enum DitError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An FP8 checkpoint (weights stored as e4m3 with their scales) that does not follow an accepted layout.
    #[error(transparent)]
    Fp8Checkpoint(#[from] Fp8CheckpointError),
    #[error("shape mismatch: {0}")]
    Shape(#[from] ShapeError),
    #[error("invalid DiT inputs: {0}")]
    Input(String),
    #[error("KV cache: {0}")]
    KvCache(String),
    /// A GPU call failed; the cause (a `tf_cuda::Error`, cuBLASLt, kernels, upload) stays in the source chain,
    /// so a lost context is visible to [`crate::nn::backend_error::chain_has_lost_context`].
    #[error("GPU backend: {0}")]
    Gpu(#[from] GpuError),
    /// A backend condition with no underlying error (an unsupported config, a missing workspace).
    #[error("backend: {0}")]
    Backend(String),
}

/// Checks a DiT folder against `config` before anything is loaded: finds the weights stored in FP8 with their
/// scales (a scaled-FP8 checkpoint; none in an ordinary one), validates them, then checks every tensor's name,
/// shape and dtype, FP8 allowed where the file has it and the scale tensors declared.
pub fn check_folder(
    model: &ModelDir,
    config: &QwenImageDitConfig,
) -> Result<Fp8Checkpoint, DitError> {
    let checkpoint = Fp8Checkpoint::scan(model)?;
    model.check(&checkpoint.model_specs(&config.tensor_specs()))?;
    Ok(checkpoint)
}

fn input_err(why: impl Into<String>) -> DitError {
    DitError::Input(why.into())
}

/// Inputs of one forward (names as the diffusers `forward` arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct DitInputs {
    /// `[B, N_img, in_channels]`: condition images' latents first, the target last.
    pub hidden_states: TensorF32,
    /// `[B, L_vlm, context_in_dim]`: text-encoder rows, including the condition images' VLM slots.
    pub encoder_hidden_states: TensorF32,
    /// `[B]`, sigma in [0, 1].
    pub timestep: TensorF32,
    /// `[B, L_vlm + N_tgt/4]`, 1 at VLM image slots (each a 2x2 group of latent tokens), target slots appended.
    pub img_mask: Tensor<u8>,
    /// `[B, L_vlm]`, 1 = valid text row, 0 = padding. Absent = all valid.
    pub encoder_hidden_states_mask: Option<Tensor<u8>>,
    /// `[B, n_images, 3]` (frame, height, width) in latent tokens, condition images first, target last.
    pub img_shapes: Tensor<i64>,
}

impl DitInputs {
    /// Reads a bundle with the tensors named as the fields (floats may be F32/BF16/F16; masks U8 or BOOL;
    /// `img_shapes` I64 or I32).
    pub fn from_bundle(file: &SafetensorsFile) -> Result<DitInputs, DitError> {
        let mask = if file.contains("encoder_hidden_states_mask") {
            Some(file.to_u8("encoder_hidden_states_mask")?)
        } else {
            None
        };
        Ok(DitInputs {
            hidden_states: file.to_f32("hidden_states")?,
            encoder_hidden_states: file.to_f32("encoder_hidden_states")?,
            timestep: file.to_f32("timestep")?,
            img_mask: file.to_u8("img_mask")?,
            encoder_hidden_states_mask: mask,
            img_shapes: file.to_i64("img_shapes")?,
        })
    }

    /// Batch size.
    pub fn batch(&self) -> usize {
        self.hidden_states.shape().first().copied().unwrap_or(0)
    }
}

/// Where a joint-sequence token comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// Row `m` of `encoder_hidden_states` (after `txt_in`).
    Text(usize),
    /// Token `n` of `hidden_states` (after `img_in`).
    Image(usize),
}

/// The joint text/image sequence of a forward, independent of weights and backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JointLayout {
    pub batch: usize,
    /// Joint sequence length S.
    pub seq_len: usize,
    /// Target-image tokens (the last `n_target` of the sequence).
    pub n_target: usize,
    /// Tokens before the target (text and condition images): `seq_len - n_target`.
    pub prefix_len: usize,
    /// Source of each joint token (same for every sample).
    pub sources: Vec<TokenSource>,
    /// Image block per joint token, `-1` for text.
    pub block_ids: Vec<i32>,
    /// RoPE (frame, height, width) position per joint token.
    pub positions: Vec<[i64; 3]>,
    /// Modulation row per joint token: 0 = the sample's timestep, 1 = the `t = 0` row (prefix tokens with
    /// `causal_condition`).
    pub row_mod: Vec<usize>,
    /// Number of modulation rows per sample (2 with `causal_condition`, else 1).
    pub n_mod: usize,
    /// Key validity `[B][S]` (padded text rows are never keys).
    pub key_valid: Vec<Vec<bool>>,
}

fn shape_eq(what: &str, actual: &[usize], expected: &[usize]) -> Result<(), DitError> {
    if actual == expected {
        Ok(())
    } else {
        Err(input_err(format!(
            "{what} has shape {actual:?}, expected {expected:?}"
        )))
    }
}

impl JointLayout {
    /// Validates `inputs` against `config` and builds the layout (the diffusers rules: VLM order, four latent
    /// tokens per image slot, target appended last; RoPE positions; block-causal metadata).
    pub fn build(config: &QwenImageDitConfig, inputs: &DitInputs) -> Result<JointLayout, DitError> {
        let [batch, n_img, in_ch] = inputs.hidden_states.dims::<3>("hidden_states")?;
        if batch == 0 {
            return Err(input_err("batch size is 0"));
        }
        if in_ch != config.in_channels {
            return Err(input_err(format!(
                "hidden_states has {in_ch} channels, the model takes {}",
                config.in_channels
            )));
        }
        let [eb, l_vlm, ctx] = inputs
            .encoder_hidden_states
            .dims::<3>("encoder_hidden_states")?;
        shape_eq(
            "encoder_hidden_states",
            &[eb, l_vlm, ctx],
            &[batch, l_vlm, config.context_in_dim],
        )?;
        shape_eq("timestep", inputs.timestep.shape(), &[batch])?;
        if inputs.timestep.data().iter().any(|t| !t.is_finite()) {
            return Err(input_err("timestep has a non-finite value"));
        }
        let [mb, m_len] = inputs.img_mask.dims::<2>("img_mask")?;
        shape_eq("img_mask", &[mb, m_len], &[batch, m_len])?;
        let [sb, n_images, three] = inputs.img_shapes.dims::<3>("img_shapes")?;
        shape_eq("img_shapes", &[sb, n_images, three], &[batch, n_images, 3])?;
        if n_images == 0 {
            return Err(input_err(
                "img_shapes lists no image (the target image must be last)",
            ));
        }

        // Every sample must share one layout (diffusers reads row 0 of img_mask and img_shapes).
        let mask_row: Vec<bool> = inputs.img_mask.data()[..m_len]
            .iter()
            .map(|&v| v != 0)
            .collect();
        for b in 1..batch {
            let row = &inputs.img_mask.data()[b * m_len..(b + 1) * m_len];
            if row.iter().map(|&v| v != 0).ne(mask_row.iter().copied()) {
                return Err(input_err(format!(
                    "img_mask row {b} differs from row 0: all samples must share a layout"
                )));
            }
        }
        let shapes_row = &inputs.img_shapes.data()[..n_images * 3];
        for b in 1..batch {
            if &inputs.img_shapes.data()[b * n_images * 3..(b + 1) * n_images * 3] != shapes_row {
                return Err(input_err(format!("img_shapes of sample {b} differ from sample 0: all samples must share a layout")));
            }
        }
        let mut shapes = Vec::with_capacity(n_images);
        for (i, s) in shapes_row.chunks_exact(3).enumerate() {
            let dims = [s[0], s[1], s[2]];
            if dims[0] != 1 {
                return Err(input_err(format!(
                    "img_shapes[{i}] has {} frames: image blocks are single frames",
                    dims[0]
                )));
            }
            if dims[1] <= 0 || dims[2] <= 0 || dims[1] > 1 << 16 || dims[2] > 1 << 16 {
                return Err(input_err(format!(
                    "img_shapes[{i}] = {dims:?} must have positive height and width"
                )));
            }
            shapes.push((dims[1] as usize, dims[2] as usize));
        }
        let block_lengths: Vec<usize> = shapes.iter().map(|&(h, w)| h * w).collect();
        let n_target = *block_lengths.last().unwrap_or(&0);
        if !n_target.is_multiple_of(TOKENS_PER_SLOT) {
            return Err(input_err(format!(
                "the target has {n_target} latent tokens, not a multiple of {TOKENS_PER_SLOT}"
            )));
        }
        let target_slots = n_target / TOKENS_PER_SLOT;
        if m_len != l_vlm + target_slots {
            return Err(input_err(format!(
                "img_mask has {m_len} entries; expected encoder rows ({l_vlm}) + target slots ({target_slots})"
            )));
        }
        if !mask_row[l_vlm..].iter().all(|&v| v) {
            return Err(input_err(
                "the trailing target slots of img_mask must all be 1",
            ));
        }
        let total_image: usize = block_lengths.iter().sum();
        let slots = mask_row.iter().filter(|&&v| v).count();
        if slots * TOKENS_PER_SLOT != total_image || total_image != n_img {
            return Err(input_err(format!(
                "img_mask marks {slots} slots ({} latent tokens), img_shapes accounts for {total_image}, hidden_states has {n_img}",
                slots * TOKENS_PER_SLOT
            )));
        }

        // Joint sequence: text rows in VLM order, each image slot expanded to four latent tokens in order.
        let mut sources = Vec::with_capacity(l_vlm + total_image);
        let mut image_token = 0usize;
        for (m, &is_image) in mask_row.iter().enumerate() {
            if is_image {
                for _ in 0..TOKENS_PER_SLOT {
                    sources.push(TokenSource::Image(image_token));
                    image_token += 1;
                }
            } else {
                sources.push(TokenSource::Text(m));
            }
        }
        let seq_len = sources.len();

        // Image block per token, by counts (adjacent images stay separate blocks).
        let mut block_ids = vec![-1i32; seq_len];
        let mut image_block = Vec::with_capacity(total_image);
        for (block, &len) in block_lengths.iter().enumerate() {
            image_block.extend(std::iter::repeat_n(block as i32, len));
        }
        for (id, src) in block_ids.iter_mut().zip(&sources) {
            if let TokenSource::Image(n) = *src {
                *id = image_block[n];
            }
        }

        // RoPE positions: text advances a running position on all axes; an image block sits at the running
        // position on the frame axis with a zero-centred grid, then the position advances by max(h, w).
        let mut positions = vec![[0i64; 3]; seq_len];
        let mut position = 0i64;
        let mut cursor = 0usize;
        for &(h, w) in &shapes {
            let block_start = (cursor..seq_len)
                .find(|&p| matches!(sources[p], TokenSource::Image(_)))
                .ok_or_else(|| input_err("img_shapes lists more image tokens than img_mask"))?;
            for pos in positions.iter_mut().take(block_start).skip(cursor) {
                *pos = [position; 3];
                position += 1;
            }
            let (hh, ww) = (h as i64, w as i64);
            for (k, pos) in positions
                .iter_mut()
                .skip(block_start)
                .take(h * w)
                .enumerate()
            {
                let (row, col) = ((k / w) as i64, (k % w) as i64);
                *pos = [position, row - (hh - hh / 2), col - (ww - ww / 2)];
            }
            position += hh.max(ww);
            cursor = block_start + h * w;
        }
        for pos in positions.iter_mut().skip(cursor) {
            *pos = [position; 3];
            position += 1;
        }

        let prefix_len = seq_len - n_target;
        let (n_mod, row_mod) = if config.causal_condition {
            (
                2,
                (0..seq_len).map(|p| usize::from(p < prefix_len)).collect(),
            )
        } else {
            (1, vec![0; seq_len])
        };

        let mut key_valid = vec![vec![true; seq_len]; batch];
        if let Some(mask) = &inputs.encoder_hidden_states_mask {
            let [kb, kl] = mask.dims::<2>("encoder_hidden_states_mask")?;
            shape_eq("encoder_hidden_states_mask", &[kb, kl], &[batch, l_vlm])?;
            for (b, valid) in key_valid.iter_mut().enumerate() {
                let row = &mask.data()[b * l_vlm..(b + 1) * l_vlm];
                for (v, src) in valid.iter_mut().zip(&sources) {
                    if let TokenSource::Text(m) = *src {
                        *v = row[m] != 0;
                    }
                }
            }
        }

        Ok(JointLayout {
            batch,
            seq_len,
            n_target,
            prefix_len,
            sources,
            block_ids,
            positions,
            row_mod,
            n_mod,
            key_valid,
        })
    }
}

/// How a forward uses the prefix KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvMode {
    /// No cache: the whole joint sequence; output `[B, S, out]`.
    None,
    /// Run the whole sequence and keep the prefix K/V; output `[B, S, out]`.
    Extract,
    /// Run only the target rows against a cache from an earlier extract; output `[B, N_tgt, out]`.
    Cached,
}

/// A forward's cache request, with the backend's cache for [`KvStep::Cached`].
#[derive(Debug, Clone, Copy)]
pub enum KvStep<'a, C> {
    None,
    Extract,
    Cached(&'a C),
}

impl<C> KvStep<'_, C> {
    /// The mode of this step.
    pub fn mode(&self) -> KvMode {
        match self {
            KvStep::None => KvMode::None,
            KvStep::Extract => KvMode::Extract,
            KvStep::Cached(_) => KvMode::Cached,
        }
    }
}

impl<'a, C> KvStep<'a, C> {
    /// The cache a cached step reads (`None` for the other modes).
    pub fn cache(&self) -> Option<&'a C> {
        match self {
            KvStep::Cached(c) => Some(c),
            _ => None,
        }
    }
}

/// A forward's result.
#[derive(Debug)]
pub struct DitOutput<C> {
    /// `sample`: `[B, S, out_channels]`, or `[B, N_tgt, out_channels]` in cached mode.
    pub sample: TensorF32,
    /// The extracted cache (extract mode only).
    pub kv_cache: Option<C>,
}

/// A DiT backend: the host reference or a GPU engine.
pub trait DitBackend {
    /// The backend's prefix K/V cache (host memory or device buffers).
    type KvCache;

    /// The model config.
    fn config(&self) -> &QwenImageDitConfig;

    /// One forward. [`KvStep::Extract`] returns the cache in the output; [`KvStep::Cached`] needs
    /// `causal_condition` and a cache extracted from inputs with the same prefix layout.
    fn forward(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, Self::KvCache>,
    ) -> Result<DitOutput<Self::KvCache>, DitError>;

    /// Copies a cache to host memory (to save it).
    fn kv_to_host(&self, cache: &Self::KvCache) -> Result<HostKvCache, DitError>;

    /// Makes a backend cache from a host copy (after loading it).
    fn kv_from_host(&mut self, cache: HostKvCache) -> Result<Self::KvCache, DitError>;
}

/// The prefix K/V of every layer in host memory: post-norm, post-RoPE, `[B, prefix_len, heads, head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostKvCache {
    pub batch: usize,
    pub prefix_len: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// `(k, v)` per layer.
    pub layers: Vec<(TensorF32, TensorF32)>,
}

impl HostKvCache {
    /// Checks that this cache fits `config` and a forward of `batch` samples with `prefix_len` prefix tokens.
    pub fn check(
        &self,
        config: &QwenImageDitConfig,
        batch: usize,
        prefix_len: usize,
    ) -> Result<(), DitError> {
        let err = |why: String| {
            Err(DitError::KvCache(format!(
                "{why}; extract the cache from the same model and prefix"
            )))
        };
        if self.layers.len() != config.num_layers {
            return err(format!(
                "{} layers, the model has {}",
                self.layers.len(),
                config.num_layers
            ));
        }
        if (self.heads, self.head_dim) != (config.num_attention_heads, config.attention_head_dim) {
            return err(format!(
                "{} heads of {}, the model has {} of {}",
                self.heads, self.head_dim, config.num_attention_heads, config.attention_head_dim
            ));
        }
        if self.batch != batch {
            return err(format!("batch {}, the inputs have {batch}", self.batch));
        }
        if self.prefix_len != prefix_len {
            return err(format!(
                "prefix of {} tokens, the inputs have {prefix_len}",
                self.prefix_len
            ));
        }
        let shape = [batch, prefix_len, self.heads, self.head_dim];
        for (i, (k, v)) in self.layers.iter().enumerate() {
            if k.shape() != shape || v.shape() != shape {
                return err(format!(
                    "layer {i} K/V shapes {:?}/{:?}, expected {shape:?}",
                    k.shape(),
                    v.shape()
                ));
            }
        }
        Ok(())
    }

    /// Writes the cache as safetensors: `kv.{i}.k` and `kv.{i}.v`, f32 `[B, P, heads, head_dim]`.
    pub fn save(&self, path: &Path) -> Result<(), DitError> {
        let names: Vec<(String, String)> = (0..self.layers.len())
            .map(|i| (format!("kv.{i}.k"), format!("kv.{i}.v")))
            .collect();
        let mut tensors = Vec::with_capacity(2 * self.layers.len());
        for ((kn, vn), (k, v)) in names.iter().zip(&self.layers) {
            tensors.push((kn.as_str(), AnyTensor::F32(k)));
            tensors.push((vn.as_str(), AnyTensor::F32(v)));
        }
        write_safetensors(path, &tensors)?;
        Ok(())
    }

    /// Reads a cache written by [`HostKvCache::save`].
    pub fn load(path: &Path) -> Result<HostKvCache, DitError> {
        let file = SafetensorsFile::open(path)?;
        let mut layers = Vec::new();
        while file.contains(&format!("kv.{}.k", layers.len())) {
            let i = layers.len();
            layers.push((
                file.to_f32(&format!("kv.{i}.k"))?,
                file.to_f32(&format!("kv.{i}.v"))?,
            ));
        }
        let Some((k0, _)) = layers.first() else {
            return Err(DitError::KvCache(format!(
                "{}: no kv.0.k tensor: not a KV cache file",
                path.display()
            )));
        };
        let [batch, prefix_len, heads, head_dim] = k0.dims::<4>("kv.0.k")?;
        if file.names().count() != 2 * layers.len() {
            return Err(DitError::KvCache(format!(
                "{}: unexpected tensors besides kv.{{i}}.k/v",
                path.display()
            )));
        }
        Ok(HostKvCache {
            batch,
            prefix_len,
            heads,
            head_dim,
            layers,
        })
    }
}
