//! Finds the CUDA tools (nvcc, cuobjdump) or installs them from PyPI into `.tools/`.
//!
//! Search order for nvcc: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `nvcc` on PATH, `.tools/cuda`, then
//! `python3 -m pip install --target .tools/cuda` of [`NVCC_PACKAGES`]. cuobjdump: `$CUOBJDUMP`,
//! `$CUDA_HOME/bin/cuobjdump`, PATH, `.tools/sass`, then [`SASS_PACKAGES`].

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::paths::tools_dir;
use crate::util::{run_captured, run_inherited};
use crate::Error;

/// nvcc 13.0.88 (the test GPU's driver is CUDA 13.0) and what it needs to compile kernels that include
/// `<cuda_bf16.h>`, `<cuda_fp16.h>` and `<mma.h>`: NVVM, the runtime headers, the crt headers, CCCL.
pub const NVCC_PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
];

/// cuobjdump and the nvdisasm it runs for `-sass`. PyPI has no 13.0 build of either; 13.2.51 is the
/// oldest, and it reads 13.0 fatbins.
pub const SASS_PACKAGES: &[&str] = &[
    "nvidia-cuda-cuobjdump==13.2.51",
    "nvidia-cuda-nvdisasm==13.2.51",
];

/// The Zig release whose `zig fetch` is the reference for the package hash.
pub const ZIG_PACKAGE: &str = "ziglang==0.17.0";

/// A located tool.
#[derive(Clone, Debug)]
pub struct Tool {
    pub path: PathBuf,
    /// Directories to put first on PATH when running it (cuobjdump finds nvdisasm there).
    pub path_prefix: Vec<PathBuf>,
}

impl Tool {
    /// A command for this tool with its PATH prefix applied.
    pub fn command(&self) -> Command {
        let mut command = Command::new(&self.path);
        if !self.path_prefix.is_empty() {
            let mut dirs = self.path_prefix.clone();
            if let Some(path) = std::env::var_os("PATH") {
                dirs.extend(std::env::split_paths(&path));
            }
            if let Ok(joined) = std::env::join_paths(dirs) {
                command.env("PATH", joined);
            }
        }
        command
    }
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

fn python() -> String {
    std::env::var("PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_string())
}

/// `python3 -m pip install --target DIR packages...`.
pub fn pip_install(target: &Path, packages: &[&str], what: &'static str) -> Result<(), Error> {
    eprintln!(
        "installing {} into {} (pip: {})",
        what,
        target.display(),
        packages.join(" ")
    );
    let mut command = Command::new(python());
    command
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(target)
        .args(packages);
    run_inherited(&mut command).map_err(|e| Error::ToolMissing {
        tool: what,
        detail: format!(
            "pip could not install {}: {e}\nset NVCC / CUDA_HOME / CUOBJDUMP to an existing CUDA 13.0 toolkit instead",
            packages.join(" ")
        ),
    })
}

/// Finds nvcc, installing the pip toolchain into `.tools/cuda` if none is found.
pub fn nvcc(root: &Path) -> Result<Tool, Error> {
    let plain = |path: PathBuf| Tool {
        path,
        path_prefix: Vec::new(),
    };
    if let Some(path) = env_path("NVCC") {
        return if path.is_file() {
            Ok(plain(path))
        } else {
            Err(Error::ToolMissing {
                tool: "nvcc",
                detail: format!("NVCC={} is not a file", path.display()),
            })
        };
    }
    if let Some(home) = env_path("CUDA_HOME") {
        let candidate = home.join("bin").join("nvcc");
        if candidate.is_file() {
            return Ok(plain(candidate));
        }
    }
    if let Some(path) = on_path("nvcc") {
        return Ok(plain(path));
    }
    let installed = tools_dir(root).join("cuda").join("nvidia/cu13/bin/nvcc");
    if !installed.is_file() {
        pip_install(&tools_dir(root).join("cuda"), NVCC_PACKAGES, "nvcc")?;
    }
    if installed.is_file() {
        Ok(plain(installed))
    } else {
        Err(Error::ToolMissing {
            tool: "nvcc",
            detail: format!(
                "pip finished but {} does not exist; delete .tools/cuda and retry",
                installed.display()
            ),
        })
    }
}

/// Finds cuobjdump (and nvdisasm beside it), installing them into `.tools/sass` if none is found.
pub fn cuobjdump(root: &Path) -> Result<Tool, Error> {
    let beside = |path: PathBuf| {
        let prefix = path.parent().map(Path::to_path_buf).into_iter().collect();
        Tool {
            path,
            path_prefix: prefix,
        }
    };
    if let Some(path) = env_path("CUOBJDUMP") {
        return Ok(beside(path));
    }
    if let Some(home) = env_path("CUDA_HOME") {
        let candidate = home.join("bin").join("cuobjdump");
        if candidate.is_file() {
            return Ok(beside(candidate));
        }
    }
    if let (Some(path), Some(_)) = (on_path("cuobjdump"), on_path("nvdisasm")) {
        return Ok(beside(path));
    }
    let bin = tools_dir(root).join("sass").join("nvidia/cu13/bin");
    if !bin.join("cuobjdump").is_file() || !bin.join("nvdisasm").is_file() {
        pip_install(&tools_dir(root).join("sass"), SASS_PACKAGES, "cuobjdump")?;
    }
    Ok(beside(bin.join("cuobjdump")))
}

/// `nvcc --version`, the text recorded in the manifest and hashed into every set's key.
pub fn nvcc_version(nvcc: &Tool) -> Result<String, Error> {
    let output = run_captured(nvcc.command().arg("--version"))?;
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// How to run `zig`: `$ZIG`, else the pip package [`ZIG_PACKAGE`] in `.tools/zig` (installed when missing)
/// through `python3 -m ziglang`. Its global cache is `.tools/zig-cache`, so the fetch tool that Zig
/// compiles on first use is built once per machine.
pub fn zig(root: &Path) -> Result<Command, Error> {
    let cache = tools_dir(root).join("zig-cache");
    let mut command = if let Some(path) = env_path("ZIG") {
        Command::new(path)
    } else {
        let target = tools_dir(root).join("zig");
        if !target.join("ziglang").is_dir() {
            pip_install(&target, &[ZIG_PACKAGE], "zig")?;
        }
        let mut command = Command::new(python());
        command.env("PYTHONPATH", &target).args(["-m", "ziglang"]);
        command
    };
    command.env("ZIG_GLOBAL_CACHE_DIR", cache);
    Ok(command)
}
