//! The INT8 GEMM launcher's checks (`tf_engines::nn::gpu::gemm_int8::plan_int8_gemm`) on the test driver: every
//! shape the kernel does not tile and every operand too small or misaligned is refused with its rule named, before
//! any driver call; a valid call encodes its tensor maps (the test driver checks them by the driver's rules) and
//! packs one persistent launch.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tf_cuda::{DeviceBuffer, DeviceView};
use tf_engines::nn::gpu::gemm_int8::{
    plan_bf16_gemm_stored, plan_int8_gemm, plan_int8_gemm_stored, plan_int8_qkv_gemm,
    plan_int8_swiglu_gemm, plan_int8_swiglu_gemm_stored, EpilogueOperands, GemmStore,
    Int8GemmOperands, Int8GemmShape, QkvDest, QkvNormRope, QkvRope, GEMM_INT8_KERNELS,
    SHARED_BYTES, SHARED_BYTES_TMA, STORE_ENV,
};
use tf_engines::nn::gpu::rope::QkvOutputs;
use tf_engines::nn::gpu::{Matrix, SwigluOrder};
use tf_testdriver::test_lock;

#[path = "common/test_driver.rs"]
mod test_driver;
use test_driver::context as test_context;

/// The INT8 GEMM's operands over `x` and `w`, one buffer of scales serving both sides (planning reads only sizes).
fn operands<'v, 'a>(
    x: &'v DeviceView<'a>,
    w: &'v DeviceView<'a>,
    scales: &'v DeviceView<'a>,
) -> Int8GemmOperands<'v, 'a> {
    Int8GemmOperands {
        x,
        x_scale: scales,
        w,
        w_scale: scales,
    }
}

/// A launch's last argument, a 4-byte int: every GEMM kernel of the set ends with its tile order's band.
fn last_int(launch: &tf_engines::nn::gpu::Launch<'_>) -> i32 {
    let sizes = launch.args().sizes();
    assert_eq!(sizes.last(), Some(&4), "the last argument is an int");
    launch.args().get::<i32>(sizes.len() - 1).expect("an int")
}

#[test]
fn the_launcher_names_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    let x_dev = DeviceBuffer::alloc(&ctx, 64 * 384).expect("x");
    let w_dev = DeviceBuffer::alloc(&ctx, 256 * 384).expect("w");
    let s_dev = DeviceBuffer::alloc(&ctx, 4 * 256).expect("scales");
    let mut y_dev = DeviceBuffer::alloc(&ctx, 2 * 64 * 256).expect("y");
    let (xv, wv, sv) = (x_dev.view(), w_dev.view(), s_dev.view());
    let inputs = operands(&xv, &wv, &sv);
    let ok = Int8GemmShape {
        m: 64,
        n: 256,
        k: 384,
    };
    for (shape, stride, needle) in [
        (Int8GemmShape { n: 201, ..ok }, 256, "N = 201 is odd"),
        (
            Int8GemmShape { k: 300, ..ok },
            256,
            "K = 300 is not a multiple of 16",
        ),
        (Int8GemmShape { m: 0, ..ok }, 256, "empty GEMM"),
        (Int8GemmShape { m: 65, ..ok }, 256, "x: needs 24960 B"),
        (Int8GemmShape { n: 512, ..ok }, 512, "w: needs 196608 B"),
        (ok, 255, "must be even and at least N = 256"),
        (ok, 258, "y: needs 33020 B"),
    ] {
        let mut yv = y_dev.view_mut();
        let err = plan_int8_gemm(&ctx, 132, shape, &inputs, &mut yv, stride)
            .expect_err(needle)
            .to_string();
        assert!(
            err.contains(needle),
            "{shape:?}, stride {stride}: {err:?} should mention {needle:?}"
        );
    }
    // A valid call: one launch of the kernel, a persistent grid of at most one CTA an SM and never more CTAs than
    // tiles (one here), 384 threads, the four stages' shared memory.
    for sms in [132, 0] {
        let mut yv = y_dev.view_mut();
        let launch = plan_int8_gemm(&ctx, sms, ok, &inputs, &mut yv, 256).expect("valid call");
        assert_eq!(launch.kernel(), GEMM_INT8_KERNELS[0]);
        let config = launch.config();
        assert_eq!((config.grid.x, config.grid.y, config.grid.z), (1, 1, 1));
        assert_eq!(config.block.x, 384);
        assert_eq!(config.shared_bytes, SHARED_BYTES);
        assert_eq!(
            last_int(&launch),
            1,
            "the tile order's band: the one M tile"
        );
    }
}

