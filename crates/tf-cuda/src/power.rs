//! The board's power, clocks and energy through NVML (`libnvidia-ml`, loaded at run time), for benchmarks that
//! must say whether a step was held by the card's power limit.
//!
//! On a card that sits at its power limit the clock falls until the draw fits under it, so a step's time follows
//! the energy it spends: the joules a step takes, beside the limit, say how much faster it can get without spending
//! less. [`PowerMeter::window`] opens a measuring window: it reads the board's energy counter at the start and the
//! end (millijoules since the driver loaded) and samples the draw, the SM clock and the clock-limiting reasons on a
//! thread of its own meanwhile; [`EnergyWindow::finish`] returns an [`EnergyReport`].
//!
//! Library search: `TF_NVML` (the only candidate when set), else `libnvidia-ml.so.1`, else `libnvidia-ml.so`. The
//! CUDA device is matched to its NVML handle by PCI address, so `CUDA_VISIBLE_DEVICES` renumbering cannot pick
//! another board. Nothing here is needed to run a model: a machine without NVML gets an error that says so, and the
//! benchmarks print it and go on.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tf_cuda::power::PowerMeter;
//!
//! # fn run_steps() {}
//! let ctx = tf_cuda::Context::new(Arc::new(tf_sys::Driver::open()?), 0)?;
//! let meter = PowerMeter::for_context(&ctx)?;
//! let window = meter.window(Duration::from_millis(10));
//! run_steps(); // ... work on the device, synchronized before the window closes
//! let report = window.finish()?;
//! println!("{:.1} J at {:.0} W mean of a {:.0} W limit", report.joules, report.mean_watts(), report.limit_watts);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString, OsString};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::Context;

/// Environment variable naming the NVML library file explicitly.
pub const ENV_PATH: &str = "TF_NVML";
const FILE_NAMES: &[&str] = &["libnvidia-ml.so.1", "libnvidia-ml.so"];
/// `NVML_CLOCK_SM`.
const CLOCK_SM: c_int = 1;
/// Longest NVML error text kept (its strings are short and static).
const MAX_ERROR_TEXT: usize = 256;

type NvmlReturn = c_int;
type NvmlDevice = *mut c_void;

/// What went wrong reading the board's power.
#[derive(Debug, Error)]
pub enum PowerError {
    /// No candidate library opened with every entry point this module uses.
    #[error(
        "NVML (libnvidia-ml, shipped with the NVIDIA driver) could not be opened: {tried}; set {ENV_PATH} to \
         the library's path, or run where the driver is installed"
    )]
    LibraryNotFound {
        /// Every candidate and why it was refused.
        tried: String,
    },
    /// An NVML call returned an error code.
    #[error("{call} failed: {text} (NVML code {code})")]
    Call {
        call: &'static str,
        code: i32,
        text: String,
    },
    /// The CUDA device's PCI address could not be read.
    #[error("reading the CUDA device's PCI address for NVML: {0}")]
    Cuda(#[from] crate::Error),
    /// The thread opening NVML in the background could not start, or ended without an answer.
    #[error("opening NVML on a thread of its own: {0}")]
    Thread(String),
}

/// NVML's entry points used here, resolved from one library.
struct NvmlApi {
    init: unsafe extern "C" fn() -> NvmlReturn,
    shutdown: unsafe extern "C" fn() -> NvmlReturn,
    error_string: unsafe extern "C" fn(NvmlReturn) -> *const c_char,
    by_pci_bus_id: unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> NvmlReturn,
    total_energy: unsafe extern "C" fn(NvmlDevice, *mut c_ulonglong) -> NvmlReturn,
    enforced_limit: unsafe extern "C" fn(NvmlDevice, *mut c_uint) -> NvmlReturn,
    power_usage: unsafe extern "C" fn(NvmlDevice, *mut c_uint) -> NvmlReturn,
    clock_info: unsafe extern "C" fn(NvmlDevice, c_int, *mut c_uint) -> NvmlReturn,
    /// `nvmlDeviceGetCurrentClocksEventReasons` (drivers from 535), else its older name `...ThrottleReasons`.
    clock_reasons: Option<unsafe extern "C" fn(NvmlDevice, *mut c_ulonglong) -> NvmlReturn>,
}

