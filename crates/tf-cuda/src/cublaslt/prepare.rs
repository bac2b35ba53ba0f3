//! Choosing GEMM algorithms ahead of the requests: the shapes a model will run, listed at load
//! ([`GemmShape`]), and the rule that picks each one's algorithm from the persistent cache, by
//! timing within a budget, or from the heuristic ([`choose_plan`], [`prepare_keys_with`]).
//!
//! The rule is written against two small traits, [`Planner`] (build a plan, time it, adopt a
//! candidate) and [`Clock`], so it runs on the host in tests with fakes; [`super::CublasLt`]
//! plugs in the library and the wall clock.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::cache::{describe_key, PlanCache, PlanCacheError, StackKey, StoredPlan, StoredSource};
use super::ffi::MatmulAlgo;
use super::plan::{
    Activation, AlgoSelection, DeviceSpan, Fp8ScaleMode, Fp8Scales, Gemm, InputType, OutputType,
    PlanKey,
};
use super::{ChosenBy, CublasLtError};

/// One GEMM shape a model will run, without operands: what [`super::CublasLt::prepare`] plans
/// ahead. Built like a [`Gemm`] (`GemmShape::bf16(m, n, k).with_bias()`), or taken from one
/// with [`GemmShape::of`]. Operands are assumed 256-byte aligned (what `DeviceBuffer` gives)
/// unless [`GemmShape::with_alignment`] says otherwise; the plan key includes alignment, so a
/// call on less aligned operands is another shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub input: InputType,
    pub output: OutputType,
    pub bias: bool,
    pub activation: Activation,
    pub fp8_fast_accum: bool,
    /// FP8 only: how the scales apply.
    pub fp8_scale_mode: Fp8ScaleMode,
    /// Alignment in bytes (power of two, at most 256) of `W`, `X` and `Y`.
    pub align_w: u32,
    pub align_x: u32,
    pub align_y: u32,
}

