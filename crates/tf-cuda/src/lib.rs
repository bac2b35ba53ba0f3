//! tf-cuda: a small, safe CUDA host runtime over the driver that tf-sys loads at run time.
//!
//! What it gives engines: one device's primary [`Context`], [`Stream`]s and [`Event`]s, graph
//! capture as a guard ([`graph::Capture`]), loaded GPU code ([`Module`], [`Function`]),
//! launches with arguments packed at C alignment ([`Args`], [`LaunchConfig`]), device and
//! pinned host memory ([`DeviceBuffer`], [`HostBuffer`]) with borrowed views, copies and fills,
//! process-wide accounting ([`usage()`]), cuBLASLt GEMMs with cached (optionally timed) plans
//! ([`cublaslt`]), TMA tensor maps for sm_90 kernels ([`tensor_map`]) and, for benchmarks, the board's power and
//! energy through NVML ([`power`]).
//!
//! Invariants:
//! - Only this crate calls tf-sys; every driver call goes through one checked path per context.
//! - A lost context never calls the driver again: the first sticky execution fault seen by any
//!   call through a context marks it lost; every later call through it (and through anything
//!   made in it) fails fast with [`Error::ContextLost`], and dropping objects of a lost context
//!   leaks them instead of calling in.
//! - Drop never panics, and never reports: teardown results are ignored.
//! - Views cannot be freed: [`DeviceView`] / [`DeviceViewMut`] borrow a buffer for a lifetime
//!   and have no free; only the owning [`DeviceBuffer`] releases memory.
//! - Zero-byte buffers allocate nothing, hold address 0 and never call the driver.
//! - Host bytes a copy reads later belong to the copy source (tf-copysource) until the GPU has
//!   read them: async uploads copy into private pinned staging; while a capture scope is open,
//!   synchronous uploads are refused with [`Error::UnownedCaptureSource`]; a graph executable
//!   keeps its captured staging alive.
//! - Launch geometry and argument size are validated before the driver is called. Launching is
//!   `unsafe` ([`Stream::launch`]): the caller vouches that the raw device addresses in the arguments
//!   point into live allocations of the stream's context. Freeing a [`DeviceBuffer`] synchronizes its
//!   context first, so work enqueued while the memory was alive never sees it freed.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tf_cuda::{Args, Context, DeviceBuffer, LaunchConfig, Module, Stream};
//!
//! let driver = Arc::new(tf_sys::Driver::open()?);
//! let ctx = Context::new(driver, 0)?;
//! let stream = Stream::new(&ctx, true)?;
//! # let ptx = "";
//! let module = Module::load_ptx(&ctx, ptx)?;
//! let fill = module.function("fill_f32")?;
//! let mut out = DeviceBuffer::alloc_elems::<f32>(&ctx, 1024)?;
//! let mut args = Args::new();
//! args.push_addr(out.addr()).push(1024u32).push(1.5f32);
//! // SAFETY: the only address is `out`'s, 1024 f32 long as the kernel writes; `out` is alive now, and its
//! // Drop waits for the context before freeing.
//! unsafe { stream.launch(&fill, &LaunchConfig::for_items(1024, 256), &args)? };
//! stream.synchronize()?;
//! let host: Vec<f32> = out.to_vec()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod arena;
pub mod context;
pub mod copy;
pub mod cublaslt;
pub mod driver;
pub mod error;
pub mod gpu_memory;
pub mod graph;
pub mod launch;
pub mod memory;
pub mod module;
pub mod power;
pub mod segments;
pub mod stream;
pub mod tensor_map;
pub mod usage;

pub use context::{Context, DeviceInfo, MemoryInfo, Schedule};
pub use driver::{driver_info, open_driver, DriverInfo};
pub use error::Error;
pub use graph::{Capture, Graph, GraphExec};
pub use launch::{row_threads, Args, Dim3, KernelArg, LaunchConfig, Pod};
pub use memory::{copy_2d, DeviceBuffer, DeviceView, DeviceViewMut, HostBuffer};
pub use module::{Function, Module};
pub use stream::{Event, Priority, Stream};
pub use usage::{driver_costs, usage, DriverCosts, Usage};

/// The driver, re-exported so users need not depend on tf-sys to open it.
pub use tf_sys::Driver;
