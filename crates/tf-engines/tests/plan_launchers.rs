//! The `plan_*` launchers that had no host test of their own, on the test driver (host memory stands in for the
//! GPU, so the views are real and the bf16 GEMM's tensor maps are encoded by the driver's rules):
//! SwiGLU (`plan_swiglu`, `plan_swiglu_ordered`, `plan_swiglu_apart`), the copies (`plan_copy_rows`,
//! `plan_transpose`, `plan_timestep_embedding`), the zero-centred RMSNorm (`plan_rms_norm_zc`), the bf16 GEMM
//! (`plan_bf16_gemm`, `plan_bf16_gemm_spans`) and the Qwen-Image DiT's adaLN kernels (`plan_adaln_modulate`,
//! `plan_gated_residual`, `plan_gated_residual_adaln`).
//!
//! For each: a valid call packs the kernel's arguments in its parameter order (kernels/nn/*.cu,
//! kernels/qwen_image/adaln.cu) over a grid that covers the shape; every precondition broken on its own is refused
//! with a message naming the op and the rule; and a property test over random shapes, strides and views checks that
//! the planner plans or refuses by name (never panics), and that every plan addresses only memory inside the views
//! it was given, by the layout the kernel documents, computed from the packed arguments the kernel will receive.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::{Context, DeviceBuffer, DeviceView, DeviceViewMut};
use tf_engines::nn::gpu::gemm_int8::{
    plan_bf16_gemm, plan_bf16_gemm_spans, Int8GemmShape, TileBand, GEMM_INT8_KERNELS, SHARED_BYTES,
    TILE_COLS, TILE_ROWS,
};
use tf_engines::nn::gpu::{
    plan_copy_rows, plan_rms_norm_zc, plan_swiglu, plan_swiglu_apart, plan_swiglu_ordered,
    plan_timestep_embedding, plan_transpose, Launch, Matrix, Modulation, ModulationRows,
    SwigluOrder, MAX_NORM_COLS,
};
use tf_engines::qwen_image::ops::{
    plan_adaln_modulate, plan_gated_residual, plan_gated_residual_adaln,
};
use tf_testdriver::test_lock;

#[path = "common/test_driver.rs"]
mod test_driver;
use test_driver::context as test_context;

/// Threads of a row kernel's block (NN_ROW_THREADS).
const ROW_THREADS: u32 = 256;
/// A 32-bit int's first value out of range.
const PAST_I32: usize = 1 << 31;

// ---------------------------------------------------------------- helpers

fn buf(ctx: &Context, bytes: usize) -> DeviceBuffer {
    DeviceBuffer::alloc(ctx, bytes.max(1)).expect("allocate on the test driver")
}

const fn mat(rows: usize, cols: usize, stride: usize) -> Matrix {
    Matrix { rows, cols, stride }
}

const fn sel(seq_len: usize, target_begin: usize, prefix_row: usize) -> ModulationRows {
    ModulationRows {
        seq_len,
        target_begin,
        prefix_row,
    }
}

/// Bytes a bf16 matrix spans from its first element to one past its last (0 when empty), saturating.
fn span_of(rows: usize, cols: usize, stride: usize) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    (rows - 1)
        .saturating_mul(stride)
        .saturating_add(cols)
        .saturating_mul(2)
}

fn bytes(m: Matrix) -> usize {
    span_of(m.rows, m.cols, m.stride)
}

/// Bytes cut from the front and from the back of a buffer to make an operand's view.
type Cut = (usize, usize);
const WHOLE: Cut = (0, 0);

fn cut(b: &DeviceBuffer, (skip, trim): Cut) -> DeviceView<'_> {
    b.slice(skip, b.len() - skip - trim).expect("slice")
}

fn cut_mut(b: &mut DeviceBuffer, (skip, trim): Cut) -> DeviceViewMut<'_> {
    let len = b.len() - skip - trim;
    b.slice_mut(skip, len).expect("slice")
}

/// `want` bytes of `b` from `skip`, clamped to the buffer (the property tests' views).
fn region(b: &DeviceBuffer, skip: usize, want: usize) -> DeviceView<'_> {
    let skip = skip.min(b.len());
    b.slice(skip, want.min(b.len() - skip)).expect("slice")
}

fn region_mut(b: &mut DeviceBuffer, skip: usize, want: usize) -> DeviceViewMut<'_> {
    let skip = skip.min(b.len());
    let len = want.min(b.len() - skip);
    b.slice_mut(skip, len).expect("slice")
}

/// `needed` bytes moved by `slack` (either way), at least 0.
fn with_slack(needed: usize, slack: i64) -> usize {
    usize::try_from((needed as i128 + i128::from(slack)).max(0)).unwrap_or(usize::MAX)
}

/// A view's extent, `(address, bytes)`.
fn extent(v: &DeviceView<'_>) -> (u64, usize) {
    (v.addr(), v.len())
}

fn extent_mut(v: &DeviceViewMut<'_>) -> (u64, usize) {
    (v.addr(), v.len())
}

fn addr(l: &Launch<'_>, i: usize) -> u64 {
    l.args().get::<u64>(i).expect("an 8-byte argument")
}

fn int(l: &Launch<'_>, i: usize) -> i32 {
    l.args().get::<i32>(i).expect("a 4-byte argument")
}

fn float(l: &Launch<'_>, i: usize) -> f32 {
    l.args().get::<f32>(i).expect("a 4-byte argument")
}

/// Packed 4-byte ints `from..to`.
fn ints(l: &Launch<'_>, from: usize, to: usize) -> Vec<i32> {
    (from..to).map(|i| int(l, i)).collect()
}

fn grid(l: &Launch<'_>) -> (u32, u32, u32) {
    let g = l.config().grid;
    (g.x, g.y, g.z)
}

fn block(l: &Launch<'_>) -> (u32, u32, u32) {
    let b = l.config().block;
    (b.x, b.y, b.z)
}

/// A plan's kernel, or its refusal's text.
fn outcome(result: Result<Launch<'_>, tf_cuda::Error>) -> Result<&'static str, String> {
    result.map(|l| l.kernel()).map_err(|e| e.to_string())
}

/// A refusal case: what the message names, and the change of the valid call that breaks that rule.
type Case<C> = (&'static str, fn(&mut C));

/// Plans the valid call `ok` (it must plan), then each case's change of it on its own: each must be refused with a
/// message naming `op` and the case's rule.
fn refusals<C: Copy + std::fmt::Debug>(
    op: &str,
    ok: C,
    cases: &[Case<C>],
    mut plan: impl FnMut(&C) -> Result<&'static str, String>,
) {
    if let Err(e) = plan(&ok) {
        panic!("{op}: the valid call {ok:?} was refused: {e}");
    }
    for (needle, change) in cases {
        let mut call = ok;
        change(&mut call);
        match plan(&call) {
            Ok(kernel) => panic!("{kernel} planned {call:?}; expected a refusal naming {needle:?}"),
            Err(e) => assert!(
                e.contains(&format!("{op}: ")) && e.contains(needle),
                "{call:?}: {e:?} should name {op} and {needle:?}"
            ),
        }
    }
}

/// Whether the bf16 rows a kernel addresses with 16-byte vectors, `rows` x `cols` elements from `addr`, `stride`
/// elements a row (the packed values), lie inside `view` with every row 16-byte aligned and no row overlapping
/// the next. Nothing is addressed when the matrix is empty.
fn rows_inside(view: (u64, usize), addr: u64, rows: i64, cols: i64, stride: i64) -> bool {
    if rows < 0 || cols < 0 {
        return false;
    }
    if rows == 0 || cols == 0 {
        return true;
    }
    if stride < cols
        || cols % 8 != 0
        || stride % 8 != 0
        || !addr.is_multiple_of(16)
        || addr < view.0
    {
        return false;
    }
    let end = u128::from(addr - view.0) + 2 * ((rows as u128 - 1) * stride as u128 + cols as u128);
    end <= view.1 as u128
}

/// The modulation row of activation row `r` (nn::modulation_row in kernels/common/common.cuh).
fn modulation_row(r: i64, seq_len: i64, target_begin: i64, prefix_row: i64) -> i64 {
    let sample = r / seq_len;
    if r - sample * seq_len >= target_begin {
        sample
    } else {
        prefix_row
    }
}

// Strategies. Each operand's wrong kinds are rare, so that a fair share of cases (which break nothing) plan.

/// Counts: mostly small, now and then past the kernels' 32-bit ints or the address space.
fn count() -> impl Strategy<Value = usize> {
    prop_oneof![
        20 => 0usize..14,
        1 => prop_oneof![Just(PAST_I32), Just(usize::MAX / 3)],
    ]
}

/// Columns: mostly whole 16-byte vectors, sometimes not, now and then past a 32-bit int.
fn columns() -> impl Strategy<Value = usize> {
    prop_oneof![
        10 => (0usize..24).prop_map(|c| c * 8),
        1 => 0usize..200,
        1 => Just(PAST_I32),
    ]
}

/// A row stride for `cols` columns by `pick`: dense, padded, short, ragged or past a 32-bit int.
fn stride_for(cols: usize, (pick, extra): (usize, usize)) -> usize {
    match pick {
        0 => cols,
        1 => cols + 8 * extra,
        2 => cols.saturating_sub(8),
        3 => cols + extra,
        _ => PAST_I32,
    }
}

fn stride_pick() -> impl Strategy<Value = (usize, usize)> {
    (
        prop_oneof![6 => Just(0usize), 4 => Just(1usize), 1 => 2usize..5],
        0usize..4,
    )
}

/// Where a view starts in its buffer: mostly 16-byte aligned, sometimes anywhere.
fn skip() -> impl Strategy<Value = usize> {
    prop_oneof![12 => (0usize..3).prop_map(|s| 16 * s), 1 => 0usize..48]
}

/// Where a view starts for an operand of `align`-byte elements: mostly aligned, sometimes anywhere.
fn skip_for(align: usize) -> impl Strategy<Value = usize> {
    prop_oneof![8 => (0usize..8).prop_map(move |s| align * s), 1 => 0usize..32]
}

/// How far a view's length is off what the shape needs: mostly exact or longer, sometimes short.
fn slack() -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => Just(0i64),
        3 => 0i64..64,
        1 => prop_oneof![-24i64..0, Just(1i64 << 20)],
    ]
}

// ---------------------------------------------------------------- SwiGLU

