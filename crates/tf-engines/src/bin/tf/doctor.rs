//! `tf doctor`: opens the CUDA driver through tf-cuda and reports what this machine offers: driver version,
//! devices (name, compute capability, SMs, memory total and free, the board's power limit, draw and SM clock through
//! NVML where it loads), optional driver entries, the kernel sets
//! embedded in this build and whether each has native code for every device, and whether cuBLASLt loads
//! (path and version). `--json` prints the same report as one JSON object.
//!
//! Exit codes (the most basic problem wins): 0 everything the GPU engines need is there; 1 no usable CUDA
//! driver; 2 bad arguments; 3 no device, or a device cannot be queried; 4 the kernels cannot run on a
//! device (none embedded, no SASS and no PTX for its architecture, or a driver older than the kernels'
//! nvcc); 5 cuBLASLt missing or newer than the driver. Never panics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use serde::Serialize;
use tf_cuda::{Context, DeviceInfo, Driver};

#[derive(clap::Args)]
pub struct Args {
    /// Open this driver library instead of the default search (TF_CUDA_DRIVER, libcuda.so.1,
    /// libcuda.so).
    #[arg(long, value_name = "PATH")]
    pub driver: Option<PathBuf>,
    /// Print the report as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Exit code: no usable driver.
const EXIT_DRIVER: u8 = 1;
/// Exit code: no device, or a device cannot be queried.
const EXIT_DEVICE: u8 = 3;
/// Exit code: the embedded kernels cannot run on a device.
const EXIT_KERNELS: u8 = 4;
/// Exit code: cuBLASLt missing or unusable with this driver.
const EXIT_CUBLASLT: u8 = 5;

#[derive(Serialize, Debug, Default)]
struct Report {
    driver: Option<DriverReport>,
    devices: Vec<DeviceReport>,
    kernels: KernelReport,
    cublaslt: CublasLtReport,
    /// Things that stop the GPU engines, each with its exit code.
    problems: Vec<Problem>,
    /// Things that work but cost something (e.g. PTX JIT at load).
    notes: Vec<String>,
    exit_code: u8,
}

#[derive(Serialize, Debug)]
struct DriverReport {
    path: PathBuf,
    /// CUDA version the driver supports, `major.minor`.
    cuda_version: String,
    /// The raw `cuDriverGetVersion` value (1000 * major + 10 * minor).
    version: i32,
    device_count: i32,
    optional_entries: BTreeMap<String, bool>,
}

#[derive(Serialize, Debug)]
struct DeviceReport {
    ordinal: i32,
    name: String,
    /// `major.minor`.
    compute_capability: String,
    sm_count: i32,
    shared_per_block_optin_kib: i32,
    total_bytes: u64,
    free_bytes: Option<u64>,
    /// Per embedded kernel set: "native SASS", "PTX (JIT at load)" or "none".
    kernels: BTreeMap<String, String>,
    /// The board's power limit, draw and SM clock now (NVML); informational, never a problem.
    power: PowerReport,
}

/// What NVML says of a board now: each figure absent where its query failed, `error` where NVML could not be used.
#[derive(Serialize, Debug, Default)]
struct PowerReport {
    limit_watts: Option<f64>,
    draw_watts: Option<f64>,
    sm_clock_mhz: Option<u32>,
    /// Why the clocks are below their maximum ("idle", "power cap", ...).
    clock_reasons: Vec<&'static str>,
    error: Option<String>,
}

fn power_report(ctx: &Context) -> PowerReport {
    match tf_cuda::power::PowerMeter::for_context(ctx) {
        Ok(meter) => PowerReport {
            limit_watts: meter.limit_watts().ok(),
            draw_watts: meter.draw_watts().ok(),
            sm_clock_mhz: meter.sm_clock_mhz().ok(),
            clock_reasons: meter
                .clock_reasons()
                .ok()
                .flatten()
                .map_or_else(Vec::new, |r| r.names()),
            error: None,
        },
        Err(e) => PowerReport {
            error: Some(e.to_string()),
            ..PowerReport::default()
        },
    }
}

/// One line for the text report.
fn power_text(power: &PowerReport) -> String {
    if let Some(e) = &power.error {
        return format!("not read ({e})");
    }
    let watts = |w: Option<f64>| w.map_or_else(|| "?".to_string(), |w| format!("{w:.0} W"));
    let mut line = format!(
        "drawing {} of a {} limit",
        watts(power.draw_watts),
        watts(power.limit_watts)
    );
    if let Some(mhz) = power.sm_clock_mhz {
        line.push_str(&format!(", SM clock {mhz} MHz"));
    }
    if !power.clock_reasons.is_empty() {
        line.push_str(&format!(
            " (clocks held by: {})",
            power.clock_reasons.join(", ")
        ));
    }
    line
}

#[derive(Serialize, Debug, Default)]
struct KernelReport {
    embedded_sets: usize,
    /// `major.minor` of the nvcc that built them, from the build manifest.
    nvcc_release: Option<String>,
    sets: Vec<KernelSetReport>,
}

#[derive(Serialize, Debug)]
struct KernelSetReport {
    name: String,
    targets: Vec<String>,
    ptx: Option<String>,
}

#[derive(Serialize, Debug, Default)]
struct CublasLtReport {
    path: Option<PathBuf>,
    /// `major.minor.patch`.
    version: Option<String>,
    error: Option<String>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
struct Problem {
    exit_code: u8,
    message: String,
}

impl Report {
    fn problem(&mut self, exit_code: u8, message: String) {
        self.problems.push(Problem { exit_code, message });
        self.exit_code = self.problems.iter().map(|p| p.exit_code).min().unwrap_or(0);
    }
}

pub fn run(args: Args) -> ExitCode {
    let report = examine(args.driver.as_deref());
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => eprintln!("tf doctor: could not write the JSON report: {e}"),
        }
    } else {
        print_text(&report);
    }
    ExitCode::from(report.exit_code)
}

