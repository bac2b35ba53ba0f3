//! Device time per phase of a launch sequence: a [`PhaseTimer`] records an event on the stream at each mark, and
//! [`PhaseTimer::totals`] sums the time between consecutive marks per phase name, with the work each phase did
//! (FLOPs and bytes) for its rate.
//!
//! Used by the benchmarks of both DiTs and the Qwen-Image VAE decoder: the production paths run the same launch
//! code with nothing marked. Events cost a little device time each, so per-phase figures add up to slightly more
//! than an unmarked run; never mark while a graph is being captured.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream) -> Result<(), tf_cuda::Error> {
//! use tf_engines::nn::gpu::phases::PhaseTimer;
//! let mut timer = PhaseTimer::begin(ctx, stream)?;
//! // ... launch a GEMM of 2 GFLOP on `stream` ...
//! timer.mark(stream, "GEMM", 2e9, 0.0)?;
//! // ... launch a norm that reads and writes 64 MB ...
//! timer.mark(stream, "norm", 0.0, 64e6)?;
//! stream.synchronize()?;
//! for phase in timer.totals()?.phases {
//!     println!("{}: {:.3} ms, {:.0} TFLOP/s, {:.0} GB/s", phase.name, phase.ms, phase.tflops(), phase.gb_per_s());
//! }
//! # Ok(()) }
//! ```

use tf_cuda::{Context, Event, Stream};

/// One phase summed over every mark of its name.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub name: &'static str,
    /// Device milliseconds between the event before each of the phase's launch groups and the one after it.
    pub ms: f64,
    /// How many launch groups the phase had (layers, for per-block phases).
    pub count: usize,
    /// Floating-point operations (0 where not counted).
    pub flops: f64,
    /// Bytes read and written (0 where not counted).
    pub bytes: f64,
}

impl Phase {
    /// TFLOP/s of the phase (0 when it counts no FLOPs or took no time).
    pub fn tflops(&self) -> f64 {
        if self.ms > 0.0 {
            self.flops / (self.ms * 1e9)
        } else {
            0.0
        }
    }

    /// GB/s of the phase (0 when it counts no bytes or took no time).
    pub fn gb_per_s(&self) -> f64 {
        if self.ms > 0.0 {
            self.bytes / (self.ms * 1e6)
        } else {
            0.0
        }
    }
}

/// The phases of one timed run.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTimes {
    /// From the first event to the last (the events themselves add a little).
    pub total_ms: f64,
    /// In order of first appearance.
    pub phases: Vec<Phase>,
}

/// Records an event after each launch group on a stream.
pub struct PhaseTimer {
    ctx: Context,
    start: Event,
    marks: Vec<(&'static str, f64, f64, Event)>,
}

impl std::fmt::Debug for PhaseTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhaseTimer")
            .field("marks", &self.marks.len())
            .finish()
    }
}

impl PhaseTimer {
    /// Starts timing on `stream`: the first phase is everything launched after this call.
    pub fn begin(ctx: &Context, stream: &Stream) -> Result<PhaseTimer, tf_cuda::Error> {
        let start = recorded(ctx, stream)?;
        Ok(PhaseTimer {
            ctx: ctx.clone(),
            start,
            marks: Vec::new(),
        })
    }

    /// Ends the phase `name`: everything launched on `stream` since the previous mark, which did `flops` and moved
    /// `bytes`.
    pub fn mark(
        &mut self,
        stream: &Stream,
        name: &'static str,
        flops: f64,
        bytes: f64,
    ) -> Result<(), tf_cuda::Error> {
        let event = recorded(&self.ctx, stream)?;
        self.marks.push((name, flops, bytes, event));
        Ok(())
    }

    /// Marks so far.
    pub fn marks(&self) -> usize {
        self.marks.len()
    }

    /// Sums each phase's time and work. Call after the stream has run past the last mark (synchronize first).
    pub fn totals(&self) -> Result<PhaseTimes, tf_cuda::Error> {
        let elapsed = |a: &Event, b: &Event| Event::elapsed_ms(a, b).map(f64::from);
        let mut phases: Vec<Phase> = Vec::new();
        let mut previous = &self.start;
        for (name, flops, bytes, event) in &self.marks {
            let ms = elapsed(previous, event)?;
            previous = event;
            match phases.iter_mut().find(|p| p.name == *name) {
                Some(p) => {
                    p.ms += ms;
                    p.count += 1;
                    p.flops += flops;
                    p.bytes += bytes;
                }
                None => phases.push(Phase {
                    name,
                    ms,
                    count: 1,
                    flops: *flops,
                    bytes: *bytes,
                }),
            }
        }
        Ok(PhaseTimes {
            total_ms: elapsed(&self.start, previous)?,
            phases,
        })
    }
}

fn recorded(ctx: &Context, stream: &Stream) -> Result<Event, tf_cuda::Error> {
    let event = Event::new(ctx, true)?;
    event.record(stream)?;
    Ok(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_zero_without_time_or_work() {
        let p = Phase {
            name: "x",
            ms: 0.0,
            count: 1,
            flops: 1e12,
            bytes: 1e9,
        };
        assert_eq!((p.tflops(), p.gb_per_s()), (0.0, 0.0));
        let q = Phase { ms: 2.0, ..p };
        assert!((q.tflops() - 500.0).abs() < 1e-9);
        assert!((q.gb_per_s() - 500.0).abs() < 1e-9);
    }
}
