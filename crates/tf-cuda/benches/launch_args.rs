//! Cost of packing kernel arguments at C alignment (host only).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tf_cuda::launch::{Args, KernelArg};

#[repr(C)]
#[derive(Clone, Copy)]
struct Shape {
    rows: u32,
    cols: u32,
    stride: u64,
    scale: f32,
}
// SAFETY: repr(C) of scalars, like the kernel's struct parameter.
unsafe impl KernelArg for Shape {}

fn pack_typical(c: &mut Criterion) {
    c.bench_function("pack 8 args (5 addresses, 2 scalars, 1 struct)", |b| {
        b.iter(|| {
            let mut args = Args::new();
            for i in 0..5u64 {
                args.push_addr(black_box(0x7f00_0000_0000 + i * 256));
            }
            args.push(black_box(4096u32)).push(black_box(1e-6f32));
            args.push(black_box(Shape {
                rows: 4096,
                cols: 3072,
                stride: 3072,
                scale: 0.125,
            }));
            black_box(args.byte_len())
        })
    });
    c.bench_function("pack 32 u64 args", |b| {
        b.iter(|| {
            let mut args = Args::new();
            for i in 0..32u64 {
                args.push(black_box(i));
            }
            black_box(args.byte_len())
        })
    });
}

criterion_group!(benches, pack_typical);
criterion_main!(benches);