/// The candidates in search order, from the given environment lookup (pure: no file access).
pub fn candidates(env: impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    match env(ENV_PATH).filter(|v| !v.is_empty()) {
        Some(explicit) => vec![PathBuf::from(explicit)],
        None => FILE_NAMES.iter().map(PathBuf::from).collect(),
    }
}

/// An initialised NVML, shared by a [`PowerLibrary`] and its meters; shut down when the last of them drops it.
struct Nvml {
    api: NvmlApi,
    // Last: the entry points above point into it.
    _lib: libloading::Library,
}

impl Nvml {
    fn open_first(candidates: &[PathBuf]) -> Result<Nvml, PowerError> {
        let mut tried = Vec::with_capacity(candidates.len());
        for candidate in candidates {
            match Self::open_one(candidate) {
                Ok(nvml) => return Ok(nvml),
                Err(reason) => tried.push(format!("{}: {reason}", candidate.display())),
            }
        }
        Err(PowerError::LibraryNotFound {
            tried: tried.join("; "),
        })
    }

    fn open_one(candidate: &std::path::Path) -> Result<Nvml, String> {
        // SAFETY: loading runs the library's initialisers; NVML's only set up its own state.
        let lib = unsafe { libloading::Library::new(candidate) }.map_err(|e| e.to_string())?;
        let api = resolve(&lib).map_err(|missing| format!("not NVML: missing {missing}"))?;
        // SAFETY: takes no arguments; NVML counts its own initialisations.
        let code = unsafe { (api.init)() };
        if code != 0 {
            return Err(format!(
                "nvmlInit_v2 failed: {} (code {code})",
                error_text(&api, code)
            ));
        }
        Ok(Nvml { api, _lib: lib })
    }

    fn check(&self, call: &'static str, code: NvmlReturn) -> Result<(), PowerError> {
        if code == 0 {
            return Ok(());
        }
        Err(PowerError::Call {
            call,
            code,
            text: error_text(&self.api, code),
        })
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: balanced with the successful nvmlInit_v2 in `open_one`; the result is ignored (Drop never reports).
        unsafe {
            (self.api.shutdown)();
        }
    }
}

/// Resolves every entry point, or names the first one missing.
fn resolve(lib: &libloading::Library) -> Result<NvmlApi, &'static str> {
    macro_rules! entry {
        ($name:literal) => {
            // SAFETY: the signature is the one `nvml.h` declares for this symbol (the field's type); libloading
            // only reads the address here.
            match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                Ok(sym) => *sym,
                Err(_) => return Err($name),
            }
        };
    }
    let optional = |name: &[u8]| {
        // SAFETY: as above; both names share one signature.
        unsafe { lib.get::<unsafe extern "C" fn(NvmlDevice, *mut c_ulonglong) -> NvmlReturn>(name) }
            .ok()
            .map(|sym| *sym)
    };
    Ok(NvmlApi {
        init: entry!("nvmlInit_v2"),
        shutdown: entry!("nvmlShutdown"),
        error_string: entry!("nvmlErrorString"),
        by_pci_bus_id: entry!("nvmlDeviceGetHandleByPciBusId_v2"),
        total_energy: entry!("nvmlDeviceGetTotalEnergyConsumption"),
        enforced_limit: entry!("nvmlDeviceGetEnforcedPowerLimit"),
        power_usage: entry!("nvmlDeviceGetPowerUsage"),
        clock_info: entry!("nvmlDeviceGetClockInfo"),
        clock_reasons: optional(b"nvmlDeviceGetCurrentClocksEventReasons\0")
            .or_else(|| optional(b"nvmlDeviceGetCurrentClocksThrottleReasons\0")),
    })
}

