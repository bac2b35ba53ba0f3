//! NCCL on a real GPU, one rank: a world-size-1 communicator through the full NCCL path (non-blocking init,
//! grouped send/receive, all-gather, all-reduce, broadcast) gives back exactly the bytes a plain device copy
//! gives, and the timeout path (a rank that never joins, a collective stuck behind a busy stream) returns an
//! error after aborting instead of hanging.
//!
//! NCCL is found through `TF_NCCL`, `libnccl.so.2` or the Python package folders (the nvidia-nccl-cu13 wheel).
//! Run (on the GPU machine, from the bundle): `gpu_nccl --include-ignored --test-threads=1 --nocapture`; with
//! one thread the tests run in name order, so `zz_` (whose abort leaves NCCL work queued behind a busy kernel)
//! runs last.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tf_cuda::{Args, Context, DeviceBuffer, LaunchConfig, Module, Stream};
use tf_nccl::{AllToAllCounts, Comm, CommOptions, DataType, Nccl, NcclError, ReduceOp};

fn gpu() -> Context {
    let driver =
        tf_cuda::open_driver().unwrap_or_else(|e| panic!("the CUDA driver did not open: {e}"));
    Context::new(driver, 0).unwrap_or_else(|e| panic!("device 0's context: {e}"))
}

fn nccl() -> Arc<Nccl> {
    let nccl = Nccl::open_with_python_packages().unwrap_or_else(|e| panic!("{e}"));
    println!(
        "NCCL {} from {} (NCCL_NVLS_ENABLE={:?})",
        nccl.version(),
        nccl.path().display(),
        std::env::var("NCCL_NVLS_ENABLE").ok()
    );
    assert_eq!(std::env::var("NCCL_NVLS_ENABLE").as_deref(), Ok("0"));
    nccl
}

fn one_rank(nccl: &Arc<Nccl>, ctx: &Context) -> Comm {
    let stream = Arc::new(Stream::new(ctx, false).unwrap());
    let id = nccl.unique_id().unwrap();
    let start = Instant::now();
    let comm = Comm::init_rank(nccl, stream, &id, 0, 1, CommOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    println!("one-rank init: {:?}", start.elapsed());
    comm
}

/// Deterministic 16-bit words (xorshift), every bit pattern possible (bf16 NaNs and infinities included:
/// the data is moved, never computed on).
fn words(n: usize, seed: u64) -> Vec<u16> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u16
        })
        .collect()
}

/// A plain device-to-device copy of `src` on `stream`: the reference every NCCL result must equal.
fn plain_copy(ctx: &Context, src: &DeviceBuffer, stream: &Stream) -> Vec<u8> {
    let mut out = DeviceBuffer::alloc(ctx, src.len()).unwrap();
    out.copy_from(0, src.view(), Some(stream)).unwrap();
    stream.synchronize().unwrap();
    out.to_vec::<u8>().unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (libnccl.so.2 or the nvidia-nccl wheel)"]
fn gpu_one_rank_collectives_equal_the_plain_copy_bit_for_bit() {
    let ctx = gpu();
    let nccl = nccl();
    let comm = one_rank(&nccl, &ctx);
    let stream = Arc::clone(comm.stream());

    // All-to-all over three tensors in one group (Q, K, V of 301 rows x 56 heads x 128, bf16): with one rank
    // the exchange is the identity.
    let n = 301 * 56 * 128;
    let inputs: Vec<DeviceBuffer> = (0..3)
        .map(|s| DeviceBuffer::from_slice(&ctx, &words(n, 11 + s)).unwrap())
        .collect();
    let mut outputs: Vec<DeviceBuffer> = (0..3)
        .map(|_| {
            let mut b = DeviceBuffer::alloc_elems::<u16>(&ctx, n).unwrap();
            b.fill_u8(0xa5, None).unwrap();
            b
        })
        .collect();
    let counts = AllToAllCounts::uniform(1, n);
    {
        let mut pairs: Vec<_> = inputs
            .iter()
            .zip(outputs.iter_mut())
            .map(|(i, o)| (i.view(), o.view_mut()))
            .collect();
        let start = Instant::now();
        // SAFETY: every buffer is of the communicator's context and outlives the synchronize below.
        unsafe { comm.all_to_all(&mut pairs, &counts, DataType::Bf16) }.unwrap();
        comm.synchronize().unwrap();
        println!("all-to-all of 3 x {} B: {:?}", n * 2, start.elapsed());
    }
    for (i, o) in inputs.iter().zip(&outputs) {
        let want = plain_copy(&ctx, i, &stream);
        assert!(
            o.to_vec::<u8>().unwrap() == want,
            "all-to-all differs from the plain copy"
        );
    }

    // An uneven all-to-all: the one peer's block at an offset in both buffers.
    let src = DeviceBuffer::from_slice(&ctx, &words(1000, 5)).unwrap();
    let mut dst = DeviceBuffer::alloc_elems::<u16>(&ctx, 1000).unwrap();
    dst.fill_u8(0, None).unwrap();
    let counts = AllToAllCounts {
        send_counts: vec![700],
        send_offsets: vec![100],
        recv_counts: vec![700],
        recv_offsets: vec![300],
    };
    // SAFETY: as above.
    unsafe { comm.all_to_all(&mut [(src.view(), dst.view_mut())], &counts, DataType::Bf16) }
        .unwrap();
    comm.synchronize().unwrap();
    let (s, d) = (src.to_vec::<u16>().unwrap(), dst.to_vec::<u16>().unwrap());
    assert!(
        d[300..1000] == s[100..800],
        "the shifted block landed where the counts say"
    );
    assert!(d[..300].iter().all(|&w| w == 0), "nothing else was written");

    // All-gather (f32 bits), all-reduce sum and broadcast of finite values: one rank gives its own data back.
    let m = 1 << 20;
    let finite: Vec<f32> = words(m, 9)
        .iter()
        .map(|&w| f32::from(w as i16) * 0.37)
        .collect();
    let a = DeviceBuffer::from_slice(&ctx, &finite).unwrap();
    let want = plain_copy(&ctx, &a, &stream);
    let mut g = DeviceBuffer::alloc_elems::<f32>(&ctx, m).unwrap();
    let mut r = DeviceBuffer::alloc_elems::<f32>(&ctx, m).unwrap();
    let mut b = DeviceBuffer::from_slice(&ctx, &finite).unwrap();
    // SAFETY: as above.
    unsafe {
        comm.all_gather(a.view(), g.view_mut(), m, DataType::F32)
            .unwrap();
        comm.all_reduce(a.view(), r.view_mut(), m, DataType::F32, ReduceOp::Sum)
            .unwrap();
        comm.broadcast_in_place(b.view_mut(), m, DataType::F32, 0)
            .unwrap();
    }
    comm.synchronize().unwrap();
    assert!(
        g.to_vec::<u8>().unwrap() == want,
        "all-gather differs from the plain copy"
    );
    assert!(
        r.to_vec::<u8>().unwrap() == want,
        "all-reduce differs from the plain copy"
    );
    assert!(
        b.to_vec::<u8>().unwrap() == want,
        "broadcast changed the root's data"
    );
    assert!(comm.failure().is_none());
    drop(comm);
    assert!(!ctx.is_lost());
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (libnccl.so.2 or the nvidia-nccl wheel)"]
fn gpu_a_rank_that_never_joins_times_out_and_the_process_carries_on() {
    let ctx = gpu();
    let nccl = nccl();
    let stream = Arc::new(Stream::new(&ctx, false).unwrap());
    let id = nccl.unique_id().unwrap();
    let options = CommOptions {
        init_timeout: Duration::from_secs(3),
        ..CommOptions::default()
    };
    let start = Instant::now();
    // Rank 0 of 2; rank 1 never comes.
    let err = Comm::init_rank(&nccl, stream, &id, 0, 2, options).unwrap_err();
    let waited = start.elapsed();
    println!("after {waited:?}: {err}");
    assert!(err.is_timeout(), "{err:?}");
    assert!(
        waited < Duration::from_secs(30),
        "the abort returned promptly: {waited:?}"
    );
    // The process and the GPU are fine: a new one-rank communicator works.
    let comm = one_rank(&nccl, &ctx);
    let a = DeviceBuffer::from_slice(&ctx, &[1.5f32, -2.0, 3.25]).unwrap();
    let mut g = DeviceBuffer::alloc_elems::<f32>(&ctx, 3).unwrap();
    // SAFETY: both buffers are of the communicator's context and outlive the synchronize.
    unsafe { comm.all_gather(a.view(), g.view_mut(), 3, DataType::F32) }.unwrap();
    comm.synchronize().unwrap();
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.25]);
}

