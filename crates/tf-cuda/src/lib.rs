//! tf-cuda (skeleton)