fn error_text(api: &NvmlApi, code: NvmlReturn) -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string (or null) for any code.
    let ptr = unsafe { (api.error_string)(code) };
    if ptr.is_null() {
        return String::from("(no description)");
    }
    // SAFETY: non-null, NUL-terminated, static storage owned by the library.
    let text = unsafe { CStr::from_ptr(ptr) }.to_string_lossy();
    text.chars().take(MAX_ERROR_TEXT).collect()
}

/// NVML's PCI bus id text for a device at `domain:bus:device` (function 0), as `nvmlDeviceGetHandleByPciBusId_v2`
/// takes it.
pub fn pci_bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:08X}:{bus:02X}:{device:02X}.0")
}

/// Why the clocks are below their maximum (NVML's clock event reason bits), as sampled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockReasons(pub u64);

impl ClockReasons {
    const NAMES: [(u64, &'static str); 8] = [
        (0x1, "idle"),
        (0x2, "application clocks"),
        (0x4, "power cap"),
        (0x8, "hardware slowdown"),
        (0x20, "thermal (software)"),
        (0x40, "thermal (hardware)"),
        (0x80, "power brake"),
        (0x100, "display clocks"),
    ];

    /// The software power cap (the board's power limit) held the clocks down.
    pub fn power_capped(self) -> bool {
        self.0 & 0x4 != 0
    }

    /// Any thermal or hardware slowdown.
    pub fn slowed(self) -> bool {
        self.0 & (0x8 | 0x20 | 0x40 | 0x80) != 0
    }

    /// The names of the set bits this module knows.
    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES
            .iter()
            .filter(|(bit, _)| self.0 & bit != 0)
            .map(|(_, name)| *name)
            .collect()
    }
}

/// One board, opened through NVML and matched to a CUDA context's device.
pub struct PowerMeter {
    nvml: Arc<Nvml>,
    device: NvmlDevice,
    bus_id: String,
}

/// NVML opened and initialised, not yet matched to a board. Loading the library and `nvmlInit_v2` take time on some
/// machines: [`PowerLibrary::open_in_background`] does it beside a model's load, off the way to the first request.
#[derive(Clone)]
pub struct PowerLibrary {
    nvml: Arc<Nvml>,
}

impl fmt::Debug for PowerLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PowerLibrary")
    }
}

impl PowerLibrary {
    /// Searches `TF_NVML`, then the system (see the module doc).
    pub fn open() -> Result<PowerLibrary, PowerError> {
        Self::open_first(&candidates(|k| std::env::var_os(k)))
    }

    /// Opens the first of `candidates` that is NVML; the error lists every attempt.
    pub fn open_first(candidates: &[PathBuf]) -> Result<PowerLibrary, PowerError> {
        Ok(PowerLibrary {
            nvml: Arc::new(Nvml::open_first(candidates)?),
        })
    }

    /// [`PowerLibrary::open`] on a thread of its own; [`OpeningLibrary::wait`] takes the result.
    pub fn open_in_background() -> OpeningLibrary {
        open_first_in_background(candidates(|k| std::env::var_os(k)))
    }

    /// The meter of `ctx`'s board, found by its PCI address.
    pub fn meter_for(&self, ctx: &Context) -> Result<Arc<PowerMeter>, PowerError> {
        use tf_sys::device_attribute as da;
        let attr = |a| -> Result<u32, PowerError> {
            let v = ctx.attribute(a)?;
            u32::try_from(v).map_err(|_| PowerError::Call {
                call: "cuDeviceGetAttribute (PCI address)",
                code: v,
                text: String::from("the driver gave a negative PCI address part"),
            })
        };
        let bus_id = pci_bus_id(
            attr(da::PCI_DOMAIN_ID)?,
            attr(da::PCI_BUS_ID)?,
            attr(da::PCI_DEVICE_ID)?,
        );
        self.meter_at(&bus_id)
    }

