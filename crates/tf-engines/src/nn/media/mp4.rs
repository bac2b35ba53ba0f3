//! MP4 files with H.264 video (yuv420p) and an optional AAC audio track, muxed by an `ffmpeg` child process.
//!
//! Nothing is encoded in this process: the frames go to `ffmpeg`'s standard input as raw RGB or RGBA, the audio
//! through a temporary 32-bit float WAV beside the output, and `ffmpeg` writes the MP4 under a temporary name that
//! is renamed into place only when it exits successfully. On any failure the temporary files are removed, so a
//! half-written MP4 never appears under the asked name.
//!
//! - [`find_ffmpeg`]: `TF_FFMPEG` (a path, or a name looked up on `PATH`), else `ffmpeg` on `PATH`. When neither
//!   exists the error says how to install it ([`INSTALL_HINT`]); nothing is downloaded at run time.
//! - [`write_mp4`]: video at the given frame rate (`-framerate`, constant), `libx264` at CRF 18 (`preset medium`),
//!   `yuv420p` (so width and height must be even), `+faststart`. The audio is cut or padded with silence to the
//!   video's duration (`round(frames * rate / fps)` samples), then AAC at 192 kb/s per stereo pair with the same
//!   channel count; a sample rate AAC does not take is raised to the next one it does.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::nn::media::mp4::{find_ffmpeg, write_mp4, AudioInput, PixelLayout, VideoInput};
//!
//! let frames = vec![vec![0u8; 64 * 32 * 3]; 24];
//! let video = VideoInput { width: 64, height: 32, fps: 24, layout: PixelLayout::Rgb, frames: &frames };
//! let tone: Vec<f32> = (0..32000).map(|i| (i as f32 * 0.05).sin() * 0.2).collect();
//! let audio = AudioInput { sample_rate: 32000, channels: 1, samples: &tone };
//! write_mp4(&find_ffmpeg()?, Path::new("out.mp4"), &video, Some(&audio))?;
//! # Ok::<(), tf_engines::nn::media::mp4::Mp4Error>(())
//! ```

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use thiserror::Error;

/// The environment variable naming the `ffmpeg` to run.
pub const FFMPEG_ENV: &str = "TF_FFMPEG";
/// How to get `ffmpeg`, in every "not found" error.
pub const INSTALL_HINT: &str = "install ffmpeg: `sudo apt-get install -y ffmpeg` (Debian, Ubuntu), `sudo dnf install \
     ffmpeg` (Fedora), `brew install ffmpeg` (macOS); or `pip install imageio-ffmpeg` and set TF_FFMPEG to the path \
     that `python3 -c 'import imageio_ffmpeg; print(imageio_ffmpeg.get_ffmpeg_exe())'` prints";
/// Highest frame rate accepted.
pub const MAX_FPS: u32 = 240;
/// Frames one file may hold, at most (an hour at 240 fps).
pub const MAX_FRAMES: usize = 240 * 3600;
/// Largest side in pixels (H.264 level 6.2 tops out at 8192).
pub const MAX_SIDE: u32 = 8192;
/// Sample rates the AAC encoder takes.
pub const AAC_SAMPLE_RATES: [u32; 13] = [
    7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000,
];
/// Channels the AAC encoder takes, at most.
pub const MAX_AUDIO_CHANNELS: u16 = 8;
/// The tail of `ffmpeg`'s error output kept in an error.
const STDERR_TAIL: usize = 4000;

/// Errors of muxing an MP4.
#[derive(Debug, Error)]
pub enum Mp4Error {
    /// No `ffmpeg` to run: the message says where it was looked for and how to install it.
    #[error("MP4: {why}; {INSTALL_HINT}")]
    FfmpegMissing { why: String },
    #[error("MP4: {0}")]
    Invalid(String),
    #[error("MP4: {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// `ffmpeg` ran and failed; its last lines of error output are kept.
    #[error("MP4: {} failed ({status}) writing {}: {stderr}", ffmpeg.display(), path.display())]
    Ffmpeg {
        ffmpeg: PathBuf,
        path: PathBuf,
        status: String,
        stderr: String,
    },
}

