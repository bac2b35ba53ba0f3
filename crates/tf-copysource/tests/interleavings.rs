//! Property test: random interleavings of uploads, lazy GPU progress, reaps, queries, synchronizes, captures,
//! graph launches, stream retirement and context teardown never release a source before the mock GPU has
//! read it, every copy lands the caller's original bytes, and nothing is left pending or allocated at the end.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use proptest::prelude::*;
use tf_copysource::mock::{MockBackend, MockContext, MockGraph, MockStream};
use tf_copysource::{
    CaptureScope, CapturedSources, Config, ContextId, CopySource, DeviceAddress, Error,
};

const STREAMS: u32 = 3;
const CONTEXTS: usize = 2;

#[derive(Clone, Debug)]
enum Action {
    Upload {
        stream: u32,
        len: usize,
        seed: u8,
        synchronous: bool,
    },
    Advance {
        stream: u32,
        ops: usize,
    },
    Reap,
    Query {
        stream: u32,
    },
    Synchronize {
        stream: u32,
    },
    BeginCapture {
        stream: u32,
    },
    EndCapture {
        stream: u32,
    },
    FailEndCapture {
        stream: u32,
    },
    Adopt {
        stream: u32,
        len: usize,
    },
    Launch {
        exec: usize,
        stream: u32,
    },
    DropExec {
        exec: usize,
    },
    RetireStream {
        stream: u32,
    },
    Teardown {
        context: usize,
    },
}

fn action() -> impl Strategy<Value = Action> {
    let stream = 0..STREAMS;
    let context = 0..CONTEXTS;
    prop_oneof![
        6 => (stream.clone(), 1usize..12_000, any::<u8>(), prop::bool::weighted(0.15))
            .prop_map(|(stream, len, seed, synchronous)| Action::Upload { stream, len, seed, synchronous }),
        5 => (stream.clone(), 0usize..5).prop_map(|(stream, ops)| Action::Advance { stream, ops }),
        2 => Just(Action::Reap),
        1 => stream.clone().prop_map(|stream| Action::Query { stream }),
        1 => stream.clone().prop_map(|stream| Action::Synchronize { stream }),
        1 => stream.clone().prop_map(|stream| Action::BeginCapture { stream }),
        1 => stream.clone().prop_map(|stream| Action::EndCapture { stream }),
        1 => stream.clone().prop_map(|stream| Action::FailEndCapture { stream }),
        1 => (stream.clone(), 1usize..100).prop_map(|(stream, len)| Action::Adopt { stream, len }),
        2 => (0usize..4, stream.clone()).prop_map(|(exec, stream)| Action::Launch { exec, stream }),
        1 => (0usize..4).prop_map(|exec| Action::DropExec { exec }),
        1 => stream.clone().prop_map(|stream| Action::RetireStream { stream }),
        1 => context.prop_map(|context| Action::Teardown { context }),
    ]
}