impl GemmShape {
    /// `Y = X · Wᵀ` in bf16 with bf16 output.
    pub fn bf16(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            m,
            n,
            k,
            input: InputType::Bf16,
            output: OutputType::Bf16,
            bias: false,
            activation: Activation::None,
            fp8_fast_accum: false,
            fp8_scale_mode: Fp8ScaleMode::Tensor,
            align_w: 256,
            align_x: 256,
            align_y: 256,
        }
    }

    /// FP8 e4m3 inputs with per-tensor scales, bf16 output.
    pub fn fp8_e4m3(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            input: InputType::Fp8E4m3,
            ..GemmShape::bf16(m, n, k)
        }
    }

    /// Signed 8-bit inputs, exact int32 output ([`Gemm::int8`]).
    pub fn int8(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            input: InputType::Int8,
            output: OutputType::I32,
            ..GemmShape::bf16(m, n, k)
        }
    }

    /// Signed 8-bit inputs with row-wise scales, bf16 output ([`Gemm::int8_row_wise`]).
    pub fn int8_row_wise(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            input: InputType::Int8,
            fp8_scale_mode: Fp8ScaleMode::RowWise,
            ..GemmShape::bf16(m, n, k)
        }
    }

    /// Signed 8-bit inputs with the W scales as the alpha vector, bf16 output ([`Gemm::int8_channel_alpha`]).
    pub fn int8_channel_alpha(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            input: InputType::Int8,
            fp8_scale_mode: Fp8ScaleMode::ChannelAlpha,
            ..GemmShape::bf16(m, n, k)
        }
    }

    /// FP8 e4m3 inputs with row-wise scales (one per row of X, one per row of W), bf16 output.
    pub fn fp8_e4m3_row_wise(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape::fp8_e4m3(m, n, k).with_fp8_scale_mode(Fp8ScaleMode::RowWise)
    }

    /// How the FP8 scales apply.
    pub fn with_fp8_scale_mode(self, fp8_scale_mode: Fp8ScaleMode) -> GemmShape {
        GemmShape {
            fp8_scale_mode,
            ..self
        }
    }

    /// With a bias of `N` elements.
    pub fn with_bias(self) -> GemmShape {
        GemmShape { bias: true, ..self }
    }

    /// With the GELU (tanh) epilogue.
    pub fn with_gelu_tanh(self) -> GemmShape {
        GemmShape {
            activation: Activation::GeluTanh,
            ..self
        }
    }

    /// With f32 output.
    pub fn with_f32_output(self) -> GemmShape {
        GemmShape {
            output: OutputType::F32,
            ..self
        }
    }

    /// FP8 fast accumulation.
    pub fn with_fp8_fast_accum(self) -> GemmShape {
        GemmShape {
            fp8_fast_accum: true,
            ..self
        }
    }

    /// Operand alignments in bytes (each a power of two, at most 256).
    pub fn with_alignment(self, w: u32, x: u32, y: u32) -> GemmShape {
        GemmShape {
            align_w: w,
            align_x: x,
            align_y: y,
            ..self
        }
    }

    /// The shape of `gemm` (alignments read from its addresses).
    pub fn of(gemm: &Gemm) -> GemmShape {
        use super::plan::alignment_of;
        GemmShape {
            m: gemm.m,
            n: gemm.n,
            k: gemm.k,
            input: gemm.input,
            output: gemm.output,
            bias: gemm.bias.is_some(),
            activation: gemm.activation,
            fp8_fast_accum: gemm.fp8_fast_accum,
            fp8_scale_mode: gemm.scale_mode,
            align_w: alignment_of(gemm.w.addr),
            align_x: alignment_of(gemm.x.addr),
            align_y: alignment_of(gemm.y.addr),
        }
    }

    /// A [`Gemm`] of this shape over placeholder addresses with exactly the shape's alignments
    /// (nothing is read or written through them), or over `bases` when given: each base must be
    /// 256-byte aligned with room for its operand plus 256 bytes.
    pub(crate) fn gemm_at(&self, bases: Option<&OperandBases>) -> Result<Gemm, CublasLtError> {
        for (name, align) in [
            ("W", self.align_w),
            ("X", self.align_x),
            ("Y", self.align_y),
        ] {
            if !align.is_power_of_two() || align > 256 {
                return Err(CublasLtError::Invalid {
                    what: format!(
                        "{name} alignment {align} of a prepared shape must be a power of two up to 256"
                    ),
                });
            }
        }
        let placeholder = OperandBases {
            x: 1 << 44,
            w: 2 << 44,
            y: 3 << 44,
            bias: 4 << 44,
            x_scale: 5 << 44,
            w_scale: 6 << 44,
        };
        let b = bases.unwrap_or(&placeholder);
        // An offset of `align` from a 256-aligned base has exactly that alignment.
        let at = |base: u64, align: u32| base + u64::from(align % 256);
        let span = |addr: u64| DeviceSpan::new(addr, usize::MAX >> 8);
        let (x_scales, w_scales) = self.fp8_scale_mode.scale_counts(self.m, self.n);
        let scale_span = |addr: u64, count: usize| DeviceSpan::new(addr, count.saturating_mul(4));
        let gemm = Gemm {
            m: self.m,
            n: self.n,
            k: self.k,
            input: self.input,
            output: self.output,
            x: span(at(b.x, self.align_x)),
            w: span(at(b.w, self.align_w)),
            y: span(at(b.y, self.align_y)),
            bias: self.bias.then(|| span(b.bias)),
            activation: self.activation,
            scales: self.scaled().then(|| Fp8Scales {
                x_scale: scale_span(b.x_scale, x_scales),
                w_scale: scale_span(b.w_scale, w_scales),
            }),
            scale_mode: self.fp8_scale_mode,
            alpha: 1.0,
            beta: 0.0,
            fp8_fast_accum: self.fp8_fast_accum,
        };
        Ok(gemm)
    }

    /// Whether the shape's GEMM reads f32 scales: FP8, and INT8 with row-wise scales or channel alphas.
    pub fn scaled(&self) -> bool {
        self.input == InputType::Fp8E4m3
            || (self.input == InputType::Int8
                && matches!(
                    self.fp8_scale_mode,
                    Fp8ScaleMode::RowWise | Fp8ScaleMode::ChannelAlpha
                ))
    }

    /// The plan key of this shape (validated as a call of it would be).
    pub fn key(&self) -> Result<PlanKey, CublasLtError> {
        Ok(self.gemm_at(None)?.plan()?.key)
    }

    /// The shape whose plan key is `key` (the inverse of [`GemmShape::key`]), or `None` when no shape has that key
    /// (an entry a newer or older plan-cache file holds, say).
    pub fn from_key(key: &PlanKey) -> Option<GemmShape> {
        [
            (false, Activation::None),
            (true, Activation::None),
            (false, Activation::GeluTanh),
            (true, Activation::GeluTanh),
        ]
        .into_iter()
        .map(|(bias, activation)| GemmShape {
            m: key.m,
            n: key.n,
            k: key.k,
            input: key.input,
            output: key.output,
            bias,
            activation,
            fp8_fast_accum: key.fast_accum,
            fp8_scale_mode: key.scale_mode,
            align_w: key.align_a,
            align_x: key.align_b,
            align_y: key.align_cd,
        })
        .find(|shape| shape.key().ok().as_ref() == Some(key))
    }
}

/// Device addresses of scratch operands for timing a prepared shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OperandBases {
    pub x: u64,
    pub w: u64,
    pub y: u64,
    pub bias: u64,
    pub x_scale: u64,
    pub w_scale: u64,
}

