//! Bounded memo of segment encodings.
//!
//! A segment is a stretch of ordinary text between added tokens; its ids depend on nothing
//! else, so the same segment always encodes to the same ids. The memo keeps two generations
//! of entries: when the current one reaches half the byte budget it becomes the previous one
//! and the old previous one is dropped. A hit in the previous generation moves the entry
//! forward. Memory stays under the budget and each operation is O(1) plus hashing.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Which pipeline produced a segment's ids: the two differ for tokenizers with normalized
/// added tokens, so they are keyed apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum SegmentKind {
    /// Template-only text: normalized added tokens may still form.
    Template,
    /// Text that holds user bytes: no added token may form.
    Plain,
}

/// (pipeline, segment starts the input, text): all a segment's ids depend on.
type Key = (SegmentKind, bool, Box<str>);

/// Per-entry bookkeeping bytes on top of the key and the ids (map slot, Arc header).
const ENTRY_OVERHEAD: usize = 64;

#[derive(Default)]
struct Generations {
    current: HashMap<Key, Arc<[u32]>>,
    current_bytes: usize,
    previous: HashMap<Key, Arc<[u32]>>,
    hits: u64,
    misses: u64,
}

/// Thread-safe bounded memo; `capacity_bytes == 0` disables it.
pub(crate) struct SegmentMemo {
    capacity_bytes: usize,
    inner: Mutex<Generations>,
}

/// Counters of the memo, for benchmarks and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoStats {
    /// Lookups answered from the memo.
    pub hits: u64,
    /// Lookups that had to encode.
    pub misses: u64,
    /// Entries held now (both generations).
    pub entries: usize,
    /// The byte budget.
    pub capacity_bytes: usize,
}

fn entry_cost(text: &str, ids: &[u32]) -> usize {
    text.len() + std::mem::size_of_val(ids) + ENTRY_OVERHEAD
}

impl SegmentMemo {
    pub(crate) fn new(capacity_bytes: usize) -> Self {
        Self {
            capacity_bytes,
            inner: Mutex::new(Generations::default()),
        }
    }

    /// The cached ids of `text`, or `encode(text)` (then remembered when it fits).
    pub(crate) fn get_or_encode<E>(
        &self,
        kind: SegmentKind,
        at_start: bool,
        text: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        // A segment larger than a quarter of a generation would flush everything else.
        let generation_budget = self.capacity_bytes / 2;
        if generation_budget == 0 || text.len() > generation_budget / 4 {
            return encode(text).map(Arc::from);
        }
        let key: Key = (kind, at_start, Box::from(text));
        {
            let mut g = self.inner.lock();
            if let Some(ids) = g.current.get(&key) {
                let ids = Arc::clone(ids);
                g.hits += 1;
                return Ok(ids);
            }
            if let Some(ids) = g.previous.remove(&key) {
                g.hits += 1;
                Self::insert(&mut g, generation_budget, key, Arc::clone(&ids));
                return Ok(ids);
            }
            g.misses += 1;
        }
        // Encode outside the lock so that threads do not serialize on the tokenizer.
        let ids: Arc<[u32]> = Arc::from(encode(text)?);
        let mut g = self.inner.lock();
        Self::insert(&mut g, generation_budget, key, Arc::clone(&ids));
        Ok(ids)
    }

    fn insert(g: &mut Generations, generation_budget: usize, key: Key, ids: Arc<[u32]>) {
        let cost = entry_cost(&key.2, &ids);
        if g.current.contains_key(&key) {
            return;
        }
        if g.current_bytes + cost > generation_budget {
            g.previous = std::mem::take(&mut g.current);
            g.current_bytes = 0;
        }
        g.current_bytes += cost;
        g.current.insert(key, ids);
    }

    pub(crate) fn clear(&self) {
        let mut g = self.inner.lock();
        g.current.clear();
        g.previous.clear();
        g.current_bytes = 0;
    }

    pub(crate) fn stats(&self) -> MemoStats {
        let g = self.inner.lock();
        MemoStats {
            hits: g.hits,
            misses: g.misses,
            entries: g.current.len() + g.previous.len(),
            capacity_bytes: self.capacity_bytes,
        }
    }

    /// Bytes charged to the entries held now (for the bound test).
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> usize {
        let g = self.inner.lock();
        g.current
            .iter()
            .chain(g.previous.iter())
            .map(|(k, v)| entry_cost(&k.2, v))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_encode(text: &str) -> Result<Vec<u32>, ()> {
        Ok(text.bytes().map(u32::from).collect())
    }

    #[test]
    fn second_lookup_is_a_hit_with_the_same_ids() {
        let memo = SegmentMemo::new(1 << 20);
        let a = memo
            .get_or_encode(SegmentKind::Plain, false, "hello", fake_encode)
            .unwrap();
        let b = memo
            .get_or_encode(SegmentKind::Plain, false, "hello", |_| Err(()))
            .unwrap();
        assert_eq!(a, b);
        let s = memo.stats();
        assert_eq!((s.hits, s.misses), (1, 1));
    }

    #[test]
    fn kinds_are_keyed_apart() {
        let memo = SegmentMemo::new(1 << 20);
        memo.get_or_encode(SegmentKind::Plain, false, "x", fake_encode)
            .unwrap();
        let other = memo.get_or_encode(SegmentKind::Template, false, "x", |_| Ok::<_, ()>(vec![7]));
        assert_eq!(&*other.unwrap(), &[7]);
    }

    #[test]
    fn memory_stays_within_the_budget() {
        let capacity = 16 * 1024;
        let memo = SegmentMemo::new(capacity);
        for i in 0..5000 {
            let text = format!("segment number {i} with some padding text");
            memo.get_or_encode(SegmentKind::Plain, false, &text, fake_encode)
                .unwrap();
            assert!(
                memo.held_bytes() <= capacity,
                "held {} > {capacity}",
                memo.held_bytes()
            );
        }
        assert!(memo.stats().entries > 0);
    }

    #[test]
    fn zero_capacity_disables_the_memo() {
        let memo = SegmentMemo::new(0);
        memo.get_or_encode(SegmentKind::Plain, false, "a", fake_encode)
            .unwrap();
        memo.get_or_encode(SegmentKind::Plain, false, "a", fake_encode)
            .unwrap();
        assert_eq!(memo.stats().entries, 0);
    }

    #[test]
    fn errors_are_not_remembered() {
        let memo = SegmentMemo::new(1 << 20);
        assert!(memo
            .get_or_encode(SegmentKind::Plain, false, "a", |_| Err::<Vec<u32>, _>(()))
            .is_err());
        let ids = memo
            .get_or_encode(SegmentKind::Plain, false, "a", fake_encode)
            .unwrap();
        assert_eq!(&*ids, &[97]);
    }
}
