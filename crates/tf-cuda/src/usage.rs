//! Process-wide accounting of the bytes held through `DeviceBuffer` and `HostBuffer`, an
//! optional device allocation limit, and the optional allocation hook.
//!
//! Counters are atomics, safe from any thread without a lock. A peak never falls below the
//! bytes held at any moment since the last reset: allocation raises the total and then the peak
//! with `fetch_max`; a reset clears the peak and then raises it to the current total, so an
//! allocation racing a reset is never lost from the peak.
//!
//! What is not counted: raw driver allocations made outside these types, driver/context
//! reservations, and library workspaces. The figures are a lower bound of the process's
//! resident footprint, not the footprint itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Bytes and allocations held through this crate's buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Device bytes held in `DeviceBuffer`s now.
    pub device: u64,
    /// Pinned host bytes held in `HostBuffer`s now.
    pub host: u64,
    /// Most device bytes held at once since the last peak reset.
    pub device_peak: u64,
    /// Most pinned host bytes held at once since the last peak reset.
    pub host_peak: u64,
    /// Live device allocations (non-empty `DeviceBuffer`s).
    pub device_allocs: u64,
    /// Live pinned host allocations.
    pub host_allocs: u64,
    /// Device allocations made since the process started.
    pub device_allocs_total: u64,
    /// Pinned host allocations made since the process started.
    pub host_allocs_total: u64,
}

pub(crate) struct Counter {
    bytes: AtomicU64,
    peak: AtomicU64,
    live: AtomicU64,
    total: AtomicU64,
}

impl Counter {
    const fn new() -> Self {
        Counter {
            bytes: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            live: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    /// Adds `n` bytes unless the total would pass `limit`; returns whether it was added.
    pub(crate) fn try_hold(&self, n: u64, limit: Option<u64>) -> bool {
        let added = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                let next = held.checked_add(n)?;
                match limit {
                    Some(cap) if next > cap => None,
                    _ => Some(next),
                }
            });
        match added {
            Ok(previous) => {
                self.peak.fetch_max(previous + n, Ordering::AcqRel);
                self.live.fetch_add(1, Ordering::AcqRel);
                self.total.fetch_add(1, Ordering::AcqRel);
                true
            }
            Err(_) => false,
        }
    }

    /// Returns `n` bytes taken by a successful [`Counter::try_hold`].
    pub(crate) fn release(&self, n: u64) {
        // Saturating so that a bookkeeping mistake can never wrap to a huge figure.
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(n))
            });
        let _ = self
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                Some(live.saturating_sub(1))
            });
    }

    /// Undoes a hold whose allocation then failed: the bytes and the counts go back.
    pub(crate) fn cancel(&self, n: u64) {
        self.release(n);
        let _ = self
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_sub(1))
            });
    }

    fn reset_peak(&self) {
        self.peak.store(0, Ordering::Release);
        self.peak
            .fetch_max(self.bytes.load(Ordering::Acquire), Ordering::AcqRel);
    }

    fn snapshot(&self) -> (u64, u64, u64, u64) {
        let bytes = self.bytes.load(Ordering::Acquire);
        let peak = self.peak.load(Ordering::Acquire).max(bytes);
        (
            bytes,
            peak,
            self.live.load(Ordering::Acquire),
            self.total.load(Ordering::Acquire),
        )
    }
}

pub(crate) static DEVICE: Counter = Counter::new();
pub(crate) static HOST: Counter = Counter::new();

/// 0 means no limit.
static DEVICE_LIMIT: AtomicU64 = AtomicU64::new(0);

/// The bytes this process holds through `DeviceBuffer` and `HostBuffer`. Safe from any thread.
pub fn usage() -> Usage {
    let (device, device_peak, device_allocs, device_allocs_total) = DEVICE.snapshot();
    let (host, host_peak, host_allocs, host_allocs_total) = HOST.snapshot();
    Usage {
        device,
        host,
        device_peak,
        host_peak,
        device_allocs,
        host_allocs,
        device_allocs_total,
        host_allocs_total,
    }
}

