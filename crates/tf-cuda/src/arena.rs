//! A device sub-allocator over virtual memory management (VMM): one large reserved virtual
//! range, physical chunks mapped into it on demand, buffers carved from the chunks.
//!
//! Invariants:
//! - Every address handed out is `alignment`-aligned (512 by default, so always 256-aligned as
//!   `DeviceBuffer` promises) and lies inside a mapped chunk; live allocations never overlap.
//! - Small requests (`<= small_max`) are carved from shared pool chunks with best-fit and
//!   coalescing of freed neighbours; a freed range is reused by later requests. Large requests
//!   get a chunk of their own (rounded to the VMM granularity) that is unmapped on free.
//! - Accounting is exact: after every allocation is freed, `live_bytes` and `live_allocs` are
//!   zero; [`Arena::trim`] then unmaps every pool chunk, bringing `mapped_bytes` to zero.
//! - A backend refusal (out of memory, address space exhausted) is an error from
//!   [`Arena::alloc`]; through the allocation hook it becomes "no", so `DeviceBuffer::alloc`
//!   falls back to `cuMemAlloc_v2`.
//! - The VMM entry points (`cuMemCreate`, `cuMemMap`, ...) are not in the driver table: the
//!   backend looks them up in the loaded driver library itself. Missing symbols or a device
//!   without VMM support is [`ArenaError::Unsupported`].
//! - Nothing installs the arena by default, and the engines never do: it serves
//!   `DeviceBuffer::alloc` only after an explicit [`Arena::install`] (once per process, and the
//!   arena then lives for the rest of the process, outliving every buffer it serves).
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context) -> Result<(), tf_cuda::arena::ArenaError> {
//! use tf_cuda::arena::{Arena, ArenaOptions, VmmBackend};
//! let backend = VmmBackend::open(ctx, 64 << 30)?; // reserve 64 GiB of addresses
//! let arena = std::sync::Arc::new(Arena::new(backend, ArenaOptions::default())?);
//! let addr = arena.alloc(1 << 20)?;
//! assert!(arena.free(addr));
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};
use std::sync::{Arc, Mutex, MutexGuard};

use tf_sys::CUdeviceptr;

use crate::context::Context;

/// Why the arena could not serve or be set up.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error("the VMM arena is unsupported here: {why}")]
    Unsupported { why: String },
    #[error("arena backend call {call} failed: {source}")]
    Driver {
        call: &'static str,
        #[source]
        source: tf_sys::Error,
    },
    #[error(
        "the arena's reserved address range is exhausted: {requested} bytes asked, {free} free of \
         {reserved}; open the backend with a larger reservation"
    )]
    AddressSpaceExhausted {
        requested: usize,
        free: usize,
        reserved: usize,
    },
    #[error("the backend refused a {bytes}-byte chunk: {why}")]
    BackendRefused { bytes: usize, why: String },
    #[error("invalid arena request: {what}")]
    Invalid { what: String },
    #[error("an allocation hook is already installed in this process; only one may be")]
    HookAlreadyInstalled,
}

/// Where chunks come from: map `len` bytes (a multiple of the granularity), unmap them later.
pub trait ChunkBackend: Send {
    /// Chunk sizes and addresses are multiples of this (a power of two).
    fn granularity(&self) -> usize;
    /// Maps `len` bytes of device memory and returns their address.
    fn map(&mut self, len: usize) -> Result<u64, ArenaError>;
    /// Unmaps a chunk `map` returned (with the same length). Never fails loudly.
    fn unmap(&mut self, addr: u64, len: usize);
}

/// Sizes that shape the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaOptions {
    /// Requests up to this many bytes share pool chunks; larger ones get their own chunk.
    pub small_max: usize,
    /// Size of a pool chunk (rounded up to the backend granularity).
    pub chunk_bytes: usize,
    /// Alignment of every address handed out (a power of two, at least 256).
    pub alignment: usize,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        ArenaOptions {
            small_max: 4 << 20,
            chunk_bytes: 64 << 20,
            alignment: 512,
        }
    }
}

