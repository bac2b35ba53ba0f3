//! The implicit-GEMM 3x3 conv launcher (`tf_engines::nn::gpu::conv::plan_conv3x3_spans`) on the test driver: every
//! operand too small or misaligned and every shape its tile does not cover is refused with its rule named; a valid
//! call on each tile encodes its two tensor maps (the test driver checks them by the driver's rules) and packs one
//! persistent launch with the tile's shared memory and the kernel's flags; any shape (a property test) plans or
//! is refused by name, never panics.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::DeviceBuffer;
use tf_engines::nn::gpu::conv::{plan_conv3x3_spans, Conv3x3Shape, ConvOutput, ConvTile};
use tf_testdriver::test_lock;

#[path = "common/test_driver.rs"]
mod test_driver;
use test_driver::context as test_context;

fn span(b: &DeviceBuffer) -> DeviceSpan {
    DeviceSpan::new(b.addr(), b.len())
}

/// A span `trim` bytes shorter than `b`, or starting `skip` bytes into it.
fn cut(b: &DeviceBuffer, skip: usize, trim: usize) -> DeviceSpan {
    DeviceSpan::new(b.addr() + skip as u64, b.len() - skip - trim)
}

#[test]
fn the_conv_launcher_names_each_refusal_and_packs_each_tile() {
    let _serial = test_lock();
    let ctx = test_context();
    // A 6 x 200 map of 144 channels into 288 (bf16), and the same 8 channels wide in f32.
    let (h, w, cin, n) = (6usize, 200usize, 144usize, 288usize);
    let x = DeviceBuffer::alloc(&ctx, h * w * cin * 2).expect("x");
    let weight = DeviceBuffer::alloc(&ctx, n * 9 * cin * 2).expect("weight");
    let bias = DeviceBuffer::alloc(&ctx, n * 4).expect("bias");
    let y = DeviceBuffer::alloc(&ctx, h * w * n * 4).expect("y");
    let shape = Conv3x3Shape { h, w, cin, n };
    let bf16_y = DeviceSpan::new(y.addr(), h * w * n * 2);
    for (shape, tile, operands, out, needle) in [
        (
            shape,
            ConvTile::Cols144,
            (cut(&x, 0, 2), span(&weight), span(&bias)),
            (bf16_y, ConvOutput::Bf16),
            "x: needs",
        ),
        (
            shape,
            ConvTile::Cols144,
            (span(&x), cut(&weight, 16, 0), span(&bias)),
            (bf16_y, ConvOutput::Bf16),
            "weight: needs",
        ),
        (
            shape,
            ConvTile::Cols144,
            (span(&x), span(&weight), span(&bias)),
            (cut(&y, 4, 0), ConvOutput::F32),
            "y",
        ),
        (
            Conv3x3Shape { n: 287, ..shape },
            ConvTile::Cols144,
            (span(&x), span(&weight), span(&bias)),
            (bf16_y, ConvOutput::Bf16),
            "odd",
        ),
        (
            shape,
            ConvTile::Tall144,
            (span(&x), span(&weight), span(&bias)),
            (bf16_y, ConvOutput::Bf16),
            "must divide 256",
        ),
        (
            Conv3x3Shape { w: 64, ..shape },
            ConvTile::Rows144,
            (span(&x), span(&weight), span(&bias)),
            (bf16_y, ConvOutput::Bf16),
            "at least 128",
        ),
    ] {
        let err = plan_conv3x3_spans(&ctx, 132, (shape, tile), operands, out, false)
            .expect_err(needle)
            .to_string();
        assert!(
            err.contains(needle),
            "{shape:?} on {tile:?}: {err:?} should mention {needle:?}"
        );
    }
    // Valid calls: 6 rows of two 128-pixel tiles (the second hanging over the row's end) by 2 output tiles of 144
    // channels = 24 tiles; 12 CTAs on a 12-SM GPU.
    for (tile, output, accumulate, flags) in [
        (ConvTile::Cols144, ConvOutput::Bf16, false, 0),
        (ConvTile::Rows144, ConvOutput::Bf16, true, 1),
        (ConvTile::Rows144, ConvOutput::F32, true, 3),
    ] {
        let out = match output {
            ConvOutput::Bf16 => bf16_y,
            ConvOutput::F32 => span(&y),
        };
        let operands = (span(&x), span(&weight), span(&bias));
        for (sms, grid) in [(132, 24), (12, 12)] {
            let launch = plan_conv3x3_spans(
                &ctx,
                sms,
                (shape, tile),
                operands,
                (out, output),
                accumulate,
            )
            .unwrap_or_else(|e| panic!("{tile:?}: {e}"));
            assert_eq!(launch.kernel(), tile.kernel());
            let config = launch.config();
            assert_eq!((config.grid.x, config.block.x), (grid, 384));
            assert_eq!(config.shared_bytes, tile.shared_bytes());
            // tm_x, tm_w, bias, y, then h, w, cin, n, box_w, flags.
            let ints: Vec<i32> = (4..10)
                .map(|i| launch.args().get::<i32>(i).unwrap())
                .collect();
            assert_eq!(ints, [6, 200, 144, 288, 128, flags], "{tile:?}");
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    /// Any shape on any tile plans or is refused by name, never panics: sizes up to past the kernel's 32-bit limits,
    /// zero and odd channel counts, widths that no tile covers. A plan's grid is at most one CTA an SM and its
    /// arguments carry the shape as given.
    #[test]
    fn any_shape_plans_or_is_refused(
        h in 0usize..70_000,
        w in 0usize..70_000,
        cin in 0usize..3000,
        n in 0usize..3000,
        tile_index in 0usize..4,
        accumulate: bool,
        f32_out: bool,
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let tile = ConvTile::ALL[tile_index];
        // Spans as large as any shape needs: planning reads no memory.
        let big = DeviceSpan::new(0x1000_0000, 1 << 46);
        let output = if f32_out { ConvOutput::F32 } else { ConvOutput::Bf16 };
        let shape = Conv3x3Shape { h, w, cin, n };
        match plan_conv3x3_spans(&ctx, 132, (shape, tile), (big, big, big), (big, output), accumulate) {
            Ok(launch) => {
                proptest::prop_assert!(shape.check(tile).is_ok());
                let config = launch.config();
                proptest::prop_assert!(config.grid.x >= 1 && config.grid.x <= 132);
                proptest::prop_assert_eq!(config.shared_bytes, tile.shared_bytes());
                let ints: Vec<i32> = (4..8).map(|i| launch.args().get::<i32>(i).unwrap()).collect();
                proptest::prop_assert_eq!(ints, vec![h as i32, w as i32, cin as i32, n as i32]);
            }
            Err(e) => proptest::prop_assert!(e.to_string().contains("3x3 conv") || e.to_string().contains("tensor map")),
        }
    }
}
