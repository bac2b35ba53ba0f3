//! A bounded set of per-shape items (a DiT's workspaces, each holding its activations and captured graphs), most
//! recently used last: finding an item moves it to the end, and adding one to a full set drops the least recently
//! used first, before the new one is made (so the device memory of both is never held at once).
//!
//! Invariants: never more than `capacity` items (at least 1); the item a lookup returns is at the last index
//! until the next lookup; a failed `make` leaves the set without the dropped item but otherwise unchanged.
//!
//! ```
//! use tf_engines::nn::gpu::recent_set::RecentSet;
//!
//! let mut set: RecentSet<(usize, &str)> = RecentSet::new(2);
//! for key in [1, 2, 1, 3] {
//!     set.find_or_make(|item| item.0 == key, || Ok::<_, ()>((key, "workspace")))?;
//! }
//! // 2 was the least recently used when 3 arrived.
//! assert_eq!(set.iter().map(|item| item.0).collect::<Vec<_>>(), [1, 3]);
//! # Ok::<(), ()>(())
//! ```

use std::ops::{Index, IndexMut};

/// At most `capacity` items, least recently used first.
pub struct RecentSet<T> {
    capacity: usize,
    items: Vec<T>,
}

impl<T> std::fmt::Debug for RecentSet<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecentSet")
            .field("capacity", &self.capacity)
            .field("len", &self.items.len())
            .finish()
    }
}

impl<T> RecentSet<T> {
    /// An empty set of at most `capacity` items (at least 1). Allocates nothing.
    pub const fn new(capacity: usize) -> RecentSet<T> {
        RecentSet {
            capacity: if capacity == 0 { 1 } else { capacity },
            items: Vec::new(),
        }
    }

    /// Most items held at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Items held.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether no item is held.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Drops every item.
    pub fn clear(&mut self) {
        self.items.clear();
    }

    /// The items, least recently used first.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.items.iter()
    }

    /// The index of the item `matches` accepts, now the most recently used (the last index); when none does,
    /// drops the least recently used item if the set is full, then adds the one `make` returns. Only the first
    /// matching item counts.
    pub fn find_or_make<E>(
        &mut self,
        matches: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<usize, E> {
        self.find_or_remake(matches, |evicted| {
            // Dropped before the new item is made: the two are never held together.
            drop(evicted);
            make()
        })
    }

    /// As [`RecentSet::find_or_make`], but the least recently used item a full set gives up is handed to `remake`
    /// (`None` when the set had room), which may reuse its parts for the new item; the set no longer holds it
    /// either way.
    pub fn find_or_remake<E>(
        &mut self,
        matches: impl Fn(&T) -> bool,
        remake: impl FnOnce(Option<T>) -> Result<T, E>,
    ) -> Result<usize, E> {
        if let Some(i) = self.items.iter().position(matches) {
            let item = self.items.remove(i);
            self.items.push(item);
            return Ok(self.items.len() - 1);
        }
        let evicted = if self.items.len() >= self.capacity {
            Some(self.items.remove(0))
        } else {
            None
        };
        let item = remake(evicted)?;
        self.items.push(item);
        Ok(self.items.len() - 1)
    }

    /// Removes and returns every item, least recently used first.
    pub fn take_all(&mut self) -> Vec<T> {
        std::mem::take(&mut self.items)
    }
}

impl<T> Index<usize> for RecentSet<T> {
    type Output = T;

    fn index(&self, index: usize) -> &T {
        &self.items[index]
    }
}

impl<T> IndexMut<usize> for RecentSet<T> {
    fn index_mut(&mut self, index: usize) -> &mut T {
        &mut self.items[index]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys(set: &RecentSet<u8>) -> Vec<u8> {
        set.iter().copied().collect()
    }

    #[test]
    fn a_hit_moves_to_the_end_and_a_miss_drops_the_least_recent() {
        let mut set = RecentSet::new(3);
        for k in [1u8, 2, 3] {
            set.find_or_make(|&x| x == k, || Ok::<_, ()>(k)).unwrap();
        }
        assert_eq!(set.find_or_make(|&x| x == 1, || Err(())), Ok(2));
        assert_eq!(keys(&set), [2, 3, 1]);
        assert_eq!(set.find_or_make(|&x| x == 4, || Ok::<_, ()>(4)), Ok(2));
        assert_eq!(keys(&set), [3, 1, 4]);
    }

    #[test]
    fn a_failed_make_keeps_the_rest() {
        let mut set = RecentSet::new(2);
        for k in [1u8, 2] {
            set.find_or_make(|&x| x == k, || Ok::<_, &str>(k)).unwrap();
        }
        assert_eq!(
            set.find_or_make(|&x| x == 9, || Err("no memory")),
            Err("no memory")
        );
        assert_eq!(keys(&set), [2]);
        let mut empty: RecentSet<u8> = RecentSet::new(0);
        assert_eq!(empty.capacity(), 1);
        assert!(empty.is_empty());
        empty.find_or_make(|_| false, || Ok::<_, ()>(7)).unwrap();
        empty.find_or_make(|_| false, || Ok::<_, ()>(8)).unwrap();
        assert_eq!(keys(&empty), [8]);
    }

    #[test]
    fn remake_gets_the_least_recent_item_only_when_full() {
        let mut set = RecentSet::new(2);
        let mut given = Vec::new();
        for k in [1u8, 2, 1, 3, 4] {
            set.find_or_remake(
                |&x| x == k,
                |old| {
                    given.push(old);
                    Ok::<_, ()>(k)
                },
            )
            .unwrap();
        }
        // 1 and 2 had room; 3 evicted 2 (1 was used after it); 4 evicted 1.
        assert_eq!(given, [None, None, Some(2), Some(1)]);
        assert_eq!(keys(&set), [3, 4]);
        assert_eq!(set.take_all(), [3, 4]);
        assert!(set.is_empty());
    }

    proptest! {
        /// Any sequence of lookups keeps the set within its capacity, without duplicate keys, with the key just
        /// looked up last, and holding exactly the most recent distinct keys.
        #[test]
        fn the_set_holds_the_most_recent_distinct_keys(
            capacity in 1usize..6,
            lookups in proptest::collection::vec(0u8..10, 0..64),
        ) {
            let mut set = RecentSet::new(capacity);
            let mut made = 0usize;
            for (n, &k) in lookups.iter().enumerate() {
                let i = set.find_or_make(|&x| x == k, || { made += 1; Ok::<_, ()>(k) }).unwrap();
                prop_assert_eq!(i, set.len() - 1);
                prop_assert_eq!(set[i], k);
                prop_assert!(set.len() <= capacity);
                let mut expected: Vec<u8> = Vec::new();
                for &key in lookups[..=n].iter().rev() {
                    if !expected.contains(&key) && expected.len() < capacity {
                        expected.push(key);
                    }
                }
                expected.reverse();
                prop_assert_eq!(keys(&set), expected);
            }
            prop_assert!(made <= lookups.len());
        }
    }
}
