//! The backend-neutral MiniMax H3 DiT interface.
//!
//! - [`H3Inputs`]: one forward's inputs, named and shaped as the diffusers `forward` arguments, read by name from a
//!   safetensors bundle ([`H3Inputs::from_bundle`]) or made from a [`PackedLayout`] ([`H3Inputs::from_layout`]).
//! - [`H3Rows`]: the inputs validated against the config (every shape, every index in range, the three index sets
//!   a partition of the sequence, tags in 0..3, timestep indices in range, finite values) and what a backend
//!   derives from them: per-row adaLN rows `timestep_index * 3 + tag`, per-row `norm_out` rows, f32 positions.
//!   Every backend builds it the same way.
//! - [`H3DitBackend`]: `forward(inputs) -> H3Output { sample, audio_sample }`. The host reference
//!   ([`super::dit_host::HostH3Dit`]) implements it; a GPU backend implements the same.

use thiserror::Error;

use super::config::{ConfigError, MiniMaxH3Config, MODALITIES};
use super::layout::{LayoutError, PackedLayout, RowTimesteps, MAX_SEQUENCE_ROWS};
use crate::nn::gpu::gemm::StoredGemms;
use crate::nn::tensor::{ShapeError, Tensor, TensorF32};
use crate::nn::weights::{Dtype, SafetensorsFile, WeightsError};

/// Batch items of one forward, at most (the batch axis only replicates the layout).
pub const MAX_BATCH: usize = 64;
/// Magnitude of a RoPE position, at most (a real sequence stays below 2e5).
pub const MAX_POSITION: f64 = 1e9;