/// The number of tensor maps a launch opens with (128-byte arguments).
fn leading_maps(launch: &tf_engines::nn::gpu::Launch<'_>) -> usize {
    launch
        .args()
        .sizes()
        .iter()
        .take_while(|&&size| size == 128)
        .count()
}

#[test]
fn the_tma_store_forms_pack_an_output_map_and_their_shared_memory() {
    let _serial = test_lock();
    let ctx = test_context();
    let (m, k) = (64usize, 384usize);
    let x_dev = DeviceBuffer::alloc(&ctx, 2 * m * k).expect("x");
    let w_dev = DeviceBuffer::alloc(&ctx, 2 * 256 * k).expect("w");
    let s_dev = DeviceBuffer::alloc(&ctx, 4 * 256).expect("scales");
    // Room for rows of 264 elements (a multiple of 8) and of 258 (not).
    let mut y_dev = DeviceBuffer::alloc(&ctx, 2 * m * 264).expect("y");
    let (xv, wv, sv) = (x_dev.view(), w_dev.view(), s_dev.view());
    let inputs = operands(&xv, &wv, &sv);
    let shape = Int8GemmShape { m, n: 256, k };
    // (store, y stride): the kernel, its shared memory and its tensor maps (x, w, and y's for the TMA form).
    for (store, stride, kernel, shared, maps) in [
        (
            GemmStore::Direct,
            264,
            "nn_gemm_int8_scaled_bf16",
            SHARED_BYTES,
            2,
        ),
        (
            GemmStore::Tma,
            264,
            "nn_gemm_int8_scaled_bf16_tma",
            SHARED_BYTES_TMA,
            3,
        ),
        // A row stride the TMA unit cannot write (not 16 bytes): the direct form.
        (
            GemmStore::Tma,
            258,
            "nn_gemm_int8_scaled_bf16",
            SHARED_BYTES,
            2,
        ),
    ] {
        let mut yv = y_dev.view_mut();
        let launch = plan_int8_gemm_stored(&ctx, 132, shape, &inputs, &mut yv, stride, store)
            .expect("valid call");
        assert_eq!(launch.kernel(), kernel, "{store:?}, stride {stride}");
        assert_eq!(launch.config().shared_bytes, shared);
        assert_eq!(leading_maps(&launch), maps, "{store:?}, stride {stride}");
        assert_eq!(last_int(&launch), 1, "the band still ends the arguments");
    }
    // The bf16 GEMM and both SwiGLU GEMMs (hidden 128 over the 256 weight rows).
    let mut yv = y_dev.view_mut();
    let launch = plan_bf16_gemm_stored(
        &ctx,
        132,
        Int8GemmShape { m, n: 256, k: 192 },
        (&xv, &wv),
        &mut yv,
        (264, GemmStore::Tma),
    )
    .expect("valid bf16 call");
    assert_eq!(
        (launch.kernel(), leading_maps(&launch)),
        ("nn_gemm_bf16_tma", 3)
    );
    assert_eq!(launch.config().shared_bytes, SHARED_BYTES_TMA);
    for (operands, kernel) in [
        (
            EpilogueOperands::Int8(&inputs),
            "nn_gemm_int8_swiglu_bf16_tma",
        ),
        (
            EpilogueOperands::Bf16 { x: &xv, w: &wv },
            "nn_gemm_bf16_swiglu_tma",
        ),
    ] {
        let mut yv = y_dev.view_mut();
        let launch = plan_int8_swiglu_gemm_stored(
            &ctx,
            132,
            (m, 128, 192),
            SwigluOrder::GateValue,
            operands,
            &mut yv,
            (128, GemmStore::Tma),
        )
        .expect("valid SwiGLU call");
        assert_eq!((launch.kernel(), leading_maps(&launch)), (kernel, 3));
        assert_eq!(launch.config().shared_bytes, SHARED_BYTES_TMA);
        assert_eq!(last_int(&launch), 1);
    }
    // The variable's values.
    assert_eq!(GemmStore::parse(""), Ok(GemmStore::Direct));
    assert_eq!(GemmStore::parse("direct"), Ok(GemmStore::Direct));
    assert_eq!(GemmStore::parse("tma"), Ok(GemmStore::Tma));
    let err = GemmStore::parse("TMA").expect_err("case matters");
    assert!(err.contains(STORE_ENV) && err.contains("direct"), "{err}");
}

