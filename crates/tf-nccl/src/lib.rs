//! tf-nccl: NCCL loaded at run time, for engines that spread one model over several GPUs of a host.
//!
//! What it gives: [`Nccl`], the library found and opened like the CUDA driver (`TF_NCCL`, then
//! `libnccl.so.2`; [`Nccl::open_with_python_packages`] also searches the Python package folders where the
//! `nvidia-nccl` wheels put it), with one declarative table of entry points ([`ffi`]); and [`Comm`], one rank of
//! a communicator bound to a tf-cuda context and stream, with all-to-all (grouped `ncclSend`/`ncclRecv`, per-peer
//! counts and offsets), all-gather, all-reduce and broadcast on bf16/f16/f32/byte device buffers.
//!
//! It is a crate of its own so that only the engines that opt into it link it: the single-GPU build never
//! loads NCCL.
//!
//! Invariants:
//! - Nothing panics: a missing library lists every path tried and why; a library lacking entry points lists
//!   every missing name; NCCL failures are [`NcclError`]s naming the rank, the call, the code and what to do.
//! - No rank hangs: communicators are non-blocking, and every NCCL call is polled with
//!   `ncclCommGetAsyncError` against a deadline ([`CommOptions`]); a passed deadline, an NCCL error or a failed
//!   CUDA call (a lost context included) aborts the communicator (`ncclCommAbort`) and returns the cause;
//!   every later call fails at once. `Drop` never waits without a deadline.
//! - NVLink multicast stays off: opening NCCL sets `NCCL_NVLS_ENABLE=0` in the process before the library
//!   loads, and nothing here sets up multicast memory.
//! - Collectives take tf-cuda views, checked against the counts before NCCL is called; they are `unsafe fn`s
//!   with one contract, as `Stream::launch` is: the views lie in memory of the communicator's context.
//!   Buffers stay valid for the queued work because a `DeviceBuffer`'s drop synchronizes its context.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tf_cuda::{Context, DeviceBuffer, Stream};
//! use tf_nccl::{Comm, CommOptions, DataType, Nccl};
//!
//! let nccl = Nccl::open_with_python_packages()?;
//! let ctx = Context::new(Arc::new(tf_cuda::Driver::open()?), 0)?;
//! let stream = Arc::new(Stream::new(&ctx, false)?);
//! // A one-rank communicator; with more ranks, rank 0 makes the id and ships `id.to_bytes()` to the others.
//! let id = nccl.unique_id()?;
//! let comm = Comm::init_rank(&nccl, stream, &id, 0, 1, CommOptions::default())?;
//! let send = DeviceBuffer::from_slice(&ctx, &[1.0f32, 2.0, 3.0])?;
//! let mut recv = DeviceBuffer::alloc_elems::<f32>(&ctx, 3)?;
//! // SAFETY: both buffers were allocated in the communicator's context and outlive the synchronize below.
//! unsafe { comm.all_gather(send.view(), recv.view_mut(), 3, DataType::F32)? };
//! comm.synchronize()?;
//! assert_eq!(recv.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod comm;
pub mod error;
pub mod ffi;
pub mod loader;

pub use comm::{AllToAllCounts, Comm, CommOptions, DataType, ReduceOp, MAX_WORLD};
pub use error::NcclError;
pub use loader::{Attempt, LoadError, Nccl, PathSource, Refusal, UniqueId, Version};
