//! Embedded kernel images (skeleton).
