//! The NCCL C ABI, declared by hand from the public `nccl.h`: the entry-point table (one declarative list,
//! the single source of truth for names and signatures), the enums' stable values and the config struct.
//!
//! Only what the communicator needs. The tests below pin every value, so an edit cannot drift silently.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclComm_t`: an opaque pointer.
pub type RawComm = *mut c_void;
/// `cudaStream_t`, which is the driver's `CUstream`.
pub type RawStream = *mut c_void;
/// `ncclDataType_t`.
pub type RawDataType = c_int;
/// `ncclRedOp_t`.
pub type RawRedOp = c_int;

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclResult_t` values.
pub mod result {
    use super::NcclResult;
    pub const SUCCESS: NcclResult = 0;
    pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
    pub const SYSTEM_ERROR: NcclResult = 2;
    pub const INTERNAL_ERROR: NcclResult = 3;
    pub const INVALID_ARGUMENT: NcclResult = 4;
    pub const INVALID_USAGE: NcclResult = 5;
    pub const REMOTE_ERROR: NcclResult = 6;
    pub const IN_PROGRESS: NcclResult = 7;
    pub const TIMEOUT: NcclResult = 8;

    /// The header's name for a result, when it is one we know.
    pub fn name(code: NcclResult) -> &'static str {
        match code {
            SUCCESS => "ncclSuccess",
            UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
            SYSTEM_ERROR => "ncclSystemError",
            INTERNAL_ERROR => "ncclInternalError",
            INVALID_ARGUMENT => "ncclInvalidArgument",
            INVALID_USAGE => "ncclInvalidUsage",
            REMOTE_ERROR => "ncclRemoteError",
            IN_PROGRESS => "ncclInProgress",
            TIMEOUT => "ncclTimeout",
            _ => "ncclResult(unknown)",
        }
    }
}

/// `ncclDataType_t` values.
pub mod data_type {
    use super::RawDataType;
    pub const UINT8: RawDataType = 1;
    pub const FLOAT16: RawDataType = 6;
    pub const FLOAT32: RawDataType = 7;
    pub const BFLOAT16: RawDataType = 9;
}

/// `ncclRedOp_t` values.
pub mod red_op {
    use super::RawRedOp;
    pub const SUM: RawRedOp = 0;
    pub const MAX: RawRedOp = 2;
    pub const MIN: RawRedOp = 3;
    pub const AVG: RawRedOp = 4;
}

/// `NCCL_VERSION(x, y, z)` for NCCL 2.9 and later.
pub const fn version_code(major: i32, minor: i32, patch: i32) -> i32 {
    major * 10_000 + minor * 100 + patch
}

/// `NCCL_API_MAGIC`, the config struct's guard value.
pub const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "NCCL picks".
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// The header version whose config layout [`RawConfig`] declares.
pub const CONFIG_VERSION: i32 = version_code(2, 17, 0);

/// `ncclConfig_t` as NCCL 2.17 laid it out. NCCL reads `size` bytes of it (never more than its own struct)
/// and, for fields newer than `version`, keeps its defaults; later releases only append fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RawConfig {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
}

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER` of this layout, with `blocking` set.
    pub fn new(blocking: bool) -> RawConfig {
        RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION as c_uint,
            blocking: c_int::from(blocking),
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

/// Whether the loader refuses a library that lacks an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requirement {
    Required,
    /// The field is `None` when the library lacks it.
    Optional,
}

/// One line of the entry list, as data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntrySpec {
    /// Exact exported symbol name.
    pub name: &'static str,
    pub requirement: Requirement,
}

macro_rules! entry_field_type {
    (required, ($($ty:ty),*), $ret:ty) => { unsafe extern "C" fn($($ty),*) -> $ret };
    (optional, ($($ty:ty),*), $ret:ty) => { Option<unsafe extern "C" fn($($ty),*) -> $ret> };
}

macro_rules! entry_requirement {
    (required) => {
        Requirement::Required
    };
    (optional) => {
        Requirement::Optional
    };
}

macro_rules! entry_resolve {
    (required, $lib:ident, $missing:ident, $name:ident, ($($ty:ty),*), $ret:ty) => {{
        // SAFETY: the symbol's C signature is declared by this list from nccl.h; libloading only reads the
        // address here.
        match unsafe { $lib.get::<unsafe extern "C" fn($($ty),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes()) } {
            Ok(sym) => Some(*sym),
            Err(_) => {
                $missing.push(stringify!($name));
                None
            }
        }
    }};
    (optional, $lib:ident, $missing:ident, $name:ident, ($($ty:ty),*), $ret:ty) => {{
        // SAFETY: as above; an absent optional symbol is simply `None`.
        let sym = unsafe { $lib.get::<unsafe extern "C" fn($($ty),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes()) };
        Some(sym.ok().map(|s| *s))
    }};
}