/// Builds the whole report; `driver_path` overrides the driver search.
fn examine(driver_path: Option<&Path>) -> Report {
    let mut report = Report {
        kernels: kernel_report(),
        cublaslt: cublaslt_report(),
        ..Report::default()
    };
    let opened = match driver_path {
        Some(path) => tf_cuda::driver::open_driver_at(path),
        None => tf_cuda::open_driver(),
    };
    match opened {
        Ok(driver) => examine_driver(&driver, &mut report),
        Err(e) => report.problem(EXIT_DRIVER, format!("no usable CUDA driver: {e}")),
    }
    check_kernels(&mut report);
    check_cublaslt(&mut report);
    report
}

fn examine_driver(driver: &Arc<Driver>, report: &mut Report) {
    let info = match tf_cuda::driver_info(driver) {
        Ok(info) => info,
        Err(e) => {
            let message = format!(
                "the CUDA driver at {} does not answer: {e}",
                driver.path().display()
            );
            report.problem(EXIT_DRIVER, message);
            return;
        }
    };
    report.driver = Some(DriverReport {
        path: info.path.clone(),
        cuda_version: info.version_text(),
        version: info.version,
        device_count: info.device_count,
        optional_entries: info
            .optional_entries
            .iter()
            .map(|(name, present)| (name.to_string(), *present))
            .collect(),
    });
    if info.device_count == 0 {
        report.problem(EXIT_DEVICE, "the driver sees no CUDA device".into());
    }
    for ordinal in 0..info.device_count {
        match DeviceInfo::query(driver, ordinal) {
            Ok(device) => {
                // Free memory and the board's power need a context on the device.
                let ctx = Context::new(Arc::clone(driver), ordinal);
                let power = match &ctx {
                    Ok(ctx) => power_report(ctx),
                    Err(e) => PowerReport {
                        error: Some(format!("no context: {e}")),
                        ..PowerReport::default()
                    },
                };
                let free = ctx.and_then(|ctx| ctx.memory_info());
                let free_bytes = match free {
                    Ok(mem) => Some(mem.free),
                    Err(e) => {
                        report.problem(
                            EXIT_DEVICE,
                            format!(
                                "device {ordinal}: cannot create a context or read its memory: {e}"
                            ),
                        );
                        None
                    }
                };
                let (major, minor) = device.compute_capability;
                report.devices.push(DeviceReport {
                    ordinal,
                    name: device.name,
                    compute_capability: format!("{major}.{minor}"),
                    sm_count: device.sm_count,
                    shared_per_block_optin_kib: device.max_shared_per_block_optin / 1024,
                    total_bytes: device.total_memory,
                    free_bytes,
                    kernels: kernel_support(major, minor),
                    power,
                });
            }
            Err(e) => report.problem(EXIT_DEVICE, format!("device {ordinal}: {e}")),
        }
    }
}

