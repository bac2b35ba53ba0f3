//! tf-copysource (skeleton)
