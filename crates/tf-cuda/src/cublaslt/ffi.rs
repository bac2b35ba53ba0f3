//! The cuBLASLt C ABI, declared by hand from the public `cublasLt.h` / `library_types.h`.
//!
//! Only what the GEMM path needs. Every enum value used here is a stable value of the public
//! headers (CUDA 12.0 through 13.x); the tests below pin them so an edit cannot drift silently.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_void};
use std::mem::size_of;

use tf_sys::CUstream;

/// `cublasStatus_t`.
pub type Status = c_int;
/// `cublasLtHandle_t`.
pub type LtHandle = *mut c_void;
/// `cublasLtMatmulDesc_t`.
pub type MatmulDesc = *mut c_void;
/// `cublasLtMatrixLayout_t`.
pub type MatrixLayout = *mut c_void;
/// `cublasLtMatmulPreference_t`.
pub type MatmulPreference = *mut c_void;

/// `cublasStatus_t` values.
pub mod status {
    use super::Status;
    pub const SUCCESS: Status = 0;
    pub const NOT_INITIALIZED: Status = 1;
    pub const ALLOC_FAILED: Status = 3;
    pub const INVALID_VALUE: Status = 7;
    pub const ARCH_MISMATCH: Status = 8;
    pub const MAPPING_ERROR: Status = 11;
    pub const EXECUTION_FAILED: Status = 13;
    pub const INTERNAL_ERROR: Status = 14;
    pub const NOT_SUPPORTED: Status = 15;
    pub const LICENSE_ERROR: Status = 16;

    /// The header's name for a status, when it is one we know.
    pub fn name(code: Status) -> &'static str {
        match code {
            SUCCESS => "CUBLAS_STATUS_SUCCESS",
            NOT_INITIALIZED => "CUBLAS_STATUS_NOT_INITIALIZED",
            ALLOC_FAILED => "CUBLAS_STATUS_ALLOC_FAILED",
            INVALID_VALUE => "CUBLAS_STATUS_INVALID_VALUE",
            ARCH_MISMATCH => "CUBLAS_STATUS_ARCH_MISMATCH",
            MAPPING_ERROR => "CUBLAS_STATUS_MAPPING_ERROR",
            EXECUTION_FAILED => "CUBLAS_STATUS_EXECUTION_FAILED",
            INTERNAL_ERROR => "CUBLAS_STATUS_INTERNAL_ERROR",
            NOT_SUPPORTED => "CUBLAS_STATUS_NOT_SUPPORTED",
            LICENSE_ERROR => "CUBLAS_STATUS_LICENSE_ERROR",
            _ => "CUBLAS_STATUS_(unknown)",
        }
    }
}

/// `cudaDataType_t` values.
pub mod data_type {
    use std::ffi::c_int;
    pub const R_32F: c_int = 0;
    pub const R_16F: c_int = 2;
    pub const R_16BF: c_int = 14;
    pub const R_8F_E4M3: c_int = 28;
    pub const R_8F_E5M2: c_int = 29;
    pub const R_8I: c_int = 3;
    pub const R_32I: c_int = 10;
}

/// `cublasComputeType_t` values.
pub mod compute_type {
    use std::ffi::c_int;
    pub const COMPUTE_32F: c_int = 68;
    pub const COMPUTE_32I: c_int = 72;
}

/// `cublasOperation_t` values.
pub mod operation {
    use std::ffi::c_int;
    pub const N: c_int = 0;
    pub const T: c_int = 1;
}

/// `cublasLtMatmulDescAttributes_t` values (the attribute's C type in the comment).
pub mod desc_attr {
    use std::ffi::c_int;
    /// int32 (`cublasLtPointerMode_t`)
    pub const POINTER_MODE: c_int = 2;
    /// int32 (`cublasOperation_t`)
    pub const TRANSA: c_int = 3;
    /// int32 (`cublasOperation_t`)
    pub const TRANSB: c_int = 4;
    /// uint32 (`cublasLtEpilogue_t`)
    pub const EPILOGUE: c_int = 7;
    /// const void* (device)
    pub const BIAS_POINTER: c_int = 8;
    /// const void* (device, f32)
    pub const A_SCALE_POINTER: c_int = 17;
    /// const void* (device, f32)
    pub const B_SCALE_POINTER: c_int = 18;
    /// int8
    pub const FAST_ACCUM: c_int = 25;
    /// int32 (`cudaDataType_t`)
    pub const BIAS_DATA_TYPE: c_int = 26;
    /// int32 (`cublasLtMatmulMatrixScale_t`), cuBLASLt 12.8 and newer
    pub const A_SCALE_MODE: c_int = 31;
    /// int32 (`cublasLtMatmulMatrixScale_t`), cuBLASLt 12.8 and newer
    pub const B_SCALE_MODE: c_int = 32;
}

