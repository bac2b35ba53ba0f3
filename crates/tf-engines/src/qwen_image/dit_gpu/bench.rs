//! Benchmark-only timing of the GPU DiT step (the `bench` feature): whole steps eager and as graph replays
//! ([`GpuDit::time_step`]), and per-phase device times of one eager step ([`GpuDit::time_phases`]) through a
//! [`StepProbe`] that records an event at each of the step's marks. The production step is the same
//! function, run with [`NoProbe`].

use tf_cuda::{Event, Stream};

use super::{cuda_err, GpuDit, GpuKvCache, NoProbe, PhaseWork, StepProbe};
use crate::nn::gpu::phases::{PhaseTimer, PhaseTimes};
use crate::qwen_image::dit::{DitError, DitInputs, KvStep};

/// Times of one benchmark run (milliseconds per step, device time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    pub eager_ms: f64,
    pub graph_ms: f64,
}

impl StepProbe for PhaseTimer {
    /// Records an event behind the phase `name` (everything launched since the previous mark).
    fn mark(
        &mut self,
        stream: &Stream,
        name: &'static str,
        work: impl FnOnce() -> PhaseWork,
    ) -> Result<(), DitError> {
        let (flops, bytes) = match work() {
            PhaseWork::Flops(flops) => (flops, 0.0),
            PhaseWork::Bytes(bytes) => (0.0, bytes),
        };
        PhaseTimer::mark(self, stream, name, flops, bytes)
            .map_err(cuda_err("recording a phase event"))
    }
}

/// A start and an end event for timing work on `engine`'s stream.
fn timing_events(engine: &super::Engine) -> Result<(Event, Event), DitError> {
    let event = || Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"));
    Ok((event()?, event()?))
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
        let cache = kv.cache();
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let iters = iters.max(1);
        let (start, end) = timing_events(engine)?;
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
        let (graph_ms, _) = self.time_graph(inputs, kv, iters)?;
        Ok(StepTimes { eager_ms, graph_ms })
    }

    /// Device time of `iters` graph replays of the step of `inputs` back to back, after one untimed replay (which
    /// captures the graph on first use); returns the milliseconds a replay and how many replays ran in all
    /// (`iters + 1`), for a caller that measures energy around the call. The stream is drained before it returns.
    pub fn time_graph(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, GpuKvCache>,
        iters: usize,
    ) -> Result<(f64, usize), DitError> {
        let index = self.prepare(inputs, &kv)?;
        let cache = kv.cache();
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let iters = iters.max(1);
        if !ws.warmed {
            engine.enqueue_step(ws, cache, &mut NoProbe)?;
            ws.warmed = true;
        }
        let (start, end) = timing_events(engine)?;
        // Captured on first use and replayed once untimed.
        engine.replay(ws, cache)?;
        let key = cache.map(GpuKvCache::binding);
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
        Ok((graph_ms, iters + 1))
    }

    /// Times each phase of one eager step of `inputs` (after an untimed warm-up step), with an event after each
    /// launch group; the normal step and its graph are untouched.
    pub fn time_phases(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, GpuKvCache>,
    ) -> Result<PhaseTimes, DitError> {
        let index = self.prepare(inputs, &kv)?;
        let cache = kv.cache();
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        engine.enqueue_step(ws, cache, &mut NoProbe)?;
        ws.warmed = true;
        let mut timer = PhaseTimer::begin(&engine.ctx, &engine.stream)
            .map_err(cuda_err("recording a phase event"))?;
        engine.enqueue_step(ws, cache, &mut timer)?;
        engine
            .stream
            .synchronize()
            .map_err(cuda_err("running the phase-timed step"))?;
        timer.totals().map_err(cuda_err("reading the phase events"))
    }
}
