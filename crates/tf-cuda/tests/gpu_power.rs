//! The board's power and energy through NVML on a real GPU: the meter finds the context's board, and a window
//! around a second of back-to-back bf16 GEMMs reads energy that matches the draw it sampled.
//! Needs an NVIDIA GPU and its driver's libnvidia-ml; run through `cargo xtask gpu-bundle`.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tf_cuda::cublaslt::{CublasLt, Gemm, LtLibrary};
use tf_cuda::power::{PowerError, PowerMeter};
use tf_cuda::{open_driver, Context, DeviceBuffer, Stream};

#[test]
#[ignore = "needs an NVIDIA GPU and libnvidia-ml: run through cargo xtask gpu-bundle"]
fn a_window_around_busy_gemms_reads_energy_the_samples_agree_with() {
    let driver = open_driver().unwrap_or_else(|e| panic!("the CUDA driver must open here: {e}"));
    let ctx = Context::new(driver, 0).unwrap_or_else(|e| panic!("context on device 0: {e}"));
    let meter =
        PowerMeter::for_context(&ctx).unwrap_or_else(|e| panic!("NVML must open here: {e}"));
    // A board (or virtual machine) that does not expose its energy counter answers NVML_ERROR_NOT_SUPPORTED (3):
    // nothing here can be checked there, which the test says instead of passing silently.
    if let Err(PowerError::Call { code: 3, call, .. }) = meter.energy_millijoules() {
        println!("SKIPPED: {call} is not supported on this board");
        return;
    }
    let limit = meter.limit_watts().expect("power limit");
    println!("board {} power limit {limit:.0} W", meter.bus_id());
    assert!((50.0..=2000.0).contains(&limit), "limit {limit} W");

    // An idle window first: little energy, no power cap.
    let idle = meter.window(Duration::from_millis(10));
    std::thread::sleep(Duration::from_millis(300));
    let idle = idle.finish().expect("idle window");
    println!("idle: {}", idle.describe(1, "window"));

    let stream = Stream::new(&ctx, true).expect("stream");
    let lib = LtLibrary::open().unwrap_or_else(|e| panic!("cuBLASLt must load here: {e}"));
    let lt = CublasLt::with_default_workspace(&ctx, Arc::clone(&lib)).expect("cuBLASLt handle");
    let n = 8192;
    let mut x = DeviceBuffer::alloc(&ctx, n * n * 2).expect("X");
    let mut w = DeviceBuffer::alloc(&ctx, n * n * 2).expect("W");
    let y = DeviceBuffer::alloc(&ctx, n * n * 2).expect("Y");
    // bf16 0x3c3c (about 0.0115) everywhere: finite sums, real work.
    x.fill_u8(0x3c, None).expect("fill X");
    w.fill_u8(0x3c, None).expect("fill W");
    let gemm = Gemm::bf16(n, n, n, (&x).into(), (&w).into(), (&y).into());
    // Warm up (plan, clocks), then a window around about a second and a half of GEMMs.
    for _ in 0..20 {
        // SAFETY: x, w and y are live until the synchronize below.
        unsafe { lt.matmul(&gemm, &stream) }.expect("GEMM");
    }
    stream.synchronize().expect("warm-up");
    let window = meter.window(Duration::from_millis(10));
    let started = Instant::now();
    let mut calls = 0usize;
    while started.elapsed() < Duration::from_millis(1500) {
        for _ in 0..50 {
            // SAFETY: as above.
            unsafe { lt.matmul(&gemm, &stream) }.expect("GEMM");
        }
        stream.synchronize().expect("GEMM batch");
        calls += 50;
    }
    let busy = window.finish().expect("busy window");
    println!("busy: {}", busy.describe(calls, "GEMM"));
    let tflops = 2.0 * (n as f64).powi(3) * calls as f64 / busy.seconds / 1e12;
    println!(
        "{calls} GEMMs of 8192^3 at {tflops:.0} TFLOP/s, {:.3} TFLOP/J",
        2.0 * (n as f64).powi(3) * calls as f64 / busy.joules / 1e12
    );

    assert!(busy.seconds >= 1.5, "window {} s", busy.seconds);
    assert!(busy.joules > 0.0, "the energy counter moved");
    // The counter and the sampled draw describe the same board: the mean lies within the samples' reach.
    let max_sampled = busy.max_sampled_watts.expect("the sampler read the draw");
    assert!(
        busy.mean_watts() <= max_sampled * 1.25 + 25.0,
        "mean {} W against sampled max {max_sampled} W",
        busy.mean_watts()
    );
    assert!(
        busy.mean_watts() <= limit * 1.1,
        "mean {} W over the {limit} W limit",
        busy.mean_watts()
    );
    // Back-to-back GEMMs draw far more than an idle board.
    assert!(
        busy.mean_watts() > idle.mean_watts() + 50.0,
        "busy {} W against idle {} W",
        busy.mean_watts(),
        idle.mean_watts()
    );
    let clock = busy.sm_clock.expect("the sampler read the SM clock");
    assert!(clock.median > 0 && clock.min <= clock.median && clock.median <= clock.max);
}
