//! Device buffers kept from a dropped workspace for the next one: a DiT that meets a new step shape (a new prompt
//! length) builds its workspace from the buffers of the one it gives up instead of freeing ~25 buffers (each a
//! device-wide wait) and allocating ~25 new ones inside the request.
//!
//! Invariants: a buffer handed out by [`SpareBuffers::take`] holds at least the bytes asked and at most twice as many
//! plus [`SMALL_BYTES`] (so a small need never takes a large buffer away from a large one); the smallest fitting
//! spare is the one taken; the spares never hold more than their byte bound (a buffer that would pass it is dropped,
//! which frees it). The buffers' contents are stale: every user writes before it reads.
//!
//! ```
//! use tf_engines::nn::gpu::spare_buffers::{with_headroom, SpareBuffers, Spare};
//!
//! struct Fake(usize);
//! impl Spare for Fake {
//!     fn bytes(&self) -> usize { self.0 }
//! }
//! let mut spares = SpareBuffers::new(1 << 30);
//! spares.give(Fake(with_headroom(64 << 20)));
//! assert!(spares.take(80 << 20).is_none()); // more than the headroom left room for
//! assert!(spares.take(60 << 20).is_some());
//! ```

/// Needs below this many bytes may take a spare up to this much larger than twice the need.
pub const SMALL_BYTES: usize = 1 << 20;
/// Sizes are rounded up to this many bytes, so that nearby needs fit one allocation.
const GRANULE: usize = 4096;

/// A buffer the spares can hold: only its size matters to them.
pub trait Spare {
    /// Bytes the buffer holds.
    fn bytes(&self) -> usize;
}

impl Spare for tf_cuda::DeviceBuffer {
    fn bytes(&self) -> usize {
        self.len()
    }
}

/// The bytes to allocate for a need of `bytes` that may grow: an eighth more, rounded up to 4 KiB, so a workspace of
/// a slightly longer prompt fits the buffers of a shorter one. Saturates instead of overflowing.
pub fn with_headroom(bytes: usize) -> usize {
    let grown = bytes.saturating_add(bytes / 8);
    grown
        .checked_next_multiple_of(GRANULE)
        .unwrap_or(grown)
        .max(GRANULE)
}

/// Spare buffers, at most `max_bytes` of them.
pub struct SpareBuffers<B> {
    buffers: Vec<B>,
    held: usize,
    max_bytes: usize,
}

impl<B> std::fmt::Debug for SpareBuffers<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpareBuffers")
            .field("buffers", &self.buffers.len())
            .field("held_bytes", &self.held)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

impl<B: Spare> SpareBuffers<B> {
    /// No spares, holding at most `max_bytes` once given some.
    pub const fn new(max_bytes: usize) -> SpareBuffers<B> {
        SpareBuffers {
            buffers: Vec::new(),
            held: 0,
            max_bytes,
        }
    }

