//! DiT config (skeleton).
