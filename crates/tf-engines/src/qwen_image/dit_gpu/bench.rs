//! Benchmark-only timing of the GPU DiT step (the `bench` feature): whole steps eager and as graph replays
//! ([`GpuDit::time_step`]), and per-phase device times of one eager step ([`GpuDit::time_phases`]) through a
//! [`StepProbe`] that records an event at each of the step's marks. The production step is the same
//! function, run with [`NoProbe`].

use tf_cuda::{Context, Event, Stream};

use super::{cuda_err, GpuDit, GpuKvCache, NoProbe, PhaseWork, StepProbe};
use crate::qwen_image::dit::{DitError, DitInputs, KvStep};

/// Times of one benchmark run (milliseconds per step, device time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    pub eager_ms: f64,
    pub graph_ms: f64,
}

/// One phase summed over the step (over every layer for the per-block phases).
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTotal {
    pub name: &'static str,
    /// Device milliseconds between the event before the phase's launches and the one after them.
    pub ms: f64,
    pub work: PhaseWork,
    /// How many times the phase ran in the step (layers, for per-block phases).
    pub count: usize,
}

/// Per-phase device times of one eager step.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTimes {
    /// From the first event to the last (the events themselves add a little).
    pub step_ms: f64,
    /// In order of first appearance in the step.
    pub phases: Vec<PhaseTotal>,
}

/// Records a timing event after each launch group of an eager step (never used while capturing a graph).
struct PhaseTimer {
    ctx: Context,
    start: Option<Event>,
    marks: Vec<(&'static str, PhaseWork, Event)>,
}

impl PhaseTimer {
    fn new(ctx: &Context) -> PhaseTimer {
        PhaseTimer {
            ctx: ctx.clone(),
            start: None,
            marks: Vec::new(),
        }
    }

    fn event(&self, stream: &Stream) -> Result<Event, DitError> {
        let event = Event::new(&self.ctx, true).map_err(cuda_err("creating a phase event"))?;
        event
            .record(stream)
            .map_err(cuda_err("recording a phase event"))?;
        Ok(event)
    }

    fn begin(&mut self, stream: &Stream) -> Result<(), DitError> {
        self.start = Some(self.event(stream)?);
        Ok(())
    }

    /// Sums each phase's time and work; call after the stream reached the last mark.
    fn totals(&self) -> Result<PhaseTimes, DitError> {
        let start = self
            .start
            .as_ref()
            .ok_or_else(|| DitError::Backend("phase timer read before it began".into()))?;
        let elapsed = |a: &Event, b: &Event| {
            Event::elapsed_ms(a, b)
                .map(f64::from)
                .map_err(cuda_err("reading a phase event"))
        };
        let mut phases: Vec<PhaseTotal> = Vec::new();
        let mut previous = start;
        for (name, work, event) in &self.marks {
            let ms = elapsed(previous, event)?;
            previous = event;
            match phases.iter_mut().find(|p| p.name == *name) {
                Some(p) => {
                    p.ms += ms;
                    p.count += 1;
                    p.work = match (p.work, *work) {
                        (PhaseWork::Flops(a), PhaseWork::Flops(b)) => PhaseWork::Flops(a + b),
                        (PhaseWork::Bytes(a), PhaseWork::Bytes(b)) => PhaseWork::Bytes(a + b),
                        (kept, _) => kept,
                    };
                }
                None => phases.push(PhaseTotal {
                    name,
                    ms,
                    work: *work,
                    count: 1,
                }),
            }
        }
        Ok(PhaseTimes {
            step_ms: elapsed(start, previous)?,
            phases,
        })
    }
}

impl StepProbe for PhaseTimer {
    /// Records an event behind the phase `name` (everything launched since the previous mark).
    fn mark(
        &mut self,
        stream: &Stream,
        name: &'static str,
        work: impl FnOnce() -> PhaseWork,
    ) -> Result<(), DitError> {
        let event = self.event(stream)?;
        self.marks.push((name, work(), event));
        Ok(())
    }
}

impl GpuDit {
    /// Times the step of `inputs` (device time, events around `iters` launches after a warm-up): eager launches,
    /// then graph replays. The workspace and graph are the ones [`DitBackend::forward`] uses.
    pub fn time_step(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, GpuKvCache>,
        iters: usize,
    ) -> Result<StepTimes, DitError> {
        let index = self.prepare(inputs, &kv)?;
        let cache = match kv {
            KvStep::Cached(c) => Some(c),
            _ => None,
        };
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let iters = iters.max(1);
        let start = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        let end = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        engine.enqueue_step(ws, cache, &mut NoProbe)?;
        ws.warmed = true;
        start
            .record(&engine.stream)
            .map_err(cuda_err("recording an event"))?;
        for _ in 0..iters {
            engine.enqueue_step(ws, cache, &mut NoProbe)?;
        }
        end.record(&engine.stream)
            .map_err(cuda_err("recording an event"))?;
        end.synchronize().map_err(cuda_err("timing eager steps"))?;
        let eager_ms =
            f64::from(Event::elapsed_ms(&start, &end).map_err(cuda_err("reading an event"))?)
                / iters as f64;
        // Captured on first use and replayed once untimed.
        engine.replay(ws, cache)?;
        let key = cache.map_or(0, |c| c.id);
        let graph = ws.graphs.get(&key).ok_or_else(|| {
            DitError::Backend("the step graph was not kept after its capture".into())
        })?;
        start
            .record(&engine.stream)
            .map_err(cuda_err("recording an event"))?;
        for _ in 0..iters {
            graph
                .launch(&engine.stream)
                .map_err(cuda_err("replaying the step graph"))?;
        }
        end.record(&engine.stream)
            .map_err(cuda_err("recording an event"))?;
        end.synchronize()
            .map_err(cuda_err("timing graph replays"))?;
        let graph_ms =
            f64::from(Event::elapsed_ms(&start, &end).map_err(cuda_err("reading an event"))?)
                / iters as f64;
        Ok(StepTimes { eager_ms, graph_ms })
    }

    /// Times each phase of one eager step of `inputs` (after an untimed warm-up step), with an event after each
    /// launch group; the normal step and its graph are untouched.
    pub fn time_phases(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, GpuKvCache>,
    ) -> Result<PhaseTimes, DitError> {
        let index = self.prepare(inputs, &kv)?;
        let cache = match kv {
            KvStep::Cached(c) => Some(c),
            _ => None,
        };
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        engine.enqueue_step(ws, cache, &mut NoProbe)?;
        ws.warmed = true;
        let mut timer = PhaseTimer::new(&engine.ctx);
        timer.begin(&engine.stream)?;
        engine.enqueue_step(ws, cache, &mut timer)?;
        engine
            .stream
            .synchronize()
            .map_err(cuda_err("running the phase-timed step"))?;
        timer.totals()
    }
}