/// Errors of a MiniMax H3 DiT load or forward.
#[derive(Debug, Error)]
pub enum H3Error {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A transformer folder storing weights in FP8 with their scales (a scaled-FP8 checkpoint) that does not
    /// follow an accepted layout; the error names the file and tensor. Boxed: the error is large and rare.
    #[error(transparent)]
    Fp8Checkpoint(Box<crate::nn::fp8_checkpoint::Fp8CheckpointError>),
    #[error("shape mismatch: {0}")]
    Shape(#[from] ShapeError),
    /// An original-layout tensor that cannot be mapped onto the diffusers layout.
    #[error("{file}: tensor {tensor:?}: {why}")]
    Checkpoint {
        file: String,
        tensor: String,
        why: String,
    },
    #[error("invalid MiniMax H3 DiT inputs: {0}")]
    Input(String),
    /// A backend condition with no underlying error (an unsupported config, a missing workspace).
    #[error("backend: {0}")]
    Backend(String),
    /// A GPU backend call failed (the typed cause stays in the chain, so a lost context is findable).
    #[error(transparent)]
    Gpu(#[from] crate::nn::backend_error::GpuError),
}

impl From<crate::nn::fp8_checkpoint::Fp8CheckpointError> for H3Error {
    fn from(e: crate::nn::fp8_checkpoint::Fp8CheckpointError) -> H3Error {
        H3Error::Fp8Checkpoint(Box::new(e))
    }
}

fn input_err<T>(why: impl Into<String>) -> Result<T, H3Error> {
    Err(H3Error::Input(why.into()))
}

/// Inputs of one forward (names as the diffusers `forward` arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct H3Inputs {
    /// `[B, Nv, in_channels * prod(patch)]`: video rows (conditioning rows first), in `video_indices` order.
    pub hidden_states: TensorF32,
    /// `[B, Na, audio_in_channels]`: audio rows in `audio_indices` order.
    pub audio_hidden_states: TensorF32,
    /// `[B, L, text_dim]`: text-encoder rows in `text_indices` order.
    pub encoder_hidden_states: TensorF32,
    /// `[T]`: the distinct timesteps of the sequence, in `[0, 1]`, 1 = clean.
    pub timestep: TensorF32,
    /// `[S]`: index of every row's timestep in `timestep`.
    pub timestep_indices: Tensor<i64>,
    /// `[S]`: modality of every row (0 video, 1 text, 2 audio).
    pub token_tags: Tensor<i64>,
    /// `[S, 3]`: `(t, h, w)` RoPE position of every row, float64.
    pub position_ids: Tensor<f64>,
    /// `[Nv]`, `[Na]`, `[L]`: sequence positions of the video, audio and text rows.
    pub video_indices: Tensor<i64>,
    pub audio_indices: Tensor<i64>,
    pub text_indices: Tensor<i64>,
}

/// Reads `name` as f64 (from F64 or F32).
fn read_f64(file: &SafetensorsFile, name: &str) -> Result<Tensor<f64>, H3Error> {
    let info = file.info(name)?;
    let bytes = file.bytes(name)?;
    let data: Vec<f64> = match info.dtype {
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        other => {
            return Err(H3Error::Weights(WeightsError::Conversion {
                path: file.path().to_path_buf(),
                name: name.to_string(),
                dtype: other,
                wanted: "f64",
            }))
        }
    };
    Ok(Tensor::new(info.shape.clone(), data)?)
}

fn i64_tensor(what: &str, values: &[usize]) -> Result<Tensor<i64>, H3Error> {
    let data = values
        .iter()
        .map(|&v| i64::try_from(v).map_err(|_| H3Error::Input(format!("{what} value {v}"))))
        .collect::<Result<Vec<i64>, H3Error>>()?;
    Ok(Tensor::new(vec![values.len()], data)?)
}

impl H3Inputs {
    /// Reads a bundle with the tensors named as the fields: floats F32/BF16/F16, `position_ids` F64 (or F32),
    /// indices and tags I64 or I32.
    pub fn from_bundle(file: &SafetensorsFile) -> Result<H3Inputs, H3Error> {
        Ok(H3Inputs {
            hidden_states: file.to_f32("hidden_states")?,
            audio_hidden_states: file.to_f32("audio_hidden_states")?,
            encoder_hidden_states: file.to_f32("encoder_hidden_states")?,
            timestep: file.to_f32("timestep")?,
            timestep_indices: file.to_i64("timestep_indices")?,
            token_tags: file.to_i64("token_tags")?,
            position_ids: read_f64(file, "position_ids")?,
            video_indices: file.to_i64("video_indices")?,
            audio_indices: file.to_i64("audio_indices")?,
            text_indices: file.to_i64("text_indices")?,
        })
    }

    /// The inputs of a forward over `layout` at the step's `timesteps`, with the given rows.
    pub fn from_layout(
        layout: &PackedLayout,
        timesteps: &RowTimesteps,
        hidden_states: TensorF32,
        audio_hidden_states: TensorF32,
        encoder_hidden_states: TensorF32,
    ) -> Result<H3Inputs, H3Error> {
        let s = layout.seq_len;
        let positions: Vec<f64> = layout.positions.iter().flatten().copied().collect();
        let tags: Vec<usize> = layout.tags.iter().map(|&t| usize::from(t)).collect();
        Ok(H3Inputs {
            hidden_states,
            audio_hidden_states,
            encoder_hidden_states,
            timestep: Tensor::new(vec![timesteps.unique.len()], timesteps.unique.clone())?,
            timestep_indices: i64_tensor("timestep_indices", &timesteps.indices)?,
            token_tags: i64_tensor("token_tags", &tags)?,
            position_ids: Tensor::new(vec![s, 3], positions)?,
            video_indices: i64_tensor("video_indices", &layout.video_indices)?,
            audio_indices: i64_tensor("audio_indices", &layout.audio_indices)?,
            text_indices: i64_tensor("text_indices", &layout.text_indices)?,
        })
    }

