//! MiniMax H3 (text to video with stereo audio): the DiT config and its two checkpoint layouts, the packed
//! layout builder, the backend-neutral DiT interface and the f32 host reference.
//!
//! - [`config`]: `MiniMaxH3Transformer3DModel` hyper-parameters, bounded and validated, and the diffusers tensors.
//! - [`checkpoint`]: the original release layout (fused qkv, `[gate; value]` fc1, other names) mapped at load.
//! - [`layout`]: frame and audio sizes, and the packed `[text | keyframes | audio | video]` sequence with its
//!   float64 RoPE positions, tags and per-row timesteps.
//! - [`dit`]: the forward's inputs (read by name from a safetensors bundle), their validation, outputs, and the
//!   [`dit::H3DitBackend`] trait.
//! - [`dit_host`]: the f32 host reference every other backend is checked against.
//! - [`scheduler`]: `MiniMaxH3Scheduler`, bit-exact in f32: the shifted grid (video 12, audio 3), timesteps
//!   `1 - sigma`, the Euler step and the forward noising of the anchors, with its validated config.
//! - [`noise`]: the conditioning, video and audio noise from one portable generator in the reference's draw order,
//!   injection from a file, and the video patchify.
//! - [`text`]: the text conditioning: a prompt under H3's rules to `hidden_states[50]` of the Qwen3-VL text
//!   encoder, on the host reference or the GPU, behind [`text::H3TextBackend`].
//! - [`vae_audio`]: `AutoencoderKLMiniMaxH3Audio` decode: its validated config, the decoder's tensors and the f32
//!   host reference (latent de-normalization, `dec_in_proj`, BigVGAN with anti-aliased SnakeBeta, stereo as a
//!   batch of 2).
//! - [`vae_audio_gpu`]: the same decode on the GPU in f32 (implicit-GEMM 1-D convolutions, transposed ones as
//!   phase convolutions, the fused anti-aliased SnakeBeta), behind the shared [`vae_audio::AudioVaeDecoder`].
//! - [`vae_video`]: `AutoencoderKLMiniMaxH3` decode: its validated config, the chunk and tile geometry, the
//!   [`vae_video::VideoVaeBackend`] trait with its 8-bit [`vae_video::VideoFrames`], and the f32 host reference
//!   (ViT decoder with register tokens and partial RoPE, temporal cross-fade, blended spatial tiles).
//! - [`vae_video_gpu`]: the same decode on the GPU: bf16 GEMMs and the shared RoPE / attention (head dim 64) /
//!   SwiGLU kernels over batches of tiles, the residual stream, norms, blends and frames in f32.
//! - [`pipeline`]: the whole text-to-video-with-audio pipeline over a diffusers MiniMax H3 folder: the memory plan
//!   (resident, or loaded, run and freed in turn), requests checked before any model runs, the prompt features, the
//!   noise, the steps under both schedules, the video and audio decodes, per-phase timings.
pub mod checkpoint;
pub mod config;
pub mod dit;
pub mod dit_gpu;
pub mod dit_host;
pub mod layout;
pub mod noise;
pub mod pipeline;
pub mod scheduler;
pub mod text;
pub mod vae_audio;
pub mod vae_audio_gpu;
pub mod vae_video;
pub mod vae_video_gpu;