#[test]
fn swiglu_packs_the_fused_matrix_for_either_order() {
    let _serial = test_lock();
    let ctx = test_context();
    // 5 rows of a fused matrix of 2 x 64 columns, rows 136 elements apart; the output's rows 72 apart.
    let layout = mat(5, 128, 136);
    let fused = buf(&ctx, bytes(layout));
    let mut out = buf(&ctx, span_of(5, 64, 72));
    let (fv, ov) = (fused.view(), out.view_mut());
    let plain = plan_swiglu(&fv, layout, &ov, 72).expect("valid call");
    for (order, kernel) in [
        (SwigluOrder::GateValue, "nn_swiglu"),
        (SwigluOrder::ValueGate, "nn_swiglu_value_gate"),
    ] {
        let l = plan_swiglu_ordered(order, &fv, layout, &ov, 72).expect("valid call");
        assert_eq!(l.kernel(), kernel);
        // (fused, its stride, out, its stride, rows, hidden): the kernel finds the second half `hidden` in.
        assert_eq!(l.args().sizes(), [8, 4, 8, 4, 4, 4]);
        assert_eq!((addr(&l, 0), addr(&l, 2)), (fv.addr(), ov.addr()));
        assert_eq!((int(&l, 1), int(&l, 3)), (136, 72));
        assert_eq!((int(&l, 4), int(&l, 5)), (5, 64));
        // One block row a matrix row; 64 columns are 8 vectors, one block of 256 threads.
        assert_eq!((grid(&l), block(&l)), ((5, 1, 1), (ROW_THREADS, 1, 1)));
        assert_eq!(l.config().shared_bytes, 0);
        assert!(!l.is_raw());
    }
    // plan_swiglu is the [gate | up] order.
    assert_eq!(plain.kernel(), "nn_swiglu");
    assert_eq!((addr(&plain, 0), addr(&plain, 2)), (fv.addr(), ov.addr()));
    assert_eq!((int(&plain, 1), int(&plain, 3)), (136, 72));
    assert_eq!((int(&plain, 4), int(&plain, 5)), (5, 64));
    // A hidden width of 4096 (512 vectors): two blocks of 256 threads a row.
    let wide_in = buf(&ctx, 2 * 8192 * 2);
    let mut wide_out = buf(&ctx, 2 * 4096 * 2);
    let (wv, wov) = (wide_in.view(), wide_out.view_mut());
    let l = plan_swiglu(&wv, Matrix::dense(2, 8192), &wov, 4096).expect("wide call");
    assert_eq!((grid(&l), int(&l, 5)), ((2, 2, 1), 4096));
    // No rows: nothing to do, still a launchable grid.
    let l = plan_swiglu(&fv, mat(0, 128, 136), &ov, 72).expect("empty");
    assert_eq!((grid(&l), int(&l, 4)), ((1, 1, 1), 0));
}

/// A SwiGLU call over the fused matrix: its layout, the views' cuts and the output stride.
#[derive(Clone, Copy, Debug)]
struct FusedCall {
    layout: Matrix,
    fused: Cut,
    out: Cut,
    out_stride: usize,
}

#[test]
fn swiglu_names_each_refusal_of_the_fused_matrix() {
    let _serial = test_lock();
    let ctx = test_context();
    let ok = FusedCall {
        layout: mat(5, 128, 136),
        fused: WHOLE,
        out: WHOLE,
        out_stride: 72,
    };
    // (4 x 136 + 128) x 2 and (4 x 72 + 64) x 2 bytes.
    let fused = buf(&ctx, 1344);
    let mut out = buf(&ctx, 704);
    let cases: &[Case<FusedCall>] = &[
        ("120 columns: it must be 2 * hidden", |c| {
            c.layout.cols = 120
        }),
        (
            "fused input: row stride 120 is less than its 128 columns",
            |c| c.layout.stride = 120,
        ),
        (
            "fused input: columns (128) and row stride (140) must be",
            |c| c.layout.stride = 140,
        ),
        ("fused input: device address", |c| c.fused = (8, 0)),
        (
            "fused input: 5 x 128 bf16 with row stride 136 needs 1344 B but the view holds 1342 B",
            |c| c.fused = (0, 2),
        ),
        (
            "out: 5 x 64 bf16 with row stride 72 needs 704 B but the view holds 702 B",
            |c| c.out = (0, 2),
        ),
        ("out: device address", |c| c.out = (4, 0)),
        ("out: row stride 56 is less than its 64 columns", |c| {
            c.out_stride = 56
        }),
        ("out: columns (64) and row stride (68) must be", |c| {
            c.out_stride = 68
        }),
        (
            "gate_up stride = 2147483648 does not fit the kernel's 32-bit int",
            |c| c.layout = mat(1, 128, PAST_I32),
        ),
        ("out stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.out_stride) = (1, PAST_I32)
        }),
        ("rows = 2147483648 does not fit", |c| {
            (c.layout, c.out_stride) = (mat(PAST_I32, 0, 0), 0)
        }),
        ("overflows the address space", |c| {
            c.layout = mat(usize::MAX / 2, 128, 1 << 40)
        }),
    ];
    // Both orders and plan_swiglu refuse alike.
    refusals("swiglu", ok, cases, |c| {
        let (fv, ov) = (cut(&fused, c.fused), cut_mut(&mut out, c.out));
        let plan = |order| outcome(plan_swiglu_ordered(order, &fv, c.layout, &ov, c.out_stride));
        let gate_value = plan(SwigluOrder::GateValue);
        assert_eq!(gate_value.clone().err(), plan(SwigluOrder::ValueGate).err());
        let plain = outcome(plan_swiglu(&fv, c.layout, &ov, c.out_stride));
        assert_eq!(gate_value, plain);
        gate_value
    });
}

/// A SwiGLU call over the two halves apart: their layout, the views' cuts and the output stride.
#[derive(Clone, Copy, Debug)]
struct ApartCall {
    layout: Matrix,
    value: Cut,
    gate: Cut,
    out: Cut,
    out_stride: usize,
}

#[test]
fn swiglu_apart_packs_gate_before_value_and_names_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    let each = mat(5, 64, 72);
    // (4 x 72 + 64) x 2 bytes each; a dense output.
    let (value, gate) = (buf(&ctx, 704), buf(&ctx, 704));
    let mut out = buf(&ctx, 640);
    {
        let (vv, gv, ov) = (value.view(), gate.view(), out.view_mut());
        let l = plan_swiglu_apart(&vv, &gv, each, &ov, 64).expect("valid call");
        assert_eq!(l.kernel(), "nn_swiglu_apart");
        // nn_swiglu_apart(gate, value, in_stride, out, out_stride, rows, hidden): gate first, whatever the
        // planner's parameter order.
        assert_eq!(l.args().sizes(), [8, 8, 4, 8, 4, 4, 4]);
        assert_eq!((addr(&l, 0), addr(&l, 1)), (gv.addr(), vv.addr()));
        assert_eq!((int(&l, 2), addr(&l, 3)), (72, ov.addr()));
        assert_eq!(ints(&l, 4, 7), [64, 5, 64]);
        assert_eq!((grid(&l), block(&l)), ((5, 1, 1), (ROW_THREADS, 1, 1)));
    }
    let ok = ApartCall {
        layout: each,
        value: WHOLE,
        gate: WHOLE,
        out: WHOLE,
        out_stride: 64,
    };
    let cases: &[Case<ApartCall>] = &[
        (
            "value: 5 x 64 bf16 with row stride 72 needs 704 B but the view holds 702 B",
            |c| c.value = (0, 2),
        ),
        (
            "gate: 5 x 64 bf16 with row stride 72 needs 704 B but the view holds 702 B",
            |c| c.gate = (0, 2),
        ),
        ("value: device address", |c| c.value = (8, 0)),
        ("gate: device address", |c| c.gate = (8, 0)),
        ("value: row stride 56 is less than its 64 columns", |c| {
            c.layout.stride = 56
        }),
        ("value: columns (60) and row stride (72) must be", |c| {
            c.layout.cols = 60
        }),
        (
            "out: 5 x 64 bf16 with row stride 64 needs 640 B but the view holds 638 B",
            |c| c.out = (0, 2),
        ),
        ("out: device address", |c| c.out = (8, 0)),
        ("out: row stride 48 is less than its 64 columns", |c| {
            c.out_stride = 48
        }),
        ("input stride = 2147483648 does not fit", |c| {
            c.layout = mat(1, 64, PAST_I32)
        }),
        ("out stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.out_stride) = (1, PAST_I32)
        }),
        ("rows = 2147483648 does not fit", |c| {
            (c.layout, c.out_stride) = (mat(PAST_I32, 0, 0), 0)
        }),
    ];
    refusals("swiglu_apart", ok, cases, |c| {
        let (vv, gv) = (cut(&value, c.value), cut(&gate, c.gate));
        let ov = cut_mut(&mut out, c.out);
        outcome(plan_swiglu_apart(&vv, &gv, c.layout, &ov, c.out_stride))
    });
}