/// Resets both peaks to the bytes held now and returns the usage read just before the reset.
pub fn reset_peaks() -> Usage {
    let before = usage();
    DEVICE.reset_peak();
    HOST.reset_peak();
    before
}

/// Caps the device bytes `DeviceBuffer::alloc` may hold at once (`None` removes the cap).
/// An allocation past the cap fails with `OutOfMemory` before the driver is called.
pub fn set_device_limit(limit: Option<u64>) {
    DEVICE_LIMIT.store(limit.unwrap_or(0), Ordering::Release);
}

/// The device allocation cap, if any.
pub fn device_limit() -> Option<u64> {
    match DEVICE_LIMIT.load(Ordering::Acquire) {
        0 => None,
        cap => Some(cap),
    }
}

/// Calls and wall time of one kind of costly driver work (see [`DriverCosts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TimedCalls {
    /// Calls made.
    pub calls: u64,
    /// Wall seconds spent in them, on the calling threads.
    pub seconds: f64,
}

impl Default for CallTimer {
    fn default() -> Self {
        CallTimer::new()
    }
}

impl TimedCalls {
    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &TimedCalls) -> TimedCalls {
        TimedCalls {
            calls: self.calls.saturating_sub(earlier.calls),
            seconds: (self.seconds - earlier.seconds).max(0.0),
        }
    }
}

impl std::fmt::Display for TimedCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({:.1} ms)", self.calls, self.seconds * 1e3)
    }
}

/// The driver work that costs wall time outside the kernels themselves, counted since the process started:
/// what a request spends setting up rather than computing ([`DriverCosts::since`] gives one request's share).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DriverCosts {
    /// `cuMemAlloc_v2` calls of `DeviceBuffer::alloc` (hook-served allocations are not driver calls).
    pub device_allocs: TimedCalls,
    /// Driver frees of `DeviceBuffer`s, each with the context-wide wait that precedes it.
    pub device_frees: TimedCalls,
    /// Stream captures, from `begin_capture` to `end` (the enqueueing of the captured work included).
    pub graph_captures: TimedCalls,
    /// Graph instantiations.
    pub graph_instantiations: TimedCalls,
}

impl DriverCosts {
    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &DriverCosts) -> DriverCosts {
        DriverCosts {
            device_allocs: self.device_allocs.since(&earlier.device_allocs),
            device_frees: self.device_frees.since(&earlier.device_frees),
            graph_captures: self.graph_captures.since(&earlier.graph_captures),
            graph_instantiations: self
                .graph_instantiations
                .since(&earlier.graph_instantiations),
        }
    }
}

impl std::fmt::Display for DriverCosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device allocations {}, frees {}, graph captures {}, instantiations {}",
            self.device_allocs, self.device_frees, self.graph_captures, self.graph_instantiations
        )
    }
}

