//! TMA tensor maps (`CUtensorMap`) for sm_90 kernels that load tiles with `cp.async.bulk.tensor`.
//!
//! A tensor map describes a strided global tensor and the box one TMA copy moves; the driver
//! encodes it (`cuTensorMapEncodeTiled`) into 128 opaque bytes that the kernel takes by value
//! (`const __grid_constant__ CUtensorMap`). The entry point is looked up by name in the loaded
//! driver library, like the VMM entry points: it is not part of the pinned driver table.
//!
//! Invariants:
//! - Everything the driver would reject is checked first and named ([`crate::Error::Invalid`]):
//!   16-byte aligned base and strides, a box of at most 256 rows and (for the 128-byte swizzle)
//!   at most 128 bytes per row.
//! - Two element types: bf16 ([`encode_bf16_tiles`]) and bytes ([`encode_int8_tiles`], INT8 or
//!   e4m3 codes); a [`Tiles`] counts columns in elements of the map's type.
//! - Rows and columns outside the tensor read as zeros (no NaN fill), so a box may hang over
//!   the end of the tensor or start at a negative coordinate.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, k: &tf_cuda::DeviceBuffer) -> Result<(), tf_cuda::Error> {
//! use tf_cuda::tensor_map::{encode_bf16_tiles, Bf16Tiles};
//! // 4096 key rows of 32 heads x 128 bf16, boxes of 64 columns x 128 rows in the 128-byte swizzle.
//! let map = encode_bf16_tiles(
//!     ctx,
//!     &Bf16Tiles {
//!         base: k.addr(),
//!         cols: 32 * 128,
//!         rows: 4096,
//!         batch: 1,
//!         row_stride_bytes: 32 * 128 * 2,
//!         batch_stride_bytes: 4096 * 32 * 128 * 2,
//!         box_cols: 64,
//!         box_rows: 128,
//!     },
//! )?;
//! let mut args = tf_cuda::Args::new();
//! args.push(map.words());
//! # Ok(()) }
//! ```

use std::ffi::{c_uint, c_void};

use crate::context::Context;
use crate::error::Error;

/// The encoded map: 128 bytes the kernel receives by value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TensorMap {
    words: [u64; 16],
}

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorMap").finish_non_exhaustive()
    }
}

impl TensorMap {
    /// The bytes to pass as the kernel argument (the kernel's parameter is 64-byte aligned; the
    /// driver copies the argument into place).
    pub fn words(&self) -> [u64; 16] {
        self.words
    }
}

/// A tensor of `batch` x `rows` x `cols` elements (row-major, strided) and the box of
/// `box_rows` x `box_cols` one TMA copy moves into shared memory in the 128-byte swizzle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Device address of element (0, 0, 0); 16-byte aligned.
    pub base: u64,
    /// Elements per row that the map covers.
    pub cols: u64,
    /// Rows per batch entry.
    pub rows: u64,
    /// Batch entries.
    pub batch: u64,
    /// Bytes from one row to the next; a multiple of 16.
    pub row_stride_bytes: u64,
    /// Bytes from one batch entry to the next; a multiple of 16 (ignored when `batch` is 1).
    pub batch_stride_bytes: u64,
    /// Columns per box: at most 128 bytes (the swizzle span): 64 bf16, 128 bytes.
    pub box_cols: u32,
    /// Rows per box: 1 to 256.
    pub box_rows: u32,
}

/// The bf16 maps' name for [`Tiles`] (columns in bf16 elements).
pub type Bf16Tiles = Tiles;

/// An element type a map can hold.
#[derive(Clone, Copy, Debug)]
struct Element {
    bytes: u64,
    data_type: c_uint,
    name: &'static str,
}

const BF16: Element = Element {
    bytes: 2,
    data_type: 9, // CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    name: "bf16",
};
const BYTE: Element = Element {
    bytes: 1,
    data_type: 0, // CU_TENSOR_MAP_DATA_TYPE_UINT8
    name: "bytes",
};
const INTERLEAVE_NONE: c_uint = 0;
const SWIZZLE_128B: c_uint = 3;
const L2_PROMOTION_256B: c_uint = 3;
const OOB_FILL_ZERO: c_uint = 0;
const SYMBOL: &str = "cuTensorMapEncodeTiled";

type EncodeTiled = unsafe extern "C" fn(
    *mut [u64; 16],
    c_uint,
    c_uint,
    *mut c_void,
    *const u64,
    *const u64,
    *const c_uint,
    *const c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
) -> tf_sys::CUresult;