    /// Batch size.
    pub fn batch(&self) -> usize {
        self.hidden_states.shape().first().copied().unwrap_or(0)
    }
}

/// Outputs of one forward.
#[derive(Debug, Clone, PartialEq)]
pub struct H3Output {
    /// `[B, Nv, in_channels * prod(patch)]`: video velocity in `video_indices` order (conditioning rows included).
    pub sample: TensorF32,
    /// `[B, Na, audio_in_channels]`: audio velocity in `audio_indices` order.
    pub audio_sample: TensorF32,
}

/// The inputs of a forward, validated, and the per-row tables every backend uses.
#[derive(Debug, Clone, PartialEq)]
pub struct H3Rows {
    pub batch: usize,
    /// Packed sequence length S.
    pub seq_len: usize,
    /// Sequence positions of the video, audio and text rows (in input order).
    pub video_rows: Vec<usize>,
    pub audio_rows: Vec<usize>,
    pub text_rows: Vec<usize>,
    /// The distinct timesteps.
    pub timesteps: Vec<f32>,
    /// Per row: its row of the `[T * 3, 6 * hidden]` adaLN table, `timestep_index * 3 + tag`.
    pub adaln_rows: Vec<usize>,
    /// Per row: its timestep index (the `norm_out` table row).
    pub timestep_rows: Vec<usize>,
    /// Per row: `(t, h, w)` cast to f32, as the reference's rotary embedding does.
    pub positions: Vec<[f32; 3]>,
}

fn dims3(t: &TensorF32, what: &str) -> Result<[usize; 3], H3Error> {
    Ok(t.dims::<3>(what)?)
}

/// Checks an index tensor against the sequence and marks its rows.
fn mark_rows(
    what: &str,
    t: &Tensor<i64>,
    expected_len: usize,
    owner: &mut [u8],
    mark: u8,
) -> Result<Vec<usize>, H3Error> {
    let [n] = t.dims::<1>(what)?;
    if n != expected_len {
        return input_err(format!(
            "{what} has {n} entries, the matching rows tensor has {expected_len}"
        ));
    }
    let seq = owner.len();
    let mut rows = Vec::with_capacity(n);
    for &v in t.data() {
        let r = usize::try_from(v)
            .ok()
            .filter(|&r| r < seq)
            .ok_or_else(|| H3Error::Input(format!("{what} holds {v}, outside 0..{seq}")))?;
        if owner[r] != 0 {
            return input_err(format!(
                "sequence row {r} is listed twice (in {what} and {}): the text, video and audio indices must partition the sequence",
                ["", "text_indices", "video_indices", "audio_indices"][usize::from(owner[r]).min(3)]
            ));
        }
        owner[r] = mark;
        rows.push(r);
    }
    Ok(rows)
}

impl H3Rows {
    /// Validates `inputs` against `config` (shapes, ranges, the row partition) and derives the per-row tables.
    pub fn build(config: &MiniMaxH3Config, inputs: &H3Inputs) -> Result<H3Rows, H3Error> {
        let [s, three] = inputs.position_ids.dims::<2>("position_ids")?;
        if three != 3 {
            return input_err(format!(
                "position_ids has shape [{s}, {three}], expected [seq_len, 3]"
            ));
        }
        if s == 0 || s > MAX_SEQUENCE_ROWS {
            return input_err(format!(
                "position_ids has {s} rows; the packed sequence must have 1 to {MAX_SEQUENCE_ROWS}"
            ));
        }
        let [b, nv, vp] = dims3(&inputs.hidden_states, "hidden_states")?;
        let [ba, na, ca] = dims3(&inputs.audio_hidden_states, "audio_hidden_states")?;
        let [bt, l, td] = dims3(&inputs.encoder_hidden_states, "encoder_hidden_states")?;
        if b == 0 || b > MAX_BATCH || ba != b || bt != b {
            return input_err(format!(
                "batch sizes {b} (hidden_states), {ba} (audio_hidden_states), {bt} (encoder_hidden_states) must agree and be 1 to {MAX_BATCH}"
            ));
        }
        for (what, got, want) in [
            ("hidden_states", vp, config.video_patch_dim()),
            ("audio_hidden_states", ca, config.audio_in_channels),
            ("encoder_hidden_states", td, config.text_dim),
        ] {
            if got != want {
                return input_err(format!(
                    "{what} has {got} channels per row, the model takes {want}"
                ));
            }
        }
        let [t] = inputs.timestep.dims::<1>("timestep")?;
        if t == 0 || t > s {
            return input_err(format!(
                "timestep has {t} values; expected 1 to seq_len ({s}) distinct timesteps"
            ));
        }
        if let Some(v) = inputs.timestep.data().iter().find(|v| !v.is_finite()) {
            return input_err(format!("timestep holds {v}"));
        }
        for (what, tensor) in [
            ("timestep_indices", &inputs.timestep_indices),
            ("token_tags", &inputs.token_tags),
        ] {
            let [n] = tensor.dims::<1>(what)?;
            if n != s {
                return input_err(format!("{what} has {n} entries, position_ids has {s} rows"));
            }
        }
        if nv.checked_add(na).and_then(|x| x.checked_add(l)) != Some(s) {
            return input_err(format!(
                "{nv} video + {na} audio + {l} text rows do not make the {s} rows of position_ids"
            ));
        }
        let mut owner = vec![0u8; s];
        let text_rows = mark_rows("text_indices", &inputs.text_indices, l, &mut owner, 1)?;
        let video_rows = mark_rows("video_indices", &inputs.video_indices, nv, &mut owner, 2)?;
        let audio_rows = mark_rows("audio_indices", &inputs.audio_indices, na, &mut owner, 3)?;

        let mut adaln_rows = Vec::with_capacity(s);
        let mut timestep_rows = Vec::with_capacity(s);
        for (row, (&ti, &tag)) in inputs
            .timestep_indices
            .data()
            .iter()
            .zip(inputs.token_tags.data())
            .enumerate()
        {
            let ti = usize::try_from(ti).ok().filter(|&v| v < t).ok_or_else(|| {
                H3Error::Input(format!(
                    "timestep_indices[{row}] = {ti} is outside 0..{t} (the timestep tensor)"
                ))
            })?;
            let tag = usize::try_from(tag)
                .ok()
                .filter(|&v| v < MODALITIES)
                .ok_or_else(|| {
                    H3Error::Input(format!(
                        "token_tags[{row}] = {tag}; tags are 0 (video), 1 (text) or 2 (audio)"
                    ))
                })?;
            adaln_rows.push(ti * MODALITIES + tag);
            timestep_rows.push(ti);
        }
        let mut positions = Vec::with_capacity(s);
        for (row, p) in inputs.position_ids.data().chunks_exact(3).enumerate() {
            if let Some(v) = p
                .iter()
                .find(|v| !(v.is_finite() && v.abs() <= MAX_POSITION))
            {
                return input_err(format!(
                    "position_ids[{row}] holds {v}; positions are finite and at most {MAX_POSITION:e} in magnitude"
                ));
            }
            positions.push([p[0] as f32, p[1] as f32, p[2] as f32]);
        }
        Ok(H3Rows {
            batch: b,
            seq_len: s,
            video_rows,
            audio_rows,
            text_rows,
            timesteps: inputs.timestep.data().to_vec(),
            adaln_rows,
            timestep_rows,
            positions,
        })
    }

