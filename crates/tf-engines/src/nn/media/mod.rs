//! Media files the engines write: PNG images.
pub mod png;
