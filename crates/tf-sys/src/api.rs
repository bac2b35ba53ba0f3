//! The driver entry-point table: one declarative list, the single source of truth.
//!
//! Each line of `driver_entries!` names an exported symbol exactly (versioned names such as
//! `cuMemAlloc_v2`), whether the table requires it, and whether it allocates memory. From that list
//! the macro generates:
//! - [`Api`], a struct of `unsafe extern "C"` function pointers, one field per symbol
//!   (`Option<..>` for optional entries);
//! - [`ENTRIES`], the list as data (read by the memcap coverage test and by `cargo xtask verify-pin`);
//! - the resolver used by the loader.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::types::*;

/// Whether the loader refuses a driver that lacks an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// A driver without it does not open ([`crate::LoadError::MissingSymbols`]).
    Required,
    /// Absent on older drivers; the field is `None` there.
    Optional,
}

/// Whether an entry allocates device or pinned host memory (what memcap must patch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Allocation {
    Allocates,
    NoAlloc,
}

/// One line of the entry list, as data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntrySpec {
    /// Exact exported symbol name.
    pub name: &'static str,
    pub requirement: Requirement,
    pub allocation: Allocation,
}

macro_rules! entry_field_type {
    (required, ($($ty:ty),*)) => { unsafe extern "C" fn($($ty),*) -> CUresult };
    (optional, ($($ty:ty),*)) => { Option<unsafe extern "C" fn($($ty),*) -> CUresult> };
}

macro_rules! entry_requirement {
    (required) => {
        Requirement::Required
    };
    (optional) => {
        Requirement::Optional
    };
}

macro_rules! entry_allocation {
    (allocates) => {
        Allocation::Allocates
    };
    (no_alloc) => {
        Allocation::NoAlloc
    };
}

macro_rules! entry_resolve {
    (required, $lib:ident, $missing:ident, $name:ident, ($($ty:ty),*)) => {{
        // SAFETY: the symbol's C signature is declared by this list from cuda.h; libloading only
        // reads the address here.
        match unsafe { $lib.get::<unsafe extern "C" fn($($ty),*) -> CUresult>(concat!(stringify!($name), "\0").as_bytes()) } {
            Ok(sym) => Some(*sym),
            Err(_) => {
                $missing.push(stringify!($name));
                None
            }
        }
    }};
    (optional, $lib:ident, $missing:ident, $name:ident, ($($ty:ty),*)) => {{
        // SAFETY: as above; an absent optional symbol is simply `None`.
        let sym = unsafe { $lib.get::<unsafe extern "C" fn($($ty),*) -> CUresult>(concat!(stringify!($name), "\0").as_bytes()) };
        Some(sym.ok().map(|s| *s))
    }};
}

macro_rules! entry_address {
    (required, $f:expr) => {
        Some($f as usize)
    };
    (optional, $f:expr) => {
        $f.map(|f| f as usize)
    };
}

macro_rules! driver_entries {
    ($( $req:ident $alloc:ident $name:ident ( $($ty:ty),* $(,)? ); )*) => {
        /// The driver's entry points, one field per exported symbol under its exact name.
        ///
        /// Fields are plain function pointers: calling one is `unsafe` and must follow cuda.h.
        /// Only `tf-cuda` calls through this table.
        #[derive(Clone, Copy)]
        pub struct Api {
            $( pub $name: entry_field_type!($req, ($($ty),*)), )*
        }

        /// Every entry of the table, in declaration order.
        pub const ENTRIES: &[EntrySpec] = &[
            $( EntrySpec {
                name: stringify!($name),
                requirement: entry_requirement!($req),
                allocation: entry_allocation!($alloc),
            }, )*
        ];

        impl Api {
            /// The address an entry points to now (`None` for an unknown name or an absent
            /// optional entry). Lets tests prove which entries a patch replaced.
            pub fn address_of(&self, name: &str) -> Option<usize> {
                match name {
                    $( stringify!($name) => entry_address!($req, self.$name), )*
                    _ => None,
                }
            }

            /// Resolves every entry from `lib`. On failure returns the names of every missing
            /// required entry (all of them, not only the first).
            pub(crate) fn resolve(lib: &libloading::Library) -> Result<Api, Vec<&'static str>> {
                let mut missing: Vec<&'static str> = Vec::new();
                $( let $name = entry_resolve!($req, lib, missing, $name, ($($ty),*)); )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                match ($($name,)*) {
                    ($(Some($name),)*) => Ok(Api { $($name,)* }),
                    #[allow(unreachable_patterns)]
                    _ => Err(missing),
                }
            }
        }
    };
}

