//! FP8 checkpoints that carry their own scales: recognition, validation, and conversion to the engine's FP8
//! layout (e4m3 codes with one f32 scale per output row, [`crate::nn::fp8`]).
//!
//! # The layouts read here
//!
//! Pre-quantized diffusion checkpoints (the "fp8_scaled" files the ComfyUI ecosystem publishes, and the
//! converters that target it) are plain safetensors files in which some linear layers are stored in 8 bits and
//! the rest keep their original float type. Two generations of the layout exist; both are accepted:
//!
//! - **Legacy scaled FP8.** A top-level tensor named `scaled_fp8` marks the file. It holds no weights: its element
//!   type names the FP8 storage format (`F8_E4M3`; an `F32` marker also means e4m3, an `F8_E5M2` one means e5m2,
//!   which the engine does not run) and it has zero elements, or two, which asks the consumer to multiply in high
//!   precision rather than in FP8 (recorded, see [`Fp8Checkpoint::full_precision_matmul`]). Each quantized layer
//!   `L` stores `L.weight` as `F8_E4M3` next to `L.scale_weight`, an f32 scalar (shape `[]`, sometimes `[1]`), and
//!   may carry `L.scale_input`, a scalar static activation scale (1.0 when none was calibrated).
//! - **Per-layer quantization metadata.** No marker. A quantized layer stores `L.weight` as `F8_E4M3` with
//!   `L.weight_scale` (f32; per tensor as above, or per output channel with shape `[out]` or `[out, 1]`) and
//!   optionally `L.input_scale`. Which layers are quantized, and in which format, is declared either by a `U8`
//!   tensor `L.comfy_quant` holding a small JSON object (`{"format": "float8_e4m3fn", ...}`) or by the file's
//!   `__metadata__` entry `_quantization_metadata`, a JSON string `{"format_version": ..., "layers": {L: {"format":
//!   ...}}}`. Files that carry neither declaration but pair an `F8_E4M3` weight with a scale are read the same way.
//!
//! In every case the real weight is `decode_e4m3(code) * scale`, the scale broadcast over the row (per output
//! channel) or over the whole tensor. Layers left in bf16, f16 or f32 carry no scale and load as they are.
//! Per-channel producers write `[out, 1]` so that a plain broadcasting multiply scales rows; a 1-D `[out]` scale is
//! read per output row as well (no producer scales input columns), which for a square weight is the one reading
//! that cannot be told from the shape.
//!
//! # What is accepted, and what is refused
//!
//! - An `F8_E4M3` tensor must be a 2-D `L.weight` with non-zero dimensions and exactly one weight scale
//!   (`L.scale_weight` or `L.weight_scale`, never both); its scale must be `F32` (or `BF16` / `F16`), shaped `[]`,
//!   `[1]`, `[out]` or `[out, 1]`, and every value finite and positive. A per-tensor scale becomes one scale per
//!   row, so the weight enters the engine's per-output-channel FP8 path without re-quantization.
//! - Input scales must be finite positive scalars. They are checked and reported but not used: the engine
//!   computes per-token activation scales in the kernel that produces each FP8 GEMM input.
//! - Refused, naming the file and tensor: e5m2 weights, block-wise scales (any other scale shape), the companion
//!   tensors of formats the engine does not run (`weight_scale_2`, `pre_quant_scale`), a declared format other
//!   than `float8_e4m3fn`, a scale or input scale or declaration beside a weight that is not FP8, a marker in a
//!   file without any FP8 weight, and NaN codes (`0x7f`, `0xff`) in a weight.
//!
//! # Use
//!
//! A model loader scans its folder once ([`Fp8Checkpoint::scan`]), checks the folder with
//! [`Fp8Checkpoint::model_specs`] (its own specs, with FP8 allowed for the scanned weights and the companion
//! tensors declared), then asks [`WeightFeed::of`] how each weight reaches the device: a checkpoint's FP8 weight
//! bound for an FP8 GEMM goes as its codes ([`Fp8CodeCheck`] on the upload ring) with [`Fp8Weight::scales`], one
//! the model runs in bf16 is dequantized on the ring ([`Fp8Dequantizer`]), and a float weight is converted to bf16
//! or quantized per row ([`RowQuantizer`]). [`WeightFeed::piece`] is its upload piece and
//! [`WeightFeed::scales`] its per-row scales once the ring is done. Host code reads any weight as f32 through
//! [`Fp8Checkpoint::to_f32`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

use thiserror::Error;

use crate::nn::fp8::{e4m3_decode, RowCodes, RowQuantizer};
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::upload::{ChunkTransform, Piece, Transform, UploadError};
use crate::nn::weights::{bytes_to_f32, Dtype, LoadStats, ModelDir, TensorSpec, WeightsError};

/// The legacy marker tensor.
pub const MARKER: &str = "scaled_fp8";
/// The `__metadata__` key of the per-layer quantization declaration.
pub const QUANT_METADATA_KEY: &str = "_quantization_metadata";
/// The one format name the engine runs.
pub const E4M3_FORMAT: &str = "float8_e4m3fn";
/// The largest `.comfy_quant` declaration read (real ones are a few dozen bytes).
pub const MAX_DECLARATION_BYTES: usize = 4096;

