//! Staging size classes and chunking: pure arithmetic, no backend (Miri-friendly).

/// Smallest staging block: 4 KiB.
pub const MIN_CLASS_BYTES: usize = 4 << 10;
/// Largest staging block: 64 MiB.
pub const MAX_CLASS_BYTES: usize = 64 << 20;
/// Number of size classes (powers of two from 4 KiB to 64 MiB).
pub const CLASS_COUNT: usize =
    (MAX_CLASS_BYTES.trailing_zeros() - MIN_CLASS_BYTES.trailing_zeros()) as usize + 1;
/// Uploads go through pinned staging in chunks of this size (8 MiB): the host copy of one
/// chunk overlaps the DMA of the ones before it.
pub const PIPELINE_CHUNK_BYTES: usize = 8 << 20;
/// Chunks copied on the host at once, one thread each (fewer when the machine has fewer cores).
pub const PIPELINE_LANES: usize = 4;
/// Batches of lanes one upload keeps in flight before it waits for the oldest and reuses its
/// blocks (triple buffering).
pub const PIPELINE_DEPTH: usize = 3;
/// Staging one upload holds at once outside a capture (96 MiB); the default spare pool keeps
/// at least this much per context, so repeated large uploads allocate no pinned memory.
pub const PIPELINE_RING_BYTES: usize = PIPELINE_CHUNK_BYTES * PIPELINE_LANES * PIPELINE_DEPTH;

/// The size class holding `len` bytes (`0 < len <= MAX_CLASS_BYTES`): its index and block size.
/// Returns `None` for 0 or anything above [`MAX_CLASS_BYTES`].
pub fn class_for(len: usize) -> Option<(usize, usize)> {
    if len == 0 || len > MAX_CLASS_BYTES {
        return None;
    }
    let bytes = len.max(MIN_CLASS_BYTES).next_power_of_two();
    let index = (bytes.trailing_zeros() - MIN_CLASS_BYTES.trailing_zeros()) as usize;
    Some((index, bytes))
}

/// Splits `len` bytes into consecutive `(offset, length)` chunks of at most `chunk` bytes (`chunk > 0`).
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |i| {
        let offset = i * chunk;
        (offset, chunk.min(len - offset))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_between_bounds() {
        assert_eq!(CLASS_COUNT, 15);
        assert_eq!(class_for(0), None);
        assert_eq!(class_for(1), Some((0, 4096)));
        assert_eq!(class_for(4096), Some((0, 4096)));
        assert_eq!(class_for(4097), Some((1, 8192)));
        assert_eq!(class_for(1 << 20), Some((8, 1 << 20)));
        assert_eq!(
            class_for(MAX_CLASS_BYTES),
            Some((CLASS_COUNT - 1, MAX_CLASS_BYTES))
        );
        assert_eq!(class_for(MAX_CLASS_BYTES + 1), None);
    }

    #[test]
    fn chunks_cover_exactly() {
        let got: Vec<_> = chunks(10, 4).collect();
        assert_eq!(got, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: if cfg!(miri) { 4 } else { 256 },
            // Miri's isolation has no working directory for the regression file.
            failure_persistence: if cfg!(miri) { None } else { proptest::prelude::ProptestConfig::default().failure_persistence },
            ..Default::default()
        })]
        #[test]
        fn class_fits_and_is_tight(len in 1usize..=MAX_CLASS_BYTES) {
            let (index, bytes) = class_for(len).unwrap();
            proptest::prop_assert!(bytes >= len);
            proptest::prop_assert!(index < CLASS_COUNT);
            proptest::prop_assert_eq!(bytes, MIN_CLASS_BYTES << index);
            proptest::prop_assert!(bytes == MIN_CLASS_BYTES || bytes / 2 < len);
        }

        #[test]
        fn chunks_partition(len in 0usize..100_000, chunk in 1usize..5000) {
            let mut next = 0;
            for (offset, n) in chunks(len, chunk) {
                proptest::prop_assert_eq!(offset, next);
                proptest::prop_assert!(n > 0 && n <= chunk);
                next += n;
            }
            proptest::prop_assert_eq!(next, len);
        }
    }
}