/// Checks `t` against the driver's rules for a 3-D bf16 map with the 128-byte swizzle.
pub fn check_bf16_tiles(t: &Tiles) -> Result<(), Error> {
    check_tiles(t, BF16)
}

/// Checks `t` (columns in bytes) against the driver's rules for a 3-D byte map with the 128-byte swizzle.
pub fn check_int8_tiles(t: &Tiles) -> Result<(), Error> {
    check_tiles(t, BYTE)
}

fn check_tiles(t: &Tiles, element: Element) -> Result<(), Error> {
    let fail = |what: String| Err(Error::invalid(format!("tensor map: {what}")));
    if !t.base.is_multiple_of(16) {
        return fail(format!("base address {:#x} is not 16-byte aligned", t.base));
    }
    if t.cols == 0 || t.rows == 0 || t.batch == 0 {
        return fail(format!(
            "empty tensor ({} x {} x {})",
            t.batch, t.rows, t.cols
        ));
    }
    let limit = 1u64 << 32;
    if t.cols > limit || t.rows > limit || t.batch > limit {
        return fail(format!(
            "dimension over 2^32 ({} x {} x {})",
            t.batch, t.rows, t.cols
        ));
    }
    for (name, stride) in [
        ("row stride", t.row_stride_bytes),
        ("batch stride", t.batch_stride_bytes),
    ] {
        if !stride.is_multiple_of(16) || stride >= 1u64 << 40 {
            return fail(format!(
                "{name} of {stride} bytes is not a multiple of 16 below 2^40"
            ));
        }
    }
    if t.row_stride_bytes < t.cols * element.bytes {
        return fail(format!(
            "row stride {} bytes is shorter than a row of {} {}",
            t.row_stride_bytes, t.cols, element.name
        ));
    }
    let max_cols = 128 / element.bytes;
    if t.box_cols == 0 || u64::from(t.box_cols) > max_cols || t.box_rows == 0 || t.box_rows > 256 {
        return fail(format!(
            "box of {} rows x {} columns (1..=256 rows, 1..={max_cols} columns of {} for the 128-byte swizzle)",
            t.box_rows, t.box_cols, element.name
        ));
    }
    Ok(())
}

/// Checks a box depth in batch entries: 1 to 256, and at most 256 rows a box in all (the tile one copy fills).
pub fn check_box_batch(t: &Tiles, box_batch: u32) -> Result<(), Error> {
    let rows = u64::from(t.box_rows) * u64::from(box_batch);
    if box_batch == 0 || box_batch > 256 || rows > 256 {
        return Err(Error::invalid(format!(
            "tensor map: box of {box_batch} batch entries x {} rows (1..=256 entries, at most 256 rows in all)",
            t.box_rows
        )));
    }
    Ok(())
}

/// Encodes the bf16 map of `t` with the driver of `ctx` (zero fill outside the tensor, 128-byte
/// swizzle, 256-byte L2 promotion).
pub fn encode_bf16_tiles(ctx: &Context, t: &Tiles) -> Result<TensorMap, Error> {
    encode_tiles(ctx, t, BF16, 1)
}

/// [`encode_bf16_tiles`] with boxes `box_batch` batch entries deep: one copy moves `box_batch` x `box_rows` rows
/// (an image's rows of pixels, say), laid out in shared memory one after another as one tile of rows.
pub fn encode_bf16_boxes(ctx: &Context, t: &Tiles, box_batch: u32) -> Result<TensorMap, Error> {
    encode_tiles(ctx, t, BF16, box_batch)
}

/// Encodes the byte map of `t` (columns in bytes: INT8 or e4m3 codes) like [`encode_bf16_tiles`].
pub fn encode_int8_tiles(ctx: &Context, t: &Tiles) -> Result<TensorMap, Error> {
    encode_tiles(ctx, t, BYTE, 1)
}