    /// These rows with their timestep tables indexed into `schedule` (distinct values, compared bit for bit)
    /// instead of this forward's own timesteps: `timesteps` becomes `schedule`, and each row's adaLN and
    /// `norm_out` rows point at its value's place there. `None` when a timestep of the forward is not in the
    /// schedule (or the schedule is empty). A backend that keeps the tables of a whole schedule uses it so that
    /// every step of a request reads the same tables.
    pub fn on_schedule(&self, schedule: &[f32]) -> Option<H3Rows> {
        let place: Vec<usize> = self
            .timesteps
            .iter()
            .map(|t| schedule.iter().position(|s| s.to_bits() == t.to_bits()))
            .collect::<Option<_>>()?;
        let remap = |own: usize| place.get(own).copied();
        let adaln_rows = self
            .adaln_rows
            .iter()
            .map(|&r| remap(r / 3).map(|t| t * 3 + r % 3))
            .collect::<Option<_>>()?;
        let timestep_rows = self
            .timestep_rows
            .iter()
            .map(|&r| remap(r))
            .collect::<Option<_>>()?;
        Some(H3Rows {
            timesteps: schedule.to_vec(),
            adaln_rows,
            timestep_rows,
            ..self.clone()
        })
    }
}

/// A MiniMax H3 DiT backend.
pub trait H3DitBackend {
    /// The model's config.
    fn config(&self) -> &MiniMaxH3Config;