    /// The smallest spare that holds `bytes` and is not more than twice as large (plus [`SMALL_BYTES`]); `None`
    /// when none fits (the caller allocates).
    pub fn take(&mut self, bytes: usize) -> Option<B> {
        let most = bytes.saturating_mul(2).saturating_add(SMALL_BYTES);
        let (index, _) = self
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| (bytes..=most).contains(&b.bytes()))
            .min_by_key(|(_, b)| b.bytes())?;
        let buffer = self.buffers.swap_remove(index);
        self.held -= buffer.bytes();
        Some(buffer)
    }

    /// Keeps `buffer` for a later [`SpareBuffers::take`], or drops it when the spares would pass their bound.
    pub fn give(&mut self, buffer: B) {
        let bytes = buffer.bytes();
        match self.held.checked_add(bytes) {
            Some(total) if total <= self.max_bytes => {
                self.held = total;
                self.buffers.push(buffer);
            }
            _ => drop(buffer),
        }
    }

    /// Gives every buffer of `buffers`, largest first (so the bound keeps the large ones, which cost the most to
    /// allocate again).
    pub fn give_all(&mut self, buffers: impl IntoIterator<Item = B>) {
        let mut buffers: Vec<B> = buffers.into_iter().collect();
        buffers.sort_by_key(|b| std::cmp::Reverse(b.bytes()));
        for buffer in buffers {
            self.give(buffer);
        }
    }

    /// Changes the bound; spares past a lower one are dropped, smallest first.
    pub fn set_max_bytes(&mut self, max_bytes: usize) {
        self.max_bytes = max_bytes;
        if self.held > max_bytes {
            self.buffers.sort_by_key(|b| std::cmp::Reverse(b.bytes()));
            while self.held > max_bytes {
                match self.buffers.pop() {
                    Some(b) => self.held -= b.bytes(),
                    None => break,
                }
            }
        }
    }

    /// Bytes held as spares.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Spares held.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Whether no spare is held.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Drops every spare.
    pub fn clear(&mut self) {
        self.buffers.clear();
        self.held = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, PartialEq, Eq)]
    struct Fake(usize);

    impl Spare for Fake {
        fn bytes(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn the_smallest_fitting_spare_is_taken_and_large_ones_are_kept_for_large_needs() {
        let mut spares = SpareBuffers::new(usize::MAX);
        spares.give_all([Fake(100 << 20), Fake(30 << 20), Fake(26 << 20), Fake(4096)]);
        assert_eq!(spares.take(25 << 20), Some(Fake(26 << 20)));
        assert_eq!(spares.take(25 << 20), Some(Fake(30 << 20)));
        // 100 MiB is more than twice 25 MiB: not handed to a small need.
        assert_eq!(spares.take(25 << 20), None);
        assert_eq!(spares.take(8), Some(Fake(4096)));
        assert_eq!(spares.take(90 << 20), Some(Fake(100 << 20)));
        assert!(spares.is_empty());
        assert_eq!(spares.held_bytes(), 0);
    }

    #[test]
    fn the_bound_drops_what_would_pass_it_and_keeps_the_largest() {
        let mut spares = SpareBuffers::new(100);
        spares.give_all([Fake(10), Fake(60), Fake(50)]);
        // Largest first: 60 kept, 50 would pass 100 (dropped), 10 kept.
        assert_eq!(spares.held_bytes(), 70);
        assert_eq!(spares.len(), 2);
        spares.set_max_bytes(60);
        assert_eq!(spares.held_bytes(), 60);
        assert_eq!(spares.take(60), Some(Fake(60)));
        spares.give(Fake(usize::MAX));
        assert!(spares.is_empty(), "a buffer past the bound is dropped");
        spares.give(Fake(5));
        spares.clear();
        assert_eq!((spares.len(), spares.held_bytes()), (0, 0));
    }

    #[test]
    fn headroom_is_an_eighth_in_granules() {
        assert_eq!(with_headroom(0), GRANULE);
        assert_eq!(with_headroom(1), GRANULE);
        assert_eq!(with_headroom(8 << 20), 9 << 20);
        assert_eq!(with_headroom(usize::MAX), usize::MAX);
    }

    proptest! {
        /// Whatever is given and taken: the held count is exact and within the bound, and every buffer taken
        /// fits its need within the size window.
        #[test]
        fn accounting_and_fit_hold(
            max_bytes in 0usize..1_000_000,
            ops in proptest::collection::vec((any::<bool>(), 0usize..400_000), 0..64),
        ) {
            let mut spares = SpareBuffers::new(max_bytes);
            for (give, bytes) in ops {
                if give {
                    spares.give(Fake(bytes));
                } else if let Some(Fake(got)) = spares.take(bytes) {
                    prop_assert!(got >= bytes && got <= 2 * bytes + SMALL_BYTES);
                }
                let sum: usize = spares.buffers.iter().map(|b| b.0).sum();
                prop_assert_eq!(sum, spares.held_bytes());
                prop_assert!(spares.held_bytes() <= max_bytes);
            }
        }
    }
}
