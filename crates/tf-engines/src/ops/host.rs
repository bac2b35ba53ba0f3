//! Host reference ops (skeleton).