impl Mp4Error {
    /// Whether the failure is a missing `ffmpeg` (as opposed to bad input or a failed run).
    pub fn is_ffmpeg_missing(&self) -> bool {
        matches!(self, Mp4Error::FfmpegMissing { .. })
    }
}

fn invalid<T>(why: impl Into<String>) -> Result<T, Mp4Error> {
    Err(Mp4Error::Invalid(why.into()))
}

/// Bytes per pixel of the frames handed to [`write_mp4`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PixelLayout {
    /// 3 bytes per pixel.
    Rgb,
    /// 4 bytes per pixel; alpha is dropped by the encoder.
    Rgba,
}

impl PixelLayout {
    /// Bytes per pixel.
    pub fn channels(self) -> usize {
        match self {
            PixelLayout::Rgb => 3,
            PixelLayout::Rgba => 4,
        }
    }

    fn ffmpeg_name(self) -> &'static str {
        match self {
            PixelLayout::Rgb => "rgb24",
            PixelLayout::Rgba => "rgba",
        }
    }
}

/// The video: frames of `width * height * layout.channels()` bytes, rows top to bottom.
#[derive(Debug, Clone, Copy)]
pub struct VideoInput<'a, F: AsRef<[u8]>> {
    pub width: u32,
    pub height: u32,
    pub fps: u32,
    pub layout: PixelLayout,
    pub frames: &'a [F],
}

/// The audio: interleaved f32 samples in `[-1, 1]`.
#[derive(Debug, Clone, Copy)]
pub struct AudioInput<'a> {
    pub sample_rate: u32,
    pub channels: u16,
    pub samples: &'a [f32],
}

/// What [`write_mp4`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Mp4Report {
    pub frames: usize,
    pub fps: u32,
    /// The video's duration, `frames / fps` seconds.
    pub seconds: f64,
    /// The AAC track's sample rate and channels, when there is one.
    pub audio: Option<(u32, u16)>,
    /// Audio samples per channel cut (positive) or padded with silence (negative) to match the video.
    pub audio_trimmed: i64,
}

/// The `ffmpeg` to run: `TF_FFMPEG` when set (a path, or a bare name looked up on `PATH`), else `ffmpeg` on
/// `PATH`.
pub fn find_ffmpeg() -> Result<PathBuf, Mp4Error> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    find_ffmpeg_in(std::env::var_os(FFMPEG_ENV).as_deref(), &path)
}

/// [`find_ffmpeg`] with the environment given (for tests).
pub fn find_ffmpeg_in(
    configured: Option<&std::ffi::OsStr>,
    search_path: &std::ffi::OsStr,
) -> Result<PathBuf, Mp4Error> {
    if let Some(given) = configured.filter(|v| !v.is_empty()) {
        let given = Path::new(given);
        if given.components().count() > 1 || given.is_absolute() {
            return if is_executable(given) {
                Ok(given.to_path_buf())
            } else {
                Err(Mp4Error::FfmpegMissing {
                    why: format!(
                        "{FFMPEG_ENV} is {} but that is not an executable file (fix or unset {FFMPEG_ENV})",
                        given.display()
                    ),
                })
            };
        }
        return on_path(given, search_path).ok_or_else(|| Mp4Error::FfmpegMissing {
            why: format!(
                "{FFMPEG_ENV} is {:?} but no such program is on PATH (give a full path, or unset {FFMPEG_ENV})",
                given
            ),
        });
    }
    on_path(Path::new("ffmpeg"), search_path).ok_or_else(|| Mp4Error::FfmpegMissing {
        why: format!("ffmpeg was not found ({FFMPEG_ENV} is unset and no `ffmpeg` is on PATH)"),
    })
}

fn on_path(name: &Path, search_path: &std::ffi::OsStr) -> Option<PathBuf> {
    std::env::split_paths(search_path)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o111 != 0
            }
            #[cfg(not(unix))]
            {
                true
            }
        }
        _ => false,
    }
}

/// The AAC sample rate for input at `rate`: the same when AAC takes it, else the next higher one it takes (the
/// highest, 96 kHz, above that).
pub fn aac_sample_rate(rate: u32) -> u32 {
    AAC_SAMPLE_RATES
        .iter()
        .copied()
        .find(|&r| r >= rate)
        .unwrap_or(96000)
}