    /// The meter of the board at `bus_id` (as [`pci_bus_id`] writes it).
    pub fn meter_at(&self, bus_id: &str) -> Result<Arc<PowerMeter>, PowerError> {
        let text = CString::new(bus_id).map_err(|_| PowerError::Call {
            call: "nvmlDeviceGetHandleByPciBusId_v2",
            code: -1,
            text: format!("the PCI bus id {bus_id:?} holds a NUL byte"),
        })?;
        let mut device: NvmlDevice = std::ptr::null_mut();
        // SAFETY: a NUL-terminated string and an out-pointer to a local, both valid for the call.
        let code = unsafe { (self.nvml.api.by_pci_bus_id)(text.as_ptr(), &mut device) };
        self.nvml.check("nvmlDeviceGetHandleByPciBusId_v2", code)?;
        Ok(Arc::new(PowerMeter {
            nvml: Arc::clone(&self.nvml),
            device,
            bus_id: bus_id.to_owned(),
        }))
    }
}

/// A [`PowerLibrary`] being opened on a thread of its own ([`PowerLibrary::open_in_background`]).
pub struct OpeningLibrary(Result<JoinHandle<Result<PowerLibrary, PowerError>>, String>);

impl OpeningLibrary {
    /// The library once its thread is done.
    pub fn wait(self) -> Result<PowerLibrary, PowerError> {
        match self.0 {
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|_| Err(PowerError::Thread("the thread panicked".into()))),
            Err(why) => Err(PowerError::Thread(why)),
        }
    }
}

fn open_first_in_background(candidates: Vec<PathBuf>) -> OpeningLibrary {
    OpeningLibrary(
        std::thread::Builder::new()
            .name("tf-nvml-open".into())
            .spawn(move || PowerLibrary::open_first(&candidates))
            .map_err(|e| format!("the thread could not start: {e}")),
    )
}

// SAFETY: NVML is thread-safe (its documentation: every call may be made from any thread), and the device handle is
// an opaque token that NVML owns for as long as it is initialised, which `nvml` keeps it.
unsafe impl Send for PowerMeter {}
// SAFETY: as above; no method takes `&mut self` or mutates shared state on this side.
unsafe impl Sync for PowerMeter {}

impl fmt::Debug for PowerMeter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PowerMeter")
            .field("bus_id", &self.bus_id)
            .finish()
    }
}

impl PowerMeter {
    /// Opens NVML (see the module doc for the search) and finds `ctx`'s device by its PCI address.
    pub fn for_context(ctx: &Context) -> Result<Arc<PowerMeter>, PowerError> {
        PowerLibrary::open()?.meter_for(ctx)
    }

    /// Opens the first of `candidates` that is NVML and finds the board at `bus_id` (as [`pci_bus_id`] writes it).
    pub fn open(candidates: &[PathBuf], bus_id: &str) -> Result<Arc<PowerMeter>, PowerError> {
        PowerLibrary::open_first(candidates)?.meter_at(bus_id)
    }

    /// The PCI address the board was found at.
    pub fn bus_id(&self) -> &str {
        &self.bus_id
    }

    /// One query of this board through `f`, an NVML device query whose one out-parameter is a `T`; its code checked
    /// under `name`.
    fn query<T: Default>(
        &self,
        name: &'static str,
        f: unsafe extern "C" fn(NvmlDevice, *mut T) -> NvmlReturn,
    ) -> Result<T, PowerError> {
        let mut out = T::default();
        // SAFETY: `f` was resolved with this signature from `nvml.h`; the handle came from NVML and stays valid
        // while `nvml` is initialised; `out` is a local of the type the entry writes.
        let code = unsafe { f(self.device, &mut out) };
        self.nvml.check(name, code)?;
        Ok(out)
    }

    /// The board's energy counter: millijoules since the driver was loaded.
    pub fn energy_millijoules(&self) -> Result<u64, PowerError> {
        self.query(
            "nvmlDeviceGetTotalEnergyConsumption",
            self.nvml.api.total_energy,
        )
    }

    /// The power limit the board enforces now, in watts.
    pub fn limit_watts(&self) -> Result<f64, PowerError> {
        let mw = self.query(
            "nvmlDeviceGetEnforcedPowerLimit",
            self.nvml.api.enforced_limit,
        )?;
        Ok(f64::from(mw) / 1000.0)
    }