const WEIGHT_SCALE_SUFFIXES: [&str; 2] = [".scale_weight", ".weight_scale"];
const INPUT_SCALE_SUFFIXES: [&str; 2] = [".scale_input", ".input_scale"];
const DECLARATION_SUFFIX: &str = ".comfy_quant";
/// Companions of quantization formats the engine does not run (NVFP4's second scale, AWQ-style smoothing).
const UNSUPPORTED_SUFFIXES: [&str; 2] = [".weight_scale_2", ".pre_quant_scale"];

/// Why an FP8 checkpoint was refused. Every variant names the file and, where there is one, the tensor.
#[derive(Debug, Error)]
pub enum Fp8CheckpointError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("{path}: tensor {name:?} is {dtype}: {why}")]
    Dtype {
        path: PathBuf,
        name: String,
        dtype: Dtype,
        why: &'static str,
    },
    #[error("{path}: FP8 weight {name:?} has shape {shape:?}: an FP8 weight must be a 2-D [out, in] matrix with no zero dimension")]
    WeightShape {
        path: PathBuf,
        name: String,
        shape: Vec<usize>,
    },
    #[error("{path}: FP8 weight {name:?} has no scale: expected {layer}.scale_weight or {layer}.weight_scale (scale-less FP8 is not accepted)")]
    MissingScale {
        path: PathBuf,
        name: String,
        layer: String,
    },
    #[error("{path}: layer {layer:?} has both {layer}.scale_weight and {layer}.weight_scale; which one applies is ambiguous")]
    TwoScales { path: PathBuf, layer: String },
    #[error("{path}: scale {name:?} has shape {shape:?}; the weight is [{rows}, {cols}], so a scale must be [], [1] (per tensor), [{rows}] or [{rows}, 1] (per output channel)")]
    ScaleShape {
        path: PathBuf,
        name: String,
        shape: Vec<usize>,
        rows: usize,
        cols: usize,
    },
    #[error(
        "{path}: scale {name:?} element {index} is {value}: scales must be finite and positive"
    )]
    ScaleValue {
        path: PathBuf,
        name: String,
        index: usize,
        value: f32,
    },
    #[error("{path}: tensor {name:?} describes a weight that is not FP8 ({weight:?} is {what}); a scale or declaration belongs beside an F8_E4M3 weight")]
    Orphan {
        path: PathBuf,
        name: String,
        weight: String,
        what: String,
    },
    #[error("{path}: {what} declares format {format:?}; the engine runs {E4M3_FORMAT} only")]
    UnsupportedFormat {
        path: PathBuf,
        what: String,
        format: String,
    },
    #[error("{path}: tensor {name:?} belongs to a quantization format the engine does not run (only per-tensor or per-channel scaled e4m3)")]
    UnsupportedCompanion { path: PathBuf, name: String },
    #[error("{path}: {what} is not a valid quantization declaration: {why}")]
    Declaration {
        path: PathBuf,
        what: String,
        why: String,
    },
    #[error(
        "{path}: the {MARKER} marker is present but no tensor of the file is an F8_E4M3 weight"
    )]
    MarkerWithoutFp8 { path: PathBuf },
    #[error("{path}: FP8 weight {name:?} holds a NaN code ({code:#04x}) at element {index}")]
    NanCode {
        path: PathBuf,
        name: String,
        index: usize,
        code: u8,
    },
    #[error(
        "{path}: weight {name:?} is stored as e4m3 codes, which the {wanted} GEMMs asked for cannot run: leave \
         `gemm=int8` out of --precision for this checkpoint, or load its bf16 original"
    )]
    StoredCodes {
        path: PathBuf,
        name: String,
        wanted: &'static str,
    },
    #[error("{path}: FP8 weight {name:?} is [{rows}, {cols}], the model wants it as [{want_rows}, {want_cols}]")]
    Layout {
        path: PathBuf,
        name: String,
        rows: usize,
        cols: usize,
        want_rows: usize,
        want_cols: usize,
    },
    #[error("{name}: {source}")]
    Feed {
        name: String,
        #[source]
        source: Box<UploadError>,
    },
}

/// How a weight's scale was stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleLayout {
    /// One scale for the whole tensor (broadcast to every row on load).
    PerTensor,
    /// One scale per output row.
    PerChannel,
}

impl fmt::Display for ScaleLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScaleLayout::PerTensor => "per-tensor",
            ScaleLayout::PerChannel => "per-channel",
        })
    }
}

/// One FP8 weight of a checkpoint, in the engine's layout: `[rows, cols]` e4m3 codes (in the file, read with
/// [`Fp8Checkpoint::codes`]) and one scale per row.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Weight {
    pub rows: usize,
    pub cols: usize,
    /// How the file stored the scale.
    pub layout: ScaleLayout,
    /// The scale tensor's name.
    pub scale_name: String,
    /// One scale per output row (a per-tensor scale repeated).
    pub scales: Vec<f32>,
    /// The file's static activation scale, if any (checked, not used: activations are scaled per token).
    pub input_scale: Option<f32>,
    /// The file holding the codes.
    pub file: PathBuf,
}

