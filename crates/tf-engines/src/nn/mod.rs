//! The model-agnostic engine layer: everything a model folder builds on, naming no model.
//!
//! - [`weights`]: safetensors files and diffusers-format model folders, validated before any GPU work.
//! - [`upload`]: the pinned upload ring that streams checked host tensors to the device.
//! - [`fp8`]: the FP8 e4m3 format on the host, per-row quantization and the load-time weight quantizer.
//! - [`fp8_checkpoint`]: FP8 checkpoints that carry their scales (scaled-FP8 safetensors), read into that layout.
//! - [`tensor`]: host tensors (f32 and raw) and the error measures the parity tests use.
//! - [`host`]: plain f32 reference ops; every GPU kernel is checked against them.
//! - [`host_work`]: host time spent building workspaces, enqueuing eager steps and waiting for steps, process-wide.
//! - [`config`]: typed config parsing that names the failing key, and the bound and product checks.
//! - [`backend_error`]: the typed error of a failed GPU backend call, and the lost-context test over a chain.
//! - [`gpu`]: launch infrastructure, the GEMM wrapper with its plan cache, attention (head dims 64 and 128), the
//!   elementwise kernels (each with its host twin) and the per-step graph cache.
//! - [`sampling`]: the scheduler trait, the flow-match sampler, the portable seeded noise, a seeded test generator.
//! - [`media`]: PNG files (through the `png` crate), WAV audio, MP4 video through an `ffmpeg` child process.
//! - [`memory_plan`]: whether a pipeline's components stay resident or run in turn on the device.
//! - [`parallel`]: sequence parallelism over GPUs: row blocks, head groups, the Ulysses and K/V-gather exchange plans.
//! - [`launcher`]: one process per GPU: the degree check, starting and watching the ranks, request agreement.
//! - [`kernels`]: the kernel images built by `cargo xtask kernels`, embedded at build time.
//!
//! Invariant (checked by the tidy test): nothing under `nn/` imports a model folder.
pub mod backend;
pub mod backend_error;
pub mod config;
pub mod fp8;
pub mod fp8_checkpoint;
pub mod gpu;
pub mod host;
pub mod host_work;
pub mod kernels;
pub mod launcher;
pub mod media;
pub mod memory_plan;
pub mod parallel;
pub mod precision;
pub mod sampling;
pub mod tensor;
pub mod upload;
pub mod weights;
