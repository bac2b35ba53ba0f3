//! Kernel launch geometry, argument packing at C alignment, and validation before the driver.
//!
//! [`Args`] stores each argument by value at its natural alignment, the way a C compiler lays
//! out the kernel's parameter list, and hands the driver one pointer per argument. Offsets are
//! recorded so tests (and the optional `cuFuncGetParamInfo` check) can compare them.
//! [`LaunchConfig::validate`] refuses impossible geometry before any driver call, so a bad
//! launch fails with a message instead of a driver code.

use std::ffi::c_void;
use std::fmt;
use std::mem::{align_of, size_of, MaybeUninit};

use crate::error::Error;

/// Largest x dimension of a grid (2^31 - 1).
pub const MAX_GRID_X: u32 = i32::MAX as u32;
/// Largest y and z dimensions of a grid.
pub const MAX_GRID_YZ: u32 = 65_535;
/// Largest x and y dimensions of a block.
pub const MAX_BLOCK_XY: u32 = 1024;
/// Largest z dimension of a block.
pub const MAX_BLOCK_Z: u32 = 64;
/// Most threads in one block on every supported GPU.
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// Dynamic shared memory a kernel may use without opting in.
pub const DEFAULT_DYNAMIC_SHARED_LIMIT: u32 = 48 * 1024;
/// Most bytes of kernel arguments a launch may pass (CUDA 12.1+ on Volta and newer).
pub const MAX_ARG_BYTES: usize = 32_764;
/// Strictest argument alignment supported (the largest C scalar/vector alignment).
pub const MAX_ARG_ALIGN: usize = 16;

/// Three dimensions of a grid or a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl Dim3 {
    /// `(x, y, z)`.
    pub const fn new(x: u32, y: u32, z: u32) -> Self {
        Dim3 { x, y, z }
    }

    /// `(x, 1, 1)`.
    pub const fn x(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }

    /// The product of the three dimensions, without overflow.
    pub fn volume(&self) -> u64 {
        u64::from(self.x) * u64::from(self.y) * u64::from(self.z)
    }
}

impl Default for Dim3 {
    fn default() -> Self {
        Dim3::new(1, 1, 1)
    }
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3::x(x)
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Dim3::new(x, y, 1)
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3::new(x, y, z)
    }
}

impl fmt::Display for Dim3 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}x{}", self.x, self.y, self.z)
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    pub grid: Dim3,
    pub block: Dim3,
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A launch of `grid` blocks of `block` threads and no dynamic shared memory.
    pub fn new(grid: impl Into<Dim3>, block: impl Into<Dim3>) -> Self {
        LaunchConfig {
            grid: grid.into(),
            block: block.into(),
            shared_bytes: 0,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> Self {
        self.shared_bytes = bytes;
        self
    }

    /// Enough blocks of `threads` threads to cover `n` items along x.
    pub fn for_items(n: u32, threads: u32) -> Self {
        let threads = threads.max(1);
        LaunchConfig::new(n.div_ceil(threads).max(1), threads)
    }

    /// Checks the geometry against the hardware limits and `shared_limit` (the kernel's dynamic
    /// shared memory limit: 48 KiB, or what it opted in to).
    pub fn validate(&self, shared_limit: u32) -> Result<(), Error> {
        let g = self.grid;
        let b = self.block;
        if g.x == 0 || g.y == 0 || g.z == 0 {
            return Err(Error::invalid(format!(
                "launch grid {g} has a zero dimension: every dimension must be at least 1"
            )));
        }
        if g.x > MAX_GRID_X || g.y > MAX_GRID_YZ || g.z > MAX_GRID_YZ {
            return Err(Error::invalid(format!(
                "launch grid {g} exceeds the limits {MAX_GRID_X}x{MAX_GRID_YZ}x{MAX_GRID_YZ}: \
                 split the work over more launches or fold dimensions into x"
            )));
        }
        if b.x == 0 || b.y == 0 || b.z == 0 {
            return Err(Error::invalid(format!(
                "launch block {b} has a zero dimension: every dimension must be at least 1"
            )));
        }
        if b.x > MAX_BLOCK_XY || b.y > MAX_BLOCK_XY || b.z > MAX_BLOCK_Z {
            return Err(Error::invalid(format!(
                "launch block {b} exceeds the limits {MAX_BLOCK_XY}x{MAX_BLOCK_XY}x{MAX_BLOCK_Z}"
            )));
        }
        if b.volume() > u64::from(MAX_THREADS_PER_BLOCK) {
            return Err(Error::invalid(format!(
                "launch block {b} has {} threads; a block holds at most {MAX_THREADS_PER_BLOCK}",
                b.volume()
            )));
        }
        if self.shared_bytes > shared_limit {
            return Err(Error::invalid(format!(
                "launch asks for {} B of dynamic shared memory but the kernel allows {shared_limit} B: \
                 call Function::set_max_dynamic_shared first (up to the device's opt-in limit)",
                self.shared_bytes
            )));
        }
        Ok(())
    }
}

/// Threads per block for a row-wise kernel over rows of `row_len` elements: one thread per
/// element rounded up to a whole warp, at least one warp and at most 1024.
pub fn row_threads(row_len: usize) -> u32 {
    let warps = row_len
        .div_ceil(32)
        .clamp(1, (MAX_THREADS_PER_BLOCK / 32) as usize);
    // `warps` is at most 32, so the product fits.
    (warps * 32) as u32
}

/// The launch description used in failure text:
/// `kernel NAME, grid XxYxZ, block XxYxZ, shared N B`.
pub fn describe(kernel: &str, cfg: &LaunchConfig) -> String {
    format!(
        "kernel {kernel}, grid {}, block {}, shared {} B",
        cfg.grid, cfg.block, cfg.shared_bytes
    )
}

/// A value a kernel may take as an argument, copied by value.
///
/// # Safety
/// The type must have the same size, alignment and layout as the kernel's C parameter type:
/// a plain scalar, or a `#[repr(C)]` struct/array of such, with no pointers to Rust-owned memory
/// that could dangle, and alignment at most [`MAX_ARG_ALIGN`].
pub unsafe trait KernelArg: Copy + 'static {}

/// A plain value whose bytes can be read back as any bit pattern (no padding, no invalid
/// values): what device buffers can be viewed as.
///
/// # Safety
/// Every bit pattern of `size_of::<T>()` bytes must be a valid `T`, and the type has no padding.
pub unsafe trait Pod: KernelArg {}

macro_rules! pod_scalars {
    ($($t:ty),*) => {$(
        // SAFETY: primitive scalars: C layout, any bit pattern valid, no padding.
        unsafe impl KernelArg for $t {}
        // SAFETY: as above.
        unsafe impl Pod for $t {}
    )*};
}
pod_scalars!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, usize, isize);

