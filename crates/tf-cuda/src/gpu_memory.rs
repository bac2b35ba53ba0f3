//! What a worker reports as resident on the GPU.
//!
//! Two figures, side by side:
//! - **resident**: device memory in use now minus what was in use at a baseline, both from
//!   `cuMemGetInfo` (`used = total - free`). This is what the job costs the device, whatever
//!   allocated it.
//! - **accounted**: the bytes held through `DeviceBuffer` (and pinned `HostBuffer`) from
//!   [`crate::usage()`].
//!
//! `accounted` is a lower bound of `resident`: it does not see raw driver allocations made
//! outside `DeviceBuffer`, the driver's and context's own reservations made after the baseline
//! (module code, local memory for kernels, graph executables), allocation rounding by the
//! driver, or library workspaces such as cuBLASLt's. The difference is reported as
//! `unaccounted`.
//!
//! Invariants of a [`ResidentReport`] (all saturating, never negative):
//! - `used_now = total - free_now`, `used_at_baseline = total_at_baseline - free_at_baseline`;
//! - `resident = used_now - used_at_baseline` (0 if the device got emptier, e.g. another process
//!   freed memory: the device is shared, so this figure includes other processes' changes);
//! - `unaccounted = resident - accounted` (0 when `accounted` exceeds `resident`).
//!
//! `cuMemGetInfo` needs a context, so the baseline is taken after the context exists: the
//! context's initial reservation is part of the baseline, not of `resident`.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context) -> Result<(), tf_cuda::Error> {
//! use tf_cuda::gpu_memory::Baseline;
//! let baseline = Baseline::capture(ctx)?; // before loading weights
//! // ... load ...
//! let report = baseline.report(ctx)?;
//! println!("resident {} B ({} B through DeviceBuffer)", report.resident, report.accounted);
//! # Ok(()) }
//! ```

use crate::context::{Context, MemoryInfo};
use crate::error::Error;
use crate::usage::Usage;

/// Device memory figures at one moment, relative to a baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResidentReport {
    /// Device memory size.
    pub total: u64,
    /// `total - free` now.
    pub used_now: u64,
    /// `total - free` at the baseline.
    pub used_at_baseline: u64,
    /// `used_now - used_at_baseline`: what the worker reports as resident.
    pub resident: u64,
    /// Device bytes held in `DeviceBuffer`s (a lower bound of `resident`).
    pub accounted: u64,
    /// `resident - accounted`: raw allocations, driver/context reservations, library workspaces.
    pub unaccounted: u64,
    /// Most device bytes held in `DeviceBuffer`s at once since the last peak reset.
    pub accounted_peak: u64,
    /// Pinned host bytes held in `HostBuffer`s.
    pub pinned_host: u64,
}

/// Combines a baseline, a fresh `cuMemGetInfo` and the buffer accounting (pure arithmetic).
pub fn resident_report(baseline: MemoryInfo, now: MemoryInfo, usage: Usage) -> ResidentReport {
    let used_now = now.total.saturating_sub(now.free);
    let used_at_baseline = baseline.total.saturating_sub(baseline.free);
    let resident = used_now.saturating_sub(used_at_baseline);
    ResidentReport {
        total: now.total,
        used_now,
        used_at_baseline,
        resident,
        accounted: usage.device,
        unaccounted: resident.saturating_sub(usage.device),
        accounted_peak: usage.device_peak,
        pinned_host: usage.host,
    }
}

/// Device memory in use when a job started (after its context was created).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Baseline {
    pub info: MemoryInfo,
}

impl Baseline {
    /// Reads `cuMemGetInfo` now.
    pub fn capture(ctx: &Context) -> Result<Baseline, Error> {
        Ok(Baseline {
            info: ctx.memory_info()?,
        })
    }

    /// A report of what is resident now relative to this baseline.
    pub fn report(&self, ctx: &Context) -> Result<ResidentReport, Error> {
        Ok(resident_report(
            self.info,
            ctx.memory_info()?,
            crate::usage::usage(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn info(free: u64, total: u64) -> MemoryInfo {
        MemoryInfo { free, total }
    }

    fn usage(device: u64) -> Usage {
        Usage {
            device,
            device_peak: device + 7,
            host: 12,
            ..Usage::default()
        }
    }

    #[test]
    fn resident_is_the_growth_of_used_memory() {
        let r = resident_report(
            info(130 * GIB, 140 * GIB),
            info(90 * GIB, 140 * GIB),
            usage(38 * GIB),
        );
        assert_eq!(r.total, 140 * GIB);
        assert_eq!(r.used_at_baseline, 10 * GIB);
        assert_eq!(r.used_now, 50 * GIB);
        assert_eq!(r.resident, 40 * GIB);
        assert_eq!(r.accounted, 38 * GIB);
        assert_eq!(r.unaccounted, 2 * GIB);
        assert_eq!(r.accounted_peak, 38 * GIB + 7);
        assert_eq!(r.pinned_host, 12);
    }

    #[test]
    fn a_device_that_got_emptier_reports_zero_not_negative() {
        let r = resident_report(
            info(90 * GIB, 140 * GIB),
            info(100 * GIB, 140 * GIB),
            usage(GIB),
        );
        assert_eq!(r.resident, 0);
        assert_eq!(r.unaccounted, 0);
        assert_eq!(r.accounted, GIB);
    }

    #[test]
    fn nonsense_driver_figures_do_not_underflow() {
        let r = resident_report(info(200, 100), info(300, 100), usage(0));
        assert_eq!((r.used_now, r.used_at_baseline, r.resident), (0, 0, 0));
    }

    proptest! {
        #[test]
        fn report_invariants(
            total in 1u64..(1 << 40), base_free_frac in 0u64..=1000, now_free_frac in 0u64..=1000,
            accounted in 0u64..(1 << 40),
        ) {
            let base = info(total / 1000 * base_free_frac, total);
            let now = info(total / 1000 * now_free_frac, total);
            let r = resident_report(base, now, usage(accounted));
            prop_assert_eq!(r.used_now, total - now.free);
            prop_assert_eq!(r.used_at_baseline, total - base.free);
            if r.used_now >= r.used_at_baseline {
                prop_assert_eq!(r.resident, r.used_now - r.used_at_baseline);
            } else {
                prop_assert_eq!(r.resident, 0);
            }
            prop_assert_eq!(r.unaccounted + r.accounted.min(r.resident), r.resident);
            prop_assert!(r.resident <= total);
        }
    }
}