/// Checks a SwiGLU plan: the halves it reads (`gate_at`, `value_at`, rows of the packed input stride) lie in
/// `input`, the output in `out`, and the grid covers every row and vector of the hidden width.
fn check_swiglu_plan(
    l: &Launch<'_>,
    inputs: [((u64, usize), u64); 2],
    in_stride: i32,
    (out, out_at, out_stride): ((u64, usize), u64, i32),
    (rows, hidden): (i32, i32),
) -> Result<(), TestCaseError> {
    let (rows, hidden) = (i64::from(rows), i64::from(hidden));
    for (view, at) in inputs {
        prop_assert!(
            rows_inside(view, at, rows, hidden, i64::from(in_stride)),
            "{rows} x {hidden} at {at:#x}, stride {in_stride}, outside {view:x?}"
        );
    }
    prop_assert!(rows_inside(
        out,
        out_at,
        rows,
        hidden,
        i64::from(out_stride)
    ));
    let (gx, gy, _) = grid(l);
    prop_assert!(i64::from(gx) >= rows && gx >= 1);
    prop_assert!(i64::from(gy) * i64::from(ROW_THREADS) * 8 >= hidden);
    prop_assert_eq!(block(l), (ROW_THREADS, 1, 1));
    prop_assert!(l.config().validate(0).is_ok());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Any fused or split SwiGLU plans or is refused naming the op, never panics; a plan reads both halves and
    /// writes the output only inside the views it was given (the halves at the offsets the kernel adds itself).
    #[test]
    fn swiglu_plans_or_refuses_and_stays_inside(
        kind in 0usize..3,
        rows in count(),
        hidden8 in prop_oneof![10 => 0usize..20, 1 => Just(PAST_I32 / 8)],
        ragged in prop_oneof![8 => Just(0usize), 1 => 1usize..16],
        strides in (stride_pick(), stride_pick()),
        skips in (skip(), skip(), skip()),
        slacks in (slack(), slack(), slack()),
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let hidden = hidden8 * 8 + ragged;
        let mut out = buf(&ctx, 64 << 10);
        let (a, b) = (buf(&ctx, 64 << 10), buf(&ctx, 64 << 10));
        let out_stride = stride_for(hidden, strides.1);
        let ov = region_mut(&mut out, skips.2, with_slack(span_of(rows, hidden, out_stride), slacks.2));
        let out_extent = extent_mut(&ov);
        if kind < 2 {
            let order = if kind == 0 { SwigluOrder::GateValue } else { SwigluOrder::ValueGate };
            let cols = hidden.saturating_mul(2);
            let layout = Matrix { rows, cols, stride: stride_for(cols, strides.0) };
            let fv = region(&a, skips.0, with_slack(bytes(layout), slacks.0));
            match plan_swiglu_ordered(order, &fv, layout, &ov, out_stride) {
                Ok(l) => {
                    prop_assert_eq!(l.kernel(), order.kernel());
                    prop_assert_eq!(l.args().sizes(), &[8, 4, 8, 4, 4, 4]);
                    let (at, h) = (addr(&l, 0), int(&l, 5));
                    prop_assert_eq!(at, fv.addr());
                    prop_assert_eq!(addr(&l, 2), ov.addr());
                    // The second half starts `hidden` elements in (gate second for ValueGate).
                    let second = at + 2 * h as u64;
                    check_swiglu_plan(
                        &l,
                        [(extent(&fv), at), (extent(&fv), second)],
                        int(&l, 1),
                        (out_extent, addr(&l, 2), int(&l, 3)),
                        (int(&l, 4), h),
                    )?;
                    prop_assert_eq!((int(&l, 4) as usize, 2 * h as usize), (rows, cols));
                }
                Err(e) => prop_assert!(e.to_string().contains("swiglu: "), "{}", e),
            }
        } else {
            let layout = Matrix { rows, cols: hidden, stride: stride_for(hidden, strides.0) };
            let vv = region(&a, skips.0, with_slack(bytes(layout), slacks.0));
            let gv = region(&b, skips.1, with_slack(bytes(layout), slacks.1));
            match plan_swiglu_apart(&vv, &gv, layout, &ov, out_stride) {
                Ok(l) => {
                    prop_assert_eq!(l.kernel(), "nn_swiglu_apart");
                    prop_assert_eq!(l.args().sizes(), &[8, 8, 4, 8, 4, 4, 4]);
                    prop_assert_eq!((addr(&l, 0), addr(&l, 1)), (gv.addr(), vv.addr()));
                    check_swiglu_plan(
                        &l,
                        [(extent(&gv), addr(&l, 0)), (extent(&vv), addr(&l, 1))],
                        int(&l, 2),
                        (out_extent, addr(&l, 3), int(&l, 4)),
                        (int(&l, 5), int(&l, 6)),
                    )?;
                    prop_assert_eq!((int(&l, 5) as usize, int(&l, 6) as usize), (rows, hidden));
                }
                Err(e) => prop_assert!(e.to_string().contains("swiglu_apart: "), "{}", e),
            }
        }
    }
}

// ---------------------------------------------------------------- row copy, transpose, timestep embedding

/// A row copy: the source layout, the views' cuts and the destination stride.
#[derive(Clone, Copy, Debug)]
struct CopyCall {
    layout: Matrix,
    src: Cut,
    dst: Cut,
    dst_stride: usize,
}

#[test]
fn copy_rows_packs_both_strides_and_names_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    // 6 rows of 40 columns read from rows 48 apart (a column slice) into dense rows: (5 x 48 + 40) x 2 and
    // 6 x 40 x 2 bytes.
    let src = buf(&ctx, 560);
    let mut dst = buf(&ctx, 480);
    {
        let (sv, dv) = (src.view(), dst.view_mut());
        let l = plan_copy_rows(&sv, mat(6, 40, 48), &dv, 40).expect("valid call");
        assert_eq!(l.kernel(), "nn_copy_rows");
        // nn_copy_rows(src, src_stride, dst, dst_stride, rows, cols)
        assert_eq!(l.args().sizes(), [8, 4, 8, 4, 4, 4]);
        assert_eq!((addr(&l, 0), addr(&l, 2)), (sv.addr(), dv.addr()));
        assert_eq!(
            (int(&l, 1), int(&l, 3), int(&l, 4), int(&l, 5)),
            (48, 40, 6, 40)
        );
        assert_eq!((grid(&l), block(&l)), ((6, 1, 1), (ROW_THREADS, 1, 1)));
    }
    // 2056 columns are 257 vectors: two blocks a row.
    let wide_src = buf(&ctx, 2056 * 2);
    let mut wide_dst = buf(&ctx, 2056 * 2);
    let (wsv, wdv) = (wide_src.view(), wide_dst.view_mut());
    let l = plan_copy_rows(&wsv, Matrix::dense(1, 2056), &wdv, 2056).expect("wide call");
    assert_eq!(grid(&l), (1, 2, 1));

    let ok = CopyCall {
        layout: mat(6, 40, 48),
        src: WHOLE,
        dst: WHOLE,
        dst_stride: 40,
    };
    let cases: &[Case<CopyCall>] = &[
        (
            "src: 6 x 40 bf16 with row stride 48 needs 560 B but the view holds 558 B",
            |c| c.src = (0, 2),
        ),
        (
            "dst: 6 x 40 bf16 with row stride 40 needs 480 B but the view holds 478 B",
            |c| c.dst = (0, 2),
        ),
        ("dst: 6 x 40 bf16 with row stride 48 needs 560 B", |c| {
            c.dst_stride = 48
        }),
        ("dst: row stride 32 is less than its 40 columns", |c| {
            c.dst_stride = 32
        }),
        ("src: columns (36) and row stride (48) must be", |c| {
            c.layout.cols = 36
        }),
        ("dst: columns (40) and row stride (44) must be", |c| {
            c.dst_stride = 44
        }),
        ("src: device address", |c| c.src = (8, 0)),
        ("dst: device address", |c| c.dst = (2, 0)),
        ("src stride = 2147483648 does not fit", |c| {
            c.layout = mat(1, 40, PAST_I32)
        }),
        ("dst stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.dst_stride) = (1, PAST_I32)
        }),
        ("rows = 2147483648 does not fit", |c| {
            (c.layout, c.dst_stride) = (mat(PAST_I32, 0, 0), 0)
        }),
    ];
    refusals("copy_rows", ok, cases, |c| {
        let (sv, dv) = (cut(&src, c.src), cut_mut(&mut dst, c.dst));
        outcome(plan_copy_rows(&sv, c.layout, &dv, c.dst_stride))
    });
}

/// A transpose: the shape and the views' cuts.
#[derive(Clone, Copy, Debug)]
struct TransposeCall {
    rows: usize,
    cols: usize,
    src: Cut,
    dst: Cut,
}

#[test]
fn transpose_tiles_the_matrix_by_32_and_names_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    // 40 x 70 (5600 bytes): 3 tiles of 32 columns by 2 of 32 rows, the last of each partial.
    let src = buf(&ctx, 5600);
    let mut dst = buf(&ctx, 5600);
    {
        let (sv, dv) = (src.view(), dst.view_mut());
        let l = plan_transpose(&sv, &dv, 40, 70).expect("valid call");
        assert_eq!(l.kernel(), "nn_transpose");
        // nn_transpose(src, dst, rows, cols); grid (column tiles, row tiles) of (32, 8) threads.
        assert_eq!(l.args().sizes(), [8, 8, 4, 4]);
        assert_eq!((addr(&l, 0), addr(&l, 1)), (sv.addr(), dv.addr()));
        assert_eq!((int(&l, 2), int(&l, 3)), (40, 70));
        assert_eq!((grid(&l), block(&l)), ((3, 2, 1), (32, 8, 1)));
        // 70 x 40 is the same bytes, the other grid; an empty matrix plans idle tiles.
        let l = plan_transpose(&sv, &dv, 70, 40).expect("valid call");
        assert_eq!(grid(&l), (2, 3, 1));
        let l = plan_transpose(&sv, &dv, 0, 70).expect("empty");
        assert_eq!((grid(&l), int(&l, 2)), ((3, 1, 1), 0));
    }
    let ok = TransposeCall {
        rows: 40,
        cols: 70,
        src: WHOLE,
        dst: WHOLE,
    };
    let cases: &[Case<TransposeCall>] = &[
        ("src: needs 5600 B but the view holds 5598 B", |c| {
            c.src = (0, 2)
        }),
        ("dst: needs 5600 B but the view holds 5598 B", |c| {
            c.dst = (0, 2)
        }),
        ("src: needs 5740 B", |c| c.rows = 41),
        ("rows * cols overflows", |c| {
            (c.rows, c.cols) = (usize::MAX / 2, 3)
        }),
        ("rows = 2147483648 does not fit", |c| {
            (c.rows, c.cols) = (PAST_I32, 0)
        }),
        ("cols = 2147483648 does not fit", |c| {
            (c.rows, c.cols) = (0, PAST_I32)
        }),
        // The kernel moves bf16 elements one at a time: each operand 2-byte aligned.
        ("src: device address", |c| (c.cols, c.src) = (8, (1, 1))),
        ("dst: device address", |c| (c.cols, c.dst) = (8, (1, 1))),
    ];
    refusals("transpose", ok, cases, |c| {
        let (sv, dv) = (cut(&src, c.src), cut_mut(&mut dst, c.dst));
        outcome(plan_transpose(&sv, &dv, c.rows, c.cols))
    });
}

/// A timestep embedding: the batch, the width and the views' cuts.
#[derive(Clone, Copy, Debug)]
struct EmbedCall {
    batch: usize,
    dim: usize,
    t: Cut,
    out: Cut,
}