    /// One forward over the packed sequence.
    fn forward(&mut self, inputs: &H3Inputs) -> Result<H3Output, H3Error>;

    /// Tells the backend every timestep value the coming forwards will use (a request's whole schedule), so that
    /// it can make their timestep-dependent tables once instead of in every step; an empty slice forgets it.
    /// Forwards stay correct whatever they are given. Returns whether the schedule is used (the default: not).
    fn set_timestep_schedule(&mut self, timesteps: &[f32]) -> Result<bool, H3Error> {
        let _ = timesteps;
        Ok(false)
    }

    /// Plans every GEMM shape the persistent plan cache stores for this GPU and loads their kernels, so that a
    /// request of a shape an earlier process planned plans and loads nothing (a worker's load). `None` when the
    /// backend has no GEMM plans (the default).
    fn prepare_stored_gemms(&mut self) -> Result<Option<StoredGemms>, H3Error> {
        Ok(None)
    }

    /// Frees the memory a forward works in (the weights stay); the next forward makes it again. A resident
    /// pipeline calls it after the last step, so the decoders never run beside the DiT's activations.
    fn release_workspaces(&mut self) {}

    /// Runs later forwards sequence-parallel over `sp`'s ranks (a no-op when already so). Only the GPU backend
    /// can; the others refuse.
    fn attach_sequence_parallel(
        &mut self,
        sp: &super::dit_gpu::parallel::SequenceParallel,
    ) -> Result<(), H3Error> {
        Err(H3Error::Backend(format!(
            "this DiT backend runs in one process; sequence parallelism over {} GPUs needs the GPU backend",
            sp.comm.world_size()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::{Geometry, KeyframeAnchor, LayoutRequest, StepTimesteps};
    use super::*;

    #[test]
    fn rows_on_a_schedule_point_at_their_values_there() {
        let rows = H3Rows::build(&tiny_config(), &inputs()).unwrap();
        assert!(rows.timesteps.len() >= 2, "{:?}", rows.timesteps);
        // The forward's values in another order, among others.
        let mut schedule = vec![0.123f32, 999.0];
        schedule.extend(rows.timesteps.iter().rev());
        schedule.push(-7.5);
        let on = rows
            .on_schedule(&schedule)
            .expect("every value is in the schedule");
        assert_eq!(on.timesteps, schedule);
        for r in 0..rows.adaln_rows.len() {
            // The same value and the same tag.
            let (own, tag) = (rows.adaln_rows[r] / 3, rows.adaln_rows[r] % 3);
            assert_eq!(on.adaln_rows[r] % 3, tag);
            assert_eq!(
                schedule[on.adaln_rows[r] / 3].to_bits(),
                rows.timesteps[own].to_bits()
            );
            assert_eq!(
                schedule[on.timestep_rows[r]].to_bits(),
                rows.timesteps[rows.timestep_rows[r]].to_bits()
            );
        }
        assert_eq!(on.positions, rows.positions);
        assert_eq!(on.video_rows, rows.video_rows);
        // A value missing from the schedule, or no schedule: the forward keeps its own tables.
        assert!(rows.on_schedule(&schedule[..schedule.len() - 2]).is_none());
        assert!(rows.on_schedule(&[]).is_none());
    }

    fn tiny_config() -> MiniMaxH3Config {
        MiniMaxH3Config {
            num_attention_heads: 2,
            attention_head_dim: 16,
            hidden_size: 24,
            num_layers: 1,
            num_refiner_layers: 1,
            ffn_dim: 40,
            in_channels: 4,
            audio_in_channels: 6,
            text_dim: 20,
            freq_dim: 16,
            time_embed_hidden_dim: 32,
            time_embed_dim: 12,
            rope_freq_dim: 2,
            ..MiniMaxH3Config::default_full_size()
        }
    }

    fn inputs() -> H3Inputs {
        let layout = PackedLayout::build(&LayoutRequest {
            text_tags: &[1, 0, 1],
            geometry: Geometry::from_latents(5, 2, 4).unwrap(),
            patch: [1, 2, 2],
            keyframes: &[KeyframeAnchor::First],
        })
        .unwrap();
        let t = layout
            .row_timesteps(StepTimesteps::pipeline(0.5, 0.25))
            .unwrap();
        let (nv, na) = (layout.video_indices.len(), layout.audio_indices.len());
        H3Inputs::from_layout(
            &layout,
            &t,
            TensorF32::zeros(vec![1, nv, 16]).unwrap(),
            TensorF32::zeros(vec![1, na, 6]).unwrap(),
            TensorF32::zeros(vec![1, 3, 20]).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn rows_from_a_layout() {
        let rows = H3Rows::build(&tiny_config(), &inputs()).unwrap();
        // 3 text, 2 keyframe rows, 2 x 8 audio, 2 x 2 video.
        assert_eq!(rows.seq_len, 25);
        assert_eq!(rows.timesteps, vec![0.25, 0.5, 0.999]);
        assert_eq!(rows.adaln_rows[0], 3 + 1, "text: t index 1, tag 1");
        assert_eq!(rows.adaln_rows[1], 3, "vision row in the text: tag 0");
        assert_eq!(rows.adaln_rows[3], 6, "keyframe: t index 2, tag 0");
        assert_eq!(rows.adaln_rows[5], 2, "audio: t index 0, tag 2");
        assert_eq!(rows.video_rows[..2], [3, 4]);
    }

    #[test]
    fn malformed_inputs_are_refused() {
        let c = tiny_config();
        let mut cases: Vec<(H3Inputs, &str)> = Vec::new();
        let mut i = inputs();
        i.video_indices.data_mut()[0] = 0;
        cases.push((i, "listed twice"));
        let mut i = inputs();
        i.audio_indices.data_mut()[0] = 99;
        cases.push((i, "outside"));
        let mut i = inputs();
        i.token_tags.data_mut()[4] = 3;
        cases.push((i, "token_tags[4]"));
        let mut i = inputs();
        i.timestep_indices.data_mut()[2] = 3;
        cases.push((i, "timestep_indices[2]"));
        let mut i = inputs();
        i.timestep.data_mut()[1] = f32::NAN;
        cases.push((i, "timestep holds"));
        let mut i = inputs();
        i.position_ids.data_mut()[7] = f64::INFINITY;
        cases.push((i, "position_ids[2]"));
        let mut i = inputs();
        i.hidden_states = TensorF32::zeros(vec![1, 6, 12]).unwrap();
        cases.push((i, "channels"));
        let mut i = inputs();
        i.encoder_hidden_states = TensorF32::zeros(vec![2, 3, 20]).unwrap();
        cases.push((i, "batch sizes"));
        let mut i = inputs();
        i.text_indices = Tensor::new(vec![2], vec![0, 1]).unwrap();
        cases.push((i, "text_indices has 2 entries"));
        for (i, needle) in cases {
            let err = H3Rows::build(&c, &i).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }
}
