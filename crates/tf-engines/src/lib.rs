//! tf-engines (skeleton; see the modules).
pub mod kernels;
pub mod ops;
pub mod qwen_image;
pub mod weights;
