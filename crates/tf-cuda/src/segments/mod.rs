//! Staggered prompt segments on CUDA streams: segment `k`'s dependent step waits on segment
//! `k - 1`'s event, the rest overlaps.
//!
//! The schedule is pure data ([`stagger::schedule`]); [`drive`] walks it over any [`Lanes`]
//! implementation, and [`Runner`] is the implementation over tf-cuda streams and events:
//! - lane 0 is the caller's stream; lanes `1..n` are the runner's own non-blocking streams;
//! - `Fork`: an event recorded on the caller's stream that every side lane waits on, so the
//!   segments start after the caller's earlier work;
//! - handoff: one event per adjacent pair, recorded by lane `k - 1` after its mixer and waited
//!   by lane `k` before its dependent step. One event serves every layer: a CUDA wait takes the
//!   latest record enqueued before it, and the schedule enqueues layer by layer;
//! - `Join`: each side lane records an event the caller's stream waits on, so work enqueued on
//!   the caller after [`Runner::run`] sees every segment's results;
//! - on any error the runner still joins, then synchronizes every lane (drain) before returning,
//!   so buffers may be reused safely.
//!
//! Invariant (tested on the host with a simulated device that honours CUDA record/wait
//! semantics under random lane interleavings): every dependency of the serial computation is
//! ordered, so each segment computes bit-for-bit what the serial run computes on its rows.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, work: &mut impl tf_cuda::segments::SegmentWork)
//! # -> Result<(), tf_cuda::Error> {
//! use tf_cuda::segments::{Runner, Wait};
//! let runner = Runner::new(ctx, 3)?;
//! runner.run(stream, 28, Wait::Mixer, work)?;
//! # Ok(()) }
//! ```

pub mod stagger;

pub use stagger::{rows, schedule, split, start, StaggerError, Step, Wait, MAX_SEGMENTS};

use crate::context::Context;
use crate::error::Error;
use crate::stream::{Event, Stream};

/// What a runner does with each step: ordering between lanes, and the family's work.
pub trait Lanes {
    type Error;
    /// Side lanes wait for the caller's work so far.
    fn fork(&mut self) -> Result<(), Self::Error>;
    /// Lane `segment` waits for the latest handoff of lane `segment - 1`.
    fn wait_handoff(&mut self, segment: usize) -> Result<(), Self::Error>;
    /// Lane `segment` records its handoff.
    fn signal_handoff(&mut self, segment: usize) -> Result<(), Self::Error>;
    /// The caller's lane waits for every side lane.
    fn join(&mut self) -> Result<(), Self::Error>;
    /// `Begin`, `Pre`, `Mixer`, `Post` or `Finish` on the step's lane.
    fn work(&mut self, step: Step) -> Result<(), Self::Error>;
    /// After a failure (and a join): wait until every lane is idle. Never fails.
    fn drain(&mut self);
}

/// Enqueues `steps` in order; on the first error, joins and drains, then returns it.
pub fn drive<L: Lanes>(steps: &[Step], lanes: &mut L) -> Result<(), L::Error> {
    for &step in steps {
        let result = match step {
            Step::Fork => lanes.fork(),
            Step::WaitHandoff { segment, .. } => lanes.wait_handoff(segment),
            Step::SignalHandoff { segment, .. } => lanes.signal_handoff(segment),
            Step::Join => lanes.join(),
            work => lanes.work(work),
        };
        if let Err(e) = result {
            let _ = lanes.join();
            lanes.drain();
            return Err(e);
        }
    }
    Ok(())
}

/// A model family's per-segment work. Each call enqueues on `stream` (the segment's lane) and
/// must not synchronize it.
pub trait SegmentWork {
    fn begin(&mut self, _segment: usize, _stream: &Stream) -> Result<(), Error> {
        Ok(())
    }
    fn pre(&mut self, segment: usize, layer: usize, stream: &Stream) -> Result<(), Error>;
    /// The step that depends on the previous segment's mixer of the same layer.
    fn mixer(&mut self, segment: usize, layer: usize, stream: &Stream) -> Result<(), Error>;
    fn post(&mut self, segment: usize, layer: usize, stream: &Stream) -> Result<(), Error>;
    fn finish(&mut self, _segment: usize, _stream: &Stream) -> Result<(), Error> {
        Ok(())
    }
}

/// Side streams and events for up to [`MAX_SEGMENTS`] segments; reusable across runs.
#[derive(Debug)]
pub struct Runner {
    segments: usize,
    side: Vec<Stream>,
    fork: Event,
    handoff: Vec<Event>,
    join: Vec<Event>,
}

