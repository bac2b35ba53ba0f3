//! Host time a model spends outside its kernels in a few named pieces of work, counted process-wide: what a step
//! at a new shape does before and around its launches (building a workspace, enqueuing an eager step) and how long
//! the host then waits for the device. The worker logs the differences between progress notes, so a slow first
//! step shows where its time went.
//!
//! ```
//! use tf_engines::nn::host_work::{self, HostWork};
//! let before = host_work::read();
//! let started = std::time::Instant::now();
//! host_work::WORKSPACE_BUILDS.record(started);
//! let done = host_work::read().since(&before);
//! assert_eq!(done.workspace_builds.calls, 1);
//! assert!(done.is_setup());
//! # let _: HostWork = done;
//! ```

use tf_cuda::usage::{CallTimer, TimedCalls};

/// Workspaces built (allocation or reuse of buffers, tables computed and uploaded).
pub static WORKSPACE_BUILDS: CallTimer = CallTimer::new();
/// Steps enqueued eagerly (the first of a workspace, or with graphs off): the host's launch time, not the device's.
pub static EAGER_STEPS: CallTimer = CallTimer::new();
/// Waits for a step's device work to finish.
pub static STEP_WAITS: CallTimer = CallTimer::new();

/// The counts and times of [`WORKSPACE_BUILDS`], [`EAGER_STEPS`] and [`STEP_WAITS`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostWork {
    pub workspace_builds: TimedCalls,
    pub eager_steps: TimedCalls,
    pub step_waits: TimedCalls,
}

/// The host work counted so far in this process.
pub fn read() -> HostWork {
    HostWork {
        workspace_builds: WORKSPACE_BUILDS.read(),
        eager_steps: EAGER_STEPS.read(),
        step_waits: STEP_WAITS.read(),
    }
}

impl HostWork {
    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &HostWork) -> HostWork {
        HostWork {
            workspace_builds: self.workspace_builds.since(&earlier.workspace_builds),
            eager_steps: self.eager_steps.since(&earlier.eager_steps),
            step_waits: self.step_waits.since(&earlier.step_waits),
        }
    }

    /// Whether a workspace was built or a step enqueued eagerly (work a warm, repeated step does not do).
    pub fn is_setup(&self) -> bool {
        self.workspace_builds.calls > 0 || self.eager_steps.calls > 0
    }
}

impl std::fmt::Display for HostWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "workspace builds {}, eager step enqueues {}, step waits {}",
            self.workspace_builds, self.eager_steps, self.step_waits
        )
    }
}
