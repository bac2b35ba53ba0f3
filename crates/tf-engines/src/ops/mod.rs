//! Ops: host reference and GPU launchers (skeleton).
pub mod gpu;
pub mod host;
