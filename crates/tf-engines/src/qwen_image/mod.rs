//! Qwen-Image 2.1: the DiT config, its backend-neutral interface, the host reference and the GPU backend.
pub mod components;
pub mod config;
pub mod dit;
pub mod dit_gpu;
pub mod dit_host;
pub mod ops;
pub mod pipeline;
pub mod vae;
pub mod vae_gpu;
pub mod vae_ops;
pub mod variant;
