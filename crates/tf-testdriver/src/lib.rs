//! Test driver (skeleton).
