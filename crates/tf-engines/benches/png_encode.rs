//! Time to encode one output image as PNG, per compression mode: a 1024x1024 RGBA and RGB image (Qwen-Image's
//! output) and a 768x448 RGB video frame (MiniMax H3's), each as smooth content with grain (what a model makes)
//! and as noise (what random weights make, the worst case for deflate). `fast` is the default mode, which at
//! these sizes deflates bands of rows on all cores; `fast_one_thread` is the same mode held to the `png` crate's
//! single-threaded fdeflate (what smaller images get). Prints each mode's file size once.
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tf_engines::nn::media::png::{
    encode_png_fast, encode_png_with, ColorType, FastPath, PngCompression,
};

/// A deterministic image: gradients plus a little grain (`noise` false), or uniform noise.
fn image(width: usize, height: usize, channels: usize, noise: bool) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut pixels = Vec::with_capacity(width * height * channels);
    for y in 0..height {
        for x in 0..width {
            for c in 0..channels {
                let value = if noise {
                    (next() >> 56) as u8
                } else if c == 3 {
                    255
                } else {
                    let base = (x * 255 / width + y * 128 / height + c * 40) % 256;
                    let grain = (next() >> 61) as usize;
                    ((base + grain) % 256) as u8
                };
                pixels.push(value);
            }
        }
    }
    pixels
}

fn encode(c: &mut Criterion) {
    let cases = [
        ("1024x1024_rgba", 1024usize, 1024usize, ColorType::Rgba),
        ("1024x1024_rgb", 1024, 1024, ColorType::Rgb),
        ("768x448_rgb", 768, 448, ColorType::Rgb),
    ];
    let mut group = c.benchmark_group("png_encode");
    group.sample_size(10);
    for (name, width, height, color) in cases {
        for noise in [false, true] {
            let pixels = image(width, height, color.channels(), noise);
            let content = if noise { "noise" } else { "smooth" };
            group.throughput(Throughput::Bytes(pixels.len() as u64));
            // `fast` takes the library's choice; `fast_bands` and `fast_one_thread` force either path.
            for (mode, compression, path) in [
                ("compatible", PngCompression::Compatible, None),
                ("fast", PngCompression::Fast, None),
                ("fast_bands", PngCompression::Fast, Some(FastPath::Bands)),
                (
                    "fast_one_thread",
                    PngCompression::Fast,
                    Some(FastPath::OneThread),
                ),
            ] {
                let run = |pixels: &[u8]| match path {
                    None => encode_png_with(width, height, color, pixels, compression),
                    Some(path) => encode_png_fast(width, height, color, pixels, path),
                };
                let size = run(&pixels).unwrap().len();
                eprintln!("{name} {content} {mode}: {size} bytes");
                let id = BenchmarkId::new(format!("{name}_{content}"), mode);
                group.bench_with_input(id, &pixels, |b, pixels| {
                    b.iter(|| run(black_box(pixels)).unwrap())
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