/// What [`super::CublasLt::prepare`] did.
#[derive(Debug, Default)]
pub struct PrepareReport {
    /// Distinct shapes asked for.
    pub shapes: usize,
    /// Shapes that already had a plan in the handle (left as they were).
    pub already_planned: usize,
    /// Shapes whose stored choice (or a stored neighbour's, below) was found and re-validated: no timing.
    pub stored: usize,
    /// Of those, shapes that took a neighbour's choice ([`super::ChosenBy::Neighbour`]): the same shape but for
    /// `m`, within an eighth of it.
    pub neighbour: usize,
    /// Shapes timed now (within the budget).
    pub timed: usize,
    /// Shapes running the heuristic's first result: heuristic policy, the budget spent, a
    /// single candidate, a rejected stored choice, or timing impossible (capture, no scratch).
    pub heuristic: usize,
    /// Of those, shapes left untimed because the budget was spent.
    pub budget_spent: usize,
    /// Stored choices the heuristic no longer offers (each also a warning).
    pub rejected: usize,
    /// Plans run once on scratch operands because their kernel had not run through this handle yet (see
    /// [`super::CublasLt::prepare`]): the kernel is loaded here rather than inside a request's step.
    pub primed: usize,
    /// Wall time of the whole prepare.
    pub elapsed: Duration,
    /// The cache file written, if one was.
    pub saved: Option<PathBuf>,
    /// Warning-level problems of the plan cache (print them; nothing failed).
    pub warnings: Vec<PlanCacheError>,
}

/// A monotonic clock, so tests can spend a budget without waiting.
pub trait Clock {
    /// Time since the clock started.
    fn elapsed(&self) -> Duration;
}

/// The wall clock from a start instant.
pub struct WallClock(pub Instant);

impl Clock for WallClock {
    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

/// The library side of choosing a plan.
pub(crate) trait Planner {
    /// Builds the plan of `key` asking the heuristic for `requested` results; returns the usable
    /// candidates' algorithms in the heuristic's order (at least one).
    fn build(&mut self, key: &PlanKey, requested: usize) -> Result<Vec<MatmulAlgo>, CublasLtError>;
    /// Times the built plan's candidates and makes it run the one chosen; returns why it runs
    /// what it runs ([`ChosenBy::Timed`], or why nothing was timed) and that candidate's index.
    fn time(&mut self, key: &PlanKey) -> Result<(ChosenBy, usize), CublasLtError>;
    /// Makes the built plan run candidate `index` without timing, recorded as `chosen_by`.
    fn adopt(&mut self, key: &PlanKey, index: usize, chosen_by: ChosenBy);
}

/// Whether a shape without a stored choice may be timed now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timing {
    Allowed,
    /// During a prepare, once its budget is spent.
    BudgetSpent,
    /// A call after a prepare, of a shape it did not list: never timed inside a request.
    Unprepared,
}

/// The persistent cache and the stack its entries are looked up under.
#[derive(Clone, Copy)]
pub(crate) struct CacheSlot<'a> {
    pub cache: &'a PlanCache,
    pub stack: &'a StackKey,
}

/// Chooses the algorithm of `key`'s plan:
/// - [`AlgoSelection::Heuristic`]: the heuristic's first, as always (the cache is not used);
/// - timed policy with a stored choice: that choice when the heuristic still offers it
///   ([`ChosenBy::Stored`]), else the heuristic's first ([`ChosenBy::StoredRejected`], a
///   warning, and the new choice stored);
/// - timed policy without one: timed when `timing` allows; else the stored choice of a neighbour (the same shape
///   but for `m`, within an eighth of it: [`PlanCache::neighbour`]) when the heuristic offers its algorithm
///   ([`ChosenBy::Neighbour`], nothing stored: a later process finds the same neighbour); else the heuristic's
///   first. A timed or heuristic result is stored (unless it came from a transient condition such as a capture).
///   [`choose_plan_with`] can put the neighbour before timing.
pub(crate) fn choose_plan(
    planner: &mut dyn Planner,
    key: &PlanKey,
    selection: AlgoSelection,
    cache: Option<CacheSlot<'_>>,
    timing: Timing,
) -> Result<ChosenBy, CublasLtError> {
    choose_plan_with(planner, key, selection, cache, timing, false)
}