#[test]
fn timestep_embedding_packs_its_constants_and_names_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    // 3 f32 timesteps; room for 3 rows of the widest embedding, 2048 bf16.
    let t = buf(&ctx, 12);
    let mut out = buf(&ctx, 3 * 2048 * 2);
    {
        let (tv, ov) = (t.view(), out.view_mut());
        let l = plan_timestep_embedding(&tv, &ov, 3, 256, 1000.0, 10_000.0).expect("valid call");
        assert_eq!(l.kernel(), "nn_timestep_embedding");
        // nn_timestep_embedding(t, out, batch, dim, t_scale, max_period): a block a sample, a thread a frequency.
        assert_eq!(l.args().sizes(), [8, 8, 4, 4, 4, 4]);
        assert_eq!((addr(&l, 0), addr(&l, 1)), (tv.addr(), ov.addr()));
        assert_eq!((int(&l, 2), int(&l, 3)), (3, 256));
        assert_eq!((float(&l, 4), float(&l, 5)), (1000.0, 10_000.0));
        assert_eq!((grid(&l), block(&l)), ((3, 1, 1), (128, 1, 1)));
        // The widest embedding is a full block of 1024 threads; no samples still launch one idle block.
        let l = plan_timestep_embedding(&tv, &ov, 3, 2048, 1.0, 10_000.0).expect("widest");
        assert_eq!(block(&l), (1024, 1, 1));
        assert!(l.config().validate(0).is_ok());
        let l = plan_timestep_embedding(&tv, &ov, 0, 256, 1.0, 10_000.0).expect("no samples");
        assert_eq!((grid(&l), int(&l, 2)), ((1, 1, 1), 0));
    }
    let ok = EmbedCall {
        batch: 3,
        dim: 256,
        t: WHOLE,
        out: WHOLE,
    };
    let cases: &[Case<EmbedCall>] = &[
        ("dim 0 must be even and at most 2048", |c| c.dim = 0),
        ("dim 255 must be even and at most 2048", |c| c.dim = 255),
        ("dim 2050 must be even and at most 2048", |c| c.dim = 2050),
        ("t: needs 12 B but the view holds 8 B", |c| c.t = (0, 4)),
        ("t: needs 16 B but the view holds 12 B", |c| c.batch = 4),
        ("out: needs 12288 B but the view holds 12286 B", |c| {
            (c.dim, c.out) = (2048, (0, 2))
        }),
        // A batch past any memory saturates the sizes rather than wrapping them.
        ("t: needs 18446744073709551615 B", |c| c.batch = usize::MAX),
        // t is read as f32 and out written as bf16, one value at a time: 4- and 2-byte aligned.
        ("t: device address", |c| (c.batch, c.t) = (1, (2, 2))),
        ("out: device address", |c| c.out = (1, 1)),
    ];
    refusals("timestep_embedding", ok, cases, |c| {
        let (tv, ov) = (cut(&t, c.t), cut_mut(&mut out, c.out));
        outcome(plan_timestep_embedding(
            &tv, &ov, c.batch, c.dim, 1.0, 10_000.0,
        ))
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any strided row copy plans or is refused by name; a plan reads and writes only rows inside its views.
    #[test]
    fn copy_rows_plans_or_refuses_and_stays_inside(
        rows in count(),
        cols in columns(),
        strides in (stride_pick(), stride_pick()),
        skips in (skip(), skip()),
        slacks in (slack(), slack()),
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let src = buf(&ctx, 64 << 10);
        let mut dst = buf(&ctx, 64 << 10);
        let layout = Matrix { rows, cols, stride: stride_for(cols, strides.0) };
        let dst_stride = stride_for(cols, strides.1);
        let sv = region(&src, skips.0, with_slack(bytes(layout), slacks.0));
        let dv = region_mut(&mut dst, skips.1, with_slack(span_of(rows, cols, dst_stride), slacks.1));
        match plan_copy_rows(&sv, layout, &dv, dst_stride) {
            Ok(l) => {
                prop_assert_eq!(l.args().sizes(), &[8, 4, 8, 4, 4, 4]);
                let (r, c) = (i64::from(int(&l, 4)), i64::from(int(&l, 5)));
                prop_assert_eq!((r as usize, c as usize), (rows, cols));
                prop_assert!(rows_inside(extent(&sv), addr(&l, 0), r, c, i64::from(int(&l, 1))));
                prop_assert!(rows_inside(extent_mut(&dv), addr(&l, 2), r, c, i64::from(int(&l, 3))));
                let (gx, gy, _) = grid(&l);
                prop_assert!(i64::from(gx) >= r && i64::from(gy) * 2048 >= c);
                prop_assert!(l.config().validate(0).is_ok());
            }
            Err(e) => prop_assert!(e.to_string().contains("copy_rows: "), "{}", e),
        }
    }

    /// Any transpose plans or is refused by name; a plan's source and destination hold rows x cols bf16 elements
    /// at 2-byte aligned addresses inside their views, and its 32 x 32 tiles cover the matrix.
    #[test]
    fn transpose_plans_or_refuses_and_stays_inside(
        rows in prop_oneof![8 => 0usize..100, 1 => Just(PAST_I32), 1 => Just(usize::MAX / 3)],
        cols in prop_oneof![8 => 0usize..100, 1 => Just(PAST_I32)],
        skips in (skip_for(2), skip_for(2)),
        slacks in (slack(), slack()),
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let src = buf(&ctx, 32 << 10);
        let mut dst = buf(&ctx, 32 << 10);
        let need = rows.saturating_mul(cols).saturating_mul(2);
        let sv = region(&src, skips.0, with_slack(need, slacks.0));
        let dv = region_mut(&mut dst, skips.1, with_slack(need, slacks.1));
        match plan_transpose(&sv, &dv, rows, cols) {
            Ok(l) => {
                prop_assert_eq!(l.args().sizes(), &[8, 8, 4, 4]);
                let (r, c) = (int(&l, 2) as u64, int(&l, 3) as u64);
                prop_assert_eq!((r as usize, c as usize), (rows, cols));
                for (at, (base, len)) in [(addr(&l, 0), extent(&sv)), (addr(&l, 1), extent_mut(&dv))] {
                    prop_assert!(at == base && at % 2 == 0, "{:#x} in {:#x}", at, base);
                    prop_assert!(u128::from(r * c * 2) <= len as u128);
                }
                let (gx, gy, _) = grid(&l);
                prop_assert!(u64::from(gx) * 32 >= c && u64::from(gy) * 32 >= r && gx >= 1 && gy >= 1);
                prop_assert_eq!(block(&l), (32, 8, 1));
            }
            Err(e) => prop_assert!(e.to_string().contains("transpose: "), "{}", e),
        }
    }

    /// Any timestep embedding plans or is refused by name; a plan reads `batch` aligned f32 timesteps and writes
    /// `batch` rows of `dim` aligned bf16 inside its views, with a block of `dim / 2` threads the GPU can run.
    #[test]
    fn timestep_embedding_plans_or_refuses_and_stays_inside(
        batch in prop_oneof![8 => 0usize..40, 1 => Just(PAST_I32), 1 => Just(usize::MAX)],
        dim in prop_oneof![4 => (0usize..1030).prop_map(|h| 2 * h), 1 => 0usize..3000],
        skips in (skip_for(4), skip_for(2)),
        slacks in (slack(), slack()),
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let t = buf(&ctx, 4 << 10);
        let mut out = buf(&ctx, 192 << 10);
        let sv = region(&t, skips.0, with_slack(batch.saturating_mul(4), slacks.0));
        let ov = region_mut(&mut out, skips.1, with_slack(batch.saturating_mul(dim).saturating_mul(2), slacks.1));
        match plan_timestep_embedding(&sv, &ov, batch, dim, 1000.0, 10_000.0) {
            Ok(l) => {
                let (b, d) = (int(&l, 2) as u64, int(&l, 3) as u64);
                prop_assert_eq!((b as usize, d as usize), (batch, dim));
                prop_assert!(d >= 2 && d % 2 == 0 && d <= 2048);
                let (t_at, out_at) = (addr(&l, 0), addr(&l, 1));
                prop_assert!(t_at == sv.addr() && t_at % 4 == 0 && u128::from(b * 4) <= sv.len() as u128);
                prop_assert!(out_at == ov.addr() && out_at % 2 == 0 && u128::from(b * d * 2) <= ov.len() as u128);
                prop_assert!(u64::from(grid(&l).0) >= b);
                prop_assert_eq!(u64::from(block(&l).0), d / 2);
                prop_assert!(l.config().validate(0).is_ok());
            }
            Err(e) => prop_assert!(e.to_string().contains("timestep_embedding: "), "{}", e),
        }
    }
}

// ---------------------------------------------------------------- zero-centred RMSNorm

/// A zero-centred RMSNorm: x's layout, y's stride and the views' cuts.
#[derive(Clone, Copy, Debug)]
struct NormCall {
    layout: Matrix,
    y_stride: usize,
    x: Cut,
    y: Cut,
    weight: Cut,
}

#[test]
fn rms_norm_zc_packs_one_block_a_row_and_names_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    // 3 rows of 3072, x's rows 3136 apart, y dense: (2 x 3136 + 3072) x 2 and 3 x 3072 x 2 bytes.
    let x = buf(&ctx, 18_688);
    let mut y = buf(&ctx, 18_432);
    let w = buf(&ctx, 3072 * 2);
    {
        let (xv, yv, wv) = (x.view(), y.view_mut(), w.view());
        let l = plan_rms_norm_zc(&xv, mat(3, 3072, 3136), &yv, 3072, &wv, 1e-6).expect("valid");
        assert_eq!(l.kernel(), "nn_rms_norm_zc");
        // nn_rms_norm_zc(x, x_stride, y, y_stride, weight, rows, cols, eps)
        assert_eq!(l.args().sizes(), [8, 4, 8, 4, 8, 4, 4, 4]);
        assert_eq!(
            (addr(&l, 0), addr(&l, 2), addr(&l, 4)),
            (xv.addr(), yv.addr(), wv.addr())
        );
        assert_eq!(
            (int(&l, 1), int(&l, 3), int(&l, 5), int(&l, 6)),
            (3136, 3072, 3, 3072)
        );
        assert_eq!(float(&l, 7), 1e-6);
        assert_eq!((grid(&l), block(&l)), ((3, 1, 1), (ROW_THREADS, 1, 1)));
        // The narrowest row, and no rows at all (one idle block).
        let l = plan_rms_norm_zc(&xv, Matrix::dense(1, 8), &yv, 8, &wv, 0.0).expect("8 columns");
        assert_eq!(int(&l, 6), 8);
        let l = plan_rms_norm_zc(&xv, mat(0, 3072, 3136), &yv, 3072, &wv, 1e-6).expect("no rows");
        assert_eq!((grid(&l), int(&l, 5)), ((1, 1, 1), 0));
        // A NaN or negative epsilon makes NaN rows: refused by name.
        for eps in [f32::NAN, -1e-6, f32::INFINITY] {
            let err = plan_rms_norm_zc(&xv, mat(3, 3072, 3136), &yv, 3072, &wv, eps)
                .err()
                .map(|e| e.to_string());
            assert!(err.is_some_and(|m| m.contains("rms_norm_zc: eps")), "{eps}");
        }
    }
    // The widest row the kernel holds in registers.
    let widest = Matrix::dense(1, MAX_NORM_COLS);
    let (wx, ww) = (buf(&ctx, bytes(widest)), buf(&ctx, bytes(widest)));
    let mut wy = buf(&ctx, bytes(widest));
    let (wxv, wyv, wwv) = (wx.view(), wy.view_mut(), ww.view());
    let l = plan_rms_norm_zc(&wxv, widest, &wyv, MAX_NORM_COLS, &wwv, 1e-6).expect("widest");
    assert_eq!(int(&l, 6), 8192);

    let ok = NormCall {
        layout: mat(3, 3072, 3136),
        y_stride: 3072,
        x: WHOLE,
        y: WHOLE,
        weight: WHOLE,
    };
    let cases: &[Case<NormCall>] = &[
        (
            "rows of 0 columns: the kernel normalises 8..=8192 columns",
            |c| c.layout.cols = 0,
        ),
        ("rows of 8200 columns", |c| {
            (c.layout, c.y_stride) = (mat(1, 8200, 8200), 8200)
        }),
        (
            "x: 3 x 3072 bf16 with row stride 3136 needs 18688 B but the view holds 18686 B",
            |c| c.x = (0, 2),
        ),
        (
            "y: 3 x 3072 bf16 with row stride 3072 needs 18432 B but the view holds 18430 B",
            |c| c.y = (0, 2),
        ),
        (
            "weight: 1 x 3072 bf16 with row stride 3072 needs 6144 B but the view holds 6128 B",
            |c| c.weight = (0, 16),
        ),
        ("y: row stride 3064 is less than its 3072 columns", |c| {
            c.y_stride = 3064
        }),
        ("x: columns (3068) and row stride (3136) must be", |c| {
            c.layout.cols = 3068
        }),
        ("x: device address", |c| c.x = (8, 0)),
        ("y: device address", |c| c.y = (8, 0)),
        ("weight: device address", |c| c.weight = (8, 0)),
        ("x stride = 2147483648 does not fit", |c| {
            c.layout = mat(1, 3072, PAST_I32)
        }),
        ("y stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.y_stride) = (1, PAST_I32)
        }),
    ];
    refusals("rms_norm_zc", ok, cases, |c| {
        let (xv, wv, yv) = (cut(&x, c.x), cut(&w, c.weight), cut_mut(&mut y, c.y));
        outcome(plan_rms_norm_zc(&xv, c.layout, &yv, c.y_stride, &wv, 1e-6))
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any zero-centred RMSNorm plans or is refused by name; a plan normalises 8..=8192 columns (what the kernel
    /// holds in registers) with one block a row, reading x and the weight and writing y only inside their views.
    #[test]
    fn rms_norm_zc_plans_or_refuses_and_stays_inside(
        rows in count(),
        cols in prop_oneof![
            6 => (0usize..1030).prop_map(|c| 8 * c),
            1 => Just(MAX_NORM_COLS),
            1 => Just(MAX_NORM_COLS + 8),
            1 => 0usize..9000,
        ],
        strides in (stride_pick(), stride_pick()),
        skips in (skip(), skip(), skip()),
        slacks in (slack(), slack(), slack()),
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let (x, w) = (buf(&ctx, 256 << 10), buf(&ctx, 20 << 10));
        let mut y = buf(&ctx, 256 << 10);
        let layout = Matrix { rows, cols, stride: stride_for(cols, strides.0) };
        let y_stride = stride_for(cols, strides.1);
        let xv = region(&x, skips.0, with_slack(bytes(layout), slacks.0));
        let yv = region_mut(&mut y, skips.1, with_slack(span_of(rows, cols, y_stride), slacks.1));
        let wv = region(&w, skips.2, with_slack(cols.saturating_mul(2), slacks.2));
        match plan_rms_norm_zc(&xv, layout, &yv, y_stride, &wv, 1e-6) {
            Ok(l) => {
                prop_assert_eq!(l.args().sizes(), &[8, 4, 8, 4, 8, 4, 4, 4]);
                let (r, c) = (i64::from(int(&l, 5)), i64::from(int(&l, 6)));
                prop_assert_eq!((r as usize, c as usize), (rows, cols));
                prop_assert!((8..=MAX_NORM_COLS as i64).contains(&c));
                prop_assert!(rows_inside(extent(&xv), addr(&l, 0), r, c, i64::from(int(&l, 1))));
                prop_assert!(rows_inside(extent_mut(&yv), addr(&l, 2), r, c, i64::from(int(&l, 3))));
                prop_assert!(rows_inside(extent(&wv), addr(&l, 4), 1, c, c));
                prop_assert!(i64::from(grid(&l).0) >= r);
                prop_assert_eq!(block(&l), (ROW_THREADS, 1, 1));
                prop_assert!(l.config().validate(0).is_ok());
            }
            Err(e) => prop_assert!(e.to_string().contains("rms_norm_zc: "), "{}", e),
        }
    }
}

// ---------------------------------------------------------------- bf16 GEMM

/// The test driver's digest of a tensor map (tf-testdriver's `cuTensorMapEncodeTiled`): word 0 the type and rank,
/// word 1 the address, then the three dimensions, the two strides and the three box dimensions.
struct MapDigest {
    data_type: u64,
    rank: u64,
    base: u64,
    dims: [u64; 3],
    row_stride: u64,
    boxes: [u64; 3],
}

fn map_digest(l: &Launch<'_>, i: usize) -> MapDigest {
    let w = l
        .args()
        .get::<[u64; 16]>(i)
        .unwrap_or_else(|| panic!("argument {i} is not a 128-byte tensor map"));
    MapDigest {
        data_type: w[0] & 0xff,
        rank: (w[0] >> 8) & 0xff,
        base: w[1],
        dims: [w[2], w[3], w[4]],
        row_stride: w[5],
        boxes: [w[7], w[8], w[9]],
    }
}

/// Checks a bf16 GEMM plan against its operands: the maps describe x `{K, M, 1}` and w `{K, N, 1}` (boxes of 64 x
/// 128 and 64 x 256, bf16, dense rows of K) inside their extents; y's rows lie inside its extent; the persistent grid
/// is at most one CTA an SM and no more than the tiles.
fn check_bf16_gemm_plan(
    l: &Launch<'_>,
    sm_count: usize,
    (x, w, y): ((u64, usize), (u64, usize), (u64, usize)),
) -> Result<(), TestCaseError> {
    prop_assert_eq!(l.kernel(), GEMM_INT8_KERNELS[1]);
    // nn_gemm_bf16(tm_x, tm_w, y, y_row_stride (int64), m, n, k, band)
    prop_assert_eq!(l.args().sizes(), &[128, 128, 8, 8, 4, 4, 4, 4]);
    let (m, n, k) = (int(l, 4) as u64, int(l, 5) as u64, int(l, 6) as u64);
    prop_assert!(m > 0 && n > 0 && k > 0 && n % 2 == 0 && k % 8 == 0);
    for (index, (base, len), rows, box_rows) in [(0, x, m, TILE_ROWS), (1, w, n, TILE_COLS)] {
        let map = map_digest(l, index);
        prop_assert_eq!((map.data_type, map.rank), (9, 3)); // CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank 3
        prop_assert_eq!(map.base, base);
        prop_assert_eq!(map.dims, [k, rows, 1]);
        prop_assert_eq!(map.row_stride, 2 * k);
        prop_assert_eq!(map.boxes, [64, box_rows as u64, 1]);
        prop_assert!(base % 16 == 0);
        prop_assert!(u128::from(rows) * u128::from(map.row_stride) <= len as u128);
    }
    let (y_at, y_stride) = (addr(l, 2), l.args().get::<i64>(3).unwrap());
    prop_assert_eq!(y_at, y.0);
    prop_assert!(y_stride >= n as i64 && y_stride % 2 == 0 && y_at % 16 == 0);
    let y_end = 2 * ((u128::from(m) - 1) * y_stride as u128 + u128::from(n));
    prop_assert!(y_end <= y.1 as u128);
    let tiles = m.div_ceil(TILE_ROWS as u64) * n.div_ceil(TILE_COLS as u64);
    let gx = u64::from(grid(l).0);
    prop_assert!(gx >= 1 && gx <= tiles && gx <= sm_count.max(1) as u64);
    prop_assert_eq!(gx, tiles.min(sm_count.max(1) as u64));
    prop_assert_eq!(block(l), (384, 1, 1));
    prop_assert_eq!(l.config().shared_bytes, SHARED_BYTES);
    prop_assert!(l.config().validate(SHARED_BYTES).is_ok());
    // The tile order's band: a bf16 GEMM's default order (TF_GEMM_BAND unset: bands) for this shape.
    let gemm = shape(m as usize, n as usize, k as usize);
    let band = int(l, 7) as usize;
    prop_assert_eq!(band, gemm.band_tiles(2, sm_count, TileBand::default_for(2)));
    prop_assert!(band >= 1 && band as u64 <= m.div_ceil(TILE_ROWS as u64));
    Ok(())
}

fn shape(m: usize, n: usize, k: usize) -> Int8GemmShape {
    Int8GemmShape { m, n, k }
}

/// A bf16 GEMM over views: the shape, y's row stride and the views' cuts.
#[derive(Clone, Copy, Debug)]
struct GemmCall {
    shape: Int8GemmShape,
    y_stride: usize,
    x: Cut,
    w: Cut,
    y: Cut,
}

#[test]
fn bf16_gemm_packs_two_maps_and_the_output_over_views_or_spans() {
    let _serial = test_lock();
    let ctx = test_context();
    // 200 x 300 over K = 136 (two K slices, the second partial): 2 x 2 tiles of 128 x 256; y's rows 304 apart,
    // (199 x 304 + 300) x 2 bytes.
    let ok_shape = shape(200, 300, 136);
    let x = buf(&ctx, 200 * 136 * 2);
    let w = buf(&ctx, 300 * 136 * 2);
    let mut y = buf(&ctx, 121_592);
    let (xv, wv) = (x.view(), w.view());
    let span = |b: &DeviceBuffer| DeviceSpan::new(b.addr(), b.len());
    let (xs, ws, ys) = (span(&x), span(&w), span(&y));
    for (sms, ctas) in [(132, 4), (3, 3), (0, 1)] {
        let mut yv = y.view_mut();
        let y_extent = extent_mut(&yv);
        let l = plan_bf16_gemm(&ctx, sms, ok_shape, (&xv, &wv), &mut yv, 304).expect("valid call");
        assert!(!l.is_raw());
        assert_eq!(grid(&l), (ctas, 1, 1));
        assert_eq!(ints(&l, 4, 7), [200, 300, 136]);
        assert_eq!(l.args().get::<i64>(3), Some(304));
        check_bf16_gemm_plan(&l, sms, (extent(&xv), extent(&wv), y_extent)).expect("covers");
        // Over raw spans of the same memory: the same launch, marked raw (only an unsafe submit takes it).
        let raw = plan_bf16_gemm_spans(&ctx, sms, ok_shape, (xs, ws), ys, 304).expect("spans");
        assert!(raw.is_raw());
        assert_eq!((raw.kernel(), raw.config()), (l.kernel(), l.config()));
        for i in 0..2 {
            assert_eq!(raw.args().get::<[u64; 16]>(i), l.args().get::<[u64; 16]>(i));
        }
        assert_eq!(
            (addr(&raw, 2), raw.args().get::<i64>(3)),
            (addr(&l, 2), Some(304))
        );
        assert_eq!(ints(&raw, 4, 7), ints(&l, 4, 7));
    }
    // The shape rules, then each operand (x, w, y in that order), as the messages name them.
    let ok = GemmCall {
        shape: ok_shape,
        y_stride: 304,
        x: WHOLE,
        w: WHOLE,
        y: WHOLE,
    };
    let cases: &[Case<GemmCall>] = &[
        ("empty GEMM", |c| c.shape.m = 0),
        ("empty GEMM", |c| c.shape.k = 0),
        ("N = 301 is odd", |c| c.shape.n = 301),
        ("K = 100 is not a multiple of 8", |c| c.shape.k = 100),
        ("x: needs 54672 B but the view holds 54400 B", |c| {
            c.shape.m = 201
        }),
        ("w: needs 82144 B but the view holds 81600 B", |c| {
            c.shape.n = 302
        }),
        ("x: needs 54400 B but the view holds 54398 B", |c| {
            c.x = (0, 2)
        }),
        ("x: device address", |c| c.x = (8, 0)),
        ("w: device address", |c| c.w = (8, 0)),
        ("y: device address", |c| c.y = (8, 0)),
        ("y row stride 298 must be even and at least N = 300", |c| {
            c.y_stride = 298
        }),
        ("y row stride 301 must be even and at least N = 300", |c| {
            c.y_stride = 301
        }),
        ("y: needs 122388 B but the view holds 121592 B", |c| {
            c.y_stride = 306
        }),
    ];
    refusals("bf16 GEMM", ok, cases, |c| {
        let (xv, wv, mut yv) = (cut(&x, c.x), cut(&w, c.w), cut_mut(&mut y, c.y));
        outcome(plan_bf16_gemm(
            &ctx,
            132,
            c.shape,
            (&xv, &wv),
            &mut yv,
            c.y_stride,
        ))
    });
    // Sizes past the address space or the kernel's ints, over spans as large as they need (planning reads no
    // memory): each refused by name.
    let huge = DeviceSpan::new(0x1_0000_0000, 1 << 60);
    for (s, needle) in [
        (shape(usize::MAX / 2, 2, 8), "bf16 GEMM: x: size"),
        (
            shape(PAST_I32, 2, 8),
            "bf16 GEMM: M = 2147483648 does not fit",
        ),
        (
            shape((1 << 32) + 128, 2, 8),
            "tensor map: dimension over 2^32",
        ),
        // 2^24 x 2^12 tiles; the tile rule is shared with the INT8 GEMM (Int8GemmShape::grid), whose name the
        // message carries.
        (
            shape(PAST_I32 - 1, 1 << 20, 8),
            "tiles = 68719476736 does not fit the kernel's 32-bit int",
        ),
    ] {
        let err = outcome(plan_bf16_gemm_spans(&ctx, 132, s, (huge, huge), huge, s.n));
        assert!(
            err.as_ref().is_err_and(|e| e.contains(needle)),
            "{s:?}: {err:?}"
        );
    }
    // A raw span out of alignment is refused as a view is.
    let odd = DeviceSpan::new(x.addr() + 4, x.len() - 4);
    let err = outcome(plan_bf16_gemm_spans(
        &ctx,
        132,
        ok_shape,
        (odd, ws),
        ys,
        304,
    ));
    assert!(
        err.as_ref()
            .is_err_and(|e| e.contains("bf16 GEMM: x: device address")),
        "{err:?}"
    );
    // The driver's refusal to encode a map names the entry point, and lasts one call.
    let control = tf_testdriver::Control::open().expect("the test driver's controls");
    assert!(control.fail_call("cuTensorMapEncodeTiled", 1, 1, 1));
    let err = outcome(plan_bf16_gemm_spans(&ctx, 132, ok_shape, (xs, ws), ys, 304));
    assert!(
        err.as_ref()
            .is_err_and(|e| e.contains("cuTensorMapEncodeTiled")),
        "{err:?}"
    );
    plan_bf16_gemm_spans(&ctx, 132, ok_shape, (xs, ws), ys, 304).expect("one refusal only");
}

fn gemm_dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => 0usize..700,
        8 => (1usize..100).prop_map(|d| 8 * d),
        1 => prop_oneof![Just(PAST_I32), Just((1 << 32) + 128), Just(usize::MAX / 4)],
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Any bf16 GEMM over any spans plans or is refused by name (its own checks or the tensor map's rules), never
    /// panics; a plan's maps describe exactly the dense operands inside their spans and y's rows lie in its span.
    #[test]
    fn bf16_gemm_spans_plan_or_refuse_and_stay_inside(
        (m, n, k) in (gemm_dim(), gemm_dim(), gemm_dim()),
        stride in (prop_oneof![6 => Just(0usize), 3 => Just(2usize), 1 => Just(3usize), 1 => Just(4usize)], 0usize..40),
        misalign in prop::array::uniform3(prop_oneof![10 => Just(0u64), 1 => 1u64..16]),
        slacks in prop::array::uniform3(prop_oneof![8 => Just(0i64), 3 => 0i64..64, 1 => -64i64..0, 1 => Just(1i64 << 50)]),
        sms in 0usize..200,
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let y_stride = match stride.0 {
            0 | 1 => n,
            2 => n + 2 * stride.1,
            3 => n.saturating_sub(stride.1),
            _ => n + 1,
        };
        let needs = [
            m.saturating_mul(k).saturating_mul(2),
            n.saturating_mul(k).saturating_mul(2),
            span_of(m, n, y_stride),
        ];
        let spans: Vec<DeviceSpan> = (0..3)
            .map(|i| DeviceSpan::new(((i as u64 + 1) << 56) + misalign[i], with_slack(needs[i], slacks[i])))
            .collect();
        let shape = Int8GemmShape { m, n, k };
        match plan_bf16_gemm_spans(&ctx, sms, shape, (spans[0], spans[1]), spans[2], y_stride) {
            Ok(l) => {
                prop_assert!(l.is_raw());
                prop_assert!(shape.check_bf16().is_ok());
                prop_assert_eq!(
                    (int(&l, 4) as usize, int(&l, 5) as usize, int(&l, 6) as usize),
                    (m, n, k)
                );
                let at = |s: DeviceSpan| (s.addr, s.bytes);
                check_bf16_gemm_plan(&l, sms, (at(spans[0]), at(spans[1]), at(spans[2])))?;
            }
            Err(e) => {
                let text = e.to_string();
                // An operand of 1 TiB or more passes the tensor-map pre-checks, but the batch stride the encoder
                // gives a batch of one (rows x row stride) is then past the driver's 2^40, and the driver refuses
                // it, naming the entry point.
                let tib = |rows: usize| rows.saturating_mul(k).saturating_mul(2) >= 1 << 40;
                let by_driver = text.contains("cuTensorMapEncodeTiled") && (tib(m) || tib(n));
                prop_assert!(
                    text.contains("bf16 GEMM: ") || text.contains("tensor map: ") || by_driver,
                    "{}",
                    text
                );
            }
        }
    }
}

// ---------------------------------------------------------------- Qwen-Image adaLN kernels

/// One block of the modulation tensor: its rows and row stride, and the block's first column.
#[derive(Clone, Copy, Debug)]
struct Block {
    rows: usize,
    stride: usize,
    offset: usize,
}

/// A call of one of the adaLN kernels: x's layout, y's and out's strides, the views' cuts (x, y, out, modulation),
/// the gate and scale blocks (the scale's in a second tensor when `scale_apart`) and the modulation-row rule.
/// `adaln_modulate` reads x and writes y with the scale; `gated_residual` updates x from y with the gate;
/// `gated_residual_adaln` does that and writes out with the scale.
#[derive(Clone, Copy, Debug)]
struct AdalnCall {
    layout: Matrix,
    y_stride: usize,
    out_stride: usize,
    cuts: [Cut; 4],
    gate: Block,
    scale: Block,
    scale_apart: bool,
    select: ModulationRows,
}

const fn blk(rows: usize, stride: usize, offset: usize) -> Block {
    Block {
        rows,
        stride,
        offset,
    }
}

/// Block `b` of the modulation tensor `data`.
fn modulation<'v, 'a>(data: &'v DeviceView<'a>, b: Block) -> Modulation<'v, 'a> {
    Modulation {
        data,
        rows: b.rows,
        stride: b.stride,
        offset: b.offset,
    }
}

impl AdalnCall {
    /// Changes both blocks alike (a change of the modulation tensor every kernel sees).
    fn blocks(&mut self, change: fn(&mut Block)) {
        change(&mut self.gate);
        change(&mut self.scale);
    }
}

/// The valid call: 6 rows of 64 columns (x's rows 72 apart, y dense, out's rows 80 apart) in 2 samples of 3 tokens,
/// the first token of each a prefix token (modulation row 2), the others their sample's row; a modulation tensor of
/// 3 rows of 256 (4 blocks of 64), the gate at column 128 and the scale at 64.
const ADALN_OK: AdalnCall = AdalnCall {
    layout: mat(6, 64, 72),
    y_stride: 64,
    out_stride: 80,
    cuts: [WHOLE; 4],
    gate: blk(3, 256, 128),
    scale: blk(3, 256, 64),
    scale_apart: false,
    select: sel(3, 1, 2),
};

/// The adaLN kernels' operands: x (848 B), y (768 B), out (928 B), the modulation tensor and a second one.
struct AdalnBuffers {
    x: DeviceBuffer,
    y: DeviceBuffer,
    out: DeviceBuffer,
    modulation: DeviceBuffer,
    other: DeviceBuffer,
}

impl AdalnBuffers {
    fn new(ctx: &Context) -> AdalnBuffers {
        AdalnBuffers {
            x: buf(ctx, span_of(6, 64, 72)),
            y: buf(ctx, span_of(6, 64, 64)),
            out: buf(ctx, span_of(6, 64, 80)),
            modulation: buf(ctx, 3 * 256 * 2),
            other: buf(ctx, 3 * 256 * 2),
        }
    }

    /// Plans kernel `kernel` (0 adaln_modulate, 1 gated_residual, 2 gated_residual_adaln) for `c`.
    fn plan(&mut self, kernel: usize, c: &AdalnCall) -> Result<&'static str, String> {
        let [xc, yc, oc, mc] = c.cuts;
        let (mv, other) = (cut(&self.modulation, mc), self.other.view());
        let gate = modulation(&mv, c.gate);
        let scale = modulation(if c.scale_apart { &other } else { &mv }, c.scale);
        let (layout, select) = (c.layout, c.select);
        if kernel == 0 {
            let (xv, yv) = (cut(&self.x, xc), cut_mut(&mut self.y, yc));
            return outcome(plan_adaln_modulate(
                &xv, layout, &yv, c.y_stride, &scale, select, 1e-6,
            ));
        }
        let (xv, yv) = (cut_mut(&mut self.x, xc), cut(&self.y, yc));
        if kernel == 1 {
            return outcome(plan_gated_residual(
                &xv, layout, &yv, c.y_stride, &gate, select,
            ));
        }
        let ov = cut_mut(&mut self.out, oc);
        outcome(plan_gated_residual_adaln(
            &xv,
            layout,
            &yv,
            c.y_stride,
            &ov,
            c.out_stride,
            &gate,
            &scale,
            select,
            1e-6,
        ))
    }
}

const ADALN_OPS: [&str; 3] = ["adaln_modulate", "gated_residual", "gated_residual_adaln"];

#[test]
fn adaln_kernels_pack_the_modulation_rule_in_their_parameter_order() {
    let _serial = test_lock();
    let ctx = test_context();
    let b = AdalnBuffers::new(&ctx);
    let (xv, yv, mv) = (b.x.view(), b.y.view(), b.modulation.view());
    let (mut xm, mut ym, mut om) = (
        buf(&ctx, b.x.len()),
        buf(&ctx, b.y.len()),
        buf(&ctx, b.out.len()),
    );
    let (xw, yw, ow) = (xm.view_mut(), ym.view_mut(), om.view_mut());
    let (gate, scale) = (
        modulation(&mv, ADALN_OK.gate),
        modulation(&mv, ADALN_OK.scale),
    );
    let (layout, select) = (ADALN_OK.layout, ADALN_OK.select);
    // qi_adaln_modulate(x, x_stride, y, y_stride, mod, mod_stride, mod_offset, rows, cols, seq_len,
    // target_begin, prefix_row, eps): one block a row.
    let l = plan_adaln_modulate(&xv, layout, &yw, 64, &scale, select, 1e-6).expect("valid call");
    assert_eq!(l.kernel(), "qi_adaln_modulate");
    assert_eq!(l.args().sizes(), [8, 4, 8, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4]);
    assert_eq!(
        (addr(&l, 0), addr(&l, 2), addr(&l, 4)),
        (xv.addr(), yw.addr(), mv.addr())
    );
    assert_eq!((int(&l, 1), int(&l, 3)), (72, 64));
    assert_eq!(ints(&l, 5, 12), [256, 64, 6, 64, 3, 1, 2]);
    assert_eq!(float(&l, 12), 1e-6);
    assert_eq!((grid(&l), block(&l)), ((6, 1, 1), (ROW_THREADS, 1, 1)));
    // qi_gated_residual(x, x_stride, y, y_stride, mod, mod_stride, mod_offset, rows, cols, seq_len, target_begin,
    // prefix_row): no eps; a row grid.
    let l = plan_gated_residual(&xw, layout, &yv, 64, &gate, select).expect("valid call");
    assert_eq!(l.kernel(), "qi_gated_residual");
    assert_eq!(l.args().sizes(), [8, 4, 8, 4, 8, 4, 4, 4, 4, 4, 4, 4]);
    assert_eq!(
        (addr(&l, 0), addr(&l, 2), addr(&l, 4)),
        (xw.addr(), yv.addr(), mv.addr())
    );
    assert_eq!((int(&l, 1), int(&l, 3)), (72, 64));
    assert_eq!(ints(&l, 5, 12), [256, 128, 6, 64, 3, 1, 2]);
    assert_eq!((grid(&l), block(&l)), ((6, 1, 1), (ROW_THREADS, 1, 1)));
    // qi_gated_residual_adaln(x, x_stride, y, y_stride, out, out_stride, mod, mod_stride, gate_offset,
    // scale_offset, rows, cols, seq_len, target_begin, prefix_row, eps): one block a row.
    let l = plan_gated_residual_adaln(&xw, layout, &yv, 64, &ow, 80, &gate, &scale, select, 1e-6)
        .expect("valid call");
    assert_eq!(l.kernel(), "qi_gated_residual_adaln");
    assert_eq!(
        l.args().sizes(),
        [8, 4, 8, 4, 8, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    );
    assert_eq!(
        (addr(&l, 0), addr(&l, 2), addr(&l, 4), addr(&l, 6)),
        (xw.addr(), yv.addr(), ow.addr(), mv.addr())
    );
    assert_eq!((int(&l, 1), int(&l, 3), int(&l, 5)), (72, 64, 80));
    assert_eq!(ints(&l, 7, 15), [256, 128, 64, 6, 64, 3, 1, 2]);
    assert_eq!(float(&l, 15), 1e-6);
    assert_eq!((grid(&l), block(&l)), ((6, 1, 1), (ROW_THREADS, 1, 1)));
    // A NaN or negative epsilon makes NaN rows: both norms refuse it by name.
    for eps in [f32::NAN, -1e-6, f32::INFINITY] {
        let refused = |r: Result<_, tf_cuda::Error>| r.err().map(|e| e.to_string());
        let msg = refused(plan_adaln_modulate(
            &xv, layout, &yw, 64, &scale, select, eps,
        ));
        assert!(
            msg.is_some_and(|m| m.contains("adaln_modulate: eps")),
            "{eps}"
        );
        let msg = refused(plan_gated_residual_adaln(
            &xw, layout, &yv, 64, &ow, 80, &gate, &scale, select, eps,
        ));
        assert!(
            msg.is_some_and(|m| m.contains("gated_residual_adaln: eps")),
            "{eps}"
        );
    }
    // Rules that need no prefix row (every token a target) or no sample rows (every token a prefix token) do not
    // check the one they do not use.
    let targets = sel(3, 0, 99);
    plan_adaln_modulate(&xv, layout, &yw, 64, &scale, targets, 1e-6).expect("prefix row unused");
    let one_row = modulation(&mv, blk(1, 256, 64));
    plan_adaln_modulate(&xv, layout, &yw, 64, &one_row, sel(3, 3, 0), 1e-6)
        .expect("no sample rows");
    // The gated residual is elementwise, so no register limit on the row: 16384 columns are 2048 vectors, 8 blocks.
    let wide = Matrix::dense(1, 16384);
    let mut wx = buf(&ctx, bytes(wide));
    let (wy, wm) = (buf(&ctx, bytes(wide)), buf(&ctx, bytes(wide)));
    let (wxv, wyv, wmv) = (wx.view_mut(), wy.view(), wm.view());
    let gate = modulation(&wmv, blk(1, 16384, 0));
    let l = plan_gated_residual(&wxv, wide, &wyv, 16384, &gate, sel(1, 0, 0)).expect("wide");
    assert_eq!(grid(&l), (1, 8, 1));
}

#[test]
fn adaln_kernels_name_each_refusal() {
    let _serial = test_lock();
    let ctx = test_context();
    let mut b = AdalnBuffers::new(&ctx);
    // Rules every kernel checks alike.
    let shared: &[Case<AdalnCall>] = &[
        (
            "x: 6 x 64 bf16 with row stride 72 needs 848 B but the view holds 846 B",
            |c| c.cuts[0] = (0, 2),
        ),
        ("x: device address", |c| c.cuts[0] = (8, 0)),
        ("x: columns (60) and row stride (72) must be", |c| {
            c.layout.cols = 60
        }),
        (
            "y: 6 x 64 bf16 with row stride 64 needs 768 B but the view holds 766 B",
            |c| c.cuts[1] = (0, 2),
        ),
        ("y: row stride 56 is less than its 64 columns", |c| {
            c.y_stride = 56
        }),
        ("modulation rows: seq_len must be at least 1", |c| {
            c.select.seq_len = 0
        }),
        (
            "6 rows are not a whole number of samples of seq_len 4",
            |c| c.select.seq_len = 4,
        ),
        (
            "6 samples need as many modulation rows but only 3 are given",
            |c| c.select = sel(1, 0, 0),
        ),
        (
            "the t = 0 modulation row 3 is outside the 3 modulation rows",
            |c| c.select.prefix_row = 3,
        ),
        ("modulation column offset 60 must be a multiple of 8", |c| {
            c.blocks(|b| b.offset = 60)
        }),
        (
            "modulation columns [200, 264) run past the row stride 256",
            |c| c.blocks(|b| b.offset = 200),
        ),
        ("modulation offset overflows", |c| {
            c.blocks(|b| b.offset = usize::MAX - 7)
        }),
        (
            "modulation: 3 x 256 bf16 with row stride 256 needs 1536 B but the view holds 1534 B",
            |c| c.cuts[3] = (0, 2),
        ),
        ("modulation: device address", |c| c.cuts[3] = (8, 0)),
        (
            "modulation: columns (260) and row stride (260) must be",
            |c| c.blocks(|b| b.stride = 260),
        ),
        // Sizes past the kernels' ints where no memory is needed.
        ("x stride = 2147483648 does not fit", |c| {
            (c.layout, c.select) = (mat(1, 64, PAST_I32), sel(1, 0, 0))
        }),
        ("y stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.y_stride, c.select) = (1, PAST_I32, sel(1, 0, 0))
        }),
        ("modulation stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.select) = (0, sel(3, 0, 0));
            c.blocks(|b| (b.rows, b.stride) = (0, PAST_I32));
        }),
        ("seq_len = 2147483648 does not fit", |c| {
            (c.layout.rows, c.select) = (0, sel(PAST_I32, 0, 0))
        }),
    ];
    for (kernel, op) in ADALN_OPS.into_iter().enumerate() {
        refusals(op, ADALN_OK, shared, |c| b.plan(kernel, c));
    }
    // The row-normalising kernels hold a row in registers.
    let norms: &[Case<AdalnCall>] = &[
        (
            "rows of 0 columns: the kernel normalises 8..=8192 columns",
            |c| c.layout.cols = 0,
        ),
        ("rows of 8200 columns", |c| {
            (c.layout, c.select) = (mat(1, 8200, 8200), sel(1, 0, 0))
        }),
    ];
    for kernel in [0, 2] {
        refusals(ADALN_OPS[kernel], ADALN_OK, norms, |c| b.plan(kernel, c));
    }
    // The fused pair's output, and its two blocks, which must share their modulation rows.
    let fused: &[Case<AdalnCall>] = &[
        (
            "out: 6 x 64 bf16 with row stride 80 needs 928 B but the view holds 926 B",
            |c| c.cuts[2] = (0, 2),
        ),
        ("out: device address", |c| c.cuts[2] = (8, 0)),
        ("out: row stride 56 is less than its 64 columns", |c| {
            c.out_stride = 56
        }),
        ("out stride = 2147483648 does not fit", |c| {
            (c.layout.rows, c.out_stride, c.select) = (1, PAST_I32, sel(1, 0, 0))
        }),
        (
            "gate and scale must be two column offsets of the same modulation rows",
            |c| c.scale_apart = true,
        ),
        (
            "gate and scale must be two column offsets of the same modulation rows",
            |c| c.scale.rows = 2,
        ),
        (
            "gate and scale must be two column offsets of the same modulation rows",
            |c| c.gate.stride = 192,
        ),
        ("modulation column offset 4 must be a multiple of 8", |c| {
            c.gate.offset = 4
        }),
        (
            "modulation columns [200, 264) run past the row stride 256",
            |c| c.scale.offset = 200,
        ),
    ];
    refusals(ADALN_OPS[2], ADALN_OK, fused, |c| b.plan(2, c));
}