/// `cublasLtPointerMode_t` values: where alpha and beta are read from.
pub mod pointer_mode {
    /// alpha is a device vector of one f32 per row of `D`; beta is zero and not read.
    pub const ALPHA_DEVICE_VECTOR_BETA_ZERO: i32 = 3;
}

/// `cublasLtMatmulMatrixScale_t` values: how an operand's scale pointer is read.
pub mod scale_mode {
    /// One f32 for the whole matrix (the default).
    pub const SCALAR_32F: i32 = 0;
    /// One f32 per row of `op(A)` (length `m`) or per column of `op(B)` (length `n`); sm_90, 12.9+.
    pub const OUTER_VEC_32F: i32 = 3;
    /// One f32 per 128 consecutive elements along K; sm_90, 12.9+ (not used here yet).
    pub const VEC128_32F: i32 = 4;
    /// One f32 per 128x128 block; sm_90, 12.9+ (not used here yet).
    pub const BLK128X128_32F: i32 = 5;
}

/// `cublasLtMatrixLayoutAttribute_t` values.
pub mod layout_attr {
    use std::ffi::c_int;
    /// int32 (`cublasLtOrder_t`)
    pub const ORDER: c_int = 1;
}

/// `cublasLtOrder_t` values.
pub mod order {
    use std::ffi::c_int;
    pub const COL: c_int = 0;
    pub const ROW: c_int = 1;
}

/// `cublasLtMatmulPreferenceAttributes_t` values.
pub mod pref_attr {
    use std::ffi::c_int;
    /// uint64
    pub const MAX_WORKSPACE_BYTES: c_int = 1;
    /// uint32
    pub const MIN_ALIGNMENT_A_BYTES: c_int = 5;
    /// uint32
    pub const MIN_ALIGNMENT_B_BYTES: c_int = 6;
    /// uint32
    pub const MIN_ALIGNMENT_C_BYTES: c_int = 7;
    /// uint32
    pub const MIN_ALIGNMENT_D_BYTES: c_int = 8;
}

/// `cublasLtEpilogue_t` values.
pub mod epilogue {
    pub const DEFAULT: u32 = 1;
    pub const BIAS: u32 = 4;
    pub const GELU: u32 = 32;
    pub const GELU_BIAS: u32 = 36;
}

/// `cublasLtMatmulAlgo_t`: an opaque 64-byte value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatmulAlgo {
    pub data: [u64; 8],
}

/// `cublasLtMatmulHeuristicResult_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeuristicResult {
    pub algo: MatmulAlgo,
    pub workspace_size: usize,
    pub state: Status,
    pub waves_count: f32,
    pub reserved: [c_int; 4],
}

const _: () = assert!(size_of::<MatmulAlgo>() == 64);
const _: () = assert!(size_of::<HeuristicResult>() == 96);
const _: () = assert!(std::mem::offset_of!(HeuristicResult, workspace_size) == 64);
const _: () = assert!(std::mem::offset_of!(HeuristicResult, state) == 72);

