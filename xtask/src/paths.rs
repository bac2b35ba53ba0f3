//! Where things live in the repository.
//!
//! The repository root is found at run time, never baked in at compile time: a compiled xtask
//! may be run from another checkout, or share a target folder with one, and must then read that
//! checkout's files. The root is `TF_REPO_ROOT` when set, else the nearest folder at or above
//! the current directory holding a `Cargo.toml` with a `[workspace]` table and an `xtask/`
//! folder.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::error::Error;

/// Environment variable that names the repository root explicitly.
pub const ENV_REPO_ROOT: &str = "TF_REPO_ROOT";

/// The repository root: `$TF_REPO_ROOT`, else found by walking up from the current directory.
pub fn repo_root() -> Result<PathBuf, Error> {
    let cwd =
        std::env::current_dir().map_err(|e| Error::io("read the current directory", ".", e))?;
    find_repo_root(&cwd, std::env::var_os(ENV_REPO_ROOT))
}

/// The repository root for a process started in `start`, with `explicit` the value of
/// `TF_REPO_ROOT` (an empty value counts as unset). An explicit root must itself be a workspace
/// root; a relative one is taken relative to `start`.
pub fn find_repo_root(start: &Path, explicit: Option<OsString>) -> Result<PathBuf, Error> {
    if let Some(explicit) = explicit.filter(|v| !v.is_empty()) {
        let root = start.join(PathBuf::from(explicit));
        return match workspace_root_problem(&root) {
            None => Ok(root),
            Some(problem) => Err(Error::RepoRoot {
                detail: format!(
                    "{ENV_REPO_ROOT}={} is not the repository root: {problem}; \
                     point it at the folder holding the workspace Cargo.toml and xtask/, or unset it",
                    root.display()
                ),
            }),
        };
    }
    for dir in start.ancestors() {
        if workspace_root_problem(dir).is_none() {
            return Ok(dir.to_path_buf());
        }
    }
    Err(Error::RepoRoot {
        detail: format!(
            "no folder at or above {} holds a Cargo.toml with [workspace] and an xtask/ folder; \
             run `cargo xtask` inside the checkout or set {ENV_REPO_ROOT} to its root",
            start.display()
        ),
    })
}

/// Why `dir` is not a workspace root with an xtask, or `None` when it is one.
fn workspace_root_problem(dir: &Path) -> Option<String> {
    let manifest = dir.join("Cargo.toml");
    let text = match std::fs::read_to_string(&manifest) {
        Ok(text) => text,
        Err(e) => return Some(format!("cannot read {}: {e}", manifest.display())),
    };
    match text.parse::<toml::Table>() {
        Ok(table) if table.get("workspace").is_some_and(toml::Value::is_table) => {}
        Ok(_) => return Some(format!("{} has no [workspace] table", manifest.display())),
        Err(e) => return Some(format!("{} is not valid TOML: {e}", manifest.display())),
    }
    if !dir.join("xtask").join("Cargo.toml").is_file() {
        return Some(format!("{} has no xtask/Cargo.toml", dir.display()));
    }
    None
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

#[cfg(test)]
mod tests {
    use super::*;

    struct Tree(PathBuf);

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tree(tag: &str) -> Tree {
        let root = std::env::temp_dir().join(format!("xtask-root-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("xtask")).unwrap();
        std::fs::create_dir_all(root.join("crates/a/src/deep")).unwrap();
        std::fs::write(
            root.join("Cargo.toml"),
            "[workspace]\nmembers = [\"xtask\", \"crates/a\"]\n",
        )
        .unwrap();
        std::fs::write(
            root.join("xtask/Cargo.toml"),
            "[package]\nname = \"xtask\"\n",
        )
        .unwrap();
        // A member manifest without [workspace] must be walked past.
        std::fs::write(
            root.join("crates/a/Cargo.toml"),
            "[package]\nname = \"a\"\n",
        )
        .unwrap();
        Tree(root)
    }

    #[test]
    fn walks_up_to_the_workspace_root() {
        let t = tree("walk");
        let deep = t.0.join("crates/a/src/deep");
        assert_eq!(find_repo_root(&deep, None).unwrap(), t.0);
        assert_eq!(find_repo_root(&t.0, None).unwrap(), t.0);
        // An empty override counts as unset.
        assert_eq!(find_repo_root(&deep, Some(OsString::new())).unwrap(), t.0);
    }

    #[test]
    fn explicit_root_wins_and_is_checked() {
        let t = tree("explicit");
        let other = tree("explicit-other");
        let found = find_repo_root(&t.0, Some(other.0.clone().into_os_string())).unwrap();
        assert_eq!(found, other.0);
        let err = find_repo_root(&t.0, Some(t.0.join("crates/a").into_os_string()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(ENV_REPO_ROOT) && err.contains("no [workspace]"),
            "{err}"
        );
    }

    #[test]
    fn a_workspace_without_xtask_or_outside_any_checkout_is_refused_clearly() {
        let t = tree("noxtask");
        std::fs::remove_dir_all(t.0.join("xtask")).unwrap();
        let err = find_repo_root(&t.0.join("crates/a"), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(ENV_REPO_ROOT) && err.contains("[workspace]"),
            "{err}"
        );
    }

    #[test]
    fn the_real_checkout_is_found_from_the_test_directory() {
        let root = repo_root().unwrap();
        assert!(
            root.join("xtask/bundle-steps.toml").is_file(),
            "{}",
            root.display()
        );
    }
}