macro_rules! nccl_entries {
    ($( $req:ident fn $name:ident ( $($ty:ty),* $(,)? ) -> $ret:ty; )*) => {
        /// NCCL's entry points, one field per exported symbol under its exact name. Calling one is `unsafe`
        /// and must follow nccl.h.
        #[derive(Clone, Copy)]
        pub struct NcclApi {
            $( pub $name: entry_field_type!($req, ($($ty),*), $ret), )*
        }

        /// Every entry of the table, in declaration order.
        pub const ENTRIES: &[EntrySpec] = &[
            $( EntrySpec { name: stringify!($name), requirement: entry_requirement!($req) }, )*
        ];

        impl NcclApi {
            /// Resolves every entry from `lib`. On failure returns the names of every missing required entry
            /// (all of them, not only the first).
            pub(crate) fn resolve(lib: &libloading::Library) -> Result<NcclApi, Vec<&'static str>> {
                let mut missing: Vec<&'static str> = Vec::new();
                $( let $name = entry_resolve!($req, lib, missing, $name, ($($ty),*), $ret); )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                match ($($name,)*) {
                    ($(Some($name),)*) => Ok(NcclApi { $($name,)* }),
                    #[allow(unreachable_patterns)]
                    _ => Err(missing),
                }
            }
        }
    };
}

nccl_entries! {
    // --- library
    required fn ncclGetVersion(*mut c_int) -> NcclResult;
    required fn ncclGetErrorString(NcclResult) -> *const c_char;
    optional fn ncclGetLastError(RawComm) -> *const c_char;
    required fn ncclGetUniqueId(*mut RawUniqueId) -> NcclResult;
    // --- communicators (non-blocking through the config)
    required fn ncclCommInitRankConfig(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> NcclResult;
    required fn ncclCommGetAsyncError(RawComm, *mut NcclResult) -> NcclResult;
    required fn ncclCommFinalize(RawComm) -> NcclResult;
    required fn ncclCommDestroy(RawComm) -> NcclResult;
    required fn ncclCommAbort(RawComm) -> NcclResult;
    // --- groups and point to point (the all-to-all)
    required fn ncclGroupStart() -> NcclResult;
    required fn ncclGroupEnd() -> NcclResult;
    required fn ncclSend(*const c_void, usize, RawDataType, c_int, RawComm, RawStream) -> NcclResult;
    required fn ncclRecv(*mut c_void, usize, RawDataType, c_int, RawComm, RawStream) -> NcclResult;
    // --- collectives
    required fn ncclAllGather(*const c_void, *mut c_void, usize, RawDataType, RawComm, RawStream) -> NcclResult;
    required fn ncclAllReduce(*const c_void, *mut c_void, usize, RawDataType, RawRedOp, RawComm, RawStream) -> NcclResult;
    required fn ncclBroadcast(*const c_void, *mut c_void, usize, RawDataType, c_int, RawComm, RawStream) -> NcclResult;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_are_pinned() {
        assert_eq!(result::IN_PROGRESS, 7);
        assert_eq!(result::REMOTE_ERROR, 6);
        assert_eq!(result::TIMEOUT, 8);
        assert_eq!(result::name(7), "ncclInProgress");
        assert_eq!(result::name(99), "ncclResult(unknown)");
        assert_eq!(
            (
                data_type::UINT8,
                data_type::FLOAT16,
                data_type::FLOAT32,
                data_type::BFLOAT16
            ),
            (1, 6, 7, 9)
        );
        assert_eq!(
            (red_op::SUM, red_op::MAX, red_op::MIN, red_op::AVG),
            (0, 2, 3, 4)
        );
        assert_eq!(version_code(2, 17, 0), 21700);
        assert_eq!(version_code(2, 28, 3), 22803);
        assert_eq!(CONFIG_MAGIC, 0xcafebeef);
        assert_eq!(std::mem::size_of::<RawUniqueId>(), 128);
    }

    #[test]
    fn the_config_has_the_2_17_layout() {
        use std::mem::offset_of;
        assert_eq!(offset_of!(RawConfig, magic), 8);
        assert_eq!(offset_of!(RawConfig, version), 12);
        assert_eq!(offset_of!(RawConfig, blocking), 16);
        assert_eq!(offset_of!(RawConfig, max_ctas), 28);
        assert_eq!(offset_of!(RawConfig, net_name), 32);
        let c = RawConfig::new(false);
        assert_eq!(c.size, 40);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.min_ctas, CONFIG_UNDEF_INT);
    }

    #[test]
    fn the_entry_list_names_each_entry_once() {
        let mut names: Vec<&str> = ENTRIES.iter().map(|e| e.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ENTRIES.len());
        assert!(names.iter().all(|n| n.starts_with("nccl")));
        // NVLink multicast is never set up by this crate: no multicast or NVLS entry is declared.
        assert!(names.iter().all(|n| !n.contains("Multicast")));
    }
}
