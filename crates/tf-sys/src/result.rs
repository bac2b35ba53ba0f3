//! Result codes: names, short descriptions, and which codes leave the context unusable.
//!
//! The driver names its own codes (`cuGetErrorName`/`cuGetErrorString`), but it cannot answer during
//! process exit or when it failed to initialise, so the standard `CUDA_ERROR_*` names are also kept
//! here as a fallback table.

use crate::types::{code, CUresult};

/// One row of the fallback table: code, standard name, short description.
struct KnownCode {
    code: CUresult,
    name: &'static str,
    description: &'static str,
}

macro_rules! known_codes {
    ($( $code:literal $name:ident $description:literal; )*) => {
        const KNOWN: &[KnownCode] = &[
            $( KnownCode { code: $code, name: stringify!($name), description: $description }, )*
        ];
    };
}

known_codes! {
    0 CUDA_SUCCESS "no error";
    1 CUDA_ERROR_INVALID_VALUE "an argument was out of range or invalid";
    2 CUDA_ERROR_OUT_OF_MEMORY "not enough memory for the request";
    3 CUDA_ERROR_NOT_INITIALIZED "the driver was not initialised (cuInit not called or failed)";
    4 CUDA_ERROR_DEINITIALIZED "the driver is shutting down";
    5 CUDA_ERROR_PROFILER_DISABLED "the profiler is disabled for this run";
    6 CUDA_ERROR_PROFILER_NOT_INITIALIZED "the profiler was not initialised";
    7 CUDA_ERROR_PROFILER_ALREADY_STARTED "the profiler was already started";
    8 CUDA_ERROR_PROFILER_ALREADY_STOPPED "the profiler was already stopped";
    34 CUDA_ERROR_STUB_LIBRARY "the loaded library is a stub, not the real driver";
    46 CUDA_ERROR_DEVICE_UNAVAILABLE "the device is busy or unavailable";
    100 CUDA_ERROR_NO_DEVICE "no CUDA-capable device was found";
    101 CUDA_ERROR_INVALID_DEVICE "the device ordinal is not a valid device";
    102 CUDA_ERROR_DEVICE_NOT_LICENSED "the device lacks a licence for this feature";
    200 CUDA_ERROR_INVALID_IMAGE "the module image is invalid";
    201 CUDA_ERROR_INVALID_CONTEXT "no valid context is current";
    202 CUDA_ERROR_CONTEXT_ALREADY_CURRENT "the context is already current";
    205 CUDA_ERROR_MAP_FAILED "a map operation failed";
    206 CUDA_ERROR_UNMAP_FAILED "an unmap operation failed";
    207 CUDA_ERROR_ARRAY_IS_MAPPED "the array is mapped";
    208 CUDA_ERROR_ALREADY_MAPPED "the resource is already mapped";
    209 CUDA_ERROR_NO_BINARY_FOR_GPU "the image has no code for this GPU";
    210 CUDA_ERROR_ALREADY_ACQUIRED "the resource was already acquired";
    211 CUDA_ERROR_NOT_MAPPED "the resource is not mapped";
    212 CUDA_ERROR_NOT_MAPPED_AS_ARRAY "the resource is not mapped as an array";
    213 CUDA_ERROR_NOT_MAPPED_AS_POINTER "the resource is not mapped as a pointer";
    214 CUDA_ERROR_ECC_UNCORRECTABLE "an uncorrectable ECC error was detected";
    215 CUDA_ERROR_UNSUPPORTED_LIMIT "the limit is not supported by the device";
    216 CUDA_ERROR_CONTEXT_ALREADY_IN_USE "the context is already in use by another thread";
    217 CUDA_ERROR_PEER_ACCESS_UNSUPPORTED "peer access is not supported between these devices";
    218 CUDA_ERROR_INVALID_PTX "PTX JIT compilation failed";
    219 CUDA_ERROR_INVALID_GRAPHICS_CONTEXT "the graphics context is invalid";
    220 CUDA_ERROR_NVLINK_UNCORRECTABLE "an uncorrectable NVLink error was detected";
    221 CUDA_ERROR_JIT_COMPILER_NOT_FOUND "the PTX JIT compiler library was not found";
    222 CUDA_ERROR_UNSUPPORTED_PTX_VERSION "the PTX was made by a newer toolchain than the driver supports";
    223 CUDA_ERROR_JIT_COMPILATION_DISABLED "PTX JIT compilation is disabled";
    224 CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY "the execution affinity is not supported";
    225 CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC "device-side synchronisation is not supported";
    226 CUDA_ERROR_CONTAINED "a device exception was contained by the GPU";
    300 CUDA_ERROR_INVALID_SOURCE "the kernel source is invalid";
    301 CUDA_ERROR_FILE_NOT_FOUND "the file was not found";
    302 CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND "a shared object symbol was not resolved";
    303 CUDA_ERROR_SHARED_OBJECT_INIT_FAILED "a shared object failed to initialise";
    304 CUDA_ERROR_OPERATING_SYSTEM "an operating system call failed";
    400 CUDA_ERROR_INVALID_HANDLE "a handle is invalid";
    401 CUDA_ERROR_ILLEGAL_STATE "the resource is not in a valid state for the call";
    402 CUDA_ERROR_LOSSY_QUERY "the query would lose information";
    500 CUDA_ERROR_NOT_FOUND "a named symbol was not found";
    600 CUDA_ERROR_NOT_READY "the work has not completed yet";
    700 CUDA_ERROR_ILLEGAL_ADDRESS "a kernel accessed an illegal memory address";
    701 CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES "the launch needs more resources than the device has";
    702 CUDA_ERROR_LAUNCH_TIMEOUT "a kernel ran past the watchdog timeout";
    703 CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING "the launch used incompatible texturing";
    704 CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED "peer access is already enabled";
    705 CUDA_ERROR_PEER_ACCESS_NOT_ENABLED "peer access is not enabled";
    708 CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE "the primary context is already active";
    709 CUDA_ERROR_CONTEXT_IS_DESTROYED "the current context was destroyed";
    710 CUDA_ERROR_ASSERT "a device-side assert failed";
    711 CUDA_ERROR_TOO_MANY_PEERS "too many peer devices";
    712 CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED "the host range is already registered";
    713 CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED "the host pointer is not registered";
    714 CUDA_ERROR_HARDWARE_STACK_ERROR "a kernel overflowed the hardware call stack";
    715 CUDA_ERROR_ILLEGAL_INSTRUCTION "a kernel executed an illegal instruction";
    716 CUDA_ERROR_MISALIGNED_ADDRESS "a kernel accessed a misaligned address";
    717 CUDA_ERROR_INVALID_ADDRESS_SPACE "a kernel used an address in the wrong address space";
    718 CUDA_ERROR_INVALID_PC "a kernel's program counter became invalid";
    719 CUDA_ERROR_LAUNCH_FAILED "a kernel raised an exception on the device";
    720 CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE "the cooperative launch has too many blocks";
    800 CUDA_ERROR_NOT_PERMITTED "the operation is not permitted";
    801 CUDA_ERROR_NOT_SUPPORTED "the operation is not supported on this device or system";
    802 CUDA_ERROR_SYSTEM_NOT_READY "the system is not ready (is the fabric manager running?)";
    803 CUDA_ERROR_SYSTEM_DRIVER_MISMATCH "the driver and kernel module versions differ";
    804 CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE "forward compatibility is not supported on this device";
    805 CUDA_ERROR_MPS_CONNECTION_FAILED "connecting to the MPS server failed";
    806 CUDA_ERROR_MPS_RPC_FAILURE "a call to the MPS server failed";
    807 CUDA_ERROR_MPS_SERVER_NOT_READY "the MPS server is not ready";
    808 CUDA_ERROR_MPS_MAX_CLIENTS_REACHED "the MPS server has too many clients";
    809 CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED "the MPS server has too many connections";
    810 CUDA_ERROR_MPS_CLIENT_TERMINATED "the MPS client was terminated";
    811 CUDA_ERROR_CDP_NOT_SUPPORTED "dynamic parallelism is not supported here";
    812 CUDA_ERROR_CDP_VERSION_MISMATCH "dynamic parallelism versions do not match";
    900 CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED "the call is not allowed while a stream is capturing";
    901 CUDA_ERROR_STREAM_CAPTURE_INVALIDATED "the stream capture was invalidated by an earlier error";
    902 CUDA_ERROR_STREAM_CAPTURE_MERGE "two independent captures would merge";
    903 CUDA_ERROR_STREAM_CAPTURE_UNMATCHED "the capture was not started on this stream";
    904 CUDA_ERROR_STREAM_CAPTURE_UNJOINED "the capture forked into a stream that did not join back";
    905 CUDA_ERROR_STREAM_CAPTURE_ISOLATION "the capture would depend on work outside it";
    906 CUDA_ERROR_STREAM_CAPTURE_IMPLICIT "the capture would depend on the legacy default stream";
    907 CUDA_ERROR_CAPTURED_EVENT "the event was recorded in a capture and cannot be used here";
    908 CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD "the capture was ended from another thread";
    909 CUDA_ERROR_TIMEOUT "a wait timed out";
    910 CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE "the executable graph cannot take this update";
    911 CUDA_ERROR_EXTERNAL_DEVICE "an external device signalled an error";
    912 CUDA_ERROR_INVALID_CLUSTER_SIZE "the cluster size is invalid";
    913 CUDA_ERROR_FUNCTION_NOT_LOADED "the function is not loaded";
    914 CUDA_ERROR_INVALID_RESOURCE_TYPE "the resource type is invalid";
    915 CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION "the resource configuration is invalid";
    999 CUDA_ERROR_UNKNOWN "an unknown internal error";
}

