//! Where things live in the repository.

use std::path::{Path, PathBuf};

/// The repository root (the parent of `xtask/`).
pub fn repo_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest_dir.to_path_buf())
}

/// Where `cargo xtask kernels` writes fatbins and manifest.json: `$TF_KERNELS_DIR`, else
/// `<root>/target/kernels` (independent of CARGO_TARGET_DIR, so every build of tf-engines finds it).
pub fn kernels_out_dir(root: &Path) -> PathBuf {
    match std::env::var_os("TF_KERNELS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => root.join("target").join("fatbins"),
    }
}

/// The folder of tools installed by xtask (git-ignored).
pub fn tools_dir(root: &Path) -> PathBuf {
    root.join(".tools")
}