impl Fp8Weight {
    /// The scales of rows `first_row..first_row + rows`, or `None` when they run past the weight.
    pub fn row_scales(&self, first_row: usize, rows: usize) -> Option<&[f32]> {
        self.scales.get(first_row..first_row.checked_add(rows)?)
    }
}

/// The FP8 weights of a model folder and the tensors that describe them.
#[derive(Debug, Clone, Default)]
pub struct Fp8Checkpoint {
    weights: BTreeMap<String, Fp8Weight>,
    /// Marker, scales, input scales and declarations: name -> (shape, dtype) as stored.
    companions: BTreeMap<String, (Vec<usize>, Dtype)>,
    marker: bool,
    full_precision_matmul: bool,
}

/// `name` without `suffix`, when it ends with it.
fn layer_of<'a>(name: &'a str, suffixes: &[&str]) -> Option<&'a str> {
    suffixes.iter().find_map(|s| name.strip_suffix(s))
}

fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

impl Fp8Checkpoint {
    /// Scans every shard of `model`: finds the FP8 weights, reads and validates their scales, input scales,
    /// declarations and the marker. A folder without FP8 tensors gives an empty checkpoint.
    pub fn scan(model: &ModelDir) -> Result<Fp8Checkpoint, Fp8CheckpointError> {
        let path_of = |name: &str| -> Result<PathBuf, Fp8CheckpointError> {
            Ok(model.file_of(name)?.path().to_path_buf())
        };
        let mut ck = Fp8Checkpoint::default();
        let mut scales: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        let mut inputs: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        let mut declarations: BTreeMap<String, &str> = BTreeMap::new();
        let mut fp8_weights: Vec<&str> = Vec::new();
        for name in model.names() {
            let info = model.info(name)?;
            let companion = |ck: &mut Fp8Checkpoint| {
                ck.companions
                    .insert(name.to_string(), (info.shape.clone(), info.dtype));
            };
            if name == MARKER {
                match info.dtype {
                    Dtype::F8E4M3 | Dtype::F32 => {}
                    Dtype::F8E5M2 => {
                        return Err(Fp8CheckpointError::UnsupportedFormat {
                            path: path_of(name)?,
                            what: format!("the {MARKER} marker (F8_E5M2)"),
                            format: "float8_e5m2".into(),
                        })
                    }
                    dtype => {
                        return Err(Fp8CheckpointError::Dtype {
                            path: path_of(name)?,
                            name: name.into(),
                            dtype,
                            why: "the scaled_fp8 marker names the FP8 format: F8_E4M3 (or F32, read as e4m3)",
                        })
                    }
                }
                let count = element_count(&info.shape).unwrap_or(usize::MAX);
                if count != 0 && count != 2 {
                    return Err(Fp8CheckpointError::Declaration {
                        path: path_of(name)?,
                        what: format!("the {MARKER} marker"),
                        why: format!("it has {count} elements; the layout uses 0, or 2 for full-precision multiplies"),
                    });
                }
                ck.marker = true;
                ck.full_precision_matmul = count == 2;
                companion(&mut ck);
            } else if let Some(layer) = layer_of(name, &WEIGHT_SCALE_SUFFIXES) {
                scales.entry(layer.to_string()).or_default().push(name);
                companion(&mut ck);
            } else if let Some(layer) = layer_of(name, &INPUT_SCALE_SUFFIXES) {
                inputs.entry(layer.to_string()).or_default().push(name);
                companion(&mut ck);
            } else if let Some(layer) = name.strip_suffix(DECLARATION_SUFFIX) {
                declarations.insert(layer.to_string(), name);
                companion(&mut ck);
            } else if UNSUPPORTED_SUFFIXES.iter().any(|s| name.ends_with(s)) {
                return Err(Fp8CheckpointError::UnsupportedCompanion {
                    path: path_of(name)?,
                    name: name.into(),
                });
            } else if info.dtype == Dtype::F8E4M3 {
                fp8_weights.push(name);
            } else if info.dtype == Dtype::F8E5M2 {
                return Err(Fp8CheckpointError::Dtype {
                    path: path_of(name)?,
                    name: name.into(),
                    dtype: info.dtype,
                    why: "e5m2 weights are not supported; the engine runs e4m3",
                });
            }
        }

        for &name in &fp8_weights {
            let path = path_of(name)?;
            let info = model.info(name)?;
            let layer = match name.strip_suffix(".weight") {
                Some(layer) => layer,
                None => return Err(Fp8CheckpointError::Dtype {
                    path,
                    name: name.into(),
                    dtype: info.dtype,
                    why: "only linear-layer weights (names ending in .weight) may be stored in FP8",
                }),
            };
            let (rows, cols) = match info.shape[..] {
                [rows, cols] if rows > 0 && cols > 0 => (rows, cols),
                _ => {
                    return Err(Fp8CheckpointError::WeightShape {
                        path,
                        name: name.into(),
                        shape: info.shape.clone(),
                    })
                }
            };
            let scale_name = match scales.remove(layer).as_deref() {
                Some([one]) => *one,
                Some(_) => {
                    return Err(Fp8CheckpointError::TwoScales {
                        path,
                        layer: layer.into(),
                    })
                }
                None => {
                    return Err(Fp8CheckpointError::MissingScale {
                        path,
                        name: name.into(),
                        layer: layer.into(),
                    })
                }
            };
            let (layout, row_scales) = read_weight_scale(model, scale_name, rows, cols)?;
            let input_scale = match inputs.remove(layer).as_deref() {
                None => None,
                Some([one]) => Some(read_input_scale(model, one)?),
                Some(two) => {
                    return Err(Fp8CheckpointError::Declaration {
                        path,
                        what: format!("layer {layer:?}"),
                        why: format!("it has two input scales: {two:?}"),
                    })
                }
            };
            if let Some(declaration) = declarations.remove(layer) {
                check_declaration(model, declaration)?;
            }
            ck.weights.insert(
                name.to_string(),
                Fp8Weight {
                    rows,
                    cols,
                    layout,
                    scale_name: scale_name.to_string(),
                    scales: row_scales,
                    input_scale,
                    file: path,
                },
            );
        }

        // What is left describes weights that are not FP8.
        let mut leftovers = scales
            .into_iter()
            .flat_map(|(layer, names)| names.into_iter().map(move |n| (layer.clone(), n)))
            .chain(
                inputs
                    .into_iter()
                    .flat_map(|(layer, names)| names.into_iter().map(move |n| (layer.clone(), n))),
            )
            .chain(declarations);
        if let Some((layer, name)) = leftovers.next() {
            let weight = format!("{layer}.weight");
            let what = match model.info(&weight) {
                Ok(info) => format!("stored as {}", info.dtype),
                Err(_) => "missing".to_string(),
            };
            if name.ends_with(DECLARATION_SUFFIX) {
                // A declaration of a format the engine does not run says so before anything else.
                check_declaration(model, name)?;
            }
            return Err(Fp8CheckpointError::Orphan {
                path: path_of(name)?,
                name: name.into(),
                weight,
                what,
            });
        }

        for shard in model.shards() {
            if let Some(text) = shard.header().metadata.get(QUANT_METADATA_KEY) {
                ck.check_metadata(model, shard.path().to_path_buf(), text)?;
            }
        }
        if ck.marker && ck.weights.is_empty() {
            return Err(Fp8CheckpointError::MarkerWithoutFp8 {
                path: path_of(MARKER)?,
            });
        }
        Ok(ck)
    }