macro_rules! lt_entries {
    ($( $name:ident : fn( $($arg:ty),* ) -> $ret:ty ; )*) => {
        /// The cuBLASLt entry points the GEMM path calls, one field per exported symbol.
        #[derive(Clone, Copy)]
        pub struct LtApi {
            $( pub $name: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        /// Every symbol [`LtApi`] resolves, in declaration order.
        pub const LT_SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl LtApi {
            /// Resolves every entry; on failure, the names of all missing symbols.
            pub fn resolve(lib: &libloading::Library) -> Result<LtApi, Vec<&'static str>> {
                let mut missing: Vec<&'static str> = Vec::new();
                $(
                    // SAFETY: the signature is the one `cublasLt.h` declares for this symbol;
                    // libloading only reads the address here.
                    let $name = match unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(
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
                    ($(Some($name),)*) => Ok(LtApi { $($name,)* }),
                    _ => Err(missing),
                }
            }
        }
    };
}

lt_entries! {
    cublasLtGetVersion: fn() -> usize;
    cublasLtGetStatusString: fn(Status) -> *const c_char;
    cublasLtCreate: fn(*mut LtHandle) -> Status;
    cublasLtDestroy: fn(LtHandle) -> Status;
    cublasLtMatmulDescCreate: fn(*mut MatmulDesc, c_int, c_int) -> Status;
    cublasLtMatmulDescSetAttribute: fn(MatmulDesc, c_int, *const c_void, usize) -> Status;
    cublasLtMatmulDescDestroy: fn(MatmulDesc) -> Status;
    cublasLtMatrixLayoutCreate: fn(*mut MatrixLayout, c_int, u64, u64, i64) -> Status;
    cublasLtMatrixLayoutSetAttribute: fn(MatrixLayout, c_int, *const c_void, usize) -> Status;
    cublasLtMatrixLayoutDestroy: fn(MatrixLayout) -> Status;
    cublasLtMatmulPreferenceCreate: fn(*mut MatmulPreference) -> Status;
    cublasLtMatmulPreferenceSetAttribute: fn(MatmulPreference, c_int, *const c_void, usize) -> Status;
    cublasLtMatmulPreferenceDestroy: fn(MatmulPreference) -> Status;
    cublasLtMatmulAlgoGetHeuristic: fn(
        LtHandle, MatmulDesc, MatrixLayout, MatrixLayout, MatrixLayout, MatrixLayout,
        MatmulPreference, c_int, *mut HeuristicResult, *mut c_int
    ) -> Status;
    cublasLtMatmul: fn(
        LtHandle, MatmulDesc, *const c_void, *const c_void, MatrixLayout, *const c_void,
        MatrixLayout, *const c_void, *const c_void, MatrixLayout, *mut c_void, MatrixLayout,
        *const MatmulAlgo, *mut c_void, usize, CUstream
    ) -> Status;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_values_match_the_public_headers() {
        assert_eq!(
            (desc_attr::TRANSA, desc_attr::TRANSB, desc_attr::EPILOGUE),
            (3, 4, 7)
        );
        assert_eq!(desc_attr::BIAS_POINTER, 8);
        assert_eq!(
            (desc_attr::A_SCALE_POINTER, desc_attr::B_SCALE_POINTER),
            (17, 18)
        );
        assert_eq!((desc_attr::FAST_ACCUM, desc_attr::BIAS_DATA_TYPE), (25, 26));
        assert_eq!((desc_attr::A_SCALE_MODE, desc_attr::B_SCALE_MODE), (31, 32));
        assert_eq!(
            (
                scale_mode::SCALAR_32F,
                scale_mode::OUTER_VEC_32F,
                scale_mode::VEC128_32F,
                scale_mode::BLK128X128_32F
            ),
            (0, 3, 4, 5)
        );
        assert_eq!(
            (data_type::R_32F, data_type::R_16F, data_type::R_16BF),
            (0, 2, 14)
        );
        assert_eq!((data_type::R_8F_E4M3, data_type::R_8F_E5M2), (28, 29));
        assert_eq!(compute_type::COMPUTE_32F, 68);
        assert_eq!((operation::N, operation::T), (0, 1));
        assert_eq!(
            (
                epilogue::DEFAULT,
                epilogue::BIAS,
                epilogue::GELU,
                epilogue::GELU_BIAS
            ),
            (1, 4, 32, 36)
        );
        // GELU_BIAS is GELU with the bias bit set.
        assert_eq!(epilogue::GELU | epilogue::BIAS, epilogue::GELU_BIAS);
        assert_eq!(pref_attr::MAX_WORKSPACE_BYTES, 1);
        assert_eq!(
            (
                pref_attr::MIN_ALIGNMENT_A_BYTES,
                pref_attr::MIN_ALIGNMENT_B_BYTES,
                pref_attr::MIN_ALIGNMENT_C_BYTES,
                pref_attr::MIN_ALIGNMENT_D_BYTES
            ),
            (5, 6, 7, 8)
        );
        assert_eq!((layout_attr::ORDER, order::COL, order::ROW), (1, 0, 1));
    }

    #[test]
    fn symbol_list_names_every_entry_once() {
        let mut names = LT_SYMBOLS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), LT_SYMBOLS.len());
        assert!(LT_SYMBOLS.contains(&"cublasLtMatmul"));
        assert!(LT_SYMBOLS.iter().all(|n| n.starts_with("cublasLt")));
    }

    #[test]
    fn status_names() {
        assert_eq!(
            status::name(status::NOT_SUPPORTED),
            "CUBLAS_STATUS_NOT_SUPPORTED"
        );
        assert_eq!(status::name(12345), "CUBLAS_STATUS_(unknown)");
    }
}