/// Checks that every row's modulation block (its modulation row by the packed rule, `offset` columns in, `cols`
/// wide) lies inside the modulation view and inside its own row of `stride` elements.
fn check_modulation_reads(
    view: (u64, usize),
    at: u64,
    (stride, offset): (i32, i32),
    (rows, cols): (i64, i64),
    (seq_len, target_begin, prefix_row): (i32, i32, i32),
) -> Result<(), TestCaseError> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let (stride, offset) = (i64::from(stride), i64::from(offset));
    prop_assert!(seq_len >= 1 && offset >= 0 && offset % 8 == 0 && offset + cols <= stride);
    for r in 0..rows {
        let m = modulation_row(
            r,
            i64::from(seq_len),
            i64::from(target_begin),
            i64::from(prefix_row),
        );
        prop_assert!(m >= 0, "row {} reads modulation row {}", r, m);
        // One row's block, from its first element, as a 1 x cols matrix.
        let first = at + 2 * (m * stride + offset) as u64;
        prop_assert!(
            rows_inside(view, first, 1, cols, stride),
            "row {} reads modulation row {} outside {:x?}",
            r,
            m,
            view
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Any adaLN, gated residual or fused pair plans or is refused by name, never panics; a plan reads and writes
    /// the activations only inside their views, and every row's modulation block, picked by the rule the kernel
    /// applies to the packed (seq_len, target_begin, prefix_row), lies inside the modulation view.
    #[test]
    fn adaln_kernels_plan_or_refuse_and_stay_inside(
        kernel in 0usize..3,
        // Rows: whole samples of seq_len tokens, now and then a ragged count or one past a 32-bit int.
        (samples, ragged, huge) in (0usize..4, prop_oneof![8 => Just(0usize), 1 => 1usize..3], prop::bool::weighted(0.05)),
        cols in prop_oneof![10 => (1usize..12).prop_map(|c| 8 * c), 1 => 0usize..100, 1 => Just(8200usize)],
        strides in (stride_pick(), stride_pick(), stride_pick()),
        // Modulation rows enough for the samples and the t = 0 row, now and then too few.
        (rows_short, stride_extra) in (prop_oneof![8 => Just(0usize), 1 => 1usize..3], prop_oneof![
            6 => Just(0usize), 2 => Just(1usize), 1 => Just(2usize), 1 => Just(3usize), 1 => Just(4usize)
        ]),
        (gate_block, scale_block) in (prop_oneof![10 => 0usize..3, 1 => Just(3usize)], prop_oneof![10 => 0usize..3, 1 => Just(3usize)]),
        (seq_len, target_begin, prefix_row) in (prop_oneof![10 => 1usize..5, 1 => Just(0usize)], 0usize..6, 0usize..4),
        skips in prop::array::uniform4(skip()),
        slacks in prop::array::uniform4(slack()),
    ) {
        let _serial = test_lock();
        let ctx = test_context();
        let rows = if huge { PAST_I32 } else { samples * seq_len + ragged };
        let mod_rows = samples.max(prefix_row + 1).saturating_sub(rows_short);
        let (y, modulation) = (buf(&ctx, 256 << 10), buf(&ctx, 128 << 10));
        let (mut x, mut out) = (buf(&ctx, 256 << 10), buf(&ctx, 256 << 10));
        let layout = Matrix { rows, cols, stride: stride_for(cols, strides.0) };
        let (y_stride, out_stride) = (stride_for(cols, strides.1), stride_for(cols, strides.2));
        // Blocks at multiples of the width (or a little off), in rows of up to three blocks (or a little off).
        let offset_of = |pick: usize| match pick {
            3 => cols + 4,
            p => p * cols,
        };
        let (gate_offset, scale_offset) = (offset_of(gate_block), offset_of(scale_block));
        let mod_stride = match stride_extra {
            0 => 3 * cols,
            1 => 3 * cols + 8,
            2 => 2 * cols,
            3 => 3 * cols + 4,
            _ => PAST_I32,
        };
        let select = ModulationRows { seq_len, target_begin, prefix_row };
        let yv = region(&y, skips[1], with_slack(span_of(rows, cols, y_stride), slacks[1]));
        let mv = region(&modulation, skips[3], with_slack(span_of(mod_rows, mod_stride, mod_stride), slacks[3]));
        let xv = region_mut(&mut x, skips[0], with_slack(bytes(layout), slacks[0]));
        let ov = region_mut(&mut out, skips[2], with_slack(span_of(rows, cols, out_stride), slacks[2]));
        let block_of = |offset| Modulation { data: &mv, rows: mod_rows, stride: mod_stride, offset };
        let (gate, scale) = (block_of(gate_offset), block_of(scale_offset));
        let (x_at, y_at, out_at, mod_at) = (extent_mut(&xv), extent(&yv), extent_mut(&ov), extent(&mv));
        let (op, result) = match kernel {
            0 => {
                // x read, its adaLN written to the out view.
                let xr = xv.as_view();
                match plan_adaln_modulate(&xr, layout, &ov, out_stride, &scale, select, 1e-6) {
                    Ok(l) => {
                        prop_assert_eq!(l.kernel(), "qi_adaln_modulate");
                        prop_assert_eq!(l.args().sizes().len(), 13);
                        let (r, c) = (i64::from(int(&l, 7)), i64::from(int(&l, 8)));
                        prop_assert!((8..=MAX_NORM_COLS as i64).contains(&c));
                        prop_assert!(rows_inside(x_at, addr(&l, 0), r, c, i64::from(int(&l, 1))));
                        prop_assert!(rows_inside(out_at, addr(&l, 2), r, c, i64::from(int(&l, 3))));
                        prop_assert_eq!(addr(&l, 4), mod_at.0);
                        check_modulation_reads(mod_at, addr(&l, 4), (int(&l, 5), int(&l, 6)), (r, c),
                            (int(&l, 9), int(&l, 10), int(&l, 11)))?;
                        prop_assert!(i64::from(grid(&l).0) >= r);
                        prop_assert!(l.config().validate(0).is_ok());
                        ("adaln_modulate", Ok(()))
                    }
                    Err(e) => ("adaln_modulate", Err(e)),
                }
            }
            1 => match plan_gated_residual(&xv, layout, &yv, y_stride, &gate, select) {
                Ok(l) => {
                    prop_assert_eq!(l.kernel(), "qi_gated_residual");
                    prop_assert_eq!(l.args().sizes().len(), 12);
                    let (r, c) = (i64::from(int(&l, 7)), i64::from(int(&l, 8)));
                    prop_assert!(rows_inside(x_at, addr(&l, 0), r, c, i64::from(int(&l, 1))));
                    prop_assert!(rows_inside(y_at, addr(&l, 2), r, c, i64::from(int(&l, 3))));
                    prop_assert_eq!(addr(&l, 4), mod_at.0);
                    check_modulation_reads(mod_at, addr(&l, 4), (int(&l, 5), int(&l, 6)), (r, c),
                        (int(&l, 9), int(&l, 10), int(&l, 11)))?;
                    let (gx, gy, _) = grid(&l);
                    prop_assert!(i64::from(gx) >= r && i64::from(gy) * 2048 >= c);
                    prop_assert!(l.config().validate(0).is_ok());
                    ("gated_residual", Ok(()))
                }
                Err(e) => ("gated_residual", Err(e)),
            },
            _ => match plan_gated_residual_adaln(
                &xv, layout, &yv, y_stride, &ov, out_stride, &gate, &scale, select, 1e-6,
            ) {
                Ok(l) => {
                    prop_assert_eq!(l.kernel(), "qi_gated_residual_adaln");
                    prop_assert_eq!(l.args().sizes().len(), 16);
                    let (r, c) = (i64::from(int(&l, 10)), i64::from(int(&l, 11)));
                    prop_assert!((8..=MAX_NORM_COLS as i64).contains(&c));
                    prop_assert!(rows_inside(x_at, addr(&l, 0), r, c, i64::from(int(&l, 1))));
                    prop_assert!(rows_inside(y_at, addr(&l, 2), r, c, i64::from(int(&l, 3))));
                    prop_assert!(rows_inside(out_at, addr(&l, 4), r, c, i64::from(int(&l, 5))));
                    prop_assert_eq!(addr(&l, 6), mod_at.0);
                    let rule = (int(&l, 12), int(&l, 13), int(&l, 14));
                    for offset in [int(&l, 8), int(&l, 9)] {
                        check_modulation_reads(mod_at, addr(&l, 6), (int(&l, 7), offset), (r, c), rule)?;
                    }
                    prop_assert!(i64::from(grid(&l).0) >= r);
                    prop_assert!(l.config().validate(0).is_ok());
                    ("gated_residual_adaln", Ok(()))
                }
                Err(e) => ("gated_residual_adaln", Err(e)),
            },
        };
        if let Err(e) = result {
            prop_assert!(e.to_string().contains(&format!("{op}: ")), "{}", e);
        }
    }
}
