//! `tf doctor`: opens the CUDA driver through tf-cuda and reports what this machine offers:
//! driver version, devices (name, compute capability, SMs, memory), optional driver entries,
//! the kernel sets embedded in this build, and whether cuBLASLt loads.
//!
//! Exits non-zero when the driver cannot be used (printing the loader's error, which lists
//! every path tried) or when a device cannot be queried. Never panics.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use tf_cuda::{Context, DeviceInfo, Driver};

#[derive(clap::Args)]
pub struct Args {
    /// Open this driver library instead of the default search (TF_CUDA_DRIVER, libcuda.so.1,
    /// libcuda.so).
    #[arg(long, value_name = "PATH")]
    pub driver: Option<PathBuf>,
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(args: Args) -> ExitCode {
    let opened = match &args.driver {
        Some(path) => tf_cuda::driver::open_driver_at(path),
        None => tf_cuda::open_driver(),
    };
    let driver = match opened {
        Ok(d) => d,
        Err(e) => {
            eprintln!("tf doctor: no usable CUDA driver: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut healthy = true;
    let info = match tf_cuda::driver_info(&driver) {
        Ok(info) => info,
        Err(e) => {
            eprintln!(
                "tf doctor: the CUDA driver at {} does not answer: {e}",
                driver.path().display()
            );
            return ExitCode::FAILURE;
        }
    };
    println!(
        "driver: {} (CUDA {}, {})",
        info.path.display(),
        info.version_text(),
        info.version
    );
    for (name, present) in &info.optional_entries {
        println!(
            "  optional entry {name}: {}",
            if *present { "present" } else { "absent" }
        );
    }
    println!("devices: {}", info.device_count);
    if info.device_count == 0 {
        eprintln!("tf doctor: the driver sees no CUDA device");
        healthy = false;
    }
    let mut capabilities = Vec::new();
    for ordinal in 0..info.device_count {
        match report_device(&driver, ordinal) {
            Ok(device) => capabilities.push(device.compute_capability),
            Err(e) => {
                eprintln!("  device {ordinal}: {e}");
                healthy = false;
            }
        }
    }
    report_kernels(&capabilities);
    report_cublaslt();
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn report_device(driver: &Arc<Driver>, ordinal: i32) -> Result<DeviceInfo, tf_cuda::Error> {
    let device = DeviceInfo::query(driver, ordinal)?;
    let (major, minor) = device.compute_capability;
    println!("device {ordinal}: {}", device.name);
    println!("  compute capability: {major}.{minor} (sm_{major}{minor})");
    println!("  SMs: {}", device.sm_count);
    println!(
        "  shared memory per block (opt-in): {} KiB",
        device.max_shared_per_block_optin / 1024
    );
    // Free memory needs the device's context.
    let ctx = Context::new(Arc::clone(driver), ordinal)?;
    let mem = ctx.memory_info()?;
    println!(
        "  memory: {:.1} GiB total, {:.1} GiB free",
        mem.total as f64 / GIB,
        mem.free as f64 / GIB
    );
    Ok(device)
}

/// The kernel sets embedded in this build, and whether each carries SASS for the devices seen.
fn report_kernels(capabilities: &[(i32, i32)]) {
    let sets = tf_engines::kernels::sets();
    if sets.is_empty() {
        println!("kernels: none embedded in this build (run `cargo xtask kernels`, then rebuild)");
        return;
    }
    println!("kernels: {} sets embedded", sets.len());
    for set in sets {
        let ptx = set.ptx.map_or(String::new(), |p| format!(", PTX {p}"));
        println!("  {}: {}{ptx}", set.name, set.targets.join(" "));
        for &(major, minor) in capabilities {
            let native = match (u32::try_from(major), u32::try_from(minor)) {
                (Ok(ma), Ok(mi)) => set.has_sass_for(ma, mi),
                _ => false,
            };
            let note = match (native, set.ptx.is_some()) {
                (true, _) => "native SASS",
                (false, true) => "no SASS: the driver JIT-compiles the PTX at load",
                (false, false) => "no SASS and no PTX: this set cannot run here",
            };
            println!("    sm_{major}{minor}: {note}");
        }
    }
}

/// Whether cuBLASLt (used for the engines' GEMMs) can be loaded.
fn report_cublaslt() {
    match tf_cuda::cublaslt::LtLibrary::open() {
        Ok(lib) => println!(
            "cuBLASLt: {} (version {})",
            lib.path().display(),
            lib.version()
        ),
        Err(e) => println!("cuBLASLt: not found: {e}"),
    }
}