/// [`choose_plan`], where `neighbours_first` puts a stored neighbour's choice before timing too (a shape's first
/// use inside a request), not only before the heuristic's first.
pub(crate) fn choose_plan_with(
    planner: &mut dyn Planner,
    key: &PlanKey,
    selection: AlgoSelection,
    cache: Option<CacheSlot<'_>>,
    timing: Timing,
    neighbours_first: bool,
) -> Result<ChosenBy, CublasLtError> {
    let AlgoSelection::Timed { candidates, .. } = selection else {
        planner.build(key, 1)?;
        planner.adopt(key, 0, ChosenBy::Heuristic);
        return Ok(ChosenBy::Heuristic);
    };
    let stored = cache.and_then(|slot| slot.cache.lookup(slot.stack, key));
    let neighbour = match stored {
        Some(_) => None,
        None => cache.and_then(|slot| slot.cache.neighbour(slot.stack, key)),
    };
    let requested = stored
        .as_ref()
        .or(neighbour.as_ref())
        .map_or(candidates, |s| s.requested.max(candidates))
        .clamp(1, AlgoSelection::MAX_CANDIDATES);
    let algos = planner.build(key, requested)?;
    let record = |source: StoredSource, index: usize, algo: Option<&MatmulAlgo>| {
        if let (Some(slot), Some(algo)) = (cache, algo) {
            slot.cache.record(
                slot.stack,
                StoredPlan::new(*key, algo, source, index, requested),
            );
        }
    };
    if let Some(stored) = stored {
        let found = stored
            .algo()
            .and_then(|algo| algos.iter().position(|a| *a == algo));
        if let Some(index) = found {
            planner.adopt(key, index, ChosenBy::Stored);
            return Ok(ChosenBy::Stored);
        }
        if let Some(slot) = cache {
            slot.cache.warn(PlanCacheError::StoredAlgoRejected {
                key: describe_key(key),
                requested,
            });
        }
        planner.adopt(key, 0, ChosenBy::StoredRejected);
        record(StoredSource::Heuristic, 0, algos.first());
        return Ok(ChosenBy::StoredRejected);
    }
    let from_neighbour = neighbour
        .and_then(|n| n.algo())
        .and_then(|algo| algos.iter().position(|a| *a == algo));
    if let Some(index) = from_neighbour.filter(|_| neighbours_first || timing != Timing::Allowed) {
        planner.adopt(key, index, ChosenBy::Neighbour);
        return Ok(ChosenBy::Neighbour);
    }
    let chosen_by = match timing {
        Timing::Allowed => {
            let (chosen_by, index) = planner.time(key)?;
            match chosen_by {
                ChosenBy::Timed => record(StoredSource::Timed, index, algos.get(index)),
                ChosenBy::OnlyCandidate => record(StoredSource::Heuristic, 0, algos.first()),
                // Capture, no scratch, failed runs: a later process may time it.
                _ => {}
            }
            chosen_by
        }
        Timing::BudgetSpent | Timing::Unprepared => {
            let chosen_by = if timing == Timing::BudgetSpent {
                ChosenBy::BudgetSpent
            } else {
                ChosenBy::Unprepared
            };
            planner.adopt(key, 0, chosen_by);
            record(StoredSource::Heuristic, 0, algos.first());
            chosen_by
        }
    };
    Ok(chosen_by)
}

/// [`prepare_keys_with`] with neighbours after timing (what the tests of the rule mostly use).
#[cfg(test)]
pub(crate) fn prepare_keys(
    planner: &mut dyn Planner,
    keys: &[PlanKey],
    already: &dyn Fn(&PlanKey) -> bool,
    selection: AlgoSelection,
    cache: Option<CacheSlot<'_>>,
    budget: Duration,
    clock: &dyn Clock,
) -> Result<PrepareReport, CublasLtError> {
    prepare_keys_with(
        planner, keys, already, selection, cache, budget, clock, false,
    )
}