driver_entries! {
    // --- initialisation and devices
    required no_alloc cuInit(c_uint);
    required no_alloc cuDriverGetVersion(*mut c_int);
    required no_alloc cuDeviceGet(*mut CUdevice, c_int);
    required no_alloc cuDeviceGetCount(*mut c_int);
    required no_alloc cuDeviceGetName(*mut c_char, c_int, CUdevice);
    required no_alloc cuDeviceGetAttribute(*mut c_int, c_int, CUdevice);
    required no_alloc cuDeviceTotalMem_v2(*mut usize, CUdevice);
    // --- primary context
    required no_alloc cuDevicePrimaryCtxRetain(*mut CUcontext, CUdevice);
    required no_alloc cuDevicePrimaryCtxRelease_v2(CUdevice);
    required no_alloc cuDevicePrimaryCtxSetFlags_v2(CUdevice, c_uint);
    required no_alloc cuCtxSetCurrent(CUcontext);
    required no_alloc cuCtxGetCurrent(*mut CUcontext);
    required no_alloc cuCtxGetDevice(*mut CUdevice);
    required no_alloc cuCtxSynchronize();
    required no_alloc cuCtxGetStreamPriorityRange(*mut c_int, *mut c_int);
    // --- memory
    required no_alloc cuMemGetInfo_v2(*mut usize, *mut usize);
    required allocates cuMemAlloc_v2(*mut CUdeviceptr, usize);
    required no_alloc cuMemFree_v2(CUdeviceptr);
    required allocates cuMemHostAlloc(*mut *mut c_void, usize, c_uint);
    required no_alloc cuMemHostGetDevicePointer_v2(*mut CUdeviceptr, *mut c_void, c_uint);
    required no_alloc cuMemFreeHost(*mut c_void);
    required allocates cuMemHostRegister_v2(*mut c_void, usize, c_uint);
    required no_alloc cuMemHostUnregister(*mut c_void);
    required no_alloc cuMemcpyHtoD_v2(CUdeviceptr, *const c_void, usize);
    required no_alloc cuMemcpyDtoH_v2(*mut c_void, CUdeviceptr, usize);
    required no_alloc cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, usize);
    required no_alloc cuMemcpyHtoDAsync_v2(CUdeviceptr, *const c_void, usize, CUstream);
    required no_alloc cuMemcpyDtoHAsync_v2(*mut c_void, CUdeviceptr, usize, CUstream);
    required no_alloc cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, usize, CUstream);
    required no_alloc cuMemcpy2DAsync_v2(*const Memcpy2D, CUstream);
    required no_alloc cuMemsetD8_v2(CUdeviceptr, u8, usize);
    required no_alloc cuMemsetD32_v2(CUdeviceptr, c_uint, usize);
    required no_alloc cuMemsetD8Async(CUdeviceptr, u8, usize, CUstream);
    required no_alloc cuMemsetD32Async(CUdeviceptr, c_uint, usize, CUstream);
    // --- streams and events
    required no_alloc cuStreamCreate(*mut CUstream, c_uint);
    required no_alloc cuStreamCreateWithPriority(*mut CUstream, c_uint, c_int);
    required no_alloc cuStreamDestroy_v2(CUstream);
    required no_alloc cuStreamSynchronize(CUstream);
    required no_alloc cuStreamWaitEvent(CUstream, CUevent, c_uint);
    required no_alloc cuStreamQuery(CUstream);
    required no_alloc cuEventCreate(*mut CUevent, c_uint);
    required no_alloc cuEventDestroy_v2(CUevent);
    required no_alloc cuEventRecord(CUevent, CUstream);
    required no_alloc cuEventRecordWithFlags(CUevent, CUstream, c_uint);
    required no_alloc cuEventSynchronize(CUevent);
    required no_alloc cuEventQuery(CUevent);
    required no_alloc cuEventElapsedTime(*mut f32, CUevent, CUevent);
    // --- modules and functions
    required no_alloc cuModuleLoadData(*mut CUmodule, *const c_void);
    required no_alloc cuModuleLoadDataEx(*mut CUmodule, *const c_void, c_uint, *mut c_int, *mut *mut c_void);
    required no_alloc cuModuleUnload(CUmodule);
    required no_alloc cuModuleGetFunction(*mut CUfunction, CUmodule, *const c_char);
    required no_alloc cuModuleGetGlobal_v2(*mut CUdeviceptr, *mut usize, CUmodule, *const c_char);
    required no_alloc cuFuncGetAttribute(*mut c_int, c_int, CUfunction);
    required no_alloc cuFuncSetAttribute(CUfunction, c_int, c_int);
    required no_alloc cuFuncSetCacheConfig(CUfunction, c_int);
    optional no_alloc cuFuncGetName(*mut *const c_char, CUfunction);
    optional no_alloc cuFuncGetParamInfo(CUfunction, usize, *mut usize, *mut usize);
    required no_alloc cuOccupancyMaxActiveBlocksPerMultiprocessor(*mut c_int, CUfunction, c_int, usize);
    // --- launches
    required no_alloc cuLaunchKernel(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void);
    required no_alloc cuLaunchKernelEx(*const LaunchConfig, CUfunction, *mut *mut c_void, *mut *mut c_void);
    // --- graphs
    required no_alloc cuStreamBeginCapture_v2(CUstream, c_int);
    required no_alloc cuStreamEndCapture(CUstream, *mut CUgraph);
    required no_alloc cuStreamIsCapturing(CUstream, *mut c_int);
    required no_alloc cuGraphCreate(*mut CUgraph, c_uint);
    required no_alloc cuGraphDestroy(CUgraph);
    required no_alloc cuGraphAddKernelNode_v2(*mut CUgraphNode, CUgraph, *const CUgraphNode, usize, *const KernelNodeParams);
    required no_alloc cuGraphKernelNodeGetParams_v2(CUgraphNode, *mut KernelNodeParams);
    required no_alloc cuGraphKernelNodeSetParams_v2(CUgraphNode, *const KernelNodeParams);
    required no_alloc cuGraphAddDependencies(CUgraph, *const CUgraphNode, *const CUgraphNode, usize);
    required no_alloc cuGraphGetNodes(CUgraph, *mut CUgraphNode, *mut usize);
    required no_alloc cuGraphInstantiateWithFlags(*mut CUgraphExec, CUgraph, u64);
    required no_alloc cuGraphUpload(CUgraphExec, CUstream);
    required no_alloc cuGraphLaunch(CUgraphExec, CUstream);
    required no_alloc cuGraphExecDestroy(CUgraphExec);
    required no_alloc cuGraphExecUpdate_v2(CUgraphExec, CUgraph, *mut ExecUpdateResultInfo);
    required no_alloc cuGraphExecKernelNodeSetParams_v2(CUgraphExec, CUgraphNode, *const KernelNodeParams);
    // --- error text
    required no_alloc cuGetErrorName(CUresult, *mut *const c_char);
    required no_alloc cuGetErrorString(CUresult, *mut *const c_char);
}

/// Looks up an entry of the list by exact name.
pub fn entry(name: &str) -> Option<&'static EntrySpec> {
    ENTRIES.iter().find(|e| e.name == name)
}

/// The table's allocating entries, in list order.
pub fn allocating_entries() -> impl Iterator<Item = &'static EntrySpec> {
    ENTRIES
        .iter()
        .filter(|e| e.allocation == Allocation::Allocates)
}