/// Samples per channel that last exactly as long as `frames` frames at `fps`: `round(frames * rate / fps)`.
pub fn matching_samples(frames: usize, fps: u32, rate: u32) -> usize {
    let exact = frames as f64 * f64::from(rate) / f64::from(fps.max(1));
    exact.round() as usize
}

/// Temporary files removed on drop unless [`Partial::keep`] moved them into place.
struct Partial {
    paths: Vec<PathBuf>,
}

impl Drop for Partial {
    fn drop(&mut self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

fn check_video<F: AsRef<[u8]>>(video: &VideoInput<'_, F>) -> Result<usize, Mp4Error> {
    let (w, h) = (video.width, video.height);
    if w == 0 || h == 0 || w > MAX_SIDE || h > MAX_SIDE {
        return invalid(format!(
            "frames of {w}x{h}; each side must be 2 to {MAX_SIDE} pixels"
        ));
    }
    if w % 2 != 0 || h % 2 != 0 {
        return invalid(format!(
            "frames of {w}x{h}; H.264 in yuv420p needs an even width and height"
        ));
    }
    if video.fps == 0 || video.fps > MAX_FPS {
        return invalid(format!(
            "{} frames per second; 1 to {MAX_FPS} are supported",
            video.fps
        ));
    }
    if video.frames.is_empty() || video.frames.len() > MAX_FRAMES {
        return invalid(format!(
            "{} frames; a video holds 1 to {MAX_FRAMES}",
            video.frames.len()
        ));
    }
    let frame_bytes = (w as usize) * (h as usize) * video.layout.channels();
    if let Some((i, f)) = video
        .frames
        .iter()
        .enumerate()
        .find(|(_, f)| f.as_ref().len() != frame_bytes)
    {
        return invalid(format!(
            "frame {i} has {} bytes; a {w}x{h} {:?} frame has {frame_bytes}",
            f.as_ref().len(),
            video.layout
        ));
    }
    Ok(frame_bytes)
}

fn check_audio(audio: &AudioInput<'_>) -> Result<(), Mp4Error> {
    if audio.channels == 0 || audio.channels > MAX_AUDIO_CHANNELS {
        return invalid(format!(
            "{} audio channels; AAC takes 1 to {MAX_AUDIO_CHANNELS}",
            audio.channels
        ));
    }
    if audio.sample_rate == 0 || audio.sample_rate > super::wav::MAX_SAMPLE_RATE {
        return invalid(format!("audio at {} Hz", audio.sample_rate));
    }
    if !audio
        .samples
        .len()
        .is_multiple_of(usize::from(audio.channels))
    {
        return invalid(format!(
            "{} audio samples do not split into frames of {} channels",
            audio.samples.len(),
            audio.channels
        ));
    }
    Ok(())
}

/// Writes `video` (and `audio`, when given) as an MP4 at `path` with the `ffmpeg` at `ffmpeg` (see the module
/// docs). The parent folder must exist. Everything is checked before `ffmpeg` starts.
pub fn write_mp4<F: AsRef<[u8]>>(
    ffmpeg: &Path,
    path: &Path,
    video: &VideoInput<'_, F>,
    audio: Option<&AudioInput<'_>>,
) -> Result<Mp4Report, Mp4Error> {
    check_video(video)?;
    if let Some(a) = audio {
        check_audio(a)?;
    }
    if path.is_dir() {
        return invalid(format!(
            "{} is a folder; give a file name ending in .mp4",
            path.display()
        ));
    }
    let frames = video.frames.len();
    let temp_video = sibling(path, ".partial");
    let temp_audio = sibling(path, ".audio.partial");
    let mut partial = Partial {
        paths: vec![temp_video.clone()],
    };

    let mut trimmed = 0i64;
    let audio_track = match audio {
        Some(a) => {
            let channels = usize::from(a.channels);
            let have = a.samples.len() / channels;
            let want = matching_samples(frames, video.fps, a.sample_rate);
            trimmed = have as i64 - want as i64;
            let mut samples = a.samples[..want.min(have) * channels].to_vec();
            samples.resize(want * channels, 0.0);
            partial.paths.push(temp_audio.clone());
            super::wav::write_wav(&temp_audio, a.sample_rate, a.channels, &samples).map_err(
                |e| match e {
                    super::wav::WavError::Io { what, path, source } => {
                        Mp4Error::Io { what, path, source }
                    }
                    other => Mp4Error::Invalid(other.to_string()),
                },
            )?;
            Some((aac_sample_rate(a.sample_rate), a.channels))
        }
        None => None,
    };

    let mut cmd = Command::new(ffmpeg);
    cmd.args(["-hide_banner", "-nostdin", "-nostats", "-loglevel", "error"])
        .args(["-f", "rawvideo", "-pix_fmt", video.layout.ffmpeg_name()])
        .arg("-s")
        .arg(format!("{}x{}", video.width, video.height))
        .arg("-framerate")
        .arg(video.fps.to_string())
        .args(["-i", "pipe:0"]);
    if audio_track.is_some() {
        cmd.args(["-f", "wav", "-i"]).arg(&temp_audio);
    }
    cmd.args(["-map", "0:v:0"]);
    cmd.args([
        "-c:v", "libx264", "-preset", "medium", "-crf", "18", "-pix_fmt", "yuv420p",
    ]);
    cmd.arg("-r").arg(video.fps.to_string());
    if let Some((rate, channels)) = audio_track {
        let bitrate = 96 * u32::from(channels);
        cmd.args(["-map", "1:a:0", "-c:a", "aac"])
            .arg("-b:a")
            .arg(format!("{bitrate}k"))
            .arg("-ar")
            .arg(rate.to_string())
            .arg("-ac")
            .arg(channels.to_string());
    }
    cmd.args(["-movflags", "+faststart", "-f", "mp4", "-y"])
        .arg(&temp_video)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Mp4Error::FfmpegMissing {
                why: format!("{} could not be started ({e})", ffmpeg.display()),
            }
        } else {
            Mp4Error::Io {
                what: "starting",
                path: ffmpeg.to_path_buf(),
                source: e,
            }
        }
    })?;
    // Read the error output on its own thread, so a chatty ffmpeg never blocks on a full pipe while we write.
    let stderr_reader = child.stderr.take().map(|mut err| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = err.read_to_end(&mut text);
            text
        })
    });
    let mut write_error = None;
    if let Some(mut stdin) = child.stdin.take() {
        for frame in video.frames {
            if let Err(e) = stdin.write_all(frame.as_ref()) {
                write_error = Some(e);
                break;
            }
        }
        drop(stdin); // end of input: ffmpeg finishes the file
    }
    let status = child.wait().map_err(|source| Mp4Error::Io {
        what: "waiting for",
        path: ffmpeg.to_path_buf(),
        source,
    })?;
    let stderr = stderr_reader
        .and_then(|t| t.join().ok())
        .map(|bytes| {
            let text = String::from_utf8_lossy(&bytes).trim().to_string();
            let start = text
                .char_indices()
                .rev()
                .nth(STDERR_TAIL)
                .map_or(0, |(i, _)| i);
            text[start..].to_string()
        })
        .unwrap_or_default();
    if !status.success() || write_error.is_some() {
        let mut why = stderr;
        if let Some(e) = write_error {
            why = format!("{why} (writing frames: {e})");
        }
        return Err(Mp4Error::Ffmpeg {
            ffmpeg: ffmpeg.to_path_buf(),
            path: path.to_path_buf(),
            status: status.to_string(),
            stderr: why,
        });
    }
    std::fs::rename(&temp_video, path).map_err(|source| Mp4Error::Io {
        what: "renaming the finished MP4 to",
        path: path.to_path_buf(),
        source,
    })?;
    drop(partial); // removes the temporary audio; the video was renamed away
    Ok(Mp4Report {
        frames,
        fps: video.fps,
        seconds: frames as f64 / f64::from(video.fps),
        audio: audio_track,
        audio_trimmed: trimmed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aac_rates_round_up() {
        assert_eq!(aac_sample_rate(32000), 32000);
        assert_eq!(aac_sample_rate(5120), 7350);
        assert_eq!(aac_sample_rate(8000), 8000);
        assert_eq!(aac_sample_rate(30000), 32000);
        assert_eq!(aac_sample_rate(200_000), 96000);
    }

    #[test]
    fn audio_matches_the_video_duration() {
        // 124 frames at 24 fps = 5.1667 s = 165,333.3 samples at 32 kHz.
        assert_eq!(matching_samples(124, 24, 32000), 165_333);
        assert_eq!(matching_samples(48, 24, 8000), 16000);
    }

    #[test]
    fn ffmpeg_lookup_honours_the_variable_then_path() {
        let dir = std::env::temp_dir().join(format!("tf-mp4-find-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("ffmpeg");
        std::fs::write(&fake, "#!/bin/sh\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let path = std::ffi::OsString::from(format!("/nonexistent:{}", dir.display()));
        assert_eq!(find_ffmpeg_in(None, &path).unwrap(), fake);
        assert_eq!(
            find_ffmpeg_in(Some(fake.as_os_str()), "".as_ref()).unwrap(),
            fake
        );
        assert_eq!(
            find_ffmpeg_in(Some("ffmpeg".as_ref()), &path).unwrap(),
            fake
        );
        let missing = find_ffmpeg_in(None, "/nonexistent".as_ref()).unwrap_err();
        assert!(missing.is_ffmpeg_missing());
        assert!(missing.to_string().contains("apt-get install"), "{missing}");
        let bad = find_ffmpeg_in(Some(dir.join("nope").as_os_str()), &path).unwrap_err();
        assert!(bad.to_string().contains("TF_FFMPEG"), "{bad}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_input_is_refused_before_ffmpeg_runs() {
        let frames = vec![vec![0u8; 4 * 4 * 3]; 2];
        let ok = VideoInput {
            width: 4,
            height: 4,
            fps: 24,
            layout: PixelLayout::Rgb,
            frames: &frames,
        };
        let never = Path::new("/nonexistent/ffmpeg");
        let out = std::env::temp_dir().join("tf-mp4-never.mp4");
        for (video, needle) in [
            (VideoInput { width: 3, ..ok }, "even"),
            (VideoInput { fps: 0, ..ok }, "frames per second"),
            (
                VideoInput {
                    layout: PixelLayout::Rgba,
                    ..ok
                },
                "frame 0 has",
            ),
        ] {
            let e = write_mp4(never, &out, &video, None).unwrap_err();
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
        let empty: Vec<Vec<u8>> = Vec::new();
        let e = write_mp4(
            never,
            &out,
            &VideoInput {
                frames: &empty,
                ..ok
            },
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("0 frames"), "{e}");
        let audio = AudioInput {
            sample_rate: 32000,
            channels: 2,
            samples: &[0.0; 3],
        };
        let e = write_mp4(never, &out, &ok, Some(&audio)).unwrap_err();
        assert!(e.to_string().contains("do not split"), "{e}");
        // A missing program is reported as such, and nothing is left behind.
        let e = write_mp4(never, &out, &ok, None).unwrap_err();
        assert!(e.is_ffmpeg_missing(), "{e}");
        assert!(!out.exists() && !sibling(&out, ".partial").exists());
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_ffmpeg_leaves_nothing_behind() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("tf-mp4-fail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Writes a partial output, complains and fails, as an encoder error mid-way would.
        let fake = dir.join("fake-ffmpeg");
        std::fs::write(
            &fake,
            "#!/bin/sh\nfor last; do :; done\ncat > /dev/null\necho half > \"$last\"\necho 'Unknown encoder libx264' >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let frames = vec![vec![0u8; 4 * 4 * 4]; 3];
        let video = VideoInput {
            width: 4,
            height: 4,
            fps: 8,
            layout: PixelLayout::Rgba,
            frames: &frames,
        };
        let audio = AudioInput {
            sample_rate: 8000,
            channels: 2,
            samples: &[0.1; 2000],
        };
        let out = dir.join("clip.mp4");
        let e = write_mp4(&fake, &out, &video, Some(&audio)).unwrap_err();
        assert!(e.to_string().contains("Unknown encoder"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "fake-ffmpeg")
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
