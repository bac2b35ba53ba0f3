//! tf-tokenizer (skeleton)