    /// Checks a `_quantization_metadata` declaration: every layer it names is an FP8 weight of the folder in
    /// e4m3.
    fn check_metadata(
        &self,
        model: &ModelDir,
        path: PathBuf,
        text: &str,
    ) -> Result<(), Fp8CheckpointError> {
        let what = format!("the {QUANT_METADATA_KEY} metadata");
        let bad = |why: String| Fp8CheckpointError::Declaration {
            path: path.clone(),
            what: what.clone(),
            why,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let layers = value
            .get("layers")
            .and_then(|l| l.as_object())
            .ok_or_else(|| bad("no \"layers\" object".into()))?;
        for (layer, conf) in layers {
            let format = conf
                .get("format")
                .and_then(|f| f.as_str())
                .ok_or_else(|| bad(format!("layer {layer:?} has no \"format\" string")))?;
            if format != E4M3_FORMAT {
                return Err(Fp8CheckpointError::UnsupportedFormat {
                    path,
                    what: format!("{what} for layer {layer:?}"),
                    format: format.into(),
                });
            }
            let weight = format!("{layer}.weight");
            if !self.weights.contains_key(&weight) {
                let stored = match model.info(&weight) {
                    Ok(info) => format!("stored as {}", info.dtype),
                    Err(_) => "missing".to_string(),
                };
                return Err(bad(format!(
                    "it declares layer {layer:?} {E4M3_FORMAT}, but {weight:?} is {stored}"
                )));
            }
        }
        Ok(())
    }

    /// True when the folder has no FP8 weight (an ordinary bf16/f32 checkpoint).
    pub fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// The FP8 weights, by tensor name.
    pub fn weights(&self) -> &BTreeMap<String, Fp8Weight> {
        &self.weights
    }

    /// Refuses `name`'s stored e4m3 codes as the weight of a GEMM in `codes` other than e4m3 (INT8 GEMMs cannot
    /// take them), naming the file, the weight and the way out; anything else passes.
    pub fn check_codes(&self, name: &str, codes: RowCodes) -> Result<(), Fp8CheckpointError> {
        match self.get(name) {
            Some(w) if codes != RowCodes::E4m3 => Err(Fp8CheckpointError::StoredCodes {
                path: w.file.clone(),
                name: name.into(),
                wanted: codes.name(),
            }),
            _ => Ok(()),
        }
    }

    /// The FP8 weight `name`, if the folder stores it in FP8.
    pub fn get(&self, name: &str) -> Option<&Fp8Weight> {
        self.weights.get(name)
    }

    /// True when the file carries the legacy marker.
    pub fn has_marker(&self) -> bool {
        self.marker
    }

    /// True when the marker asks for high-precision multiplies (a two-element marker). The engine's FP8 modes
    /// multiply in FP8 regardless; bf16 mode dequantizes.
    pub fn full_precision_matmul(&self) -> bool {
        self.full_precision_matmul
    }

    /// The tensors that describe the FP8 weights (marker, scales, input scales, declarations), sorted.
    pub fn companions(&self) -> impl Iterator<Item = &str> {
        self.companions.keys().map(String::as_str)
    }

    /// `specs` adapted to this checkpoint, for [`ModelDir::check`]: the scanned FP8 weights also accept
    /// `F8_E4M3` (their shapes are still checked) and the companion tensors are declared as they are stored.
    pub fn model_specs(&self, specs: &[TensorSpec]) -> Vec<TensorSpec> {
        let mut out: Vec<TensorSpec> = specs
            .iter()
            .map(|spec| {
                let mut spec = spec.clone();
                if self.weights.contains_key(&spec.name) && !spec.dtypes.contains(&Dtype::F8E4M3) {
                    spec.dtypes.push(Dtype::F8E4M3);
                }
                spec
            })
            .collect();
        let known: BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        for (name, (shape, dtype)) in &self.companions {
            if !known.contains(name.as_str()) {
                out.push(TensorSpec {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtypes: vec![*dtype],
                });
            }
        }
        out
    }

    /// The e4m3 codes of FP8 weight `name` (`rows * cols` bytes, row-major), as stored.
    pub fn codes<'m>(&self, model: &'m ModelDir, name: &str) -> Result<&'m [u8], WeightsError> {
        model.bytes(name)
    }

    /// `name` as f32: an FP8 weight dequantized (`decode(code) * scale` of its row), any other tensor converted
    /// from its float type.
    pub fn to_f32(&self, model: &ModelDir, name: &str) -> Result<TensorF32, Fp8CheckpointError> {
        let Some(w) = self.weights.get(name) else {
            return Ok(model.to_f32(name)?);
        };
        let codes = model.bytes(name)?;
        let mut values = Vec::with_capacity(codes.len());
        for (r, row) in codes.chunks_exact(w.cols).enumerate() {
            let scale = w.scales.get(r).copied().unwrap_or(f32::NAN);
            for (c, &code) in row.iter().enumerate() {
                if code & 0x7f == 0x7f {
                    return Err(Fp8CheckpointError::NanCode {
                        path: w.file.clone(),
                        name: name.into(),
                        index: r * w.cols + c,
                        code,
                    });
                }
                values.push(e4m3_decode(code) * scale);
            }
        }
        Tensor::new(vec![w.rows, w.cols], values).map_err(|e| {
            Fp8CheckpointError::Weights(WeightsError::Config {
                path: w.file.clone(),
                why: format!("{name}: {e}"),
            })
        })
    }

    /// [`ModelDir::load_f32`] through [`Fp8Checkpoint::to_f32`]: every tensor of `names` as f32, timed.
    pub fn load_f32(
        &self,
        model: &ModelDir,
        names: &[&str],
    ) -> Result<(BTreeMap<String, TensorF32>, LoadStats), Fp8CheckpointError> {
        let start = Instant::now();
        let mut bytes = 0u64;
        let mut out = BTreeMap::new();
        for &name in names {
            bytes += model.info(name)?.len_bytes() as u64;
            out.insert(name.to_string(), self.to_f32(model, name)?);
        }
        Ok((
            out,
            LoadStats {
                bytes,
                seconds: start.elapsed().as_secs_f64(),
            },
        ))
    }

    /// A one-line summary for load reports: how many weights are stored in FP8 and how their scales are laid out.
    pub fn describe(&self) -> String {
        if self.weights.is_empty() {
            return "no FP8 weights in the checkpoint".into();
        }
        let per_tensor = self
            .weights
            .values()
            .filter(|w| w.layout == ScaleLayout::PerTensor)
            .count();
        let per_channel = self.weights.len() - per_tensor;
        let inputs = self
            .weights
            .values()
            .filter(|w| w.input_scale.is_some())
            .count();
        format!(
            "{} FP8 e4m3 weights in the checkpoint ({per_tensor} per-tensor, {per_channel} per-channel scales{}{})",
            self.weights.len(),
            if self.marker { "; scaled_fp8 marker" } else { "" },
            if inputs > 0 {
                format!("; {inputs} static input scales ignored, activations are scaled per token")
            } else {
                String::new()
            }
        )
    }
}

