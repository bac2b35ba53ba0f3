//! Qwen-Image 2.1 (skeleton).
pub mod config;
pub mod dit_gpu;
pub mod dit_host;
