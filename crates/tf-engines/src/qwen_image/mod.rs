//! Qwen-Image 2.1: the DiT config, its backend-neutral interface, the host reference and the GPU backend.
pub mod components;
pub mod config;
pub mod dit;
pub mod dit_gpu;
pub mod dit_host;
pub mod pipeline;
pub mod text_encoder;
pub mod text_encoder_gpu;
pub mod upload;
pub mod vae;
pub mod vae_gpu;