/// Plans every distinct key of `keys` not `already` planned, timing unseen ones while `clock`
/// is within `budget`, then saves the cache when something was timed or a stored entry replaced. A shape starts
/// timing only while the budget lasts; the one in progress may finish past it. With `neighbours_first` a stored
/// neighbour's choice comes before timing ([`choose_plan_with`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare_keys_with(
    planner: &mut dyn Planner,
    keys: &[PlanKey],
    already: &dyn Fn(&PlanKey) -> bool,
    selection: AlgoSelection,
    cache: Option<CacheSlot<'_>>,
    budget: Duration,
    clock: &dyn Clock,
    neighbours_first: bool,
) -> Result<PrepareReport, CublasLtError> {
    let mut report = PrepareReport::default();
    let mut seen: Vec<PlanKey> = Vec::with_capacity(keys.len());
    for key in keys {
        if seen.contains(key) {
            continue;
        }
        seen.push(*key);
        report.shapes += 1;
        if already(key) {
            report.already_planned += 1;
            continue;
        }
        let timing = if clock.elapsed() < budget {
            Timing::Allowed
        } else {
            Timing::BudgetSpent
        };
        match choose_plan_with(planner, key, selection, cache, timing, neighbours_first)? {
            ChosenBy::Stored => report.stored += 1,
            ChosenBy::Neighbour => {
                report.stored += 1;
                report.neighbour += 1;
            }
            ChosenBy::Timed => report.timed += 1,
            ChosenBy::StoredRejected => {
                report.rejected += 1;
                report.heuristic += 1;
            }
            ChosenBy::BudgetSpent => {
                report.budget_spent += 1;
                report.heuristic += 1;
            }
            _ => report.heuristic += 1,
        }
    }
    if let Some(slot) = cache {
        // Written only when this call measured something (or replaced a stale entry): a heuristic pick costs a
        // later process a heuristic query, while a save reads, merges and rewrites the file with an fsync, which a
        // request planning a new shape (a zero budget, never timed) must not wait for. What is left recorded goes
        // out with the next save (a later prepare that times, `save_plan_cache`, or the handle's drop).
        if report.timed > 0 || report.rejected > 0 {
            match slot.cache.save() {
                Ok(saved) => report.saved = saved,
                Err(warning) => slot.cache.warn(warning),
            }
        }
        report.warnings = slot.cache.take_warnings();
    }
    report.elapsed = clock.elapsed();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::collections::HashMap;

    use super::*;

    proptest::proptest! {
        /// A plan key maps back to a shape with that key, the same sizes and the same epilogue.
        #[test]
        fn a_shape_comes_back_from_its_key(
            m in 1usize..9000,
            n in 1usize..9000,
            k in 1usize..9000,
            fp8 in proptest::bool::ANY,
            int8 in proptest::bool::ANY,
            f32_out in proptest::bool::ANY,
            bias in proptest::bool::ANY,
            gelu in proptest::bool::ANY,
            fast in proptest::bool::ANY,
            row_wise in proptest::bool::ANY,
            channel_alpha in proptest::bool::ANY,
            align in 0u32..9,
        ) {
            // INT8 GEMMs need K and N multiples of 16: keep most INT8 draws plannable.
            let (n, k) = if int8 { (n.next_multiple_of(16), k.next_multiple_of(16)) } else { (n, k) };
            let mut shape = if int8 {
                if channel_alpha {
                    GemmShape::int8_channel_alpha(m, n, k)
                } else if row_wise {
                    GemmShape::int8_row_wise(m, n, k)
                } else {
                    GemmShape::int8(m, n, k)
                }
            } else if fp8 {
                let shape = if row_wise {
                    GemmShape::fp8_e4m3_row_wise(m, n, k)
                } else {
                    GemmShape::fp8_e4m3(m, n, k)
                };
                if fast { shape.with_fp8_fast_accum() } else { shape }
            } else {
                GemmShape::bf16(m, n, k)
            };
            if f32_out {
                shape = shape.with_f32_output();
            }
            if bias {
                shape = shape.with_bias();
            }
            if gelu {
                shape = shape.with_gelu_tanh();
            }
            let shape = shape.with_alignment(1 << align, 256, 256 >> (align % 4));
            // Combinations the plan refuses have no key to come back from.
            let Ok(key) = shape.key() else { return Ok(()) };
            let back = GemmShape::from_key(&key);
            proptest::prop_assert!(back.is_some(), "no shape for {key:?}");
            let back = back.unwrap_or(shape);
            proptest::prop_assert_eq!(back.key().ok(), Some(key));
            proptest::prop_assert_eq!((back.m, back.n, back.k), (m, n, k));
            proptest::prop_assert_eq!((back.bias, back.activation), (shape.bias, shape.activation));
        }
    }

    /// A fake library: each key has a fixed candidate list and fixed timing results; every
    /// timing advances the fake clock.
    struct FakePlanner<'c> {
        candidates: HashMap<PlanKey, Vec<MatmulAlgo>>,
        fastest: usize,
        clock: &'c FakeClock,
        time_cost: Duration,
        built: Vec<(PlanKey, usize)>,
        timed: Vec<PlanKey>,
        adopted: HashMap<PlanKey, (usize, ChosenBy)>,
    }

    struct FakeClock(Cell<Duration>);

    impl Clock for FakeClock {
        fn elapsed(&self) -> Duration {
            self.0.get()
        }
    }

    fn algo(key: &PlanKey, i: usize) -> MatmulAlgo {
        MatmulAlgo {
            data: [key.m as u64, i as u64, 7, 0, 0, 0, 0, 0],
        }
    }

    impl<'c> FakePlanner<'c> {
        fn new(clock: &'c FakeClock, keys: &[PlanKey], fastest: usize) -> FakePlanner<'c> {
            FakePlanner {
                candidates: keys
                    .iter()
                    .map(|k| (*k, (0..8).map(|i| algo(k, i)).collect()))
                    .collect(),
                fastest,
                clock,
                time_cost: Duration::from_millis(100),
                built: Vec::new(),
                timed: Vec::new(),
                adopted: HashMap::new(),
            }
        }
    }

    impl Planner for FakePlanner<'_> {
        fn build(
            &mut self,
            key: &PlanKey,
            requested: usize,
        ) -> Result<Vec<MatmulAlgo>, CublasLtError> {
            self.built.push((*key, requested));
            let all = self.candidates.get(key).cloned().unwrap_or_default();
            Ok(all.into_iter().take(requested).collect())
        }
        fn time(&mut self, key: &PlanKey) -> Result<(ChosenBy, usize), CublasLtError> {
            self.timed.push(*key);
            self.clock.0.set(self.clock.0.get() + self.time_cost);
            self.adopted.insert(*key, (self.fastest, ChosenBy::Timed));
            Ok((ChosenBy::Timed, self.fastest))
        }
        fn adopt(&mut self, key: &PlanKey, index: usize, chosen_by: ChosenBy) {
            self.adopted.insert(*key, (index, chosen_by));
        }
    }

    const TIMED: AlgoSelection = AlgoSelection::Timed {
        candidates: 8,
        repeats: 5,
    };

    fn keys(n: usize) -> Vec<PlanKey> {
        (1..=n)
            .map(|m| GemmShape::bf16(m * 64, 3072, 3072).key().unwrap())
            .collect()
    }

    fn stack() -> StackKey {
        StackKey {
            gpu_name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            driver_version: 13000,
            driver_release: String::new(),
            cublaslt_version: 130_100,
            workspace_bytes: 32 << 20,
            timing_data: crate::cublaslt::TimingData::Constant,
        }
    }

    fn never(_: &PlanKey) -> bool {
        false
    }

    fn temp_file(tag: &str) -> PathBuf {
        std::env::temp_dir()
            .join(format!("tf-prepare-{tag}-{}", std::process::id()))
            .join("gemm-plans.json")
    }

    #[test]
    fn shape_keys_match_the_calls_they_stand_for() {
        let x = DeviceSpan::new(0x7000_0000, 1 << 30);
        let w = DeviceSpan::new(0x9000_0010, 1 << 30);
        let y = DeviceSpan::new(0xb000_0002, 1 << 30);
        let bias = DeviceSpan::new(0xd000_0000, 1 << 20);
        let gemm = Gemm::bf16(512, 1024, 256, x, w, y)
            .with_bias(bias)
            .with_gelu_tanh()
            .with_f32_output();
        let call_key = Gemm {
            y: DeviceSpan::new(0xb000_0004, 1 << 30),
            ..gemm
        }
        .plan()
        .unwrap()
        .key;
        let shape = GemmShape::of(&Gemm {
            y: DeviceSpan::new(0xb000_0004, 1 << 30),
            ..gemm
        });
        assert_eq!(shape.key().unwrap(), call_key);
        assert_eq!((shape.align_w, shape.align_x, shape.align_y), (16, 256, 4));
        let built = GemmShape::bf16(512, 1024, 256)
            .with_bias()
            .with_gelu_tanh()
            .with_f32_output()
            .with_alignment(16, 256, 4);
        assert_eq!(built, shape);
        let fp8 = GemmShape::fp8_e4m3(64, 64, 64)
            .with_fp8_fast_accum()
            .key()
            .unwrap();
        assert_eq!((fp8.input, fp8.fast_accum), (InputType::Fp8E4m3, true));
        // Huge shapes still have a key; invalid ones name the problem.
        assert!(GemmShape::bf16(1 << 20, 1 << 20, 1 << 20).key().is_ok());
        assert!(GemmShape::bf16(0, 1, 1).key().is_err());
        assert!(GemmShape::bf16(8, 8, 8)
            .with_alignment(3, 256, 256)
            .key()
            .is_err());
        assert!(GemmShape::fp8_e4m3(16, 24, 32).key().is_err());
        // Row-wise FP8: its own key, matching a call of it.
        let row_wise = GemmShape::fp8_e4m3_row_wise(4096, 3072, 12288);
        let key = row_wise.key().unwrap();
        assert_eq!(key.scale_mode, Fp8ScaleMode::RowWise);
        assert_ne!(key, GemmShape::fp8_e4m3(4096, 3072, 12288).key().unwrap());
        let scales = Fp8Scales {
            x_scale: DeviceSpan::new(0xe000_0000, 4096 * 4),
            w_scale: DeviceSpan::new(0xf000_0000, 3072 * 4),
        };
        let call = Gemm::fp8_e4m3_row_wise(
            4096,
            3072,
            12288,
            x,
            w,
            DeviceSpan::new(0xb000_0000, 1 << 30),
            scales,
        );
        assert_eq!(GemmShape::of(&call), row_wise.with_alignment(16, 256, 256));
        assert_eq!(
            GemmShape::of(&call).key().unwrap(),
            call.plan().unwrap().key
        );
    }

    #[test]
    fn a_new_m_takes_a_stored_neighbours_choice_instead_of_the_heuristics_or_before_timing() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let shape = |m: usize| GemmShape::bf16(m, 3072, 3072).key().unwrap();
        let (stored_key, near, offered_elsewhere, far) =
            (shape(4096), shape(4131), shape(4000), shape(6000));
        let keys = [near, offered_elsewhere, far];
        let stored_algo = algo(&stored_key, 3);
        // The heuristic offers the neighbour's algorithm for `near` (second) but not for `offered_elsewhere`.
        let planner_for = |clock| {
            let mut planner = FakePlanner::new(clock, &keys, 5);
            planner.candidates.get_mut(&near).unwrap()[1] = stored_algo;
            planner
        };
        let stack = stack();
        let run = |budget: Duration, neighbours_first: bool| {
            let cache = PlanCache::in_memory();
            cache.record(
                &stack,
                StoredPlan::new(stored_key, &stored_algo, StoredSource::Timed, 3, 8),
            );
            let slot = CacheSlot {
                cache: &cache,
                stack: &stack,
            };
            let mut planner = planner_for(&clock);
            let report = prepare_keys_with(
                &mut planner,
                &keys,
                &never,
                TIMED,
                Some(slot),
                budget,
                &clock,
                neighbours_first,
            )
            .unwrap();
            let near_stored = cache.lookup(&stack, &near).is_some();
            (planner.adopted, planner.timed, report, near_stored)
        };
        // A request (no budget): the neighbour instead of the heuristic's first; not stored.
        let (adopted, timed, report, near_stored) = run(Duration::ZERO, false);
        assert_eq!(adopted[&near], (1, ChosenBy::Neighbour));
        assert_eq!(adopted[&far], (0, ChosenBy::BudgetSpent));
        assert_eq!(adopted[&offered_elsewhere], (0, ChosenBy::BudgetSpent));
        assert!(timed.is_empty());
        assert_eq!(
            (report.stored, report.neighbour, report.heuristic),
            (1, 1, 2)
        );
        assert!(!near_stored, "a neighbour's pick is not stored");
        // A load with a budget: every shape without a stored choice is timed, neighbour or not.
        let (adopted, timed, report, near_stored) = run(Duration::from_secs(60), false);
        assert_eq!(timed, keys.to_vec());
        assert_eq!((report.timed, report.neighbour), (3, 0));
        assert_eq!(adopted[&near].1, ChosenBy::Timed);
        assert!(near_stored);
        // A first use inside a request: the neighbour before timing; the others are timed.
        let (adopted, timed, report, _) = run(Duration::from_secs(60), true);
        assert_eq!(adopted[&near], (1, ChosenBy::Neighbour));
        assert_eq!(timed, vec![offered_elsewhere, far]);
        assert_eq!((report.stored, report.neighbour, report.timed), (1, 1, 2));
    }

    #[test]
    fn heuristic_policy_takes_the_first_and_never_touches_the_cache() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(3);
        let mut planner = FakePlanner::new(&clock, &ks, 5);
        let cache = PlanCache::in_memory();
        let stack = stack();
        let slot = CacheSlot {
            cache: &cache,
            stack: &stack,
        };
        let report = prepare_keys(
            &mut planner,
            &ks,
            &never,
            AlgoSelection::Heuristic,
            Some(slot),
            Duration::from_secs(60),
            &clock,
        )
        .unwrap();
        assert_eq!((report.heuristic, report.timed, report.stored), (3, 0, 0));
        assert!(planner.built.iter().all(|(_, requested)| *requested == 1));
        assert!(planner.timed.is_empty());
        assert!(planner
            .adopted
            .values()
            .all(|a| *a == (0, ChosenBy::Heuristic)));
        assert!(cache.is_empty());
    }

    #[test]
    fn a_fresh_process_reuses_every_stored_choice_without_timing() {
        let path = temp_file("reuse");
        let _ = std::fs::remove_file(&path);
        let ks = keys(4);
        let stack = stack();
        {
            let clock = FakeClock(Cell::new(Duration::ZERO));
            let mut planner = FakePlanner::new(&clock, &ks, 3);
            let cache = PlanCache::open(&path);
            let slot = CacheSlot {
                cache: &cache,
                stack: &stack,
            };
            let report = prepare_keys(
                &mut planner,
                &ks,
                &never,
                TIMED,
                Some(slot),
                Duration::from_secs(60),
                &clock,
            )
            .unwrap();
            assert_eq!((report.timed, report.stored), (4, 0));
            assert_eq!(report.saved.as_deref(), Some(path.as_path()));
            assert!(report.warnings.is_empty(), "{:?}", report.warnings);
        }
        // "Another process": a new cache from the file, a library that would now time
        // another candidate fastest.
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let mut planner = FakePlanner::new(&clock, &ks, 6);
        let cache = PlanCache::open(&path);
        let slot = CacheSlot {
            cache: &cache,
            stack: &stack,
        };
        let report = prepare_keys(
            &mut planner,
            &ks,
            &never,
            TIMED,
            Some(slot),
            Duration::from_secs(60),
            &clock,
        )
        .unwrap();
        assert_eq!((report.timed, report.stored, report.heuristic), (0, 4, 0));
        assert!(
            planner.timed.is_empty(),
            "nothing timed: {:?}",
            planner.timed
        );
        for key in &ks {
            assert_eq!(planner.adopted[key], (3, ChosenBy::Stored));
        }
        assert_eq!(clock.elapsed(), Duration::ZERO);
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn past_the_budget_shapes_take_the_heuristic_first_and_are_stored_as_such() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(5);
        let mut planner = FakePlanner::new(&clock, &ks, 2);
        let cache = PlanCache::in_memory();
        let stack = stack();
        let slot = CacheSlot {
            cache: &cache,
            stack: &stack,
        };
        // Each timing costs 100 ms: two fit in 150 ms (the second starts at 100 ms).
        let report = prepare_keys(
            &mut planner,
            &ks,
            &never,
            TIMED,
            Some(slot),
            Duration::from_millis(150),
            &clock,
        )
        .unwrap();
        assert_eq!(
            (report.timed, report.budget_spent, report.heuristic),
            (2, 3, 3)
        );
        assert_eq!(planner.timed, ks[..2]);
        for key in &ks[2..] {
            assert_eq!(planner.adopted[key], (0, ChosenBy::BudgetSpent));
            let stored = cache.lookup(&stack, key).unwrap();
            assert_eq!((stored.source, stored.index), (StoredSource::Heuristic, 0));
        }
        assert_eq!(
            cache.lookup(&stack, &ks[0]).unwrap().source,
            StoredSource::Timed
        );
        assert_eq!(cache.lookup(&stack, &ks[0]).unwrap().index, 2);
    }

    #[test]
    fn a_zero_budget_times_nothing() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(3);
        let mut planner = FakePlanner::new(&clock, &ks, 2);
        let report = prepare_keys(
            &mut planner,
            &ks,
            &never,
            TIMED,
            None,
            Duration::ZERO,
            &clock,
        )
        .unwrap();
        assert_eq!((report.timed, report.budget_spent), (0, 3));
        assert!(planner.timed.is_empty());
    }

    #[test]
    fn heuristic_picks_are_recorded_but_saved_only_with_a_timed_choice() {
        let path = temp_file("save");
        let _ = std::fs::remove_file(&path);
        let cache = PlanCache::open(&path);
        let stack = stack();
        let slot = CacheSlot {
            cache: &cache,
            stack: &stack,
        };
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(3);
        // A request's planning: no budget, nothing timed; the picks are recorded, the file is not written.
        let mut planner = FakePlanner::new(&clock, &ks, 2);
        let report = prepare_keys(
            &mut planner,
            &ks[..2],
            &never,
            TIMED,
            Some(slot),
            Duration::ZERO,
            &clock,
        )
        .unwrap();
        assert_eq!((report.timed, report.budget_spent), (0, 2));
        assert_eq!(report.saved, None);
        assert!(!path.exists());
        assert_eq!(
            cache.lookup(&stack, &ks[0]).unwrap().source,
            StoredSource::Heuristic
        );
        // A load's planning times a shape: the file is written with every choice recorded so far.
        let mut planner = FakePlanner::new(&clock, &ks, 2);
        let report = prepare_keys(
            &mut planner,
            &ks[2..],
            &never,
            TIMED,
            Some(slot),
            Duration::from_secs(60),
            &clock,
        )
        .unwrap();
        assert_eq!(report.timed, 1);
        assert_eq!(report.saved.as_deref(), Some(path.as_path()));
        let reread = PlanCache::open(&path);
        for key in &ks {
            assert!(
                reread.lookup(&stack, key).is_some(),
                "{key:?} not in the saved file"
            );
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn duplicates_and_planned_shapes_are_skipped() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(3);
        let mut planner = FakePlanner::new(&clock, &ks, 1);
        let listed = [ks[0], ks[1], ks[0], ks[2], ks[1]];
        let planned = |k: &PlanKey| *k == ks[2];
        let report = prepare_keys(
            &mut planner,
            &listed,
            &planned,
            TIMED,
            None,
            Duration::from_secs(1),
            &clock,
        )
        .unwrap();
        assert_eq!(
            (report.shapes, report.already_planned, report.timed),
            (3, 1, 2)
        );
        assert_eq!(planner.built.len(), 2);
    }

    #[test]
    fn an_unprepared_call_is_never_timed_and_is_recorded_as_heuristic() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(1);
        let mut planner = FakePlanner::new(&clock, &ks, 4);
        let cache = PlanCache::in_memory();
        let stack = stack();
        let slot = CacheSlot {
            cache: &cache,
            stack: &stack,
        };
        let by = choose_plan(&mut planner, &ks[0], TIMED, Some(slot), Timing::Unprepared).unwrap();
        assert_eq!(by, ChosenBy::Unprepared);
        assert!(planner.timed.is_empty());
        assert_eq!(planner.adopted[&ks[0]], (0, ChosenBy::Unprepared));
        assert_eq!(
            cache.lookup(&stack, &ks[0]).unwrap().source,
            StoredSource::Heuristic
        );
        // Its stored choice then serves the next process, still untimed.
        let mut next = FakePlanner::new(&clock, &ks, 4);
        let by = choose_plan(&mut next, &ks[0], TIMED, Some(slot), Timing::Allowed).unwrap();
        assert_eq!(by, ChosenBy::Stored);
        assert!(next.timed.is_empty());
    }

    #[test]
    fn a_stored_choice_the_heuristic_no_longer_offers_falls_back_with_a_warning() {
        let clock = FakeClock(Cell::new(Duration::ZERO));
        let ks = keys(2);
        let cache = PlanCache::in_memory();
        let stack = stack();
        let gone = MatmulAlgo { data: [99; 8] };
        cache.record(
            &stack,
            StoredPlan::new(ks[0], &gone, StoredSource::Timed, 5, 8),
        );
        // Stored with more candidates than the policy asks now: the check asks for as many.
        cache.record(
            &stack,
            StoredPlan::new(ks[1], &algo(&ks[1], 11), StoredSource::Timed, 11, 16),
        );
        let mut planner = FakePlanner::new(&clock, &ks, 1);
        planner
            .candidates
            .insert(ks[1], (0..16).map(|i| algo(&ks[1], i)).collect());
        let slot = CacheSlot {
            cache: &cache,
            stack: &stack,
        };
        let report = prepare_keys(
            &mut planner,
            &ks,
            &never,
            TIMED,
            Some(slot),
            Duration::from_secs(1),
            &clock,
        )
        .unwrap();
        assert_eq!((report.rejected, report.stored, report.timed), (1, 1, 0));
        assert_eq!(planner.adopted[&ks[0]], (0, ChosenBy::StoredRejected));
        assert_eq!(planner.adopted[&ks[1]], (11, ChosenBy::Stored));
        assert_eq!(planner.built[1], (ks[1], 16));
        assert!(matches!(
            &report.warnings[..],
            [PlanCacheError::StoredAlgoRejected { requested: 8, .. }]
        ));
        let replaced = cache.lookup(&stack, &ks[0]).unwrap();
        assert_eq!(replaced.algo(), Some(algo(&ks[0], 0)));
        assert_eq!(replaced.source, StoredSource::Heuristic);
    }
}