    /// The board's draw now (NVML's average over its last second or so), in watts.
    pub fn draw_watts(&self) -> Result<f64, PowerError> {
        let mw = self.query("nvmlDeviceGetPowerUsage", self.nvml.api.power_usage)?;
        Ok(f64::from(mw) / 1000.0)
    }

    /// The SM clock now, in MHz.
    pub fn sm_clock_mhz(&self) -> Result<u32, PowerError> {
        let mut mhz: c_uint = 0;
        // SAFETY: as in `query`; CLOCK_SM is a valid clock type.
        let code = unsafe { (self.nvml.api.clock_info)(self.device, CLOCK_SM, &mut mhz) };
        self.nvml.check("nvmlDeviceGetClockInfo", code)?;
        Ok(mhz)
    }

    /// Why the clocks are below their maximum now (`None` where this NVML lacks the query).
    pub fn clock_reasons(&self) -> Result<Option<ClockReasons>, PowerError> {
        match self.nvml.api.clock_reasons {
            Some(f) => Ok(Some(ClockReasons(
                self.query("nvmlDeviceGetCurrentClocksEventReasons", f)?,
            ))),
            None => Ok(None),
        }
    }

    /// The energy counter now, to measure a span of work from ([`EnergyMark::spent`]).
    pub fn mark(self: &Arc<Self>) -> Result<EnergyMark, PowerError> {
        Ok(EnergyMark {
            meter: Arc::clone(self),
            millijoules: self.energy_millijoules()?,
            at: Instant::now(),
        })
    }

    /// Opens a measuring window: the energy counter now, and a thread sampling every `every` until
    /// [`EnergyWindow::finish`].
    pub fn window(self: &Arc<Self>, every: Duration) -> EnergyWindow {
        let start_mj = self.energy_millijoules();
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let meter = Arc::clone(self);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("tf-power-sampler".into())
                .spawn(move || {
                    let mut samples = Vec::new();
                    while !stop.load(Ordering::Acquire) {
                        samples.push(Sample {
                            watts: meter.draw_watts().ok(),
                            sm_mhz: meter.sm_clock_mhz().ok(),
                            reasons: meter.clock_reasons().ok().flatten(),
                        });
                        std::thread::sleep(every);
                    }
                    samples
                })
                .ok()
        };
        EnergyWindow {
            meter: Arc::clone(self),
            start_mj,
            started,
            stop,
            sampler,
        }
    }
}

/// The board's energy counter at one moment ([`PowerMeter::mark`]): what a span of work spent, without a sampler
/// thread (for a whole request; the benchmarks' windows sample the clocks too).
pub struct EnergyMark {
    meter: Arc<PowerMeter>,
    millijoules: u64,
    at: Instant,
}

impl EnergyMark {
    /// Joules the board spent since the mark, and the seconds since it.
    pub fn spent(&self) -> Result<EnergySpent, PowerError> {
        let now = self.meter.energy_millijoules()?;
        Ok(EnergySpent {
            joules: now.saturating_sub(self.millijoules) as f64 / 1000.0,
            seconds: self.at.elapsed().as_secs_f64(),
        })
    }
}

/// What the board spent between an [`EnergyMark`] and [`EnergyMark::spent`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EnergySpent {
    pub joules: f64,
    pub seconds: f64,
}

impl EnergySpent {
    /// Mean draw over the span, in watts (0 for an empty span).
    pub fn mean_watts(&self) -> f64 {
        mean_watts(self.joules, self.seconds)
    }
}

/// Joules over seconds, 0 where no time passed.
fn mean_watts(joules: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        joules / seconds
    } else {
        0.0
    }
}

/// One sample of the sampler thread (each part `None` where its query failed).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    pub watts: Option<f64>,
    pub sm_mhz: Option<u32>,
    pub reasons: Option<ClockReasons>,
}

/// An open measuring window ([`PowerMeter::window`]).
pub struct EnergyWindow {
    meter: Arc<PowerMeter>,
    start_mj: Result<u64, PowerError>,
    started: Instant,
    stop: Arc<AtomicBool>,
    sampler: Option<JoinHandle<Vec<Sample>>>,
}

