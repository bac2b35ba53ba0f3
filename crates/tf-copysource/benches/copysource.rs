//! Overhead of the copy-source bookkeeping on the mock backend: per async upload (64 B, 4 KiB, 1 MiB; the
//! figure includes the host copy into staging and the mock's own queueing) and per reap of finished entries.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tf_copysource::mock::{MockBackend, MockContext, MockStream};
use tf_copysource::{CopySource, DeviceAddress};

const STREAM: MockStream = MockStream(1);
/// Uploads between (untimed) GPU drains, so the pool reaches its steady state.
const DRAIN_EVERY: u64 = 32;

fn uploads(c: &mut Criterion) {
    let mut group = c.benchmark_group("upload_async");
    for len in [64usize, 4 << 10, 1 << 20] {
        let gpu = MockBackend::new();
        let source = CopySource::new(gpu.clone());
        let context = source.register_context(MockContext(0)).expect("register");
        let bytes = vec![0x5Au8; len];
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_with_input(BenchmarkId::from_parameter(len), &len, |b, _| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for i in 0..iters {
                    let start = Instant::now();
                    source
                        .upload_async(context, STREAM, DeviceAddress(0), black_box(&bytes))
                        .expect("upload");
                    timed += start.elapsed();
                    if i % DRAIN_EVERY == DRAIN_EVERY - 1 {
                        gpu.run_all();
                    }
                }
                gpu.run_all();
                source.reap().expect("reap");
                timed
            });
        });
    }
    group.finish();
}

fn reaps(c: &mut Criterion) {
    const ENTRIES: usize = 16;
    let gpu = MockBackend::new();
    let source = CopySource::new(gpu.clone());
    let context = source.register_context(MockContext(0)).expect("register");
    let bytes = vec![1u8; 4 << 10];
    c.bench_function("reap_16_finished_uploads", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                for _ in 0..ENTRIES {
                    source
                        .upload_async(context, STREAM, DeviceAddress(0), &bytes)
                        .expect("upload");
                }
                gpu.run_all();
                let start = Instant::now();
                black_box(source.reap().expect("reap"));
                timed += start.elapsed();
            }
            timed
        });
    });
}

criterion_group!(benches, uploads, reaps);
criterion_main!(benches);