/// Counters of an arena.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes held by live allocations (each rounded to the alignment / granularity).
    pub live_bytes: u64,
    pub live_allocs: u64,
    /// Bytes mapped from the backend now (pool and large chunks).
    pub mapped_bytes: u64,
    pub pool_chunks: u64,
    pub large_chunks: u64,
    /// Allocations served since creation.
    pub allocs_total: u64,
    /// Small allocations served from space an earlier free returned.
    pub reused: u64,
    /// Backend refusals (the hook then lets the driver allocate).
    pub refusals: u64,
}

/// Free address ranges of one region: best-fit allocation, coalescing on release.
#[derive(Clone, Debug, Default)]
pub struct FreeRanges {
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl FreeRanges {
    /// All of `[base, base + len)` free.
    pub fn whole(base: u64, len: u64) -> FreeRanges {
        let mut ranges = FreeRanges::default();
        if len > 0 {
            ranges.insert(base, len);
        }
        ranges
    }

    fn insert(&mut self, addr: u64, len: u64) {
        self.by_addr.insert(addr, len);
        self.by_size.insert((len, addr));
    }

    fn remove(&mut self, addr: u64, len: u64) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(len, addr));
    }

    /// The smallest free range of at least `len` bytes (lowest address among equals); its
    /// start is returned and the rest stays free.
    pub fn take(&mut self, len: u64) -> Option<u64> {
        let &(size, addr) = self.by_size.range((len, 0)..).next()?;
        self.remove(addr, size);
        if size > len {
            self.insert(addr + len, size - len);
        }
        Some(addr)
    }

    /// Returns `[addr, addr + len)`, merging it with free neighbours.
    pub fn give(&mut self, addr: u64, len: u64) {
        let mut start = addr;
        let mut size = len;
        if let Some((&prev, &prev_len)) = self.by_addr.range(..addr).next_back() {
            if prev + prev_len == addr {
                self.remove(prev, prev_len);
                start = prev;
                size += prev_len;
            }
        }
        if let Some(&next_len) = self.by_addr.get(&(addr + len)) {
            self.remove(addr + len, next_len);
            size += next_len;
        }
        self.insert(start, size);
    }

    /// Total free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.by_addr.values().sum()
    }

    /// Number of separate free ranges.
    pub fn fragments(&self) -> usize {
        self.by_addr.len()
    }
}

struct PoolChunk {
    len: u64,
    free: FreeRanges,
    live_bytes: u64,
    /// Bytes this chunk has ever handed out past its bump point (to count reuse).
    high_water: u64,
}

#[derive(Clone, Copy)]
enum LiveKind {
    Pool { chunk_base: u64 },
    Large,
}

#[derive(Clone, Copy)]
struct Live {
    len: u64,
    kind: LiveKind,
}

struct State<B> {
    backend: B,
    pool: BTreeMap<u64, PoolChunk>,
    large: HashMap<u64, u64>,
    live: HashMap<u64, Live>,
    stats: ArenaStats,
}

/// The sub-allocator. `Send + Sync`; every operation takes one internal lock.
pub struct Arena<B: ChunkBackend> {
    options: ArenaOptions,
    granularity: usize,
    state: Mutex<State<B>>,
}

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

impl<B: ChunkBackend> Arena<B> {
    /// An empty arena over `backend` (nothing is mapped until the first allocation).
    pub fn new(backend: B, options: ArenaOptions) -> Result<Arena<B>, ArenaError> {
        let granularity = backend.granularity();
        let invalid = |what: String| Err(ArenaError::Invalid { what });
        if !options.alignment.is_power_of_two() || options.alignment < 256 {
            return invalid(format!(
                "alignment {} must be a power of two of at least 256",
                options.alignment
            ));
        }
        if !granularity.is_power_of_two() || granularity < options.alignment {
            return invalid(format!(
                "backend granularity {granularity} must be a power of two of at least the alignment {}",
                options.alignment
            ));
        }
        if options.chunk_bytes == 0
            || options.small_max == 0
            || options.small_max > options.chunk_bytes
        {
            return invalid(format!(
                "small_max ({}) must be in 1..=chunk_bytes ({})",
                options.small_max, options.chunk_bytes
            ));
        }
        Ok(Arena {
            options,
            granularity,
            state: Mutex::new(State {
                backend,
                pool: BTreeMap::new(),
                large: HashMap::new(),
                live: HashMap::new(),
                stats: ArenaStats::default(),
            }),
        })
    }