fn kernel_report() -> KernelReport {
    let sets = tf_engines::nn::kernels::sets();
    KernelReport {
        embedded_sets: sets.len(),
        nvcc_release: tf_engines::nn::kernels::manifest_json().and_then(nvcc_release),
        sets: sets
            .iter()
            .map(|s| KernelSetReport {
                name: s.name.to_string(),
                targets: s.targets.iter().map(|t| t.to_string()).collect(),
                ptx: s.ptx.map(str::to_string),
            })
            .collect(),
    }
}

const NATIVE: &str = "native SASS";
const JIT: &str = "PTX (JIT at load)";
const NONE: &str = "none";

fn kernel_support(major: i32, minor: i32) -> BTreeMap<String, String> {
    tf_engines::nn::kernels::sets()
        .iter()
        .map(|set| {
            let native = match (u32::try_from(major), u32::try_from(minor)) {
                (Ok(ma), Ok(mi)) => set.has_sass_for(ma, mi),
                _ => false,
            };
            let support = match (native, set.ptx.is_some()) {
                (true, _) => NATIVE,
                (false, true) => JIT,
                (false, false) => NONE,
            };
            (set.name.to_string(), support.to_string())
        })
        .collect()
}

fn check_kernels(report: &mut Report) {
    if report.kernels.embedded_sets == 0 {
        report.problem(
            EXIT_KERNELS,
            "no kernels are embedded in this build: run `cargo xtask kernels`, then rebuild".into(),
        );
        return;
    }
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    for device in &report.devices {
        for (set, support) in &device.kernels {
            let sm = device.compute_capability.replace('.', "");
            match support.as_str() {
                NONE => problems.push(format!(
                    "kernel set `{set}` has neither SASS nor PTX for device {} (sm_{sm}): add the target to kernels/kernels.toml and rebuild",
                    device.ordinal
                )),
                JIT => notes.push(format!(
                    "kernel set `{set}` has no SASS for device {} (sm_{sm}): the driver JIT-compiles its PTX at load (slower load)",
                    device.ordinal
                )),
                _ => {}
            }
        }
    }
    if let (Some(driver), Some(nvcc)) = (&report.driver, &report.kernels.nvcc_release) {
        if let Some(needed) = version_number(nvcc) {
            if driver.version < needed {
                problems.push(format!(
                    "the driver supports CUDA {} but the kernels were built by nvcc {nvcc}: update the driver, or rebuild the kernels with an nvcc no newer than the driver",
                    driver.cuda_version
                ));
            }
        }
    }
    for p in problems {
        report.problem(EXIT_KERNELS, p);
    }
    report.notes.extend(notes);
}

fn cublaslt_report() -> CublasLtReport {
    match tf_cuda::cublaslt::LtLibrary::open() {
        Ok(lib) => CublasLtReport {
            path: Some(lib.path().to_path_buf()),
            version: Some(cublaslt_version_text(lib.version())),
            error: None,
        },
        Err(e) => CublasLtReport {
            error: Some(e.to_string()),
            ..CublasLtReport::default()
        },
    }
}

fn check_cublaslt(report: &mut Report) {
    if let Some(error) = &report.cublaslt.error {
        let message = format!("cuBLASLt not found (the engines' GEMMs need it): {error}");
        report.problem(EXIT_CUBLASLT, message);
        return;
    }
    let lt_major = report
        .cublaslt
        .version
        .as_deref()
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse::<i32>().ok());
    if let (Some(lt_major), Some(driver)) = (lt_major, &report.driver) {
        let driver_major = driver.version / 1000;
        if lt_major > driver_major {
            let message = format!(
                "cuBLASLt {lt_major}.x needs a CUDA {lt_major} driver, this one supports CUDA {}: update the driver or use a matching libcublasLt (TF_CUBLASLT)",
                driver.cuda_version
            );
            report.problem(EXIT_CUBLASLT, message);
        }
    }
}

