//! Host cost of the GEMM path before the library: validation and the row-major to column-major
//! mapping of one call, and the plan-cache key lookup a repeated shape takes (host only; the
//! cached-call cost including `cublasLtMatmul` is measured on the GPU by tests/gpu_cublaslt.rs).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tf_cuda::cublaslt::{DeviceSpan, Gemm, PlanKey};

fn gemm() -> Gemm {
    let (m, n, k) = (4096, 3072, 3072);
    Gemm::bf16(
        m,
        n,
        k,
        DeviceSpan::new(0x7f00_0000_0000, m * k * 2),
        DeviceSpan::new(0x7f10_0000_0000, n * k * 2),
        DeviceSpan::new(0x7f20_0000_0000, m * n * 2),
    )
    .with_bias(DeviceSpan::new(0x7f30_0000_0000, n * 2))
}

fn plan_and_lookup(c: &mut Criterion) {
    let g = gemm();
    c.bench_function("validate + map a bf16 GEMM with bias", |b| {
        b.iter(|| black_box(black_box(&g).plan()))
    });
    // A cache the size of a DiT's distinct GEMM shapes.
    let mut cache: HashMap<PlanKey, u64> = HashMap::new();
    for i in 0..32usize {
        let shape = Gemm {
            n: 3072 + 128 * i,
            ..g
        };
        if let Ok(call) = shape.plan() {
            cache.insert(call.key, i as u64);
        }
    }
    c.bench_function("validate + map + cache lookup (hit)", |b| {
        b.iter(|| {
            let call = black_box(&g).plan().ok()?;
            cache.get(&call.key).copied()
        })
    });
}

criterion_group!(benches, plan_and_lookup);
criterion_main!(benches);