// SAFETY: `bool` is one byte with C `_Bool` layout; it is an argument, never read back as Pod.
unsafe impl KernelArg for bool {}
// SAFETY: an array of kernel arguments has C array layout.
unsafe impl<T: KernelArg, const N: usize> KernelArg for [T; N] {}
// SAFETY: an array of Pod values is Pod (no padding between elements of a padding-free type).
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

/// Kernel arguments packed by value at C alignment, in parameter order.
///
/// ```
/// use tf_cuda::launch::Args;
/// let mut args = Args::new();
/// args.push(0x1000u64).push(7i32).push(true).push(2.5f64);
/// assert_eq!(args.offsets(), &[0, 8, 12, 16]);
/// ```
#[derive(Clone, Default)]
pub struct Args {
    /// Backing store in 16-byte units so every offset up to 16-byte alignment is aligned in memory.
    storage: Vec<MaybeUninit<u128>>,
    used: usize,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

impl fmt::Debug for Args {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Args")
            .field("offsets", &self.offsets)
            .field("sizes", &self.sizes)
            .field("bytes", &self.used)
            .finish()
    }
}

impl Args {
    /// No arguments.
    pub fn new() -> Self {
        Args::default()
    }

    /// Appends `value` at the next offset aligned to its alignment.
    pub fn push<T: KernelArg>(&mut self, value: T) -> &mut Self {
        const {
            assert!(
                align_of::<T>() <= MAX_ARG_ALIGN,
                "kernel argument over-aligned"
            )
        };
        let align = align_of::<T>();
        let size = size_of::<T>();
        let offset = self.used.div_ceil(align) * align;
        let end = offset + size;
        let units = end.div_ceil(size_of::<u128>());
        if self.storage.len() < units {
            self.storage.resize(units, MaybeUninit::zeroed());
        }
        // SAFETY: `storage` holds at least `end` bytes; `offset` is a multiple of `align` and the
        // base is 16-byte aligned, so the destination is aligned for T. Copying T's bytes
        // (padding included) into MaybeUninit storage is always allowed.
        unsafe {
            let base = self.storage.as_mut_ptr().cast::<u8>();
            std::ptr::write(base.add(offset).cast::<T>(), value);
        }
        self.offsets.push(offset);
        self.sizes.push(size);
        self.used = end;
        self
    }

    /// Appends a device address (`CUdeviceptr`, a 64-bit C pointer parameter).
    pub fn push_addr(&mut self, addr: u64) -> &mut Self {
        self.push(addr)
    }

    /// Number of arguments.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// True when no argument was pushed.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Total bytes including alignment padding.
    pub fn byte_len(&self) -> usize {
        self.used
    }