/// `cublasLtGetVersion()` (major * 10000 + minor * 100 + patch) as `major.minor.patch`.
fn cublaslt_version_text(version: usize) -> String {
    format!(
        "{}.{}.{}",
        version / 10_000,
        version / 100 % 100,
        version % 100
    )
}

/// `major.minor` from nvcc's `--version` text in the kernel manifest ("... release 13.0, V13.0.88").
fn nvcc_release(manifest: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(manifest).ok()?;
    let text = value.get("nvcc_version")?.as_str()?;
    let after = text.split("release ").nth(1)?;
    let release: String = after
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    version_number(&release).map(|_| release)
}

/// `"13.0"` as the driver's encoding (13000).
fn version_number(release: &str) -> Option<i32> {
    let mut parts = release.split('.');
    let major: i32 = parts.next()?.parse().ok()?;
    let minor: i32 = parts.next().unwrap_or("0").parse().ok()?;
    Some(major * 1000 + minor * 10)
}

fn print_text(report: &Report) {
    if let Some(driver) = &report.driver {
        println!(
            "driver: {} (CUDA {}, {})",
            driver.path.display(),
            driver.cuda_version,
            driver.version
        );
        for (name, present) in &driver.optional_entries {
            println!(
                "  optional entry {name}: {}",
                if *present { "present" } else { "absent" }
            );
        }
        println!("devices: {}", driver.device_count);
    }
    for device in &report.devices {
        let sm = device.compute_capability.replace('.', "");
        println!("device {}: {}", device.ordinal, device.name);
        println!(
            "  compute capability: {} (sm_{sm})",
            device.compute_capability
        );
        println!("  SMs: {}", device.sm_count);
        println!(
            "  shared memory per block (opt-in): {} KiB",
            device.shared_per_block_optin_kib
        );
        match device.free_bytes {
            Some(free) => println!(
                "  memory: {:.1} GiB total, {:.1} GiB free",
                device.total_bytes as f64 / GIB,
                free as f64 / GIB
            ),
            None => println!(
                "  memory: {:.1} GiB total, free unknown",
                device.total_bytes as f64 / GIB
            ),
        }
        println!("  power: {}", power_text(&device.power));
        let native = device.kernels.values().filter(|s| *s == NATIVE).count();
        println!(
            "  kernels: {native} of {} sets with native SASS for sm_{sm}",
            device.kernels.len()
        );
    }
    let kernels = &report.kernels;
    if kernels.embedded_sets == 0 {
        println!("kernels: none embedded in this build (run `cargo xtask kernels`, then rebuild)");
    } else {
        let nvcc = kernels
            .nvcc_release
            .as_deref()
            .map_or(String::new(), |r| format!(", built by nvcc {r}"));
        println!("kernels: {} sets embedded{nvcc}", kernels.embedded_sets);
        for set in &kernels.sets {
            let ptx = set
                .ptx
                .as_deref()
                .map_or(String::new(), |p| format!(", PTX {p}"));
            println!("  {}: {}{ptx}", set.name, set.targets.join(" "));
            for device in &report.devices {
                if let Some(support) = device.kernels.get(&set.name) {
                    let sm = device.compute_capability.replace('.', "");
                    println!("    sm_{sm}: {support}");
                }
            }
        }
    }
    match (&report.cublaslt.path, &report.cublaslt.version) {
        (Some(path), Some(version)) => println!("cuBLASLt: {} (version {version})", path.display()),
        _ => println!(
            "cuBLASLt: not found: {}",
            report.cublaslt.error.as_deref().unwrap_or("unknown error")
        ),
    }
    for note in &report.notes {
        println!("note: {note}");
    }
    for problem in &report.problems {
        eprintln!(
            "tf doctor: {} (exit {})",
            problem.message, problem.exit_code
        );
    }
    if report.problems.is_empty() {
        println!("ready: the GPU engines can run here");
    } else {
        println!(
            "not ready: {} problem(s), exit code {}",
            report.problems.len(),
            report.exit_code
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode() {
        assert_eq!(cublaslt_version_text(130_100), "13.1.0");
        assert_eq!(cublaslt_version_text(120_803), "12.8.3");
        assert_eq!(version_number("13.0"), Some(13_000));
        assert_eq!(version_number("12.8"), Some(12_080));
        assert_eq!(version_number("x"), None);
        let manifest = r#"{"nvcc_version":"Cuda compilation tools, release 13.0, V13.0.88"}"#;
        assert_eq!(nvcc_release(manifest).as_deref(), Some("13.0"));
        assert_eq!(nvcc_release(r#"{"nvcc_version":"garbage"}"#), None);
        assert_eq!(nvcc_release("not json"), None);
    }

    #[test]
    fn the_most_basic_problem_sets_the_exit_code() {
        let mut report = Report::default();
        assert_eq!(report.exit_code, 0);
        report.problem(EXIT_CUBLASLT, "a".into());
        assert_eq!(report.exit_code, EXIT_CUBLASLT);
        report.problem(EXIT_DEVICE, "b".into());
        report.problem(EXIT_KERNELS, "c".into());
        assert_eq!(report.exit_code, EXIT_DEVICE);
    }

    #[test]
    fn a_missing_driver_is_exit_1_and_names_the_path() {
        let report = examine(Some(Path::new("/no/such/libcuda.so.1")));
        assert_eq!(report.exit_code, EXIT_DRIVER);
        assert!(report.driver.is_none());
        assert!(
            report.problems[0].message.contains("/no/such/libcuda.so.1"),
            "{:?}",
            report.problems
        );
    }

    #[test]
    fn the_fake_driver_reports_its_device_and_a_consistent_exit_code() {
        let _guard = tf_testdriver::test_lock();
        let path = tf_testdriver::library_path().expect("tf-testdriver library");
        let report = examine(Some(&path));
        let driver = report.driver.as_ref().expect("driver report");
        assert!(driver.device_count >= 1);
        assert_eq!(report.devices.len(), driver.device_count as usize);
        let device = &report.devices[0];
        assert_eq!(device.compute_capability, "9.0");
        assert!(device.free_bytes.is_some_and(|f| f <= device.total_bytes));
        assert_eq!(device.kernels.len(), report.kernels.embedded_sets);
        // Without a GPU the exit code comes from kernels or cuBLASLt only, never from the driver or device.
        let codes: Vec<u8> = report.problems.iter().map(|p| p.exit_code).collect();
        assert!(
            codes
                .iter()
                .all(|&c| c == EXIT_KERNELS || c == EXIT_CUBLASLT),
            "{:?}",
            report.problems
        );
        assert_eq!(report.exit_code, codes.iter().copied().min().unwrap_or(0));
        assert_eq!(
            report.cublaslt.error.is_some(),
            codes.contains(&EXIT_CUBLASLT)
        );
        // The fake driver's board has no NVML behind it (or this host none at all): the power is reported as not
        // read, with the reason, and is never a problem.
        let power = &device.power;
        if let Some(why) = &power.error {
            assert!(!why.is_empty());
            assert!(power.limit_watts.is_none() && power.draw_watts.is_none());
        }
        let json = serde_json::to_value(&report).expect("report serializes");
        assert_eq!(json["devices"][0]["compute_capability"], "9.0");
        assert!(json["devices"][0]["power"].is_object());
        assert_eq!(json["exit_code"], report.exit_code);
    }

    #[test]
    fn the_power_line_says_what_was_read_and_why_not() {
        let read = PowerReport {
            limit_watts: Some(700.0),
            draw_watts: Some(112.4),
            sm_clock_mhz: Some(1980),
            clock_reasons: vec!["idle"],
            error: None,
        };
        assert_eq!(
            power_text(&read),
            "drawing 112 W of a 700 W limit, SM clock 1980 MHz (clocks held by: idle)"
        );
        let partial = PowerReport {
            limit_watts: Some(700.0),
            ..PowerReport::default()
        };
        assert_eq!(power_text(&partial), "drawing ? of a 700 W limit");
        let missing = PowerReport {
            error: Some("NVML could not be opened".into()),
            ..PowerReport::default()
        };
        assert_eq!(power_text(&missing), "not read (NVML could not be opened)");
    }
}
