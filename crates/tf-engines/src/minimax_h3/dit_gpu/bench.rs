//! Benchmark-only timing of the H3 DiT step (the `bench` feature): device time per step from events around
//! back-to-back launches, eager and as graph replays, on the workspace and graph a forward uses
//! ([`GpuH3Dit::time_step`]); and the device time of each phase of one eager step ([`GpuH3Dit::time_phases`])
//! through a probe that records an event at each of the step's marks. The production step is the same function,
//! run with a probe that marks nothing.

use tf_cuda::{Event, Stream};

use super::step::{NoProbe, StepProbe};
use super::workspace::Workspace;
use super::{cuda_err, Engine, GpuH3Dit, H3ScheduleTimes, H3StepTimes};
use crate::minimax_h3::dit::{H3Error, H3Inputs};
use crate::nn::gpu::phases::{PhaseTimer, PhaseTimes};

impl StepProbe for PhaseTimer {
    fn mark(
        &mut self,
        stream: &Stream,
        name: &'static str,
        flops: f64,
        bytes: f64,
    ) -> Result<(), H3Error> {
        PhaseTimer::mark(self, stream, name, flops, bytes)
            .map_err(cuda_err("recording a phase event"))
    }
}

/// Milliseconds per launch of `iters` calls of `launch` on `stream`, timed by events around them.
fn timed(
    start: &Event,
    end: &Event,
    stream: &Stream,
    iters: usize,
    mut launch: impl FnMut() -> Result<(), H3Error>,
) -> Result<f64, H3Error> {
    start
        .record(stream)
        .map_err(cuda_err("recording an event"))?;
    for _ in 0..iters {
        launch()?;
    }
    end.record(stream).map_err(cuda_err("recording an event"))?;
    end.synchronize().map_err(cuda_err("timing the steps"))?;
    let ms = Event::elapsed_ms(start, end).map_err(cuda_err("reading an event"))?;
    Ok(f64::from(ms) / iters as f64)
}

/// Device time of a graph replay of `ws`'s step (whole with `tables`, else without the timestep tables): the first
/// replay captures the graph, `warmup - 1` more run untimed, then `iters` are timed; the stream is drained after.
fn time_replays(
    engine: &Engine,
    ws: &mut Workspace,
    tables: bool,
    (start, end): (&Event, &Event),
    warmup: usize,
    iters: usize,
) -> Result<f64, H3Error> {
    engine.replay(ws, tables)?;
    for _ in 1..warmup.max(1) {
        engine.replay(ws, tables)?;
    }
    let ms = timed(start, end, &engine.stream, iters, || {
        engine.replay(ws, tables)
    })?;
    engine
        .stream
        .synchronize()
        .map_err(cuda_err("finishing the timed steps"))?;
    Ok(ms)
}

impl GpuH3Dit {
    /// Device time of one forward's step (events; `warmup` then `iters` launches), eager and graph replay. The
    /// inputs are uploaded once; the workspace (and its GEMM planning, on first use) and the graph are the ones
    /// [`crate::minimax_h3::dit::H3DitBackend::forward`] uses. `peak_device_bytes` is the process's peak of device
    /// buffer bytes since the last `tf_cuda::usage::reset_peaks`.
    pub fn time_step(
        &mut self,
        inputs: &H3Inputs,
        warmup: usize,
        iters: usize,
    ) -> Result<H3StepTimes, H3Error> {
        let (index, _) = self.prepare(inputs)?;
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let iters = iters.max(1);
        let start = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        let end = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        // At least one eager step first: it builds the GEMM plans, so the capture below records no planning.
        for _ in 0..warmup.max(1) {
            engine.enqueue_step(ws, &mut NoProbe)?;
        }
        ws.warmed = true;
        let eager_ms = timed(&start, &end, &engine.stream, iters, || {
            engine.enqueue_step(ws, &mut NoProbe)
        })?;
        let graph_ms = time_replays(engine, ws, true, (&start, &end), warmup, iters)?;
        Ok(H3StepTimes {
            eager_ms,
            graph_ms,
            peak_device_bytes: tf_cuda::usage().device_peak,
        })
    }

