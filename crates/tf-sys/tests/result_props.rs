//! Property tests of result classification.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use tf_sys::result::{is_sticky, known_codes, known_name, shutdown_note, STICKY_CODES};
use tf_sys::{check, Error, FallbackText};

/// Which variant a code maps to (exactly one per code).
fn variant(code: i32) -> &'static str {
    match check(&FallbackText, "call", code) {
        Ok(()) => "ok",
        Err(Error::OutOfMemory { .. }) => "oom",
        Err(Error::NotFound { .. }) => "not_found",
        Err(Error::NotReady) => "not_ready",
        Err(Error::ContextLost { .. }) => "context_lost",
        Err(Error::Failed { .. }) => "failed",
        Err(other) => panic!("check produced an unexpected variant: {other:?}"),
    }
}

fn interesting_code() -> impl Strategy<Value = i32> {
    prop_oneof![
        any::<i32>(),
        -5i32..1100,
        proptest::sample::select(known_codes().collect::<Vec<_>>()),
        proptest::sample::select(STICKY_CODES.to_vec()),
    ]
}

proptest! {
    #[test]
    fn every_code_maps_to_exactly_the_expected_variant(code in interesting_code()) {
        let expected = match code {
            0 => "ok",
            2 => "oom",
            500 => "not_found",
            600 => "not_ready",
            c if is_sticky(c) => "context_lost",
            _ => "failed",
        };
        prop_assert_eq!(variant(code), expected);
        // The mapping is a function of the code alone.
        prop_assert_eq!(variant(code), variant(code));
        if let Err(e) = check(&FallbackText, "call", code) {
            prop_assert_eq!(e.code(), Some(code));
            prop_assert_eq!(e.is_context_lost(), is_sticky(code));
        }
    }

    #[test]
    fn sticky_codes_are_context_lost(code in proptest::sample::select(STICKY_CODES.to_vec())) {
        let is_lost = matches!(check(&FallbackText, "cuStreamSynchronize", code), Err(Error::ContextLost { code: c, .. }) if c == code);
        prop_assert!(is_lost);
    }

    #[test]
    fn fallback_names_are_stable_and_standard(code in interesting_code()) {
        let first = known_name(code);
        prop_assert_eq!(first, known_name(code));
        if let Some(name) = first {
            prop_assert!(name.starts_with("CUDA_ERROR_") || name == "CUDA_SUCCESS");
            if let Err(Error::Failed { name: reported, .. }) = check(&FallbackText, "call", code) {
                prop_assert_eq!(reported, name);
            }
        }
        prop_assert_eq!(shutdown_note(code).is_empty(), code != 4);
    }
}

#[test]
fn unknown_and_shutdown_are_not_sticky() {
    assert!(!is_sticky(999));
    assert!(!is_sticky(4));
    assert_eq!(variant(999), "failed");
    assert_eq!(variant(4), "failed");
    assert_eq!(
        variant(800),
        "failed",
        "800 is mapped to GraphNotPermitted by tf-cuda at instantiate only"
    );
}