/// Reads a weight scale of a `[rows, cols]` weight: its layout and one scale per row.
fn read_weight_scale(
    model: &ModelDir,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<(ScaleLayout, Vec<f32>), Fp8CheckpointError> {
    let info = model.info(name)?;
    let path = model.file_of(name)?.path().to_path_buf();
    let layout = match info.shape[..] {
        [] | [1] | [1, 1] => ScaleLayout::PerTensor,
        [n] | [n, 1] if n == rows => ScaleLayout::PerChannel,
        _ => {
            return Err(Fp8CheckpointError::ScaleShape {
                path,
                name: name.into(),
                shape: info.shape.clone(),
                rows,
                cols,
            })
        }
    };
    let values = read_scale_values(model, name)?;
    Ok(match layout {
        ScaleLayout::PerTensor => (layout, vec![values[0]; rows]),
        ScaleLayout::PerChannel => (layout, values),
    })
}

/// Reads a static input scale: a finite positive scalar.
fn read_input_scale(model: &ModelDir, name: &str) -> Result<f32, Fp8CheckpointError> {
    let info = model.info(name)?;
    if element_count(&info.shape) != Some(1) || info.shape.len() > 1 {
        return Err(Fp8CheckpointError::Declaration {
            path: model.file_of(name)?.path().to_path_buf(),
            what: format!("input scale {name:?}"),
            why: format!(
                "shape {:?}; an input scale is a scalar ([] or [1])",
                info.shape
            ),
        });
    }
    Ok(read_scale_values(model, name)?[0])
}

/// The values of scale tensor `name` (F32, BF16 or F16; at least one), each finite and positive.
fn read_scale_values(model: &ModelDir, name: &str) -> Result<Vec<f32>, Fp8CheckpointError> {
    let info = model.info(name)?;
    let path =
        || -> Result<PathBuf, Fp8CheckpointError> { Ok(model.file_of(name)?.path().to_path_buf()) };
    if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
        return Err(Fp8CheckpointError::Dtype {
            path: path()?,
            name: name.into(),
            dtype: info.dtype,
            why: "a scale must be F32 (or BF16, F16)",
        });
    }
    let values = bytes_to_f32(info.dtype, model.bytes(name)?).unwrap_or_default();
    if values.is_empty() {
        return Err(Fp8CheckpointError::Declaration {
            path: path()?,
            what: format!("scale {name:?}"),
            why: "it holds no value".into(),
        });
    }
    if let Some((index, &value)) = values
        .iter()
        .enumerate()
        .find(|(_, v)| !(v.is_finite() && **v > 0.0))
    {
        return Err(Fp8CheckpointError::ScaleValue {
            path: path()?,
            name: name.into(),
            index,
            value,
        });
    }
    Ok(values)
}