    /// Offset of each argument in the packed parameter block.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Size of each argument.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Reads back argument `index` as `T` when its size matches.
    pub fn get<T: Pod>(&self, index: usize) -> Option<T> {
        let offset = *self.offsets.get(index)?;
        if *self.sizes.get(index)? != size_of::<T>() {
            return None;
        }
        // SAFETY: the argument's bytes lie within `storage` and were written from a value of
        // the same size; T is Pod so any bit pattern is valid; the read is unaligned-safe.
        Some(unsafe {
            std::ptr::read_unaligned(self.storage.as_ptr().cast::<u8>().add(offset).cast::<T>())
        })
    }

    /// Checks the total size against what a launch may pass.
    pub fn validate(&self) -> Result<(), Error> {
        if self.used > MAX_ARG_BYTES {
            return Err(Error::invalid(format!(
                "kernel arguments take {} B; a launch passes at most {MAX_ARG_BYTES} B: \
                 pass large data through device memory",
                self.used
            )));
        }
        Ok(())
    }

    /// The `void**` array the driver reads: one pointer per argument into this block.
    ///
    /// Rebuilt on each call, so a moved `Args` never hands out stale addresses. The pointers
    /// are valid while `self` is neither moved nor mutated.
    pub(crate) fn pointers(&self) -> Vec<*mut c_void> {
        let base = self.storage.as_ptr().cast::<u8>();
        self.offsets
            .iter()
            // SAFETY: each offset is within `storage` (written by `push`).
            .map(|&o| unsafe { base.add(o) }.cast_mut().cast::<c_void>())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Mixed {
        a: u64,
        b: i32,
        c: f32,
    }
    // SAFETY: repr(C) of scalars.
    unsafe impl KernelArg for Mixed {}

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Padded {
        a: u8,
        b: u32,
        c: u16,
    }
    // SAFETY: repr(C) of scalars.
    unsafe impl KernelArg for Padded {}

    #[test]
    fn packs_scalars_and_structs_at_c_offsets() {
        let mut args = Args::new();
        args.push(1u64)
            .push(-2i32)
            .push(true)
            .push(3.5f64)
            .push(Mixed { a: 9, b: 8, c: 7.0 });
        assert_eq!(args.offsets(), &[0, 8, 12, 16, 24]);
        assert_eq!(args.sizes(), &[8, 4, 1, 8, 16]);
        assert_eq!(args.byte_len(), 40);
        assert_eq!(args.get::<u64>(0), Some(1));
        assert_eq!(args.get::<i32>(1), Some(-2));
        assert_eq!(args.get::<f64>(3), Some(3.5));
        assert_eq!(args.get::<u32>(0), None, "size mismatch is refused");
        assert_eq!(args.get::<u32>(9), None, "absent index is refused");
    }

    #[test]
    fn padded_struct_takes_its_c_size_and_alignment() {
        let mut args = Args::new();
        args.push(1u8).push(Padded { a: 1, b: 2, c: 3 }).push(5u8);
        assert_eq!(size_of::<Padded>(), 12);
        assert_eq!(args.offsets(), &[0, 4, 16]);
    }

    #[test]
    fn pointers_point_at_each_argument() {
        let mut args = Args::new();
        args.push(0xdead_beefu64).push(42u32);
        let ptrs = args.pointers();
        assert_eq!(ptrs.len(), 2);
        // SAFETY: pointers into `args`, which is alive and unchanged.
        unsafe {
            assert_eq!(*(ptrs[0] as *const u64), 0xdead_beef);
            assert_eq!(*(ptrs[1] as *const u32), 42);
        }
    }

    #[test]
    fn oversize_arguments_are_refused() {
        let mut args = Args::new();
        for _ in 0..(MAX_ARG_BYTES / 8 + 1) {
            args.push(0u64);
        }
        assert!(args.validate().is_err());
    }

    #[test]
    fn config_validation() {
        let ok = LaunchConfig::new(10, 256);
        assert!(ok.validate(DEFAULT_DYNAMIC_SHARED_LIMIT).is_ok());
        assert!(LaunchConfig::new(0, 256).validate(49152).is_err());
        assert!(LaunchConfig::new(1, 0).validate(49152).is_err());
        assert!(LaunchConfig::new(1, 2048).validate(49152).is_err());
        assert!(LaunchConfig::new(1, (32, 64)).validate(49152).is_err());
        assert!(LaunchConfig::new(1, (1, 1, 65)).validate(49152).is_err());
        assert!(LaunchConfig::new((1, 65_536), 1).validate(49152).is_err());
        assert!(LaunchConfig::new(1, 1)
            .with_shared(49153)
            .validate(49152)
            .is_err());
        assert!(LaunchConfig::new(1, 1)
            .with_shared(100_000)
            .validate(200_000)
            .is_ok());
        let msg = LaunchConfig::new(1, 2048)
            .validate(0)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("2048"), "{msg}");
    }