#[test]
fn the_swiglu_launcher_names_each_refusal_and_packs_both_halves() {
    let _serial = test_lock();
    let ctx = test_context();
    // hidden 128: w holds 256 rows (gate and value), y 128 columns.
    let x_dev = DeviceBuffer::alloc(&ctx, 64 * 384).expect("x");
    let w_dev = DeviceBuffer::alloc(&ctx, 256 * 384).expect("w");
    let s_dev = DeviceBuffer::alloc(&ctx, 4 * 256).expect("scales");
    let mut y_dev = DeviceBuffer::alloc(&ctx, 2 * 64 * 128).expect("y");
    let (xv, wv, sv) = (x_dev.view(), w_dev.view(), s_dev.view());
    let inputs = operands(&xv, &wv, &sv);
    for ((m, hidden, k), stride, needle) in [
        (
            (64, 96, 384),
            128,
            "hidden width 96 is not a positive multiple of 128",
        ),
        ((64, 0, 384), 128, "hidden width 0"),
        (
            (64, 128, 384),
            132,
            "y row stride 132 is not a multiple of 8",
        ),
        ((64, 128, 300), 128, "K = 300 is not a multiple of 16"),
        ((64, 256, 384), 256, "w: needs 196608 B"),
        ((65, 128, 384), 128, "x: needs 24960 B"),
        ((64, 128, 384), 136, "y: needs"),
    ] {
        let mut yv = y_dev.view_mut();
        let err = plan_int8_swiglu_gemm(
            &ctx,
            132,
            (m, hidden, k),
            SwigluOrder::GateValue,
            EpilogueOperands::Int8(&inputs),
            &mut yv,
            stride,
        )
        .expect_err(needle)
        .to_string();
        assert!(
            err.contains(needle),
            "({m}, {hidden}, {k}), stride {stride}: {err:?} should mention {needle:?}"
        );
    }
    // Valid in either order: the SwiGLU kernel, one tile here, the INT8 GEMM's threads and shared memory.
    for order in [SwigluOrder::GateValue, SwigluOrder::ValueGate] {
        let mut yv = y_dev.view_mut();
        let launch = plan_int8_swiglu_gemm(
            &ctx,
            132,
            (64, 128, 384),
            order,
            EpilogueOperands::Int8(&inputs),
            &mut yv,
            128,
        )
        .expect("valid call");
        assert_eq!(launch.kernel(), GEMM_INT8_KERNELS[2]);
        let config = launch.config();
        assert_eq!((config.grid.x, config.block.x), (1, 384));
        assert_eq!(config.shared_bytes, SHARED_BYTES);
        assert_eq!(
            last_int(&launch),
            1,
            "the tile order's band: the one M tile"
        );
    }
}

