//! The error type of every xtask command.

use std::path::PathBuf;

/// What went wrong, with enough context to fix it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file system operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A configuration or data file is malformed.
    #[error("{path}: {detail}")]
    Config { path: PathBuf, detail: String },
    /// An external tool could not be found or installed.
    #[error("{tool} not available: {detail}")]
    ToolMissing { tool: &'static str, detail: String },
    /// An external command ran and failed.
    #[error("`{command}` failed ({status}):\n{output}")]
    CommandFailed {
        command: String,
        status: String,
        output: String,
    },
    /// A check found problems; each line says what and how to fix it.
    #[error("{check} failed:\n  - {}", failures.join("\n  - "))]
    CheckFailed {
        check: &'static str,
        failures: Vec<String>,
    },
    /// The repository root could not be found (see `paths::repo_root`).
    #[error("cannot find the repository root: {detail}")]
    RepoRoot { detail: String },
    /// The command line was not understood.
    #[error("{0}\nrun `cargo xtask help` for usage")]
    Usage(String),
}

impl Error {
    /// Wraps an I/O error with the action and path it concerns.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// A malformed-file error.
    pub fn config(path: impl Into<PathBuf>, detail: impl Into<String>) -> Error {
        Error::Config {
            path: path.into(),
            detail: detail.into(),
        }
    }
}