    /// Device time of `iters` graph replays of the whole step of `inputs` back to back, after one untimed replay
    /// (which captures the graph on first use, behind an eager step where the workspace has run none); returns the
    /// milliseconds a replay and how many replays ran in all (`iters + 1`), for a caller that measures energy around
    /// the call. The stream is drained before it returns.
    pub fn time_graph(&mut self, inputs: &H3Inputs, iters: usize) -> Result<(f64, usize), H3Error> {
        let (index, _) = self.prepare(inputs)?;
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let iters = iters.max(1);
        if !ws.warmed {
            engine.enqueue_step(ws, &mut NoProbe)?;
            ws.warmed = true;
        }
        let start = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        let end = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        let ms = time_replays(engine, ws, true, (&start, &end), 1, iters)?;
        Ok((ms, iters + 1))
    }

    /// Device times of the step of `inputs` on the timestep schedule `schedule` (which holds the step's values):
    /// the schedule's tables (one GEMM per block over all its values, as a request's first step makes them), then
    /// the step without them, eager and as graph replays (what every later step of the request runs). Leaves no
    /// schedule set.
    pub fn time_step_on_schedule(
        &mut self,
        inputs: &H3Inputs,
        schedule: &[f32],
        warmup: usize,
        iters: usize,
    ) -> Result<H3ScheduleTimes, H3Error> {
        if !self.set_timestep_schedule(schedule)? {
            return Err(H3Error::Backend(format!(
                "a schedule of {} values is not used by this DiT (at most {} distinct values, one GPU)",
                schedule.len(),
                super::MAX_SCHEDULE_TIMESTEPS
            )));
        }
        let times = self.time_scheduled(inputs, warmup, iters.max(1));
        self.set_timestep_schedule(&[])?;
        times
    }

    fn time_scheduled(
        &mut self,
        inputs: &H3Inputs,
        warmup: usize,
        iters: usize,
    ) -> Result<H3ScheduleTimes, H3Error> {
        let (index, timesteps) = self.prepare(inputs)?;
        if timesteps.len() != self.schedule.len() {
            return Err(H3Error::Backend(
                "the step's timesteps are not all in the schedule".into(),
            ));
        }
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let start = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        let end = Event::new(&engine.ctx, true).map_err(cuda_err("creating an event"))?;
        // An eager whole step first: it builds the GEMM plans (the tables' included), so nothing timed plans.
        engine.enqueue_step(ws, &mut NoProbe)?;
        ws.warmed = true;
        let tables_ms = timed(&start, &end, &engine.stream, iters, || {
            engine.enqueue_tables(ws, &mut NoProbe)
        })?;
        ws.tables_for = Some(timesteps);
        for _ in 0..warmup {
            engine.enqueue_body(ws, &mut NoProbe)?;
        }
        let body_eager_ms = timed(&start, &end, &engine.stream, iters, || {
            engine.enqueue_body(ws, &mut NoProbe)
        })?;
        let body_graph_ms = time_replays(engine, ws, false, (&start, &end), warmup, iters)?;
        Ok(H3ScheduleTimes {
            timesteps: self.schedule.len(),
            tables_ms,
            body_eager_ms,
            body_graph_ms,
        })
    }

    /// Device time of each phase of one eager step of `inputs` (after an untimed eager warm-up step), with an event
    /// after each launch group: time embedder, adaLN tables, input projections, the token refiner's phases, and per
    /// block the qkv GEMM, QK norm + RoPE, attention, out GEMM, the fused residual + norms, fc1, SwiGLU, fc2, then
    /// the heads. The normal step and its graph are untouched.
    pub fn time_phases(&mut self, inputs: &H3Inputs) -> Result<PhaseTimes, H3Error> {
        let (index, _) = self.prepare(inputs)?;
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        engine.enqueue_step(ws, &mut NoProbe)?;
        ws.warmed = true;
        let mut timer = PhaseTimer::begin(&engine.ctx, &engine.stream)
            .map_err(cuda_err("recording a phase event"))?;
        engine.enqueue_step(ws, &mut timer)?;
        engine
            .stream
            .synchronize()
            .map_err(cuda_err("running the phase-timed step"))?;
        timer.totals().map_err(cuda_err("reading the phase events"))
    }
}