/// Name returned when neither the driver nor the fallback table knows a code.
pub const UNKNOWN_CODE_NAME: &str = "CUDA_ERROR_UNKNOWN_CODE";

/// The standard `CUDA_ERROR_*` name of `code`, from the built-in table (no driver needed).
pub fn known_name(code: CUresult) -> Option<&'static str> {
    KNOWN.iter().find(|k| k.code == code).map(|k| k.name)
}

/// A short description of `code` in this crate's words, for when the driver cannot describe it.
pub fn known_description(code: CUresult) -> Option<&'static str> {
    KNOWN.iter().find(|k| k.code == code).map(|k| k.description)
}

/// Every code of the fallback table, ascending.
pub fn known_codes() -> impl Iterator<Item = CUresult> {
    KNOWN.iter().map(|k| k.code)
}

/// An explanation to append to a failure's message: non-empty only for `CUDA_ERROR_DEINITIALIZED`,
/// which the driver answers to every call once the process has begun to exit.
pub fn shutdown_note(result: CUresult) -> &'static str {
    if result == code::DEINITIALIZED {
        " (the CUDA driver is shutting down: the process is exiting)"
    } else {
        ""
    }
}

/// Whether `result` is an execution fault after which the context is unusable ("sticky"): every
/// later call returns an error and only a new process can use the GPU again.
///
/// `CUDA_ERROR_UNKNOWN` (999) is not sticky by itself; `CUDA_ERROR_DEINITIALIZED` (4) is shutdown,
/// not a fault.
pub fn is_sticky(result: CUresult) -> bool {
    match result {
        // 214 ECC_UNCORRECTABLE: the documentation says "an uncorrectable ECC error was detected
        // during execution"; device memory can no longer be trusted, so nothing after it is valid.
        214 => true,
        // 226 CONTAINED: "This leaves the process in an inconsistent state and any further CUDA
        // work will return the same error. To continue using CUDA, the process must be terminated
        // and relaunched."
        226 => true,
        // 700 ILLEGAL_ADDRESS: "This leaves the process in an inconsistent state and any further
        // CUDA work will return the same error."
        700 => true,
        // 702 LAUNCH_TIMEOUT: "This leaves the process in an inconsistent state and any further
        // CUDA work will return the same error."
        702 => true,
        // 710 ASSERT: "The context cannot be used anymore, and must be destroyed. All existing
        // device memory allocations from this context are invalid."
        710 => true,
        // 714 HARDWARE_STACK_ERROR: "This leaves the process in an inconsistent state and any
        // further CUDA work will return the same error."
        714 => true,
        // 715 ILLEGAL_INSTRUCTION: "This leaves the process in an inconsistent state and any
        // further CUDA work will return the same error."
        715 => true,
        // 716 MISALIGNED_ADDRESS: "This leaves the process in an inconsistent state and any
        // further CUDA work will return the same error."
        716 => true,
        // 717 INVALID_ADDRESS_SPACE: "This leaves the process in an inconsistent state and any
        // further CUDA work will return the same error."
        717 => true,
        // 718 INVALID_PC: "This leaves the process in an inconsistent state and any further CUDA
        // work will return the same error."
        718 => true,
        // 719 LAUNCH_FAILED: "An exception occurred on the device while executing a kernel ...
        // This leaves the process in an inconsistent state and any further CUDA work will return
        // the same error."
        719 => true,
        // 911 EXTERNAL_DEVICE: "This leaves the process in an inconsistent state and any further
        // CUDA work will return the same error."
        911 => true,
        _ => false,
    }
}

