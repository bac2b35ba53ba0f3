//! tf-engines: inference engines on the tf-cuda runtime, and their host reference.
//!
//! - [`weights`]: safetensors files and diffusers-format model folders, validated before any GPU work, with typed
//!   host access and a chunked upload plan for pinned staging.
//! - [`ops::host`]: plain f32 reference ops (the GPU kernels are checked against them).
//! - [`qwen_image`]: the Qwen-Image 2.1 DiT: config, backend-neutral interface ([`qwen_image::dit`]), host
//!   reference backend and the GPU backend; the host references of the Qwen3-VL text path
//!   ([`qwen_image::text_encoder`]) and of the VAE decoder ([`qwen_image::vae`]).
//! - [`sampler`]: FlowMatchEulerDiscrete as the reference pipeline runs it (sigma grid, shifts, bf16 timestep
//!   quantization, Euler step, true CFG combine).
//! - [`noise`]: a documented portable seeded normal generator, and injected noise from a file.
//! - [`png`]: 8-bit RGB/RGBA PNG files (writer, and a reader for checks).
//! - [`qwen_image::pipeline`]: the whole text-to-image pipeline (prompt to RGBA pixels) on the host or the GPU.
//! - [`kernels`]: the kernel images built by `cargo xtask kernels`, embedded at build time.
//! - [`worker`]: LocalRouter's worker protocol (`tf worker`): JSON lines in and out, over any [`worker::WorkerEngine`].
//!
//! Invariants: library code returns errors (never panics) on bad input; host-reference ops are deterministic.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::dit::{DitBackend, DitInputs, KvStep};
//! use tf_engines::qwen_image::dit_host::HostDit;
//! use tf_engines::weights::{ModelDir, SafetensorsFile};
//!
//! let model = ModelDir::open(Path::new("transformer"))?;
//! let mut dit = HostDit::load(&model)?;
//! let inputs = DitInputs::from_bundle(&SafetensorsFile::open(Path::new("step0.safetensors"))?)?;
//! let out = dit.forward(&inputs, KvStep::None)?;
//! println!("sample {:?}", out.sample.shape());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
pub mod kernels;
pub mod noise;
pub mod ops;
pub mod png;
pub mod qwen_image;
pub mod sampler;
pub mod tensor;
pub mod weights;
pub mod worker;
