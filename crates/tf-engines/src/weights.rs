//! Safetensors model folders (skeleton).