impl Runner {
    /// A runner for `segments` (1..=4) segments: `segments - 1` side streams and their events.
    pub fn new(ctx: &Context, segments: usize) -> Result<Runner, Error> {
        if segments == 0 || segments > MAX_SEGMENTS {
            return Err(Error::invalid(format!(
                "{segments} segments asked: between 1 and {MAX_SEGMENTS} are supported"
            )));
        }
        let side = (1..segments)
            .map(|_| Stream::new(ctx, false))
            .collect::<Result<Vec<_>, _>>()?;
        let handoff = (1..segments)
            .map(|_| Event::new(ctx, false))
            .collect::<Result<Vec<_>, _>>()?;
        let join = (1..segments)
            .map(|_| Event::new(ctx, false))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Runner {
            segments,
            side,
            fork: Event::new(ctx, false)?,
            handoff,
            join,
        })
    }

    pub fn segments(&self) -> usize {
        self.segments
    }

    /// The stream segment `k` runs on (the caller's for `k == 0`).
    pub fn lane<'a>(&'a self, caller: &'a Stream, segment: usize) -> &'a Stream {
        match segment.checked_sub(1).and_then(|i| self.side.get(i)) {
            Some(stream) => stream,
            None => caller,
        }
    }

    /// Runs `layers` layers of `work` staggered over the segments. Returns once everything is
    /// enqueued; the caller's stream is ordered after every segment.
    pub fn run<W: SegmentWork>(
        &self,
        caller: &Stream,
        layers: usize,
        wait: Wait,
        work: &mut W,
    ) -> Result<(), Error> {
        let steps =
            schedule(self.segments, layers, wait).map_err(|e| Error::invalid(e.to_string()))?;
        let mut lanes = CudaLanes {
            runner: self,
            caller,
            work,
        };
        drive(&steps, &mut lanes)
    }
}

struct CudaLanes<'a, W> {
    runner: &'a Runner,
    caller: &'a Stream,
    work: &'a mut W,
}

impl<W> CudaLanes<'_, W> {
    fn event<'e>(events: &'e [Event], index: usize, what: &str) -> Result<&'e Event, Error> {
        events
            .get(index)
            .ok_or_else(|| Error::invalid(format!("no {what} event for segment {index}")))
    }
}