/// The codes [`is_sticky`] accepts, ascending.
pub const STICKY_CODES: &[CUresult] = &[214, 226, 700, 702, 710, 714, 715, 716, 717, 718, 719, 911];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_key_codes() {
        assert_eq!(known_name(4), Some("CUDA_ERROR_DEINITIALIZED"));
        assert_eq!(known_name(700), Some("CUDA_ERROR_ILLEGAL_ADDRESS"));
        assert_eq!(known_name(2), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(known_name(800), Some("CUDA_ERROR_NOT_PERMITTED"));
        assert_eq!(known_name(999), Some("CUDA_ERROR_UNKNOWN"));
        assert_eq!(known_name(12345), None);
        assert_eq!(known_name(-1), None);
    }

    #[test]
    fn table_is_sorted_unique_and_well_formed() {
        let codes: Vec<CUresult> = known_codes().collect();
        assert!(
            codes.windows(2).all(|w| w[0] < w[1]),
            "codes must ascend: {codes:?}"
        );
        for k in KNOWN {
            assert!(k.name.starts_with("CUDA_"), "{}", k.name);
            assert!(!k.description.is_empty(), "{}", k.name);
        }
    }

    #[test]
    fn shutdown_note_only_for_deinitialized() {
        assert!(shutdown_note(4).contains("process is exiting"));
        assert_eq!(shutdown_note(1), "");
        assert_eq!(shutdown_note(700), "");
    }

    #[test]
    fn sticky_set_matches_the_list() {
        for c in -10..2000 {
            assert_eq!(is_sticky(c), STICKY_CODES.contains(&c), "code {c}");
        }
        assert!(!is_sticky(999), "999 is not sticky by itself");
        assert!(!is_sticky(4), "shutdown is not a fault");
        for c in STICKY_CODES {
            assert!(known_name(*c).is_some(), "sticky code {c} has a name");
        }
    }
}
