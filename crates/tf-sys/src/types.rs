//! Scalar, handle and struct types of the CUDA driver ABI (CUDA 12.0+), declared by hand.
//!
//! Every struct passed to the driver has its size and key field offsets asserted at compile
//! time, so a layout mistake fails the build instead of corrupting a launch.

use std::ffi::{c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};

/// Raw `CUresult` as the driver returns it.
pub type CUresult = c_int;
/// `CUdevice`: a device ordinal handle.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CUdeviceptr = u64;

macro_rules! opaque_handles {
    ($($(#[$m:meta])* $name:ident),* $(,)?) => {$(
        $(#[$m])*
        pub type $name = *mut c_void;
    )*};
}
opaque_handles!(
    /// `CUcontext`
    CUcontext,
    /// `CUmodule`
    CUmodule,
    /// `CUfunction`
    CUfunction,
    /// `CUstream`
    CUstream,
    /// `CUevent`
    CUevent,
    /// `CUgraph`
    CUgraph,
    /// `CUgraphNode`
    CUgraphNode,
    /// `CUgraphExec`
    CUgraphExec,
    /// `CUkernel`
    CUkernel,
);

/// Result codes the runtime names directly.
pub mod code {
    use super::CUresult;
    pub const SUCCESS: CUresult = 0;
    pub const INVALID_VALUE: CUresult = 1;
    pub const OUT_OF_MEMORY: CUresult = 2;
    pub const NOT_INITIALIZED: CUresult = 3;
    pub const DEINITIALIZED: CUresult = 4;
    pub const NO_DEVICE: CUresult = 100;
    pub const INVALID_DEVICE: CUresult = 101;
    pub const INVALID_IMAGE: CUresult = 200;
    pub const INVALID_CONTEXT: CUresult = 201;
    pub const NO_BINARY_FOR_GPU: CUresult = 209;
    pub const INVALID_PTX: CUresult = 218;
    pub const INVALID_HANDLE: CUresult = 400;
    pub const NOT_FOUND: CUresult = 500;
    pub const NOT_READY: CUresult = 600;
    pub const ILLEGAL_ADDRESS: CUresult = 700;
    pub const LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
    pub const LAUNCH_TIMEOUT: CUresult = 702;
    pub const CONTEXT_IS_DESTROYED: CUresult = 709;
    pub const ASSERT: CUresult = 710;
    pub const HARDWARE_STACK_ERROR: CUresult = 714;
    pub const ILLEGAL_INSTRUCTION: CUresult = 715;
    pub const MISALIGNED_ADDRESS: CUresult = 716;
    pub const INVALID_ADDRESS_SPACE: CUresult = 717;
    pub const INVALID_PC: CUresult = 718;
    pub const LAUNCH_FAILED: CUresult = 719;
    pub const NOT_PERMITTED: CUresult = 800;
    pub const NOT_SUPPORTED: CUresult = 801;
    pub const STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
    pub const STREAM_CAPTURE_INVALIDATED: CUresult = 901;
    pub const STREAM_CAPTURE_UNMATCHED: CUresult = 903;
    pub const STREAM_CAPTURE_UNJOINED: CUresult = 904;
    pub const STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
    pub const UNKNOWN: CUresult = 999;
}

/// Flag and attribute constants.
pub mod flags {
    use std::ffi::{c_int, c_uint};
    pub const STREAM_DEFAULT: c_uint = 0;
    pub const STREAM_NON_BLOCKING: c_uint = 1;
    pub const EVENT_DEFAULT: c_uint = 0;
    pub const EVENT_BLOCKING_SYNC: c_uint = 1;
    pub const EVENT_DISABLE_TIMING: c_uint = 2;
    /// `CU_EVENT_RECORD_EXTERNAL`
    pub const EVENT_RECORD_EXTERNAL: c_uint = 1;
    pub const HOST_ALLOC_PORTABLE: c_uint = 1;
    pub const HOST_ALLOC_DEVICEMAP: c_uint = 2;
    pub const HOST_REGISTER_PORTABLE: c_uint = 1;
    pub const HOST_REGISTER_DEVICEMAP: c_uint = 2;
    pub const HOST_REGISTER_IOMEMORY: c_uint = 4;
    pub const CTX_SCHED_AUTO: c_uint = 0;
    pub const CTX_SCHED_SPIN: c_uint = 1;
    pub const CTX_SCHED_YIELD: c_uint = 2;
    pub const CTX_SCHED_BLOCKING_SYNC: c_uint = 4;
    pub const FUNC_CACHE_PREFER_SHARED: c_int = 1;
    pub const JIT_INFO_LOG_BUFFER: c_int = 3;
    pub const JIT_INFO_LOG_BUFFER_SIZE_BYTES: c_int = 4;
    pub const JIT_ERROR_LOG_BUFFER: c_int = 5;
    pub const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;
    pub const MEMORYTYPE_HOST: c_uint = 1;
    pub const MEMORYTYPE_DEVICE: c_uint = 2;
    pub const MEMORYTYPE_ARRAY: c_uint = 3;
    pub const MEMORYTYPE_UNIFIED: c_uint = 4;
}

/// `CUstreamCaptureMode`
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    Global = 0,
    ThreadLocal = 1,
    Relaxed = 2,
}

/// `CUstreamCaptureStatus` values (the driver may grow more; kept as a raw int in calls).
pub mod capture_status {
    use std::ffi::c_int;
    pub const NONE: c_int = 0;
    pub const ACTIVE: c_int = 1;
    pub const INVALIDATED: c_int = 2;
}

/// `CUdevice_attribute` values used by the runtime.
pub mod device_attribute {
    use std::ffi::c_int;
    pub const MAX_THREADS_PER_BLOCK: c_int = 1;
    pub const WARP_SIZE: c_int = 10;
    pub const CLOCK_RATE: c_int = 13;
    pub const MULTIPROCESSOR_COUNT: c_int = 16;
    pub const INTEGRATED: c_int = 18;
    pub const PCI_BUS_ID: c_int = 33;
    pub const PCI_DEVICE_ID: c_int = 34;
    pub const L2_CACHE_SIZE: c_int = 38;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
    pub const PCI_DOMAIN_ID: c_int = 50;
    pub const COMPUTE_CAPABILITY_MAJOR: c_int = 75;
    pub const COMPUTE_CAPABILITY_MINOR: c_int = 76;
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: c_int = 81;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
    pub const VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
    /// CUDA assigns 110 to RDMA-with-VMM support (126 is the memory sync domain count).
    pub const GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 110;
}

/// `CUfunction_attribute` values used by the runtime.
pub mod function_attribute {
    use std::ffi::c_int;
    pub const MAX_THREADS_PER_BLOCK: c_int = 0;
    pub const SHARED_SIZE_BYTES: c_int = 1;
    pub const CONST_SIZE_BYTES: c_int = 2;
    pub const LOCAL_SIZE_BYTES: c_int = 3;
    pub const NUM_REGS: c_int = 4;
    pub const PTX_VERSION: c_int = 5;
    pub const BINARY_VERSION: c_int = 6;
    pub const MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
    pub const NON_PORTABLE_CLUSTER_SIZE_ALLOWED: c_int = 14;
}

/// `CUlaunchAttributeID` values.
pub mod launch_attribute {
    use std::ffi::c_uint;
    pub const COOPERATIVE: c_uint = 2;
    pub const CLUSTER_DIMENSION: c_uint = 4;
    pub const CLUSTER_SCHEDULING_POLICY_PREFERENCE: c_uint = 5;
    pub const PROGRAMMATIC_STREAM_SERIALIZATION: c_uint = 6;
    pub const PRIORITY: c_uint = 8;
}

/// `CUgraphExecUpdateResult` values.
pub mod exec_update_result {
    use std::ffi::c_uint;
    pub const SUCCESS: c_uint = 0;
    pub const ERROR: c_uint = 1;
    pub const TOPOLOGY_CHANGED: c_uint = 2;
    pub const NODE_TYPE_CHANGED: c_uint = 3;
    pub const FUNCTION_CHANGED: c_uint = 4;
    pub const PARAMETERS_CHANGED: c_uint = 5;
    pub const NOT_SUPPORTED: c_uint = 6;
    pub const UNSUPPORTED_FUNCTION_CHANGE: c_uint = 7;
    pub const ATTRIBUTES_CHANGED: c_uint = 8;
}

/// Cluster dimensions inside a launch attribute value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterDim {
    pub x: c_uint,
    pub y: c_uint,
    pub z: c_uint,
}

