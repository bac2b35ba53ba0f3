//! Stress: uploads, reaps, queries, synchronizes and captures from several threads while a "GPU" thread
//! executes queued work at its own pace. No source may be released before the GPU read it.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tf_copysource::mock::{MockBackend, MockContext, MockStream};
use tf_copysource::{Config, CopySource, DeviceAddress};

#[test]
fn concurrent_streams_and_a_lazy_gpu_never_release_early() {
    let gpu = MockBackend::new();
    let config = Config {
        max_spare_bytes_per_context: 64 << 10,
        staging_limit_bytes: None,
    };
    let source = CopySource::with_config(gpu.clone(), config);
    let context = source.register_context(MockContext(0)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    const WORKERS: u32 = 4;
    const ROUNDS: u64 = 300;

    std::thread::scope(|scope| {
        let gpu_thread = {
            let gpu = gpu.clone();
            let stop = Arc::clone(&stop);
            scope.spawn(move || {
                let mut turn = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    gpu.advance(MockStream(turn % (WORKERS + 1)), 3);
                    turn = turn.wrapping_add(1);
                    std::thread::yield_now();
                }
            })
        };
        let mut workers = Vec::new();
        for worker in 0..WORKERS {
            let source = source.clone();
            let gpu = gpu.clone();
            workers.push(scope.spawn(move || {
                let stream = MockStream(worker);
                for round in 0..ROUNDS {
                    let len = 1 + ((round * 977 + u64::from(worker) * 131) % 9000) as usize;
                    let mut bytes = vec![(round as u8) ^ (worker as u8); len];
                    let destination = DeviceAddress(u64::from(worker) << 40 | round << 16);
                    source
                        .upload_async(context, stream, destination, &bytes)
                        .unwrap();
                    bytes.fill(0xFF);
                    match round % 7 {
                        0 => {
                            source.reap().unwrap();
                        }
                        3 => {
                            source.query(stream).unwrap();
                        }
                        5 => source.synchronize(stream).unwrap(),
                        _ => {}
                    }
                    // One worker also captures and launches a small graph now and then.
                    if worker == 0 && round % 50 == 0 {
                        let captured = MockStream(WORKERS);
                        let scope = source.begin_capture(context, captured).unwrap();
                        gpu.begin_capture(captured);
                        source
                            .upload_async(
                                context,
                                captured,
                                DeviceAddress(1 << 60 | round),
                                &[7; 100],
                            )
                            .unwrap();
                        let graph = gpu.end_capture(captured).unwrap();
                        let sources = scope.end();
                        gpu.launch(&graph, captured);
                        source.graph_launched(&sources, captured).unwrap();
                        drop(graph);
                        drop(sources);
                    }
                }
            }));
        }
        for worker in workers {
            worker.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        gpu_thread.join().unwrap();
    });

    gpu.run_all();
    source.reap().unwrap();
    assert_eq!(source.stats().pending_entries, 0);
    for worker in 0..WORKERS {
        for round in 0..ROUNDS {
            let len = 1 + ((round * 977 + u64::from(worker) * 131) % 9000) as usize;
            let destination = DeviceAddress(u64::from(worker) << 40 | round << 16);
            let expected = vec![(round as u8) ^ (worker as u8); len];
            assert_eq!(
                gpu.device_bytes(destination),
                Some(expected),
                "worker {worker} round {round}"
            );
        }
    }
    source.unregister_context(context).unwrap();
    assert_eq!(gpu.violations(), Vec::<String>::new());
    assert!(gpu.copies().iter().all(|copy| copy.source_intact));
    assert_eq!(gpu.live_blocks(), 0);
    assert_eq!(gpu.live_markers(), 0);
    println!(
        "copies executed: {}, staging allocations: {}",
        gpu.copies().len(),
        gpu.allocations()
    );
}