    pub fn options(&self) -> ArenaOptions {
        self.options
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        // A panic while locked cannot leave the maps inconsistent in a way that matters more
        // than losing the arena: keep serving.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `len` (> 0) bytes at an `alignment`-aligned address.
    pub fn alloc(&self, len: usize) -> Result<u64, ArenaError> {
        if len == 0 {
            return Err(ArenaError::Invalid {
                what: "zero-byte allocations hold no memory; DeviceBuffer never asks for them"
                    .into(),
            });
        }
        let align = self.options.alignment as u64;
        let gran = self.granularity as u64;
        let too_big = || ArenaError::Invalid {
            what: format!("{len} bytes cannot be rounded to the granularity"),
        };
        let mut st = self.lock();
        if len > self.options.small_max {
            let n = round_up(len as u64, gran).ok_or_else(too_big)?;
            let addr = match st.backend.map(n as usize) {
                Ok(addr) => addr,
                Err(e) => {
                    st.stats.refusals += 1;
                    return Err(e);
                }
            };
            st.large.insert(addr, n);
            st.live.insert(
                addr,
                Live {
                    len: n,
                    kind: LiveKind::Large,
                },
            );
            st.stats.large_chunks += 1;
            st.stats.mapped_bytes += n;
            st.stats.live_bytes += n;
            st.stats.live_allocs += 1;
            st.stats.allocs_total += 1;
            return Ok(addr);
        }
        let n = round_up(len as u64, align).ok_or_else(too_big)?;
        let mut found = None;
        for (&base, chunk) in st.pool.iter_mut() {
            if let Some(addr) = chunk.free.take(n) {
                found = Some((base, addr));
                break;
            }
        }
        let (base, addr) = match found {
            Some(hit) => hit,
            None => {
                let chunk_len =
                    round_up((self.options.chunk_bytes as u64).max(n), gran).ok_or_else(too_big)?;
                let base = match st.backend.map(chunk_len as usize) {
                    Ok(base) => base,
                    Err(e) => {
                        st.stats.refusals += 1;
                        return Err(e);
                    }
                };
                let mut chunk = PoolChunk {
                    len: chunk_len,
                    free: FreeRanges::whole(base, chunk_len),
                    live_bytes: 0,
                    high_water: 0,
                };
                let addr = chunk.free.take(n).ok_or_else(|| ArenaError::Invalid {
                    what: "internal: a fresh chunk could not hold its first allocation".into(),
                })?;
                st.pool.insert(base, chunk);
                st.stats.pool_chunks += 1;
                st.stats.mapped_bytes += chunk_len;
                (base, addr)
            }
        };
        let reused = match st.pool.get_mut(&base) {
            Some(chunk) => {
                chunk.live_bytes += n;
                let end = addr - base + n;
                let reused = end <= chunk.high_water;
                chunk.high_water = chunk.high_water.max(end);
                reused
            }
            None => false,
        };
        if reused {
            st.stats.reused += 1;
        }
        st.live.insert(
            addr,
            Live {
                len: n,
                kind: LiveKind::Pool { chunk_base: base },
            },
        );
        st.stats.live_bytes += n;
        st.stats.live_allocs += 1;
        st.stats.allocs_total += 1;
        Ok(addr)
    }

    /// Takes back `addr`; false when it is not a live allocation of this arena.
    pub fn free(&self, addr: u64) -> bool {
        let mut st = self.lock();
        let Some(live) = st.live.remove(&addr) else {
            return false;
        };
        st.stats.live_bytes -= live.len;
        st.stats.live_allocs -= 1;
        match live.kind {
            LiveKind::Large => {
                st.large.remove(&addr);
                st.backend.unmap(addr, live.len as usize);
                st.stats.large_chunks -= 1;
                st.stats.mapped_bytes -= live.len;
            }
            LiveKind::Pool { chunk_base } => {
                if let Some(chunk) = st.pool.get_mut(&chunk_base) {
                    chunk.free.give(addr, live.len);
                    chunk.live_bytes -= live.len;
                }
            }
        }
        true
    }

    /// Whether `addr` is a live allocation of this arena.
    pub fn owns(&self, addr: u64) -> bool {
        self.lock().live.contains_key(&addr)
    }

    /// Unmaps every pool chunk that holds no live allocation; returns the bytes released.
    pub fn trim(&self) -> u64 {
        let mut st = self.lock();
        let empty: Vec<(u64, u64)> = st
            .pool
            .iter()
            .filter(|(_, c)| c.live_bytes == 0)
            .map(|(&b, c)| (b, c.len))
            .collect();
        let mut released = 0;
        for (base, len) in empty {
            st.pool.remove(&base);
            st.backend.unmap(base, len as usize);
            st.stats.pool_chunks -= 1;
            st.stats.mapped_bytes -= len;
            released += len;
        }
        released
    }

    pub fn stats(&self) -> ArenaStats {
        self.lock().stats
    }
}

impl<B: ChunkBackend> Drop for Arena<B> {
    fn drop(&mut self) {
        let st = match self.state.get_mut() {
            Ok(st) => st,
            Err(poisoned) => poisoned.into_inner(),
        };
        let large: Vec<(u64, u64)> = st.large.drain().collect();
        for (addr, len) in large {
            st.backend.unmap(addr, len as usize);
        }
        let pool = std::mem::take(&mut st.pool);
        for (base, chunk) in pool {
            st.backend.unmap(base, chunk.len as usize);
        }
        st.live.clear();
    }
}

/// Serves `DeviceBuffer::alloc` from an arena once installed.
struct ArenaHook<B: ChunkBackend>(Arc<Arena<B>>);

impl<B: ChunkBackend + 'static> crate::usage::AllocationHook for ArenaHook<B> {
    fn alloc(&self, len: usize) -> Option<u64> {
        self.0.alloc(len).ok()
    }
    fn free(&self, addr: u64, _len: usize) {
        self.0.free(addr);
    }
}

