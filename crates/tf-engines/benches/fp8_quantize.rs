//! Load-time FP8 weight quantization on the host: one thread running the upload ring's per-row quantizer
//! (`RowQuantizer`) over a 4096 x 4096 bf16 weight (32 MiB in, 16 MiB of codes out), the work a loading
//! `--precision fp8` model does for every quantized layer; and the same weight into INT8 codes (`gemm=int8`).
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tf_engines::nn::fp8::{RowCodes, RowQuantizer};
use tf_engines::nn::upload::{fill_host, ChunkTransform, Piece, Transform};
use tf_engines::nn::weights::Dtype;

fn quantize(c: &mut Criterion) {
    const ROWS: usize = 4096;
    const COLS: usize = 4096;
    // A weight-like spread of bf16 values (a fixed xorshift sequence, no two rows alike).
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let src: Vec<u8> = (0..ROWS * COLS)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let bits = (unit * 0.04).to_bits();
            ((bits >> 16) as u16).to_le_bytes()
        })
        .collect();
    let mut dst = vec![0u8; ROWS * COLS];
    let mut group = c.benchmark_group("fp8_weight_quantize");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(src.len() as u64));
    group.bench_function("bf16_4096x4096_one_thread", |b| {
        let quantizer = RowQuantizer::new(Dtype::BF16, ROWS, COLS).unwrap();
        b.iter(|| quantizer.apply(0, black_box(&src), &mut dst).unwrap())
    });
    group.bench_function("bf16_4096x4096_int8_one_thread", |b| {
        let quantizer = RowQuantizer::with_codes(Dtype::BF16, ROWS, COLS, RowCodes::Int8).unwrap();
        b.iter(|| quantizer.apply(0, black_box(&src), &mut dst).unwrap())
    });
    // The same weight through the ring's fill path (64 MiB slots) on every host thread: what a load does.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    group.bench_function(format!("bf16_4096x4096_fill_{threads}_threads"), |b| {
        let quantizer = RowQuantizer::new(Dtype::BF16, ROWS, COLS).unwrap();
        let pieces = [Piece {
            src: &src,
            transform: Transform::Custom(&quantizer),
            dst_offset: 0,
        }];
        b.iter(|| fill_host(&mut dst, black_box(&pieces), 64 << 20, threads).unwrap())
    });
    group.finish();
}

criterion_group!(benches, quantize);
criterion_main!(benches);
