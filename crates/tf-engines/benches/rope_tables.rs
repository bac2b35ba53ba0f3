//! Time to build a step's 3-axis RoPE tables on the host. Qwen-Image does it once per new step shape (a new prompt
//! length): 80 text rows and a 64 x 64 image grid (1024x1024), 64 rotation pairs a row. MiniMax H3 does it once per
//! request (bf16 tables at fractional positions, 16 frequencies an axis): 12,600 rows, about a 768x448 5 s layout,
//! beside the direct computation of every entry.
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tf_engines::nn::host::{rope_inverse_frequencies, rope_tables, rope_tables_bf16};

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
    // H3-like rows: frames 5/3 apart, 28 lines and 48 columns of a normalised grid.
    let h3: Vec<[f32; 3]> = (0..12_600)
        .map(|i| {
            [
                (i / 1344) as f32 * 5.0 / 3.0,
                ((i / 48) % 28) as f32 * 0.37,
                (i % 48) as f32 * 1.25,
            ]
        })
        .collect();
    let freqs = rope_inverse_frequencies(32, 10000.0);
    let direct = |positions: &[[f32; 3]]| {
        let mut cos = Vec::with_capacity(positions.len() * 48);
        let mut sin = Vec::with_capacity(positions.len() * 48);
        for p in positions {
            for &axis in p {
                for &w in &freqs {
                    let angle = f64::from(axis * w);
                    cos.push(half::bf16::from_f32(angle.cos() as f32).to_bits());
                    sin.push(half::bf16::from_f32(angle.sin() as f32).to_bits());
                }
            }
        }
        (cos, sin)
    };
    assert_eq!(rope_tables_bf16(&h3, &freqs), direct(&h3));
    group.bench_function("minimax_h3_12600_rows", |b| {
        b.iter(|| rope_tables_bf16(black_box(&h3), &freqs))
    });
    group.bench_function("minimax_h3_12600_rows_direct", |b| {
        b.iter(|| direct(black_box(&h3)))
    });
    group.finish();
}

criterion_group!(benches, tables);
criterion_main!(benches);