impl<B: ChunkBackend + 'static> Arena<B> {
    /// Makes this arena serve every later `DeviceBuffer::alloc` of the process (a refusal falls
    /// back to the driver). Once per process; the arena then lives until the process exits.
    /// The engines never call this.
    pub fn install(self: &Arc<Self>) -> Result<(), ArenaError> {
        crate::usage::install_allocation_hook(Box::new(ArenaHook(Arc::clone(self))))
            .map_err(|_| ArenaError::HookAlreadyInstalled)
    }
}

// ---------------------------------------------------------------------------------------------
// The VMM backend.

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AllocFlags {
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MemAllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location: MemLocation,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: AllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MemAccessDesc {
    location: MemLocation,
    flags: c_int,
}

const _: () = assert!(size_of::<MemAllocationProp>() == 32);
const _: () = assert!(offset_of!(MemAllocationProp, location) == 8);
const _: () = assert!(offset_of!(MemAllocationProp, win32_handle_meta_data) == 16);
const _: () = assert!(offset_of!(MemAllocationProp, alloc_flags) == 24);
const _: () = assert!(size_of::<MemAccessDesc>() == 12);
const _: () = assert!(offset_of!(MemAccessDesc, flags) == 8);

/// `CU_MEM_ALLOCATION_TYPE_PINNED`
const ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`
const LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`
const ACCESS_READ_WRITE: c_int = 3;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`
const GRANULARITY_RECOMMENDED: c_int = 1;
/// The smallest chunk granularity used, whatever the driver recommends.
const MIN_GRANULARITY: usize = 2 << 20;

type MemHandle = u64;

macro_rules! vmm_entries {
    ($( $name:ident ( $($arg:ty),* ); )*) => {
        /// The VMM entry points, looked up by name in the loaded driver library.
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        struct VmmFns {
            $( $name: unsafe extern "C" fn($($arg),*) -> tf_sys::CUresult, )*
        }

        /// Every VMM symbol the backend needs.
        pub const VMM_SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl VmmFns {
            #[allow(non_snake_case)]
            fn resolve(lib: &libloading::Library) -> Result<VmmFns, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    // SAFETY: the signature is the one cuda.h declares for this symbol; only the
                    // address is read here.
                    let $name = match unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> tf_sys::CUresult>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                    } {
                        Ok(sym) => Some(*sym),
                        Err(_) => {
                            missing.push(stringify!($name));
                            None
                        }
                    };
                )*
                match ($($name,)*) {
                    ($(Some($name),)*) => Ok(VmmFns { $($name,)* }),
                    _ => Err(missing),
                }
            }
        }
    };
}

vmm_entries! {
    cuMemAddressReserve(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    cuMemAddressFree(CUdeviceptr, usize);
    cuMemCreate(*mut MemHandle, usize, *const MemAllocationProp, u64);
    cuMemRelease(MemHandle);
    cuMemMap(CUdeviceptr, usize, usize, MemHandle, u64);
    cuMemUnmap(CUdeviceptr, usize);
    cuMemSetAccess(CUdeviceptr, usize, *const MemAccessDesc, usize);
    cuMemGetAllocationGranularity(*mut usize, *const MemAllocationProp, c_int);
}

/// Chunks of device memory mapped into one reserved virtual range of a context's device.
///
/// Unmapped ranges return to the reservation and are reused by later chunks.
pub struct VmmBackend {
    ctx: Context,
    fns: VmmFns,
    prop: MemAllocationProp,
    access: MemAccessDesc,
    granularity: usize,
    reserve_base: u64,
    reserve_len: usize,
    addresses: FreeRanges,
}

// SAFETY: the raw pointer in `prop` is always null (no Windows metadata); the rest is plain data
// and a Context, which is Send.
unsafe impl Send for VmmBackend {}

impl std::fmt::Debug for VmmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmBackend")
            .field("granularity", &self.granularity)
            .field("reserve_base", &format_args!("{:#x}", self.reserve_base))
            .field("reserve_len", &self.reserve_len)
            .finish()
    }
}

impl VmmBackend {
    /// Reserves `va_bytes` (rounded up to the granularity) of virtual addresses on `ctx`'s
    /// device. Fails with [`ArenaError::Unsupported`] when the device or driver lacks VMM.
    pub fn open(ctx: &Context, va_bytes: usize) -> Result<VmmBackend, ArenaError> {
        let supported = ctx
            .attribute(tf_sys::device_attribute::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
            .map_err(|e| ArenaError::Unsupported {
                why: format!("cannot query VMM support: {e}"),
            })?;
        if supported == 0 {
            return Err(ArenaError::Unsupported {
                why: format!(
                    "device {} reports no virtual memory management support (attribute 102 = 0)",
                    ctx.ordinal()
                ),
            });
        }
        let fns =
            VmmFns::resolve(ctx.driver().library()).map_err(|missing| ArenaError::Unsupported {
                why: format!(
                    "the driver library {} does not export {}; a CUDA 10.2+ driver is needed",
                    ctx.driver().path().display(),
                    missing.join(", ")
                ),
            })?;
        let location = MemLocation {
            kind: LOCATION_TYPE_DEVICE,
            id: ctx.ordinal(),
        };
        let prop = MemAllocationProp {
            kind: ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: AllocFlags::default(),
        };
        let access = MemAccessDesc {
            location,
            flags: ACCESS_READ_WRITE,
        };
        let mut granularity = 0usize;
        vmm_call(ctx, "cuMemGetAllocationGranularity", || {
            // SAFETY: out-pointer to a local; `prop` is a valid property struct.
            unsafe {
                (fns.cuMemGetAllocationGranularity)(
                    &mut granularity,
                    &prop,
                    GRANULARITY_RECOMMENDED,
                )
            }
        })?;
        let granularity = granularity.max(MIN_GRANULARITY).next_power_of_two();
        let reserve_len = round_up(va_bytes.max(1) as u64, granularity as u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| ArenaError::Invalid {
                what: format!("{va_bytes} bytes of address space cannot be reserved"),
            })?;
        let mut reserve_base: CUdeviceptr = 0;
        vmm_call(ctx, "cuMemAddressReserve", || {
            // SAFETY: out-pointer to a local; size and alignment are granularity multiples.
            unsafe { (fns.cuMemAddressReserve)(&mut reserve_base, reserve_len, granularity, 0, 0) }
        })?;
        Ok(VmmBackend {
            ctx: ctx.clone(),
            fns,
            prop,
            access,
            granularity,
            reserve_base,
            reserve_len,
            addresses: FreeRanges::whole(reserve_base, reserve_len as u64),
        })
    }

    /// The reserved range: base address and length.
    pub fn reservation(&self) -> (u64, usize) {
        (self.reserve_base, self.reserve_len)
    }
}

fn vmm_call(
    ctx: &Context,
    call: &'static str,
    f: impl FnOnce() -> tf_sys::CUresult,
) -> Result<(), ArenaError> {
    let inner = &ctx.inner;
    let result = inner
        .call_raw(call, |_| f())
        .and_then(|r| inner.map(call, r));
    result.map_err(|source| ArenaError::Driver { call, source })
}

impl ChunkBackend for VmmBackend {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn map(&mut self, len: usize) -> Result<u64, ArenaError> {
        let free = self.addresses.free_bytes() as usize;
        let Some(addr) = self.addresses.take(len as u64) else {
            return Err(ArenaError::AddressSpaceExhausted {
                requested: len,
                free,
                reserved: self.reserve_len,
            });
        };
        let fns = self.fns;
        let mut handle: MemHandle = 0;
        let prop = self.prop;
        if let Err(e) = vmm_call(&self.ctx, "cuMemCreate", || {
            // SAFETY: out-pointer to a local; len is a granularity multiple.
            unsafe { (fns.cuMemCreate)(&mut handle, len, &prop, 0) }
        }) {
            self.addresses.give(addr, len as u64);
            return Err(e);
        }
        let mapped = vmm_call(&self.ctx, "cuMemMap", || {
            // SAFETY: [addr, addr+len) is an unmapped part of our reservation; handle is live.
            unsafe { (fns.cuMemMap)(addr, len, 0, handle, 0) }
        });
        // The mapping keeps the memory alive until unmapped; the handle is not needed after.
        let _ = vmm_call(&self.ctx, "cuMemRelease", || {
            // SAFETY: releases the handle created above, once.
            unsafe { (fns.cuMemRelease)(handle) }
        });
        if let Err(e) = mapped {
            self.addresses.give(addr, len as u64);
            return Err(e);
        }
        let access = self.access;
        if let Err(e) = vmm_call(&self.ctx, "cuMemSetAccess", || {
            // SAFETY: the range was just mapped; one access descriptor.
            unsafe { (fns.cuMemSetAccess)(addr, len, &access, 1) }
        }) {
            let _ = vmm_call(&self.ctx, "cuMemUnmap", || {
                // SAFETY: unmaps the range mapped above.
                unsafe { (fns.cuMemUnmap)(addr, len) }
            });
            self.addresses.give(addr, len as u64);
            return Err(e);
        }
        Ok(addr)
    }

    fn unmap(&mut self, addr: u64, len: usize) {
        if self.ctx.is_lost() {
            return;
        }
        let fns = self.fns;
        // Stream-ordered work may still read the range: wait for the device first, as
        // cuMemFree would.
        let _ = self.ctx.synchronize();
        let unmapped = vmm_call(&self.ctx, "cuMemUnmap", || {
            // SAFETY: the range was mapped by `map` with this length.
            unsafe { (fns.cuMemUnmap)(addr, len) }
        });
        if unmapped.is_ok() {
            self.addresses.give(addr, len as u64);
        }
    }
}

impl Drop for VmmBackend {
    fn drop(&mut self) {
        if self.ctx.is_lost() {
            return;
        }
        let fns = self.fns;
        let (base, len) = (self.reserve_base, self.reserve_len);
        let _ = vmm_call(&self.ctx, "cuMemAddressFree", || {
            // SAFETY: frees the reservation made in `open`, once; the arena unmapped its chunks.
            unsafe { (fns.cuMemAddressFree)(base, len) }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const KIB: usize = 1024;
    const MIB: usize = 1024 * KIB;

    /// A fake address space: maps are bumped upward, every mapped range is recorded.
    #[derive(Clone, Default)]
    struct FakeBackend {
        granularity: usize,
        next: u64,
        mapped: Arc<Mutex<BTreeMap<u64, usize>>>,
        refuse_after: Option<usize>,
        maps: Arc<AtomicU64>,
    }

    impl FakeBackend {
        fn new(granularity: usize) -> FakeBackend {
            FakeBackend {
                granularity,
                next: 0x7f00_0000_0000,
                ..FakeBackend::default()
            }
        }
    }

    impl ChunkBackend for FakeBackend {
        fn granularity(&self) -> usize {
            self.granularity
        }
        fn map(&mut self, len: usize) -> Result<u64, ArenaError> {
            assert_eq!(
                len % self.granularity,
                0,
                "chunks are granularity multiples"
            );
            let count = self.maps.fetch_add(1, Ordering::SeqCst) as usize;
            if self.refuse_after.is_some_and(|n| count >= n) {
                return Err(ArenaError::BackendRefused {
                    bytes: len,
                    why: "fake refusal".into(),
                });
            }
            let addr = self.next;
            // Leave a hole so chunks are never adjacent (a merge across chunks would show).
            self.next += (len + self.granularity) as u64;
            self.mapped.lock().unwrap().insert(addr, len);
            Ok(addr)
        }
        fn unmap(&mut self, addr: u64, len: usize) {
            let was = self.mapped.lock().unwrap().remove(&addr);
            assert_eq!(
                was,
                Some(len),
                "unmap of a range that was not mapped as such"
            );
        }
    }

    fn options() -> ArenaOptions {
        ArenaOptions {
            small_max: 256 * KIB,
            chunk_bytes: 2 * MIB,
            alignment: 512,
        }
    }

    #[test]
    fn small_allocations_pack_aligned_in_one_chunk() {
        let arena = Arena::new(FakeBackend::new(2 * MIB), options()).unwrap();
        let a = arena.alloc(20480).unwrap();
        let b = arena.alloc(100).unwrap();
        let c = arena.alloc(513).unwrap();
        assert_eq!(b, a + 20480);
        assert_eq!(c, b + 512);
        for p in [a, b, c] {
            assert_eq!(p % 512, 0);
        }
        let s = arena.stats();
        assert_eq!((s.pool_chunks, s.live_allocs), (1, 3));
        assert_eq!(s.live_bytes, 20480 + 512 + 1024);
    }

    #[test]
    fn a_freed_hole_is_reused_exactly() {
        let arena = Arena::new(FakeBackend::new(2 * MIB), options()).unwrap();
        let _a = arena.alloc(4096).unwrap();
        let b = arena.alloc(4096).unwrap();
        let _c = arena.alloc(4096).unwrap();
        assert!(arena.free(b));
        assert_eq!(
            arena.alloc(4000).unwrap(),
            b,
            "best fit takes the 4 KiB hole"
        );
        assert_eq!(arena.stats().reused, 1);
    }

    #[test]
    fn large_allocations_get_their_own_rounded_chunk_released_on_free() {
        let backend = FakeBackend::new(2 * MIB);
        let mapped = Arc::clone(&backend.mapped);
        let arena = Arena::new(backend, options()).unwrap();
        let big = arena.alloc(5 * MIB).unwrap();
        assert_eq!(mapped.lock().unwrap().get(&big), Some(&(6 * MIB)));
        assert_eq!(arena.stats().large_chunks, 1);
        assert!(arena.free(big));
        assert!(mapped.lock().unwrap().is_empty());
        assert_eq!(arena.stats().mapped_bytes, 0);
    }

    #[test]
    fn unknown_and_double_frees_are_refused() {
        let arena = Arena::new(FakeBackend::new(2 * MIB), options()).unwrap();
        assert!(!arena.free(0x1234_0000));
        let a = arena.alloc(1000).unwrap();
        assert!(arena.owns(a));
        assert!(arena.free(a));
        assert!(!arena.free(a));
        assert!(!arena.owns(a));
    }

    #[test]
    fn backend_refusal_is_an_error_and_counted() {
        let mut backend = FakeBackend::new(2 * MIB);
        backend.refuse_after = Some(1);
        let arena = Arena::new(backend, options()).unwrap();
        let _ = arena.alloc(100 * KIB).unwrap(); // maps the one pool chunk allowed
        let err = arena.alloc(2 * MIB).expect_err("second chunk refused");
        assert!(err.to_string().contains("fake refusal"));
        assert_eq!(arena.stats().refusals, 1);
        // The pool chunk still serves what fits.
        assert!(arena.alloc(KIB).is_ok());
    }

    #[test]
    fn options_are_checked() {
        let bad = ArenaOptions {
            alignment: 384,
            ..options()
        };
        assert!(Arena::new(FakeBackend::new(2 * MIB), bad).is_err());
        let bad = ArenaOptions {
            small_max: 4 * MIB,
            ..options()
        };
        assert!(Arena::new(FakeBackend::new(2 * MIB), bad).is_err());
        assert!(Arena::new(FakeBackend::new(3 * MIB), options()).is_err());
        assert!(Arena::new(FakeBackend::new(2 * MIB), options())
            .unwrap()
            .alloc(0)
            .is_err());
    }

    #[test]
    fn drop_unmaps_everything() {
        let backend = FakeBackend::new(2 * MIB);
        let mapped = Arc::clone(&backend.mapped);
        {
            let arena = Arena::new(backend, options()).unwrap();
            arena.alloc(100).unwrap();
            arena.alloc(3 * MIB).unwrap();
            assert_eq!(mapped.lock().unwrap().len(), 2);
        }
        assert!(mapped.lock().unwrap().is_empty());
    }

    #[test]
    fn free_ranges_coalesce_both_sides() {
        let mut r = FreeRanges::whole(0, 4096);
        let a = r.take(1024).unwrap();
        let b = r.take(1024).unwrap();
        let c = r.take(1024).unwrap();
        assert_eq!((a, b, c), (0, 1024, 2048));
        r.give(a, 1024);
        r.give(c, 1024);
        assert_eq!(r.fragments(), 2);
        r.give(b, 1024);
        assert_eq!(r.fragments(), 1);
        assert_eq!(r.free_bytes(), 4096);
        assert_eq!(r.take(4096), Some(0));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => prop_oneof![1usize..4096, 4096usize..300_000, Just(256 * KIB), 256 * KIB + 1..3 * MIB]
                .prop_map(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #[test]
        fn no_overlap_alignment_reuse_and_exact_accounting(ops in proptest::collection::vec(op(), 1..120)) {
            let backend = FakeBackend::new(2 * MIB);
            let mapped = Arc::clone(&backend.mapped);
            let arena = Arena::new(backend, options()).unwrap();
            // live: addr -> requested len
            let mut live: BTreeMap<u64, usize> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let addr = arena.alloc(len).unwrap();
                        prop_assert_eq!(addr % 512, 0);
                        // Inside a mapped range.
                        let map = mapped.lock().unwrap();
                        let (&base, &mlen) = map.range(..=addr).next_back().expect("inside a mapped chunk");
                        prop_assert!(addr + len as u64 <= base + mlen as u64);
                        drop(map);
                        // No overlap with any live allocation.
                        if let Some((&prev, &plen)) = live.range(..=addr).next_back() {
                            prop_assert!(prev + plen as u64 <= addr, "overlaps the one below");
                        }
                        if let Some((&next, _)) = live.range(addr..).next() {
                            prop_assert!(addr + len as u64 <= next, "overlaps the one above");
                        }
                        live.insert(addr, len);
                    }
                    Op::Free(pick) => {
                        if live.is_empty() {
                            prop_assert!(!arena.free(0x10_0000));
                            continue;
                        }
                        let addr = *live.keys().nth(pick % live.len()).unwrap();
                        live.remove(&addr);
                        prop_assert!(arena.free(addr));
                        prop_assert!(!arena.free(addr));
                    }
                }
                let s = arena.stats();
                prop_assert_eq!(s.live_allocs, live.len() as u64);
                prop_assert!(s.live_bytes >= live.values().map(|&l| l as u64).sum::<u64>());
                prop_assert_eq!(s.mapped_bytes, mapped.lock().unwrap().values().map(|&l| l as u64).sum::<u64>());
            }
            for addr in live.keys().copied().collect::<Vec<_>>() {
                prop_assert!(arena.free(addr));
            }
            let s = arena.stats();
            prop_assert_eq!((s.live_bytes, s.live_allocs, s.large_chunks), (0, 0, 0));
            arena.trim();
            let s = arena.stats();
            prop_assert_eq!((s.mapped_bytes, s.pool_chunks), (0, 0));
            prop_assert!(mapped.lock().unwrap().is_empty());
        }
    }
}