/// Checks a `.comfy_quant` declaration: a U8 tensor of bounded size holding JSON whose `format` is e4m3.
fn check_declaration(model: &ModelDir, name: &str) -> Result<(), Fp8CheckpointError> {
    let info = model.info(name)?;
    let path = model.file_of(name)?.path().to_path_buf();
    let bad = |why: String| Fp8CheckpointError::Declaration {
        path: path.clone(),
        what: format!("tensor {name:?}"),
        why,
    };
    if !matches!(info.dtype, Dtype::U8 | Dtype::I8) {
        return Err(bad(format!(
            "it is {}; a declaration is U8 bytes of JSON",
            info.dtype
        )));
    }
    let bytes = model.bytes(name)?;
    if bytes.len() > MAX_DECLARATION_BYTES {
        return Err(bad(format!(
            "{} bytes, more than the {MAX_DECLARATION_BYTES} a declaration may take",
            bytes.len()
        )));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| bad(format!("not UTF-8: {e}")))?;
    let value: serde_json::Value =
        serde_json::from_str(text.trim()).map_err(|e| bad(format!("not JSON: {e}")))?;
    let format = value
        .get("format")
        .and_then(|f| f.as_str())
        .ok_or_else(|| bad("no \"format\" string".into()))?;
    if format != E4M3_FORMAT {
        return Err(Fp8CheckpointError::UnsupportedFormat {
            path,
            what: format!("tensor {name:?}"),
            format: format.into(),
        });
    }
    Ok(())
}

fn nan_code_error(transform: &'static str, index: usize, code: u8) -> UploadError {
    UploadError::Transform {
        transform,
        why: format!(
            "a NaN e4m3 code ({code:#04x}) at element {index} of an FP8 checkpoint weight"
        ),
    }
}

/// Copies FP8 checkpoint codes onto the upload ring as they are, refusing NaN codes on the way (the check costs
/// nothing extra: the ring reads every byte anyway).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp8CodeCheck;

impl ChunkTransform for Fp8CodeCheck {
    fn name(&self) -> &'static str {
        "fp8-codes"
    }

    fn src_elem_bytes(&self) -> usize {
        1
    }

    fn dst_elem_bytes(&self) -> usize {
        1
    }

    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        if src.len() != dst.len() {
            return Err(UploadError::Transform {
                transform: self.name(),
                why: format!("{} source bytes for {} device bytes", src.len(), dst.len()),
            });
        }
        if let Some(i) = src.iter().position(|&c| c & 0x7f == 0x7f) {
            return Err(nan_code_error(self.name(), first + i, src[i]));
        }
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// Dequantizes FP8 checkpoint codes to bf16 on the upload ring (`decode(code) * scale` of the row, rounded to
/// nearest even), for layers an engine runs in bf16. The ring hands it whole rows.
#[derive(Debug, Clone)]
pub struct Fp8Dequantizer {
    scales: Vec<f32>,
    cols: usize,
}

impl Fp8Dequantizer {
    /// A dequantizer of `weight`'s rows.
    pub fn new(weight: &Fp8Weight) -> Fp8Dequantizer {
        Fp8Dequantizer {
            scales: weight.scales.clone(),
            cols: weight.cols.max(1),
        }
    }