/// A call count and its summed nanoseconds, lock-free: a `static` of it counts one kind of work process-wide
/// (this crate's driver costs; the engines count their own host work the same way).
pub struct CallTimer {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl CallTimer {
    /// No calls yet.
    pub const fn new() -> Self {
        CallTimer {
            calls: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }

    /// Counts one call that started at `started`.
    pub fn record(&self, started: std::time::Instant) {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.calls.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .nanos
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_add(nanos))
            });
    }

    /// The calls counted so far and their time.
    pub fn read(&self) -> TimedCalls {
        TimedCalls {
            calls: self.calls.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

pub(crate) static ALLOC_CALLS: CallTimer = CallTimer::new();
pub(crate) static FREE_CALLS: CallTimer = CallTimer::new();
pub(crate) static CAPTURE_CALLS: CallTimer = CallTimer::new();
pub(crate) static INSTANTIATE_CALLS: CallTimer = CallTimer::new();

/// The costly driver work done so far in this process. Safe from any thread.
pub fn driver_costs() -> DriverCosts {
    DriverCosts {
        device_allocs: ALLOC_CALLS.read(),
        device_frees: FREE_CALLS.read(),
        graph_captures: CAPTURE_CALLS.read(),
        graph_instantiations: INSTANTIATE_CALLS.read(),
    }
}

/// A launch or library call that returns later than this waited for something (an enqueue normally takes
/// microseconds): such calls are kept by name until read ([`take_slow_calls`]).
pub const SLOW_CALL: std::time::Duration = std::time::Duration::from_millis(1);
/// Slow calls kept between two readings (the first ones).
const MAX_SLOW_CALLS: usize = 16;
static SLOW_CALLS: std::sync::Mutex<Vec<(f64, String)>> = std::sync::Mutex::new(Vec::new());

/// Notes a call that started at `started` if it took [`SLOW_CALL`] or longer, described by `what` (called only
/// then). Kernel launches, graph launches and cuBLASLt matmuls note themselves.
pub fn note_slow_call(started: std::time::Instant, what: impl FnOnce() -> String) {
    let took = started.elapsed();
    if took < SLOW_CALL {
        return;
    }
    let mut slow = SLOW_CALLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if slow.len() < MAX_SLOW_CALLS {
        slow.push((took.as_secs_f64() * 1e3, what()));
    }
}

/// The slow calls noted since the last call (milliseconds, what), oldest first; empties the list.
pub fn take_slow_calls() -> Vec<(f64, String)> {
    std::mem::take(
        &mut *SLOW_CALLS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

/// A sub-allocator under `DeviceBuffer` (such as the arena).
///
/// Once installed, `DeviceBuffer::alloc` asks it first; `None` falls back to the driver.
/// A buffer the hook gave out is returned to the hook, never to the driver.
pub trait AllocationHook: Send + Sync {
    /// `len` (> 0) bytes at a 256-byte aligned device address, or `None` to let the driver allocate.
    fn alloc(&self, len: usize) -> Option<u64>;
    /// Takes back an address this hook returned from `alloc` (with the same `len`).
    fn free(&self, addr: u64, len: usize);
}

static HOOK: OnceLock<Box<dyn AllocationHook>> = OnceLock::new();

/// Installs the process's allocation hook, once, before the buffers it should serve.
///
/// Fails (returning the hook) when one is already installed. Nothing installs a hook by
/// default.
pub fn install_allocation_hook(
    hook: Box<dyn AllocationHook>,
) -> Result<(), Box<dyn AllocationHook>> {
    HOOK.set(hook)
}

/// The installed allocation hook, if any.
pub(crate) fn allocation_hook() -> Option<&'static dyn AllocationHook> {
    HOOK.get().map(|b| b.as_ref())
}

/// Whether an allocation hook is installed.
pub fn allocation_hook_installed() -> bool {
    HOOK.get().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    #[test]
    fn only_slow_calls_are_kept_by_name() {
        let now = std::time::Instant::now();
        drop(take_slow_calls());
        note_slow_call(now, || "fast".to_string());
        note_slow_call(now - std::time::Duration::from_millis(3), || {
            "slow".to_string()
        });
        let slow = take_slow_calls();
        assert!(
            slow.iter().any(|(ms, what)| *ms >= 3.0 && what == "slow"),
            "{slow:?}"
        );
        assert!(!slow.iter().any(|(_, what)| what == "fast"), "{slow:?}");
    }

    #[test]
    fn call_timers_count_calls_and_time_and_difference_by_reading() {
        let t = CallTimer::new();
        assert_eq!(t.read(), TimedCalls::default());
        let started = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.record(started);
        t.record(std::time::Instant::now());
        let first = t.read();
        assert_eq!(first.calls, 2);
        assert!(first.seconds >= 0.002, "{first:?}");
        t.record(std::time::Instant::now());
        let later = t.read().since(&first);
        assert_eq!(later.calls, 1);
        assert!(later.seconds < first.seconds, "{later:?} vs {first:?}");
        // A reading never goes negative, even taken against a later one.
        assert_eq!(first.since(&t.read()), TimedCalls::default());
        assert!(format!("{first}").starts_with("2 ("), "{first}");
        let costs = DriverCosts {
            device_allocs: first,
            ..DriverCosts::default()
        };
        assert_eq!(costs.since(&costs), DriverCosts::default());
        assert!(
            costs.to_string().starts_with("device allocations 2 ("),
            "{costs}"
        );
    }

    #[test]
    fn hold_release_and_peak() {
        let c = Counter::new();
        assert!(c.try_hold(1000, None));
        assert!(c.try_hold(24, None));
        c.release(1000);
        let (bytes, peak, live, total) = c.snapshot();
        assert_eq!((bytes, peak, live, total), (24, 1024, 1, 2));
        c.reset_peak();
        assert_eq!(c.snapshot().1, 24);
    }

    #[test]
    fn limit_refuses_past_the_cap_and_leaves_counts() {
        let c = Counter::new();
        assert!(c.try_hold(600, Some(1000)));
        assert!(!c.try_hold(401, Some(1000)));
        assert!(c.try_hold(400, Some(1000)));
        assert_eq!(c.snapshot(), (1000, 1000, 2, 2));
        c.cancel(400);
        assert_eq!(c.snapshot(), (600, 1000, 1, 1));
    }

    #[test]
    fn peak_reset_racing_an_allocation_keeps_it() {
        // A reset interleaved with an allocation must leave peak >= the bytes held.
        for _ in 0..200 {
            let c = Arc::new(Counter::new());
            assert!(c.try_hold(100, None));
            let a = Arc::clone(&c);
            let t = std::thread::spawn(move || {
                assert!(a.try_hold(300, None));
            });
            c.reset_peak();
            t.join().ok();
            let (bytes, peak, _, _) = c.snapshot();
            assert_eq!(bytes, 400);
            assert!(c.peak.load(Ordering::Acquire) >= 100);
            assert_eq!(peak, 400);
        }
    }

    proptest! {
        /// Concurrent threads allocating and freeing: the final bytes equal the sum of what was
        /// not freed, and the peak is at least the largest total any thread could observe
        /// alone, and never more than the sum of every hold.
        #[test]
        fn concurrent_accounting_is_exact(
            plans in proptest::collection::vec(
                proptest::collection::vec((1u64..10_000, any::<bool>()), 1..40), 2..6)
        ) {
            let c = Arc::new(Counter::new());
            let handles: Vec<_> = plans.iter().cloned().map(|plan| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    let mut kept = 0u64;
                    let mut own_peak = 0u64;
                    let mut own = 0u64;
                    for (n, free_it) in plan {
                        assert!(c.try_hold(n, None));
                        own += n;
                        own_peak = own_peak.max(own);
                        if free_it {
                            c.release(n);
                            own -= n;
                        } else {
                            kept += n;
                        }
                    }
                    (kept, own_peak)
                })
            }).collect();
            let mut kept_all = 0;
            let mut max_own_peak = 0;
            for h in handles {
                let (kept, own_peak) = h.join().map_err(|_| TestCaseError::fail("thread panicked"))?;
                kept_all += kept;
                max_own_peak = max_own_peak.max(own_peak);
            }
            let all_holds: u64 = plans.iter().flatten().map(|(n, _)| n).sum();
            let holds: u64 = plans.iter().map(|p| p.len() as u64).sum();
            let kept_count: u64 = plans.iter().flatten().filter(|(_, f)| !f).count() as u64;
            let (bytes, peak, live, total) = c.snapshot();
            prop_assert_eq!(bytes, kept_all);
            prop_assert!(peak >= max_own_peak);
            prop_assert!(peak >= bytes);
            prop_assert!(peak <= all_holds);
            prop_assert_eq!(live, kept_count);
            prop_assert_eq!(total, holds);
        }
    }
}