/// `CUlaunchAttributeValue`: a 64-byte union.
#[repr(C)]
#[derive(Clone, Copy)]
pub union LaunchAttributeValue {
    pub pad: [u8; 64],
    pub align8: *mut c_void,
    pub int: c_int,
    pub cluster_dim: ClusterDim,
}

/// `CUlaunchAttribute`
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LaunchAttribute {
    pub id: c_uint,
    pub pad: [u8; 4],
    pub value: LaunchAttributeValue,
}

/// `CUlaunchConfig`
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LaunchConfig {
    pub grid_x: c_uint,
    pub grid_y: c_uint,
    pub grid_z: c_uint,
    pub block_x: c_uint,
    pub block_y: c_uint,
    pub block_z: c_uint,
    pub shared_bytes: c_uint,
    pub stream: CUstream,
    pub attrs: *mut LaunchAttribute,
    pub num_attrs: c_uint,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2`
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KernelNodeParams {
    pub func: CUfunction,
    pub grid_x: c_uint,
    pub grid_y: c_uint,
    pub grid_z: c_uint,
    pub block_x: c_uint,
    pub block_y: c_uint,
    pub block_z: c_uint,
    pub shared_bytes: c_uint,
    pub params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub kern: CUkernel,
    pub ctx: CUcontext,
}

/// `CUgraphExecUpdateResultInfo`
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExecUpdateResultInfo {
    pub result: c_uint,
    pub error_node: CUgraphNode,
    pub error_from_node: CUgraphNode,
}

/// `CUDA_MEMCPY2D_v2`
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Memcpy2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: CUdeviceptr,
    pub src_array: *mut c_void,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: CUdeviceptr,
    pub dst_array: *mut c_void,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}

impl Memcpy2D {
    /// A zeroed descriptor (all addresses null, all sizes zero).
    pub const fn zeroed() -> Self {
        Memcpy2D {
            src_x_in_bytes: 0,
            src_y: 0,
            src_memory_type: 0,
            src_host: std::ptr::null(),
            src_device: 0,
            src_array: std::ptr::null_mut(),
            src_pitch: 0,
            dst_x_in_bytes: 0,
            dst_y: 0,
            dst_memory_type: 0,
            dst_host: std::ptr::null_mut(),
            dst_device: 0,
            dst_array: std::ptr::null_mut(),
            dst_pitch: 0,
            width_in_bytes: 0,
            height: 0,
        }
    }
}

// Layouts as the driver's headers define them (x86-64 / aarch64, 64-bit pointers).
const _: () = assert!(size_of::<LaunchAttributeValue>() == 64);
const _: () = assert!(size_of::<LaunchAttribute>() == 72);
const _: () = assert!(offset_of!(LaunchAttribute, value) == 8);
const _: () = assert!(size_of::<LaunchConfig>() == 56);
const _: () = assert!(offset_of!(LaunchConfig, stream) == 32);
const _: () = assert!(offset_of!(LaunchConfig, attrs) == 40);
const _: () = assert!(offset_of!(LaunchConfig, num_attrs) == 48);
const _: () = assert!(size_of::<KernelNodeParams>() == 72);
const _: () = assert!(offset_of!(KernelNodeParams, shared_bytes) == 32);
const _: () = assert!(offset_of!(KernelNodeParams, params) == 40);
const _: () = assert!(offset_of!(KernelNodeParams, kern) == 56);
const _: () = assert!(offset_of!(KernelNodeParams, ctx) == 64);
const _: () = assert!(size_of::<ExecUpdateResultInfo>() == 24);
const _: () = assert!(size_of::<Memcpy2D>() == 128);
const _: () = assert!(offset_of!(Memcpy2D, src_host) == 24);
const _: () = assert!(offset_of!(Memcpy2D, src_pitch) == 48);
const _: () = assert!(offset_of!(Memcpy2D, dst_memory_type) == 72);
const _: () = assert!(offset_of!(Memcpy2D, dst_device) == 88);
const _: () = assert!(offset_of!(Memcpy2D, width_in_bytes) == 112);
