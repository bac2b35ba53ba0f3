//! A small keyed cache of captured CUDA graphs: a step is captured once per key (a workspace's KV cache, a
//! request shape) and replayed afterwards.
//!
//! [`GraphCache::capture`] captures on the first use of a key: it opens a thread-local capture on the stream,
//! runs the caller's enqueue, ends the capture (always, so a failed enqueue never leaves the stream
//! capturing), instantiates the graph and uploads it. At capacity the oldest entry is dropped first.
//!
//! Invariant: a graph references the buffers its capture used; the owner keeps the cache beside (and drops it
//! with, or before reusing) those buffers.

use tf_cuda::graph::Mode;
use tf_cuda::{GraphExec, Stream};

/// Captured graphs by key, oldest first.
pub struct GraphCache<K> {
    capacity: usize,
    entries: Vec<(K, GraphExec)>,
}

impl<K> std::fmt::Debug for GraphCache<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphCache")
            .field("capacity", &self.capacity)
            .field("len", &self.entries.len())
            .finish()
    }
}

impl<K: PartialEq> GraphCache<K> {
    /// An empty cache holding at most `capacity` graphs (at least 1). Allocates nothing.
    pub const fn new(capacity: usize) -> GraphCache<K> {
        GraphCache {
            capacity: if capacity == 0 { 1 } else { capacity },
            entries: Vec::new(),
        }
    }

    /// Graphs held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no graph is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every graph.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The graph of `key`, if captured.
    pub fn get(&self, key: &K) -> Option<&GraphExec> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, g)| g)
    }

    /// The graph of `key`, captured from `enqueue` on `stream` if missing. `cuda` maps a driver failure (and
    /// the step it happened in) into the caller's error.
    pub fn capture<E>(
        &mut self,
        key: K,
        stream: &Stream,
        enqueue: impl FnOnce() -> Result<(), E>,
        cuda: impl Fn(&'static str, tf_cuda::Error) -> E,
    ) -> Result<&GraphExec, E> {
        if let Some(i) = self.entries.iter().position(|(k, _)| *k == key) {
            return Ok(&self.entries[i].1);
        }
        if self.entries.len() >= self.capacity {
            self.entries.remove(0);
        }
        let capture = stream
            .begin_capture(Mode::ThreadLocal)
            .map_err(|e| cuda("beginning the step capture", e))?;
        let enqueued = enqueue();
        let graph = capture.end();
        enqueued?;
        let graph = graph.map_err(|e| cuda("ending the step capture", e))?;
        let exec = graph
            .instantiate()
            .map_err(|e| cuda("instantiating the step graph", e))?;
        exec.upload(stream)
            .map_err(|e| cuda("uploading the step graph", e))?;
        self.entries.push((key, exec));
        let last = self.entries.len() - 1;
        Ok(&self.entries[last].1)
    }
}