    /// A dequantizer of the piece of `weight` that starts at row `first_row` and spans `rows` rows (a loader that
    /// places a weight in row blocks: per-head pieces, swapped halves); `None` when the rows run past the weight.
    pub fn for_rows(weight: &Fp8Weight, first_row: usize, rows: usize) -> Option<Fp8Dequantizer> {
        Some(Fp8Dequantizer {
            scales: weight.row_scales(first_row, rows)?.to_vec(),
            cols: weight.cols.max(1),
        })
    }
}

impl ChunkTransform for Fp8Dequantizer {
    fn name(&self) -> &'static str {
        "fp8-dequantize"
    }

    fn src_elem_bytes(&self) -> usize {
        1
    }

    fn dst_elem_bytes(&self) -> usize {
        2
    }

    fn granule(&self) -> usize {
        self.cols
    }

    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        let cols = self.cols;
        if !first.is_multiple_of(cols)
            || !src.len().is_multiple_of(cols)
            || dst.len() != src.len() * 2
        {
            return Err(UploadError::Transform {
                transform: self.name(),
                why: format!(
                    "a chunk of {} codes at element {first} is not whole rows of {cols} (or its device image is not 2 bytes each)",
                    src.len()
                ),
            });
        }
        let first_row = first / cols;
        for (r, (row, out)) in src
            .chunks_exact(cols)
            .zip(dst.chunks_exact_mut(cols * 2))
            .enumerate()
        {
            let scale = *self
                .scales
                .get(first_row + r)
                .ok_or_else(|| UploadError::Transform {
                    transform: "fp8-dequantize",
                    why: format!(
                        "row {} is past the weight's {} rows",
                        first_row + r,
                        self.scales.len()
                    ),
                })?;
            for (c, (&code, o)) in row.iter().zip(out.chunks_exact_mut(2)).enumerate() {
                if code & 0x7f == 0x7f {
                    return Err(nan_code_error(self.name(), first + r * cols + c, code));
                }
                let v = half::bf16::from_f32(e4m3_decode(code) * scale);
                o.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        Ok(())
    }
}

