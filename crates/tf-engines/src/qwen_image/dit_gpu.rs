//! DiT GPU backend (skeleton).
