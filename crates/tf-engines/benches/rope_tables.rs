//! Time to build a Qwen-Image step's 3-axis RoPE tables on the host, which a DiT does once per new step shape (a new
//! prompt length): 80 text rows and a 64 x 64 image grid (1024x1024), 64 rotation pairs a row.
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tf_engines::nn::host::rope_tables;

/// Text rows on the diagonal past the image's extent, then the image grid centred on zero (frame 0).
fn positions(text: i64, side: i64) -> Vec<[i64; 3]> {
    let mut out: Vec<[i64; 3]> = (0..text).map(|i| [side / 2 + i; 3]).collect();
    for y in 0..side {
        for x in 0..side {
            out.push([0, y - side / 2, x - side / 2]);
        }
    }
    out
}

fn tables(c: &mut Criterion) {
    let mut group = c.benchmark_group("rope_tables");
    group.sample_size(20);
    let rows = positions(80, 64);
    group.bench_function("qwen_image_1024x1024_80_text_rows", |b| {
        b.iter(|| rope_tables(black_box(&rows), [16, 56, 56], 10000.0))
    });
    group.finish();
}

criterion_group!(benches, tables);
criterion_main!(benches);
