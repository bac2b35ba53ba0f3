//! Qwen3-VL's text path: the host reference and the GPU backend, shared by every engine that conditions on it.
pub mod text_encoder;
pub mod text_encoder_gpu;
