//! tf-engines: inference engines on the tf-cuda runtime, and their host reference.
//!
//! - [`nn`]: the model-agnostic layer every model folder builds on: weights and the upload ring, host reference
//!   ops, GPU launchers over our kernels, sampling and noise, media files, the embedded kernel images. It names
//!   no model.
//! - [`qwen3_vl`]: the Qwen3-VL text path (host reference and GPU backend), a component shared by the engines.
//! - [`qwen_image`]: Qwen-Image 2.1: its DiT (host reference and GPU backend), 2-D VAE and the pipeline.
//! - [`minimax_h3`]: MiniMax H3 (text to video with stereo audio): its packed layout, DiT (host reference and GPU
//!   backend, one GPU or sequence-parallel over several), video and audio VAEs, scheduler, noise and the pipeline.
//! - [`worker`]: LocalRouter's worker protocol (`tf worker`): JSON lines in and out, over any [`worker::WorkerEngine`].
//!
//! Invariants: library code returns errors (never panics) on bad input; host-reference ops are deterministic; a
//! model folder imports `nn` (and `qwen3_vl`), never another model; a pipeline's GPU components run on the one
//! blocking stream it opens ([`nn::gpu::GpuDevice`]) and make none of their own (xtask/tests/tidy.rs checks the
//! last two).
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::dit::{DitBackend, DitInputs, KvStep};
//! use tf_engines::qwen_image::dit_host::HostDit;
//! use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
//!
//! let model = ModelDir::open(Path::new("transformer"))?;
//! let mut dit = HostDit::load(&model)?;
//! let inputs = DitInputs::from_bundle(&SafetensorsFile::open(Path::new("step0.safetensors"))?)?;
//! let out = dit.forward(&inputs, KvStep::None)?;
//! println!("sample {:?}", out.sample.shape());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
pub mod minimax_h3;
pub mod nn;
pub mod qwen3_vl;
pub mod qwen_image;
pub mod worker;
