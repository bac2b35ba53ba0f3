//! GPU launchers (skeleton).
