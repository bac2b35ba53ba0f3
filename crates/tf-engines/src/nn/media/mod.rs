//! Media files the engines write: PNG images, WAV audio, and MP4 videos (H.264 + AAC, muxed by `ffmpeg`).
pub mod mp4;
pub mod png;
pub mod wav;

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` through a temporary file (`<path>.partial`) renamed into place, so a reader never
/// sees half a file; on failure the temporary file is removed.
///
/// The file is not flushed to the disk before the rename (no `fsync`): every other process sees it whole at once,
/// which is the contract, and a request does not wait on the disk (writing a 1024x1024 PNG, the flush included,
/// took 16-117 ms on the GPU machine). Surviving a power cut is left to the caller.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let written = std::fs::File::create(&partial)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}
