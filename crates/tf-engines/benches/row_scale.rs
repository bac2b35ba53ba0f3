//! Load-time layer-scale folding on the host, at the size of one MiniMax H3 video-VAE feed-forward output weight
//! (2048 x 8192 f32, 64 MiB in, 32 MiB of bf16 out; the decoder has 36, plus 36 attention outputs a quarter that
//! size): the upload ring's `RowScaleToBf16` on one thread and on every host thread, against the host path it
//! replaced (the f32 values read, each row scaled into a new vector, turned into bytes, then converted to bf16).
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tf_engines::nn::upload::{
    convert_to_bf16, fill_host, ChunkTransform, Piece, RowScaleToBf16, Transform,
};
use tf_engines::nn::weights::Dtype;

fn row_scale(c: &mut Criterion) {
    const ROWS: usize = 2048;
    const COLS: usize = 8192;
    // A weight-like spread of f32 values (a fixed xorshift sequence) and per-row scales near 0.1.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let values: Vec<f32> = (0..ROWS * COLS).map(|_| next() * 0.04).collect();
    let scale: Vec<f32> = (0..ROWS).map(|_| 0.1 + next() * 0.01).collect();
    let src: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut dst = vec![0u8; ROWS * COLS * 2];
    let mut group = c.benchmark_group("row_scale_fold");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(src.len() as u64));
    group.bench_function("host_path_f32_2048x8192", |b| {
        b.iter(|| {
            let read: Vec<f32> = black_box(&src)
                .chunks_exact(4)
                .map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]))
                .collect();
            let scaled: Vec<f32> = read
                .chunks_exact(COLS)
                .zip(&scale)
                .flat_map(|(row, &s)| row.iter().map(move |&v| v * s))
                .collect();
            let bytes: Vec<u8> = scaled.iter().flat_map(|v| v.to_le_bytes()).collect();
            convert_to_bf16(&bytes, Dtype::F32, &mut dst).unwrap();
        })
    });
    let fold = RowScaleToBf16::new(Dtype::F32, COLS, scale.clone()).unwrap();
    group.bench_function("ring_transform_f32_2048x8192_one_thread", |b| {
        b.iter(|| fold.apply(0, black_box(&src), &mut dst).unwrap())
    });
    // The same weight through the ring's fill path (64 MiB slots) on every host thread: what a load does.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    group.bench_function(format!("ring_fill_f32_2048x8192_{threads}_threads"), |b| {
        let pieces = [Piece {
            src: &src,
            transform: Transform::Custom(&fold),
            dst_offset: 0,
        }];
        b.iter(|| fill_host(&mut dst, black_box(&pieces), 64 << 20, threads).unwrap())
    });
    group.finish();
}

criterion_group!(benches, row_scale);
criterion_main!(benches);