/// A kernel that spins for `cycles` clock cycles, then returns: a stand-in for a peer that does not arrive.
const SPIN_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry spin_cycles(
    .param .u64 p_cycles
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [p_cycles];
    mov.u64 %rd2, %clock64;
LOOP:
    mov.u64 %rd3, %clock64;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra LOOP;
    ret;
}
"#;

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (libnccl.so.2 or the nvidia-nccl wheel)"]
fn zz_gpu_a_collective_stuck_behind_a_busy_stream_times_out_and_aborts() {
    let ctx = gpu();
    let nccl = nccl();
    let stream = Arc::new(Stream::new(&ctx, false).unwrap());
    let id = nccl.unique_id().unwrap();
    let options = CommOptions {
        op_timeout: Duration::from_millis(500),
        ..CommOptions::default()
    };
    let comm = Comm::init_rank(&nccl, Arc::clone(&stream), &id, 0, 1, options).unwrap();
    let module = Module::load_ptx(&ctx, SPIN_PTX).unwrap();
    let spin = module.function("spin_cycles").unwrap();
    let mut args = Args::new();
    // About 3 s at H200 clocks.
    args.push(6_000_000_000u64);
    // SAFETY: the kernel takes no address.
    unsafe { stream.launch(&spin, &LaunchConfig::for_items(1, 1), &args) }.unwrap();
    let a = DeviceBuffer::from_slice(&ctx, &[1.0f32; 256]).unwrap();
    let mut g = DeviceBuffer::alloc_elems::<f32>(&ctx, 256).unwrap();
    // SAFETY: both buffers are of the communicator's context and outlive the stream synchronize below.
    unsafe { comm.all_gather(a.view(), g.view_mut(), 256, DataType::F32) }.unwrap();
    let start = Instant::now();
    let err = comm.synchronize().unwrap_err();
    let total = start.elapsed();
    println!("after {total:?} (deadline found, then the abort returned): {err}");
    let NcclError::Timeout { waited, .. } = err else {
        panic!("expected a timeout, got {err:?}");
    };
    // The deadline is found on time; the abort may wait for the busy kernel (at most its ~3 s), never forever.
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    assert!(total < Duration::from_secs(20), "{total:?}");
    assert!(matches!(comm.synchronize(), Err(NcclError::Aborted { .. })));
    // The spin ends on its own; the stream then drains and the context is healthy.
    stream.synchronize().unwrap();
    assert!(!ctx.is_lost());
    drop(comm);
}