/// How one weight reaches the device on the upload ring, for a loader that may hold a checkpoint's FP8 weights.
#[derive(Debug)]
pub enum WeightFeed<'a> {
    /// A float tensor (F32, BF16 or F16) converted to bf16.
    Bf16 { src: &'a [u8], dtype: Dtype },
    /// A float tensor quantized per output row on the ring.
    Quantize {
        src: &'a [u8],
        quantizer: RowQuantizer,
    },
    /// A checkpoint's e4m3 codes as stored, with one scale per row.
    Codes { src: &'a [u8], scales: Vec<f32> },
    /// A checkpoint's e4m3 codes dequantized to bf16.
    Dequantize {
        src: &'a [u8],
        dequantizer: Fp8Dequantizer,
    },
}

/// The one NaN-checking copy every [`WeightFeed::Codes`] piece shares.
static CODE_CHECK: Fp8CodeCheck = Fp8CodeCheck;

impl<'a> WeightFeed<'a> {
    /// The feed of tensor `name` of `model`, stored as the folder stores it. `fp8` is the `[rows, cols]` the model
    /// runs in FP8 (`None`: bf16). A checkpoint FP8 weight bound for FP8 must have exactly that shape.
    pub fn of(
        model: &'a ModelDir,
        checkpoint: &Fp8Checkpoint,
        name: &str,
        fp8: Option<(usize, usize)>,
    ) -> Result<WeightFeed<'a>, Fp8CheckpointError> {
        WeightFeed::of_codes(model, checkpoint, name, fp8, RowCodes::E4m3)
    }

    /// [`WeightFeed::of`] with a float tensor bound for 8 bits quantized into `codes` (e4m3, or INT8 for our INT8
    /// GEMM). A checkpoint's stored codes are e4m3: bound for INT8 they are refused, naming the tensor.
    pub fn of_codes(
        model: &'a ModelDir,
        checkpoint: &Fp8Checkpoint,
        name: &str,
        fp8: Option<(usize, usize)>,
        codes: RowCodes,
    ) -> Result<WeightFeed<'a>, Fp8CheckpointError> {
        let feed_err = |source| Fp8CheckpointError::Feed {
            name: name.to_string(),
            source: Box::new(source),
        };
        if fp8.is_some() {
            checkpoint.check_codes(name, codes)?;
        }
        Ok(match (checkpoint.get(name), fp8) {
            (Some(w), Some((rows, cols))) => {
                if (w.rows, w.cols) != (rows, cols) {
                    return Err(Fp8CheckpointError::Layout {
                        path: w.file.clone(),
                        name: name.into(),
                        rows: w.rows,
                        cols: w.cols,
                        want_rows: rows,
                        want_cols: cols,
                    });
                }
                WeightFeed::Codes {
                    src: model.bytes(name)?,
                    scales: w.scales.clone(),
                }
            }
            (Some(w), None) => WeightFeed::Dequantize {
                src: model.bytes(name)?,
                dequantizer: Fp8Dequantizer::new(w),
            },
            (None, Some((rows, cols))) => WeightFeed::Quantize {
                src: model.bytes(name)?,
                quantizer: RowQuantizer::with_codes(model.info(name)?.dtype, rows, cols, codes)
                    .map_err(feed_err)?,
            },
            (None, None) => WeightFeed::Bf16 {
                src: model.bytes(name)?,
                dtype: model.info(name)?.dtype,
            },
        })
    }

    /// The upload piece writing this feed's device image at `dst_offset`.
    pub fn piece(&self, dst_offset: usize) -> Piece<'_> {
        let (src, transform) = match self {
            WeightFeed::Bf16 { src, dtype } => (*src, Transform::ToBf16 { from: *dtype }),
            WeightFeed::Quantize { src, quantizer } => (*src, Transform::Custom(quantizer)),
            WeightFeed::Codes { src, .. } => (*src, Transform::Custom(&CODE_CHECK)),
            WeightFeed::Dequantize { src, dequantizer } => (*src, Transform::Custom(dequantizer)),
        };
        Piece {
            src,
            transform,
            dst_offset,
        }
    }

    /// True for a feed whose device image is e4m3 codes (quantized or as stored).
    pub fn is_fp8(&self) -> bool {
        matches!(self, WeightFeed::Quantize { .. } | WeightFeed::Codes { .. })
    }

    /// True for a checkpoint's codes used as stored.
    pub fn is_as_stored(&self) -> bool {
        matches!(self, WeightFeed::Codes { .. })
    }

    /// The per-row scales of an FP8 feed (for a quantized one, once the ring is done: a row it never handed
    /// over reads NaN); `None` for a bf16 feed.
    pub fn scales(&self) -> Option<Vec<f32>> {
        match self {
            WeightFeed::Quantize { quantizer, .. } => Some(quantizer.scales()),
            WeightFeed::Codes { scales, .. } => Some(scales.clone()),
            WeightFeed::Bf16 { .. } | WeightFeed::Dequantize { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::upload::{fill_host, Piece, Transform};

    #[test]
    fn the_ring_transforms_copy_checked_codes_and_dequantize_rows() {
        let weight = Fp8Weight {
            rows: 3,
            cols: 4,
            layout: ScaleLayout::PerChannel,
            scale_name: "l.weight_scale".into(),
            scales: vec![0.5, 2.0, 0.25],
            input_scale: None,
            file: PathBuf::from("x.safetensors"),
        };
        let codes: Vec<u8> = (0..12u8).map(|i| i * 9 % 0x7e).collect();
        let mut copied = vec![0u8; 12];
        fill_host(
            &mut copied,
            &[Piece {
                src: &codes,
                transform: Transform::Custom(&Fp8CodeCheck),
                dst_offset: 0,
            }],
            5,
            2,
        )
        .unwrap();
        assert_eq!(copied, codes);
        let dq = Fp8Dequantizer::new(&weight);
        let mut out = vec![0u8; 24];
        fill_host(
            &mut out,
            &[Piece {
                src: &codes,
                transform: Transform::Custom(&dq),
                dst_offset: 0,
            }],
            8,
            2,
        )
        .unwrap();
        for (i, pair) in out.chunks_exact(2).enumerate() {
            let got = half::bf16::from_bits(u16::from_le_bytes([pair[0], pair[1]])).to_f32();
            let want = half::bf16::from_f32(e4m3_decode(codes[i]) * weight.scales[i / 4]).to_f32();
            assert_eq!(got, want, "element {i}");
        }
        // NaN codes are refused by both, naming the element.
        let mut bad = codes.clone();
        bad[6] = 0xff;
        let err = Fp8CodeCheck.apply(10, &bad, &mut [0u8; 12]).unwrap_err();
        assert!(err.to_string().contains("element 16"), "{err}");
        let err = dq.apply(0, &bad, &mut [0u8; 24]).unwrap_err();
        assert!(err.to_string().contains("element 6"), "{err}");
        // Rows past the end, and chunks that are not whole rows.
        assert!(dq.apply(12, &codes[..4], &mut [0u8; 8]).is_err());
        assert!(dq.apply(2, &codes[..4], &mut [0u8; 8]).is_err());
        // A row block of the weight: its own rows' scales, counted from the block's first row.
        assert_eq!(weight.row_scales(1, 2), Some(&[2.0, 0.25][..]));
        assert!(weight.row_scales(2, 2).is_none() && weight.row_scales(usize::MAX, 2).is_none());
        assert!(Fp8Dequantizer::for_rows(&weight, 2, 2).is_none());
        let block = Fp8Dequantizer::for_rows(&weight, 1, 2).unwrap();
        let mut out = vec![0u8; 16];
        block.apply(0, &codes[4..12], &mut out).unwrap();
        for (i, pair) in out.chunks_exact(2).enumerate() {
            let got = half::bf16::from_bits(u16::from_le_bytes([pair[0], pair[1]])).to_f32();
            let want = half::bf16::from_f32(e4m3_decode(codes[4 + i]) * weight.scales[1 + i / 4]);
            assert_eq!(got, want.to_f32(), "block element {i}");
        }
    }
}
