//! DiT host reference (skeleton).