impl<W: SegmentWork> Lanes for CudaLanes<'_, W> {
    type Error = Error;

    fn fork(&mut self) -> Result<(), Error> {
        self.runner.fork.record(self.caller)?;
        for side in &self.runner.side {
            side.wait(&self.runner.fork)?;
        }
        Ok(())
    }

    fn wait_handoff(&mut self, segment: usize) -> Result<(), Error> {
        let previous = segment
            .checked_sub(1)
            .ok_or_else(|| Error::invalid("segment 0 waits for no one".to_string()))?;
        let event = Self::event(&self.runner.handoff, previous, "handoff")?;
        self.runner.lane(self.caller, segment).wait(event)
    }

    fn signal_handoff(&mut self, segment: usize) -> Result<(), Error> {
        let event = Self::event(&self.runner.handoff, segment, "handoff")?;
        event.record(self.runner.lane(self.caller, segment))
    }

    fn join(&mut self) -> Result<(), Error> {
        let mut first_error = None;
        for (side, event) in self.runner.side.iter().zip(&self.runner.join) {
            let result = event.record(side).and_then(|()| self.caller.wait(event));
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn work(&mut self, step: Step) -> Result<(), Error> {
        let lane = |segment| self.runner.lane(self.caller, segment);
        match step {
            Step::Begin { segment } => self.work.begin(segment, lane(segment)),
            Step::Pre { segment, layer } => self.work.pre(segment, layer, lane(segment)),
            Step::Mixer { segment, layer } => self.work.mixer(segment, layer, lane(segment)),
            Step::Post { segment, layer } => self.work.post(segment, layer, lane(segment)),
            Step::Finish { segment } => self.work.finish(segment, lane(segment)),
            other => Err(Error::invalid(format!("{other:?} is not work"))),
        }
    }

    fn drain(&mut self) {
        let _ = self.caller.synchronize();
        for side in &self.runner.side {
            let _ = side.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// One queued operation of a simulated lane.
    #[derive(Clone, Copy, Debug)]
    enum Op {
        Work(Step),
        /// Wait until `lane` has executed past `position` (None: the event was never recorded,
        /// so the wait is a no-op, as in CUDA).
        Wait(Option<(usize, usize)>),
        Record,
        /// The caller reads every segment's result.
        Consume,
    }

    /// A device that honours CUDA semantics: a record marks a position in its lane; a wait
    /// captures the latest record enqueued before it; lanes execute in any order otherwise.
    struct SimLanes {
        segments: usize,
        queues: Vec<Vec<Op>>,
        /// event id -> latest record (lane, position)
        records: HashMap<usize, (usize, usize)>,
    }

    const FORK: usize = 100;
    const JOIN: usize = 200;

    impl SimLanes {
        fn new(segments: usize) -> SimLanes {
            SimLanes {
                segments,
                queues: vec![Vec::new(); segments],
                records: HashMap::new(),
            }
        }
        fn record(&mut self, event: usize, lane: usize) {
            self.records.insert(event, (lane, self.queues[lane].len()));
            self.queues[lane].push(Op::Record);
        }
        fn wait(&mut self, event: usize, lane: usize) {
            let dep = self.records.get(&event).copied();
            self.queues[lane].push(Op::Wait(dep));
        }
    }

    impl Lanes for SimLanes {
        type Error = String;
        fn fork(&mut self) -> Result<(), String> {
            self.record(FORK, 0);
            for lane in 1..self.segments {
                self.wait(FORK, lane);
            }
            Ok(())
        }
        fn wait_handoff(&mut self, segment: usize) -> Result<(), String> {
            self.wait(segment - 1, segment);
            Ok(())
        }
        fn signal_handoff(&mut self, segment: usize) -> Result<(), String> {
            self.record(segment, segment);
            Ok(())
        }
        fn join(&mut self) -> Result<(), String> {
            for lane in 1..self.segments {
                self.record(JOIN + lane, lane);
                self.wait(JOIN + lane, 0);
            }
            Ok(())
        }
        fn work(&mut self, step: Step) -> Result<(), String> {
            let lane = step.segment().ok_or("work without a lane")?;
            self.queues[lane].push(Op::Work(step));
            Ok(())
        }
        fn drain(&mut self) {}
    }

    fn mix(a: u64, b: u64) -> u64 {
        (a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .rotate_left(23)
            .wrapping_mul(0xbf58_476d_1ce4_e5b9)
    }

    /// The model a segment computes over its rows: per layer an elementwise pre step, a causal
    /// prefix scan (the mixer, whose carry crosses segments), an elementwise post step.
    struct Model {
        ranges: Vec<std::ops::Range<usize>>,
        values: Vec<u64>,
        /// (segment, layer) -> scan state after the segment's last row
        carry: HashMap<(usize, usize), u64>,
        finished: Vec<bool>,
        result: Option<Vec<u64>>,
    }

    impl Model {
        fn new(n: usize, segments: usize) -> Model {
            Model {
                ranges: split(n, segments).expect("valid split"),
                values: vec![0; n],
                carry: HashMap::new(),
                finished: vec![false; segments],
                result: None,
            }
        }

        fn apply(&mut self, op: Op) -> Result<(), String> {
            let step = match op {
                Op::Work(step) => step,
                Op::Consume => {
                    if self.finished.iter().any(|f| !f) {
                        return Err("the caller read results before every segment finished".into());
                    }
                    self.result = Some(self.values.clone());
                    return Ok(());
                }
                _ => return Ok(()),
            };
            match step {
                Step::Begin { segment } => {
                    for r in self.ranges[segment].clone() {
                        self.values[r] = mix(r as u64, 7);
                    }
                }
                Step::Pre { segment, layer } => {
                    for r in self.ranges[segment].clone() {
                        self.values[r] = mix(self.values[r], 3 * layer as u64 + 1);
                    }
                }
                Step::Mixer { segment, layer } => {
                    let mut state = if segment == 0 {
                        layer as u64
                    } else {
                        *self.carry.get(&(segment - 1, layer)).ok_or_else(|| {
                            format!("segment {segment} layer {layer} read the carry before segment {} wrote it", segment - 1)
                        })?
                    };
                    for r in self.ranges[segment].clone() {
                        state = mix(state, self.values[r]);
                        self.values[r] = state;
                    }
                    self.carry.insert((segment, layer), state);
                }
                Step::Post { segment, layer } => {
                    for r in self.ranges[segment].clone() {
                        self.values[r] = mix(self.values[r], 3 * layer as u64 + 2);
                    }
                }
                Step::Finish { segment } => self.finished[segment] = true,
                _ => {}
            }
            Ok(())
        }
    }

    /// Executes the lanes in a random order allowed by their waits; errors on a dependency the
    /// model sees violated, or on a deadlock.
    fn execute(mut sim: SimLanes, n: usize, seed: u64) -> Result<Vec<u64>, String> {
        sim.queues[0].push(Op::Consume);
        let mut model = Model::new(n, sim.segments);
        let mut done = vec![0usize; sim.segments];
        let mut rng = seed | 1;
        loop {
            let ready: Vec<usize> = (0..sim.segments)
                .filter(|&l| match sim.queues[l].get(done[l]) {
                    None => false,
                    Some(Op::Wait(Some((lane, pos)))) => done[*lane] > *pos,
                    Some(_) => true,
                })
                .collect();
            if ready.is_empty() {
                if (0..sim.segments).all(|l| done[l] == sim.queues[l].len()) {
                    break;
                }
                return Err("deadlock: every lane waits".into());
            }
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let lane = ready[(rng % ready.len() as u64) as usize];
            let op = sim.queues[lane][done[lane]];
            model.apply(op)?;
            done[lane] += 1;
        }
        model.result.ok_or_else(|| "no result".to_string())
    }

    fn run(
        n: usize,
        segments: usize,
        layers: usize,
        wait: Wait,
        seed: u64,
        drop_waits: bool,
    ) -> Result<Vec<u64>, String> {
        let mut steps = schedule(segments, layers, wait).map_err(|e| e.to_string())?;
        if drop_waits {
            steps.retain(|s| !matches!(s, Step::WaitHandoff { .. }));
        }
        let mut sim = SimLanes::new(segments);
        drive(&steps, &mut sim)?;
        execute(sim, n, seed)
    }

    proptest! {
        #[test]
        fn staggered_runs_are_bit_identical_to_the_serial_run(
            n in 4usize..64, segments in 1usize..=MAX_SEGMENTS, layers in 1usize..5,
            pre in any::<bool>(), seed in any::<u64>(),
        ) {
            let wait = if pre { Wait::Pre } else { Wait::Mixer };
            let serial = run(n, 1, layers, wait, seed, false).unwrap();
            let staggered = run(n, segments, layers, wait, seed, false);
            prop_assert_eq!(staggered, Ok(serial));
        }
    }

    #[test]
    fn a_missing_handoff_is_caught() {
        let mut caught = 0;
        for seed in 0..200u64 {
            if run(
                40,
                3,
                4,
                Wait::Mixer,
                seed.wrapping_mul(0x2545_f491_4f6c_dd1d),
                true,
            )
            .is_err()
            {
                caught += 1;
            }
        }
        assert!(
            caught > 0,
            "the simulation never ran a mixer before its predecessor"
        );
    }

    #[test]
    fn a_missing_join_is_caught() {
        let mut caught = 0;
        for seed in 0..200u64 {
            let mut steps = schedule(3, 2, Wait::Mixer).unwrap();
            steps.retain(|s| *s != Step::Join);
            let mut sim = SimLanes::new(3);
            drive(&steps, &mut sim).unwrap();
            if execute(sim, 30, seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).is_err() {
                caught += 1;
            }
        }
        assert!(caught > 0);
    }

    /// Lanes that fail at a chosen step, recording what the driver did after.
    struct FailingLanes {
        fail_at: usize,
        seen: usize,
        joined: bool,
        drained: bool,
    }

    impl Lanes for FailingLanes {
        type Error = String;
        fn fork(&mut self) -> Result<(), String> {
            self.tick()
        }
        fn wait_handoff(&mut self, _: usize) -> Result<(), String> {
            self.tick()
        }
        fn signal_handoff(&mut self, _: usize) -> Result<(), String> {
            self.tick()
        }
        fn join(&mut self) -> Result<(), String> {
            self.joined = true;
            Ok(())
        }
        fn work(&mut self, _: Step) -> Result<(), String> {
            self.tick()
        }
        fn drain(&mut self) {
            self.drained = true;
        }
    }

    impl FailingLanes {
        fn tick(&mut self) -> Result<(), String> {
            self.seen += 1;
            if self.seen == self.fail_at {
                return Err(format!("failed at step {}", self.seen));
            }
            Ok(())
        }
    }

    #[test]
    fn a_failure_joins_and_drains_before_returning() {
        let steps = schedule(2, 3, Wait::Mixer).unwrap();
        let mut lanes = FailingLanes {
            fail_at: 5,
            seen: 0,
            joined: false,
            drained: false,
        };
        assert_eq!(
            drive(&steps, &mut lanes),
            Err("failed at step 5".to_string())
        );
        assert!(lanes.joined && lanes.drained);
        assert_eq!(lanes.seen, 5, "nothing is enqueued after the failure");
    }
}