/// Each stream belongs to one context, as a driver stream does.
fn context_of(stream: u32) -> usize {
    stream as usize % CONTEXTS
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

struct Exec {
    graph: MockGraph,
    sources: CapturedSources<MockBackend>,
    context: usize,
    /// (destination, bytes) of every upload captured in it.
    uploads: Vec<(DeviceAddress, Vec<u8>)>,
    launched: bool,
}

struct Scope {
    scope: CaptureScope<MockBackend>,
    context: usize,
    uploads: Vec<(DeviceAddress, Vec<u8>)>,
}

struct Harness {
    gpu: MockBackend,
    source: CopySource<MockBackend>,
    contexts: Vec<ContextId>,
    scopes: HashMap<u32, Scope>,
    execs: Vec<Exec>,
    /// Destination -> bytes that must be there once everything has run.
    expected: HashMap<DeviceAddress, Vec<u8>>,
    /// Captured uploads of graphs that were launched at least once.
    next_destination: u64,
}

impl Harness {
    fn new(config: Config) -> Self {
        let gpu = MockBackend::new();
        let source = CopySource::with_config(gpu.clone(), config);
        let contexts = (0..CONTEXTS as u32)
            .map(|i| source.register_context(MockContext(i)).unwrap())
            .collect();
        Harness {
            gpu,
            source,
            contexts,
            scopes: HashMap::new(),
            execs: Vec::new(),
            expected: HashMap::new(),
            next_destination: 0,
        }
    }

    fn apply(&mut self, action: Action) -> Result<(), TestCaseError> {
        match action {
            Action::Upload {
                stream,
                len,
                seed,
                synchronous,
            } => {
                let context = context_of(stream);
                self.next_destination += 1;
                let destination = DeviceAddress(self.next_destination << 24);
                let mut bytes = pattern(len, seed);
                let original = bytes.clone();
                let id = self.contexts[context];
                if synchronous {
                    let result =
                        self.source
                            .upload_sync(id, MockStream(stream), destination, &bytes);
                    if self.scopes.is_empty() {
                        prop_assert!(result.is_ok(), "{result:?}");
                        prop_assert_eq!(self.gpu.device_bytes(destination), Some(original.clone()));
                        self.expected.insert(destination, original);
                    } else {
                        prop_assert!(
                            matches!(result, Err(Error::UnownedCaptureSource { .. })),
                            "synchronous upload during capture must be refused: {result:?}"
                        );
                    }
                } else {
                    self.source
                        .upload_async(id, MockStream(stream), destination, &bytes)
                        .unwrap();
                    match self.scopes.get_mut(&stream) {
                        Some(scope) => scope.uploads.push((destination, original)),
                        None => {
                            self.expected.insert(destination, original);
                        }
                    }
                }
                // The caller reuses its buffer at once.
                bytes.fill(0xDD);
                drop(bytes);
            }
            Action::Advance { stream, ops } => {
                self.gpu.advance(MockStream(stream), ops);
            }
            Action::Reap => {
                self.source.reap().unwrap();
            }
            Action::Query { stream } => {
                if !self.scopes.contains_key(&stream) {
                    self.source.query(MockStream(stream)).unwrap();
                }
            }
            Action::Synchronize { stream } => {
                if !self.scopes.contains_key(&stream) {
                    self.source.synchronize(MockStream(stream)).unwrap();
                }
            }
            Action::BeginCapture { stream } => {
                let context = context_of(stream);
                if !self.scopes.contains_key(&stream) {
                    let scope = self
                        .source
                        .begin_capture(self.contexts[context], MockStream(stream))
                        .unwrap();
                    self.gpu.begin_capture(MockStream(stream));
                    self.scopes.insert(
                        stream,
                        Scope {
                            scope,
                            context,
                            uploads: Vec::new(),
                        },
                    );
                } else {
                    let again = self
                        .source
                        .begin_capture(self.contexts[context], MockStream(stream));
                    prop_assert!(
                        matches!(again, Err(Error::CaptureAlreadyOpen { .. })),
                        "second begin_capture must be refused"
                    );
                }
            }
            Action::EndCapture { stream } => {
                if let Some(scope) = self.scopes.remove(&stream) {
                    let graph = self.gpu.end_capture(MockStream(stream)).unwrap();
                    let sources = scope.scope.end();
                    prop_assert_eq!(sources.block_count(), scope.uploads.len());
                    self.execs.push(Exec {
                        graph,
                        sources,
                        context: scope.context,
                        uploads: scope.uploads,
                        launched: false,
                    });
                }
            }
            Action::FailEndCapture { stream } => {
                if let Some(scope) = self.scopes.remove(&stream) {
                    self.gpu.abort_capture(MockStream(stream));
                    drop(scope);
                }
            }
            Action::Adopt { stream, len } => {
                if let Some(scope) = self.scopes.get(&stream) {
                    let range = scope.scope.adopt(pattern(len, 7));
                    prop_assert_eq!(range.len, len);
                }
            }
            Action::Launch { exec, stream } => {
                if !self.scopes.contains_key(&stream) {
                    if let Some(exec) = self.execs.get_mut(exec) {
                        self.gpu.launch(&exec.graph, MockStream(stream));
                        self.source
                            .graph_launched(&exec.sources, MockStream(stream))
                            .unwrap();
                        exec.launched = true;
                    }
                }
            }
            Action::DropExec { exec } => {
                if exec < self.execs.len() {
                    self.retire_exec(exec);
                }
            }
            Action::RetireStream { stream } => {
                if !self.scopes.contains_key(&stream) {
                    self.source.retire_stream(MockStream(stream));
                }
            }
            Action::Teardown { context } => {
                let busy = self.scopes.values().any(|s| s.context == context)
                    || self.execs.iter().any(|e| e.context == context);
                if !busy {
                    let report = self
                        .source
                        .unregister_context(self.contexts[context])
                        .unwrap();
                    prop_assert_eq!(report.leaked_blocks, 0);
                    self.contexts[context] = self
                        .source
                        .register_context(MockContext(context as u32))
                        .unwrap();
                }
            }
        }
        prop_assert_eq!(self.gpu.violations(), Vec::<String>::new());
        Ok(())
    }

    fn retire_exec(&mut self, index: usize) {
        let exec = self.execs.remove(index);
        if exec.launched {
            for (destination, bytes) in exec.uploads {
                self.expected.insert(destination, bytes);
            }
        }
        // The driver graph goes first, then the sources it read (as a graph executable's fields drop).
        drop(exec.graph);
        drop(exec.sources);
    }

    fn finish(mut self) -> Result<(), TestCaseError> {
        for (stream, scope) in std::mem::take(&mut self.scopes) {
            self.gpu.abort_capture(MockStream(stream));
            drop(scope);
        }
        self.source.reap().unwrap();
        while !self.execs.is_empty() {
            self.retire_exec(0);
        }
        self.gpu.run_all();
        self.source.reap().unwrap();
        for stream in 0..STREAMS {
            self.source.synchronize(MockStream(stream)).unwrap();
        }
        let stats = self.source.stats();
        prop_assert_eq!(
            stats.pending_entries,
            0,
            "nothing pending once the GPU is idle: {:?}",
            stats
        );
        prop_assert_eq!(stats.open_captures, 0);
        prop_assert_eq!(stats.leaked_blocks, 0);
        for id in std::mem::take(&mut self.contexts) {
            let report = self.source.unregister_context(id).unwrap();
            prop_assert_eq!(report.leaked_blocks, 0);
        }
        prop_assert_eq!(self.source.stats().staging_bytes, 0);
        prop_assert_eq!(self.gpu.live_blocks(), 0, "every staging block freed");
        prop_assert_eq!(self.gpu.live_markers(), 0, "every marker destroyed");
        prop_assert_eq!(self.gpu.violations(), Vec::<String>::new());
        for copy in self.gpu.copies() {
            prop_assert!(
                copy.source_intact,
                "copy read a released source: {:?}",
                copy.destination
            );
        }
        for (destination, bytes) in &self.expected {
            let landed = self.gpu.device_bytes(*destination);
            prop_assert!(
                landed.as_ref() == Some(bytes),
                "wrong bytes at {:#x}",
                destination.0
            );
        }
        Ok(())
    }
}

fn config() -> impl Strategy<Value = Config> {
    (
        prop_oneof![Just(0usize), Just(8192), Just(1 << 20)],
        prop_oneof![Just(None), Just(Some(1usize << 22))],
    )
        .prop_map(|(spare, limit)| Config {
            max_spare_bytes_per_context: spare,
            staging_limit_bytes: limit,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn sources_outlive_every_gpu_read(config in config(), actions in prop::collection::vec(action(), 1..80)) {
        let mut harness = Harness::new(config);
        for action in actions {
            harness.apply(action)?;
        }
        harness.finish()?;
    }
}