fn encode_tiles(
    ctx: &Context,
    t: &Tiles,
    element: Element,
    box_batch: u32,
) -> Result<TensorMap, Error> {
    check_tiles(t, element)?;
    check_box_batch(t, box_batch)?;
    let driver = ctx.driver();
    // SAFETY: the signature is the one cuda.h declares for this symbol; only the address is read.
    let encode = unsafe {
        driver
            .library()
            .get::<EncodeTiled>(b"cuTensorMapEncodeTiled\0")
    }
    .map_err(|_| Error::Driver(tf_sys::Error::MissingSymbol { name: SYMBOL }))?;
    // A batch of one never steps: give it a stride the driver accepts whatever the caller passed.
    let batch_stride = if t.batch == 1 {
        t.row_stride_bytes * t.rows
    } else {
        t.batch_stride_bytes
    };
    let dims = [t.cols, t.rows, t.batch];
    let strides = [t.row_stride_bytes, batch_stride];
    let boxes = [t.box_cols, t.box_rows, box_batch];
    let element_strides = [1u32; 3];
    let mut words = [0u64; 16];
    // SAFETY: every pointer refers to a live local array of the length the rank (3) implies;
    // the output is 128 bytes; the arguments were checked against the driver's rules above.
    let code = unsafe {
        encode(
            &mut words,
            element.data_type,
            3,
            t.base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            INTERLEAVE_NONE,
            SWIZZLE_128B,
            L2_PROMOTION_256B,
            OOB_FILL_ZERO,
        )
    };
    tf_sys::check(driver.as_ref(), SYMBOL, code).map_err(Error::from)?;
    Ok(TensorMap { words })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Bf16Tiles {
        Bf16Tiles {
            base: 0x7000_0000,
            cols: 4096,
            rows: 4176,
            batch: 2,
            row_stride_bytes: 3 * 4096 * 2,
            batch_stride_bytes: 4176 * 3 * 4096 * 2,
            box_cols: 64,
            box_rows: 128,
        }
    }

    #[test]
    fn accepts_the_attention_layouts() {
        assert!(check_bf16_tiles(&keys()).is_ok());
        let one = Bf16Tiles {
            batch: 1,
            batch_stride_bytes: 0,
            ..keys()
        };
        assert!(check_bf16_tiles(&one).is_ok());
    }

    #[test]
    fn names_what_the_driver_would_reject() {
        let cases = [
            (
                Bf16Tiles {
                    base: 0x7000_0008,
                    ..keys()
                },
                "not 16-byte aligned",
            ),
            (
                Bf16Tiles {
                    row_stride_bytes: 8200,
                    ..keys()
                },
                "row stride of 8200",
            ),
            (
                Bf16Tiles {
                    row_stride_bytes: 4096,
                    ..keys()
                },
                "shorter than a row",
            ),
            (
                Bf16Tiles {
                    box_cols: 128,
                    ..keys()
                },
                "box of 128 rows x 128 columns",
            ),
            (
                Bf16Tiles {
                    box_rows: 300,
                    ..keys()
                },
                "box of 300 rows",
            ),
            (Bf16Tiles { rows: 0, ..keys() }, "empty tensor"),
        ];
        for (tiles, needle) in cases {
            let err = check_bf16_tiles(&tiles).expect_err(needle).to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }

    #[test]
    fn byte_maps_take_128_columns_a_box_and_rows_of_bytes() {
        // x of the INT8 GEMM: 6026 rows of K = 5376 bytes, boxes of 128 bytes x 128 rows.
        let x = Tiles {
            base: 0x7000_0000,
            cols: 5376,
            rows: 6026,
            batch: 1,
            row_stride_bytes: 5376,
            batch_stride_bytes: 0,
            box_cols: 128,
            box_rows: 128,
        };
        assert!(check_int8_tiles(&x).is_ok());
        assert!(check_int8_tiles(&Tiles { box_rows: 256, ..x }).is_ok());
        // The same geometry is over the swizzle span in bf16, and its rows too short.
        assert!(check_bf16_tiles(&x).is_err());
        let err = check_int8_tiles(&Tiles { box_cols: 129, ..x }).expect_err("129 bytes");
        assert!(
            err.to_string().contains("1..=128 columns of bytes"),
            "{err}"
        );
        let err = check_int8_tiles(&Tiles {
            row_stride_bytes: 5360,
            ..x
        })
        .expect_err("short rows");
        assert!(
            err.to_string().contains("shorter than a row of 5376 bytes"),
            "{err}"
        );
    }

    #[test]
    fn box_depth_is_bounded_by_the_tile() {
        // An NHWC map of 64-pixel rows: two rows a box make a 128-row tile; four would be 256; five too many.
        let pixels = Tiles {
            base: 0x7000_0000,
            cols: 144,
            rows: 64,
            batch: 64,
            row_stride_bytes: 144 * 2,
            batch_stride_bytes: 64 * 144 * 2,
            box_cols: 64,
            box_rows: 64,
        };
        assert!(check_box_batch(&pixels, 2).is_ok());
        assert!(check_box_batch(&pixels, 4).is_ok());
        for bad in [0, 5] {
            let err = check_box_batch(&pixels, bad).expect_err("outside 1..=256 rows");
            assert!(err.to_string().contains("at most 256 rows"), "{err}");
        }
    }
}