    #[test]
    fn row_threads_is_a_warp_multiple_capped_at_1024() {
        assert_eq!(row_threads(0), 32);
        assert_eq!(row_threads(1), 32);
        assert_eq!(row_threads(32), 32);
        assert_eq!(row_threads(33), 64);
        assert_eq!(row_threads(1000), 1024);
        assert_eq!(row_threads(1 << 20), 1024);
    }

    #[test]
    fn describe_names_kernel_and_geometry() {
        let cfg = LaunchConfig::new((70000, 2), 128).with_shared(49152);
        assert_eq!(
            describe("_stream_pf", &cfg),
            "kernel _stream_pf, grid 70000x2x1, block 128x1x1, shared 49152 B"
        );
    }

    /// One argument kind in the property test: (size, align) and a pusher.
    #[derive(Clone, Copy, Debug)]
    enum Kind {
        U8,
        Bool,
        U16,
        I32,
        F32,
        U64,
        F64,
        Mixed,
        Padded,
        Arr3U16,
        Vec4F32,
    }

    #[repr(C, align(16))]
    #[derive(Clone, Copy)]
    struct Float4([f32; 4]);
    // SAFETY: repr(C) aligned array of scalars, like CUDA's float4.
    unsafe impl KernelArg for Float4 {}

    fn push_kind(args: &mut Args, k: Kind) -> (usize, usize) {
        match k {
            Kind::U8 => args.push(1u8),
            Kind::Bool => args.push(true),
            Kind::U16 => args.push(2u16),
            Kind::I32 => args.push(3i32),
            Kind::F32 => args.push(4f32),
            Kind::U64 => args.push(5u64),
            Kind::F64 => args.push(6f64),
            Kind::Mixed => args.push(Mixed { a: 1, b: 2, c: 3.0 }),
            Kind::Padded => args.push(Padded { a: 1, b: 2, c: 3 }),
            Kind::Arr3U16 => args.push([1u16, 2, 3]),
            Kind::Vec4F32 => args.push(Float4([1.0; 4])),
        };
        // The C-layout facts of each kind, written independently of `push`.
        match k {
            Kind::U8 | Kind::Bool => (1, 1),
            Kind::U16 => (2, 2),
            Kind::I32 | Kind::F32 => (4, 4),
            Kind::U64 | Kind::F64 => (8, 8),
            Kind::Mixed => (16, 8),
            Kind::Padded => (12, 4),
            Kind::Arr3U16 => (6, 2),
            Kind::Vec4F32 => (16, 16),
        }
    }

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::U8),
            Just(Kind::Bool),
            Just(Kind::U16),
            Just(Kind::I32),
            Just(Kind::F32),
            Just(Kind::U64),
            Just(Kind::F64),
            Just(Kind::Mixed),
            Just(Kind::Padded),
            Just(Kind::Arr3U16),
            Just(Kind::Vec4F32),
        ]
    }

    proptest! {
        /// Offsets equal a reference C struct layout computation: each member at the next
        /// multiple of its alignment after the previous member's end.
        #[test]
        fn offsets_match_reference_c_layout(kinds in proptest::collection::vec(kind(), 0..40)) {
            let mut args = Args::new();
            let mut reference = Vec::new();
            let mut aligns = Vec::new();
            let mut cursor = 0usize;
            for k in &kinds {
                let (size, align) = push_kind(&mut args, *k);
                let offset = cursor.next_multiple_of(align);
                reference.push(offset);
                aligns.push(align);
                cursor = offset + size;
            }
            prop_assert_eq!(args.offsets(), &reference[..]);
            prop_assert_eq!(args.byte_len(), cursor);
            for (ptr, align) in args.pointers().iter().zip(&aligns) {
                prop_assert_eq!(*ptr as usize % align, 0, "argument misaligned in memory");
            }
        }

        /// Values read back are the values pushed, whatever precedes them.
        #[test]
        fn values_round_trip(values in proptest::collection::vec(any::<(u8, u32, u64)>(), 0..20)) {
            let mut args = Args::new();
            for (a, b, c) in &values {
                args.push(*a).push(*b).push(*c);
            }
            for (i, (a, b, c)) in values.iter().enumerate() {
                prop_assert_eq!(args.get::<u8>(3 * i), Some(*a));
                prop_assert_eq!(args.get::<u32>(3 * i + 1), Some(*b));
                prop_assert_eq!(args.get::<u64>(3 * i + 2), Some(*c));
            }
        }
    }
}
