//! Time to draw a request's initial noise on the host with the portable generator: Qwen-Image's packed latents at
//! 1024x1024 (16 channels x 128 x 128) and MiniMax H3's video and audio noise at 768x448, 5 s.
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tf_engines::minimax_h3::noise::{H3Noise, NoiseShape};
use tf_engines::nn::sampling::flow_match::LatentDtype;
use tf_engines::nn::sampling::noise::packed_latents;

fn draw(c: &mut Criterion) {
    let mut group = c.benchmark_group("noise");
    group.sample_size(20);
    group.bench_function("qwen_image_1024x1024_bf16", |b| {
        b.iter(|| packed_latents(black_box(7), 1, 16, 128, 128, LatentDtype::Bf16).unwrap())
    });
    // 768x448, 5 s as released: 24 x 37 x 28 x 48 video latents, 2 x 207 audio rows of 32.
    let shape = NoiseShape {
        channels: 24,
        frames: 37,
        height: 28,
        width: 48,
        audio_rows: 414,
        audio_channels: 32,
    };
    group.bench_function("minimax_h3_768x448_5s", |b| {
        b.iter(|| H3Noise::generate(black_box(7), &shape).unwrap())
    });
    group.finish();
}

criterion_group!(benches, draw);
criterion_main!(benches);
