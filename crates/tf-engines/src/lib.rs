//! tf-engines (skeleton)
