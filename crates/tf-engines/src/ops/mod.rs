//! Ops: the host reference ([`host`], plain f32) and the GPU launchers ([`gpu`]), checked against it.
pub mod gpu;
pub mod gpu_text;
pub mod gpu_vae;
pub mod host;