impl EnergyWindow {
    /// Closes the window: the energy spent since it opened and what the samples saw.
    pub fn finish(mut self) -> Result<EnergyReport, PowerError> {
        let end_mj = self.meter.energy_millijoules();
        let seconds = self.started.elapsed().as_secs_f64();
        let samples = self.stop_sampler();
        let start_mj = std::mem::replace(&mut self.start_mj, Ok(0))?;
        let end_mj = end_mj?;
        let limit_watts = self.meter.limit_watts()?;
        Ok(EnergyReport::new(
            end_mj.saturating_sub(start_mj),
            seconds,
            limit_watts,
            &samples,
        ))
    }

    fn stop_sampler(&mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Release);
        self.sampler
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for EnergyWindow {
    fn drop(&mut self) {
        // A window dropped unfinished still stops its thread; a finished one has none left.
        self.stop_sampler();
    }
}

/// Spread of the SM clock over a window's samples, in MHz.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSpread {
    pub median: u32,
    pub min: u32,
    pub max: u32,
}

impl ClockSpread {
    /// `None` for no samples; the median of an even count is the lower middle one.
    pub fn of(values: &[u32]) -> Option<ClockSpread> {
        let mut v = values.to_vec();
        v.sort_unstable();
        let (&min, &max) = (v.first()?, v.last()?);
        Some(ClockSpread {
            median: v[(v.len() - 1) / 2],
            min,
            max,
        })
    }
}

/// What a measuring window saw.
#[derive(Clone, Debug, PartialEq)]
pub struct EnergyReport {
    /// Energy the board spent over the window (its counter's difference).
    pub joules: f64,
    /// The window's length (host clock).
    pub seconds: f64,
    /// The enforced power limit at the window's end.
    pub limit_watts: f64,
    /// The SM clock over the samples (`None` where none read it).
    pub sm_clock: Option<ClockSpread>,
    /// Samples that read the clock-limiting reasons, and of them those where the power cap held the clocks.
    pub reason_samples: usize,
    pub power_capped_samples: usize,
    /// Samples where a thermal or hardware slowdown held the clocks.
    pub slowed_samples: usize,
    /// The highest draw sampled, in watts.
    pub max_sampled_watts: Option<f64>,
}

impl EnergyReport {
    /// A report from a window's raw readings.
    pub fn new(
        millijoules: u64,
        seconds: f64,
        limit_watts: f64,
        samples: &[Sample],
    ) -> EnergyReport {
        let clocks: Vec<u32> = samples.iter().filter_map(|s| s.sm_mhz).collect();
        let reasons: Vec<ClockReasons> = samples.iter().filter_map(|s| s.reasons).collect();
        let max_sampled_watts = samples
            .iter()
            .filter_map(|s| s.watts)
            .fold(None, |m: Option<f64>, w| Some(m.map_or(w, |m| m.max(w))));
        EnergyReport {
            joules: millijoules as f64 / 1000.0,
            seconds,
            limit_watts,
            sm_clock: ClockSpread::of(&clocks),
            reason_samples: reasons.len(),
            power_capped_samples: reasons.iter().filter(|r| r.power_capped()).count(),
            slowed_samples: reasons.iter().filter(|r| r.slowed()).count(),
            max_sampled_watts,
        }
    }

    /// Mean draw over the window (0 for an empty window).
    pub fn mean_watts(&self) -> f64 {
        mean_watts(self.joules, self.seconds)
    }

    /// Mean draw as a share of the limit (0 where the limit reads 0).
    pub fn limit_share(&self) -> f64 {
        if self.limit_watts > 0.0 {
            self.mean_watts() / self.limit_watts
        } else {
            0.0
        }
    }

    /// Share of the reason samples in which the power cap held the clocks (`None` without such samples).
    pub fn power_capped_share(&self) -> Option<f64> {
        (self.reason_samples > 0)
            .then(|| self.power_capped_samples as f64 / self.reason_samples as f64)
    }