#[test]
fn the_qkv_launcher_names_each_refusal_and_packs_its_epilogue() {
    let _serial = test_lock();
    let ctx = test_context();
    // Two heads (width 256): w holds 768 rows, q, k and v 256 columns each, rope tables 64 rows of 64.
    let (m, k) = (64usize, 384usize);
    let x_dev = DeviceBuffer::alloc(&ctx, m * k).expect("x");
    let w_dev = DeviceBuffer::alloc(&ctx, 768 * k).expect("w");
    let s_dev = DeviceBuffer::alloc(&ctx, 4 * 768).expect("scales");
    let nw_dev = DeviceBuffer::alloc(&ctx, 2 * 128).expect("norm weights");
    let table_dev = DeviceBuffer::alloc(&ctx, 4 * 64 * 64).expect("rope table");
    let short_table = DeviceBuffer::alloc(&ctx, 4 * 63 * 64).expect("short rope table");
    let mut out_devs: Vec<DeviceBuffer> = (0..3)
        .map(|_| DeviceBuffer::alloc(&ctx, 2 * m * 264).expect("output"))
        .collect();
    let (xv, wv, sv, nwv, tv, short_v) = (
        x_dev.view(),
        w_dev.view(),
        s_dev.view(),
        nw_dev.view(),
        table_dev.view(),
        short_table.view(),
    );
    let inputs = operands(&xv, &wv, &sv);
    let norm = QkvNormRope {
        heads: 2,
        q_weight: &nwv,
        k_weight: &nwv,
        eps: 1e-6,
        rope: QkvRope::Interleaved,
        rope_cos: &tv,
        rope_sin: &tv,
        rope_stride: 64,
    };
    // (norm operands, (M, K), the q, k and v strides, what the refusal names)
    type Case<'v, 'a> = (
        QkvNormRope<'v, 'a>,
        (usize, usize),
        [usize; 3],
        &'static str,
    );
    let cases: [Case; 7] = [
        (
            QkvNormRope { heads: 3, ..norm },
            (m, k),
            [384; 3],
            "3 heads of 128 (384 columns) are not a positive multiple of 256",
        ),
        (
            QkvNormRope { heads: 0, ..norm },
            (m, k),
            [256; 3],
            "0 heads",
        ),
        (
            norm,
            (m, k),
            [256, 264, 256],
            "q, k and v row strides 256, 264, 256 must be one multiple of 8",
        ),
        (norm, (m, 300), [256; 3], "K = 300 is not a multiple of 16"),
        (
            QkvNormRope {
                rope_cos: &short_v,
                ..norm
            },
            (m, k),
            [256; 3],
            "rope_cos: needs 16384 B",
        ),
        (
            QkvNormRope {
                rope_stride: 32,
                ..norm
            },
            (m, k),
            [256; 3],
            "rope stride 32 must be even and at least 64",
        ),
        (norm, (m + 1, k), [256; 3], "x: needs 24960 B"),
    ];
    for (norm_case, (cm, ck), strides, needle) in cases {
        let [q, kk, v] = &mut out_devs[..] else {
            unreachable!("three outputs")
        };
        let (mut qv, mut kv, mut vv) = (q.view_mut(), kk.view_mut(), v.view_mut());
        let outputs = QkvOutputs {
            q: &mut qv,
            q_stride: strides[0],
            k: &mut kv,
            k_stride: strides[1],
            v: &mut vv,
            v_stride: strides[2],
        };
        let err = plan_int8_qkv_gemm(
            &ctx,
            132,
            (cm, ck),
            EpilogueOperands::Int8(&inputs),
            &norm_case,
            QkvDest::Apart(&outputs),
        )
        .expect_err(needle)
        .to_string();
        assert!(
            err.contains(needle),
            "({cm}, {ck}), strides {strides:?}: {err:?} should mention {needle:?}"
        );
    }
    // Valid: the q|k|v kernel over the whole weight (3 column tiles), the INT8 GEMM's threads and shared memory,
    // and outputs with a wider stride.
    for stride in [256, 264] {
        let [q, kk, v] = &mut out_devs[..] else {
            unreachable!("three outputs")
        };
        let (mut qv, mut kv, mut vv) = (q.view_mut(), kk.view_mut(), v.view_mut());
        let outputs = QkvOutputs::with_stride((&mut qv, &mut kv, &mut vv), stride);
        let launch = plan_int8_qkv_gemm(
            &ctx,
            132,
            (m, k),
            EpilogueOperands::Int8(&inputs),
            &norm,
            QkvDest::Apart(&outputs),
        )
        .expect("valid call");
        assert_eq!(launch.kernel(), GEMM_INT8_KERNELS[3]);
        let config = launch.config();
        assert_eq!((config.grid.x, config.block.x), (3, 384));
        assert_eq!(config.shared_bytes, SHARED_BYTES);
    }
    // MiniMax H3's form: bf16 tables of at least 48 columns, in place on one q|k|v matrix.
    let half_table = DeviceBuffer::alloc(&ctx, 2 * 64 * 48).expect("bf16 rope table");
    let hv = half_table.view();
    let half = QkvNormRope {
        rope: QkvRope::Half96,
        rope_cos: &hv,
        rope_sin: &hv,
        rope_stride: 48,
        ..norm
    };
    let mut joint = DeviceBuffer::alloc(&ctx, 2 * m * 776).expect("q|k|v");
    for (norm_case, stride, needle) in [
        (
            QkvNormRope {
                rope_stride: 47,
                ..half
            },
            768,
            "rope stride 47 must be even and at least 48",
        ),
        (
            QkvNormRope {
                rope_stride: 64,
                ..half
            },
            768,
            "rope_cos: needs 8160 B",
        ),
        (half, 764, "qkv row stride 764 is not a multiple of 8"),
        (
            half,
            760,
            "qkv row stride 760 must be even and at least N = 768",
        ),
        (half, 784, "qkv: needs"),
    ] {
        let mut jv = joint.view_mut();
        let err = plan_int8_qkv_gemm(
            &ctx,
            132,
            (m, k),
            EpilogueOperands::Int8(&inputs),
            &norm_case,
            QkvDest::Joint {
                qkv: &mut jv,
                stride,
            },
        )
        .expect_err(needle)
        .to_string();
        assert!(
            err.contains(needle),
            "stride {stride}: {err:?} should mention {needle:?}"
        );
    }
    for stride in [768, 776] {
        let mut jv = joint.view_mut();
        let launch = plan_int8_qkv_gemm(
            &ctx,
            132,
            (m, k),
            EpilogueOperands::Int8(&inputs),
            &half,
            QkvDest::Joint {
                qkv: &mut jv,
                stride,
            },
        )
        .expect("valid in-place call");
        assert_eq!(launch.kernel(), GEMM_INT8_KERNELS[4]);
        assert_eq!(launch.config().grid.x, 3);
        assert_eq!(
            last_int(&launch),
            1,
            "the tile order's band: the one M tile"
        );
    }
    // The separate pass's operands carry the same norm and tables; the rotate-half form has no such pass here.
    let jv = joint.view();
    let pass = norm
        .interleaved_pass(&jv, Matrix::dense(m, 768))
        .expect("the interleaved pass");
    assert_eq!(
        (pass.heads, pass.eps, pass.rope_stride, pass.qkv_layout),
        (
            norm.heads,
            norm.eps,
            norm.rope_stride,
            Matrix::dense(m, 768)
        )
    );
    assert_eq!(pass.rope_cos.addr(), norm.rope_cos.addr());
    let err = half
        .interleaved_pass(&jv, Matrix::dense(m, 768))
        .expect_err("no rotate-half pass")
        .to_string();
    assert!(err.contains("Half96"), "{err}");
}