    /// Joules each of `items` equal pieces of work in the window spent (the whole for 0 items).
    pub fn joules_per(&self, items: usize) -> f64 {
        self.joules / items.max(1) as f64
    }

    /// The most joules a piece of work may spend to take `seconds` with the board drawing its whole limit.
    pub fn joules_allowed(&self, seconds: f64) -> f64 {
        self.limit_watts * seconds
    }

    /// One line for a benchmark's output, for `items` equal pieces of work named `item`.
    pub fn describe(&self, items: usize, item: &str) -> String {
        let mut line = format!(
            "{:.2} J a {item} ({items} in {:.2} s), mean {:.0} W of a {:.0} W limit ({:.0}%)",
            self.joules_per(items),
            self.seconds,
            self.mean_watts(),
            self.limit_watts,
            100.0 * self.limit_share()
        );
        if let Some(c) = self.sm_clock {
            line.push_str(&format!(
                ", SM clock median {} MHz ({}-{})",
                c.median, c.min, c.max
            ));
        }
        if let Some(share) = self.power_capped_share() {
            line.push_str(&format!(
                ", power cap holding the clocks in {:.0}% of {} samples",
                100.0 * share,
                self.reason_samples
            ));
            if self.slowed_samples > 0 {
                line.push_str(&format!(
                    " (thermal or hardware slowdown in {})",
                    self.slowed_samples
                ));
            }
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(watts: f64, mhz: u32, bits: u64) -> Sample {
        Sample {
            watts: Some(watts),
            sm_mhz: Some(mhz),
            reasons: Some(ClockReasons(bits)),
        }
    }

    #[test]
    fn the_explicit_path_is_the_only_candidate() {
        let c = candidates(|k| (k == ENV_PATH).then(|| OsString::from("/opt/nvml.so")));
        assert_eq!(c, vec![PathBuf::from("/opt/nvml.so")]);
        let c = candidates(|k| (k == ENV_PATH).then(|| OsString::from("")));
        assert_eq!(c[0], PathBuf::from("libnvidia-ml.so.1"));
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_missing_library_names_every_path_and_the_fix() {
        let dir = std::env::temp_dir().join("tf-cuda-nvml-missing");
        let tried = vec![dir.join("a.so"), dir.join("b.so")];
        let err = PowerMeter::open(&tried, "00000000:01:00.0").expect_err("nothing there to open");
        let text = err.to_string();
        for path in &tried {
            assert!(text.contains(&path.display().to_string()), "{text}");
        }
        assert!(text.contains(ENV_PATH), "{text}");
        assert!(matches!(err, PowerError::LibraryNotFound { .. }));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_library_that_is_not_nvml_is_refused_by_name() {
        // The C library opens everywhere and exports none of NVML's entries.
        let err = PowerMeter::open(&[PathBuf::from("libc.so.6")], "00000000:01:00.0")
            .expect_err("libc is not NVML");
        assert!(
            err.to_string().contains("not NVML: missing nvmlInit_v2"),
            "{err}"
        );
    }

    #[test]
    fn a_library_opened_in_the_background_answers_as_in_the_foreground() {
        let dir = std::env::temp_dir().join("tf-cuda-nvml-missing-bg");
        let err = open_first_in_background(vec![dir.join("a.so")])
            .wait()
            .expect_err("nothing there to open");
        assert!(matches!(err, PowerError::LibraryNotFound { .. }), "{err}");
        assert!(err.to_string().contains("a.so"), "{err}");
    }

    #[test]
    fn pci_bus_ids_are_written_as_nvml_reads_them() {
        assert_eq!(pci_bus_id(0, 0x1b, 0), "00000000:1B:00.0");
        assert_eq!(pci_bus_id(1, 0xc1, 0x1f), "00000001:C1:1F.0");
    }

    #[test]
    fn clock_reasons_name_their_bits() {
        let r = ClockReasons(0x4 | 0x20 | 0x1000);
        assert!(r.power_capped());
        assert!(r.slowed());
        assert_eq!(r.names(), vec!["power cap", "thermal (software)"]);
        assert!(!ClockReasons(0x1).power_capped());
        assert!(!ClockReasons(0x4).slowed());
    }

    #[test]
    fn clock_spread_takes_the_lower_middle_and_the_ends() {
        assert_eq!(ClockSpread::of(&[]), None);
        let s = ClockSpread::of(&[1980, 1305, 1515, 1600]).unwrap();
        assert_eq!((s.median, s.min, s.max), (1515, 1305, 1980));
        assert_eq!(ClockSpread::of(&[7]).unwrap().median, 7);
    }

    #[test]
    fn a_report_counts_joules_power_and_the_cap() {
        let samples = [
            sample(690.0, 1500, 0x4),
            sample(702.5, 1515, 0x4),
            sample(650.0, 1700, 0x0),
            Sample::default(),
        ];
        let r = EnergyReport::new(1_400_000, 2.0, 700.0, &samples);
        assert_eq!(r.joules, 1400.0);
        assert_eq!(r.mean_watts(), 700.0);
        assert_eq!(r.limit_share(), 1.0);
        assert_eq!(r.reason_samples, 3);
        assert_eq!(r.power_capped_samples, 2);
        assert_eq!(r.power_capped_share(), Some(2.0 / 3.0));
        assert_eq!(r.max_sampled_watts, Some(702.5));
        assert_eq!(r.sm_clock.unwrap().median, 1515);
        assert_eq!(r.joules_per(20), 70.0);
        assert_eq!(r.joules_per(0), 1400.0);
        assert!((r.joules_allowed(0.06) - 42.0).abs() < 1e-9);
        let line = r.describe(20, "step");
        assert!(
            line.starts_with("70.00 J a step (20 in 2.00 s), mean 700 W of a 700 W limit (100%)"),
            "{line}"
        );
        assert!(
            line.contains("power cap holding the clocks in 67% of 3 samples"),
            "{line}"
        );
    }

    proptest::proptest! {
        #[test]
        fn a_report_keeps_its_shares_and_spread_in_range(
            millijoules in 0u64..10_000_000_000,
            seconds in 0.0f64..100.0,
            limit in 0.0f64..2000.0,
            raw in proptest::collection::vec((0.0f64..1500.0, 0u32..3000, 0u64..0x200, proptest::bool::ANY), 0..64),
            items in 0usize..10_000,
        ) {
            let samples: Vec<Sample> = raw
                .iter()
                .map(|&(w, mhz, bits, missing)| Sample {
                    watts: (!missing).then_some(w),
                    sm_mhz: (!missing).then_some(mhz),
                    reasons: (!missing).then_some(ClockReasons(bits)),
                })
                .collect();
            let r = EnergyReport::new(millijoules, seconds, limit, &samples);
            proptest::prop_assert!(r.joules >= 0.0 && r.mean_watts() >= 0.0 && r.limit_share() >= 0.0);
            proptest::prop_assert!((r.joules_per(items) * items.max(1) as f64 - r.joules).abs() <= 1e-9 * r.joules.max(1.0));
            proptest::prop_assert!(r.power_capped_samples <= r.reason_samples);
            if let Some(share) = r.power_capped_share() {
                proptest::prop_assert!((0.0..=1.0).contains(&share));
            }
            if let Some(c) = r.sm_clock {
                proptest::prop_assert!(c.min <= c.median && c.median <= c.max);
                proptest::prop_assert!(samples.iter().any(|s| s.sm_mhz == Some(c.median)));
            }
            proptest::prop_assert_eq!(r.sm_clock.is_none(), samples.iter().all(|s| s.sm_mhz.is_none()));
        }
    }

    #[test]
    fn an_empty_window_divides_by_nothing() {
        let r = EnergyReport::new(0, 0.0, 0.0, &[]);
        assert_eq!((r.mean_watts(), r.limit_share()), (0.0, 0.0));
        assert_eq!(r.power_capped_share(), None);
        assert_eq!(r.sm_clock, None);
        assert_eq!(
            r.describe(0, "step"),
            "0.00 J a step (0 in 0.00 s), mean 0 W of a 0 W limit (0%)"
        );
    }
}
