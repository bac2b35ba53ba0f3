//! WAV files: interleaved f32 samples written as 32-bit float PCM (format 3), and a reader for 32-bit float and
//! 16-bit integer PCM (for tests and checks) with a bound on what a file may make it allocate.
//!
//! The writer emits the canonical 44-byte header (`RIFF`, `WAVE`, a 16-byte `fmt ` chunk, `data`) and the samples
//! little-endian, interleaved frame by frame (left, right, left, right, ... for stereo). Samples are written as
//! given: a decoder's output is already in `[-1, 1]`, and clamping here would hide a fault upstream.
//! [`write_wav`] writes through a temporary name renamed into place ([`super::write_atomically`]), so a reader
//! never sees half a file.
//!
//! ```
//! use tf_engines::nn::media::wav::{decode_wav, encode_wav, interleave};
//!
//! let left = [0.0f32, 0.5, -0.5];
//! let right = [1.0f32, -1.0, 0.25];
//! let samples = interleave(&[&left, &right])?;
//! let file = encode_wav(32000, 2, &samples)?;
//! let back = decode_wav(&file)?;
//! assert_eq!((back.sample_rate, back.channels, back.samples), (32000, 2, samples));
//! # Ok::<(), tf_engines::nn::media::wav::WavError>(())
//! ```

use std::path::Path;

use thiserror::Error;

/// Channels a file may have, at most.
pub const MAX_CHANNELS: u16 = 64;
/// Highest sample rate accepted (Hz).
pub const MAX_SAMPLE_RATE: u32 = 768_000;
/// Most samples (all channels) [`decode_wav`] allocates: 2^28 f32 = 1 GiB, over an hour of 32 kHz stereo.
pub const MAX_DECODED_SAMPLES: usize = 1 << 28;
/// Bytes of the canonical header.
const HEADER_BYTES: usize = 44;

/// Errors of writing or reading a WAV file.
#[derive(Debug, Error)]
pub enum WavError {
    #[error("WAV: {0}")]
    Invalid(String),
    #[error("WAV: {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

fn invalid<T>(why: impl Into<String>) -> Result<T, WavError> {
    Err(WavError::Invalid(why.into()))
}

/// Decoded audio: interleaved samples as f32 in `[-1, 1]` (16-bit integers are scaled by `1 / 32768`).
#[derive(Debug, Clone, PartialEq)]
pub struct WavAudio {
    pub sample_rate: u32,
    pub channels: u16,
    /// `frames * channels` samples, interleaved.
    pub samples: Vec<f32>,
}

impl WavAudio {
    /// Sample frames (samples per channel).
    pub fn frames(&self) -> usize {
        self.samples.len() / usize::from(self.channels.max(1))
    }

    /// The samples of channel `c`.
    pub fn channel(&self, c: u16) -> Vec<f32> {
        let n = usize::from(self.channels.max(1));
        self.samples
            .iter()
            .skip(usize::from(c))
            .step_by(n)
            .copied()
            .collect()
    }
}

/// Interleaves equally long channels (`[left, right]` gives `l0 r0 l1 r1 ...`).
pub fn interleave(channels: &[&[f32]]) -> Result<Vec<f32>, WavError> {
    let Some(first) = channels.first() else {
        return invalid("interleave needs at least one channel");
    };
    if let Some((i, c)) = channels
        .iter()
        .enumerate()
        .find(|(_, c)| c.len() != first.len())
    {
        return invalid(format!(
            "channel {i} has {} samples, channel 0 has {}; channels must be equally long",
            c.len(),
            first.len()
        ));
    }
    let mut out = Vec::with_capacity(first.len().saturating_mul(channels.len()));
    for k in 0..first.len() {
        out.extend(channels.iter().map(|c| c[k]));
    }
    Ok(out)
}

fn check_format(sample_rate: u32, channels: u16) -> Result<(), WavError> {
    if channels == 0 || channels > MAX_CHANNELS {
        return invalid(format!(
            "{channels} channels; 1 to {MAX_CHANNELS} are supported"
        ));
    }
    if sample_rate == 0 || sample_rate > MAX_SAMPLE_RATE {
        return invalid(format!(
            "sample rate {sample_rate} Hz; 1 to {MAX_SAMPLE_RATE} Hz are supported"
        ));
    }
    Ok(())
}

/// A 32-bit float WAV file of `samples` (interleaved, `channels` per frame) at `sample_rate` Hz.
pub fn encode_wav(sample_rate: u32, channels: u16, samples: &[f32]) -> Result<Vec<u8>, WavError> {
    check_format(sample_rate, channels)?;
    if !samples.len().is_multiple_of(usize::from(channels)) {
        return invalid(format!(
            "{} samples do not split into frames of {channels} channels",
            samples.len()
        ));
    }
    if let Some(bad) = samples.iter().find(|s| !s.is_finite()) {
        return invalid(format!(
            "the audio holds a non-finite sample ({bad}); the decoder output is broken"
        ));
    }
    let data_bytes = samples
        .len()
        .checked_mul(4)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n <= u32::MAX - 36)
        .ok_or_else(|| {
            WavError::Invalid(format!(
                "{} samples are more than a WAV file (4 GiB) holds",
                samples.len()
            ))
        })?;
    let block = u32::from(channels) * 4;
    let byte_rate = sample_rate.checked_mul(block).ok_or_else(|| {
        WavError::Invalid(format!(
            "{sample_rate} Hz x {channels} channels overflows the byte rate"
        ))
    })?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + data_bytes as usize);
    bytes.extend_from_slice(b"RIFF");
    bytes.extend_from_slice(&(36 + data_bytes).to_le_bytes());
    bytes.extend_from_slice(b"WAVEfmt ");
    bytes.extend_from_slice(&16u32.to_le_bytes());
    bytes.extend_from_slice(&3u16.to_le_bytes()); // IEEE float
    bytes.extend_from_slice(&channels.to_le_bytes());
    bytes.extend_from_slice(&sample_rate.to_le_bytes());
    bytes.extend_from_slice(&byte_rate.to_le_bytes());
    bytes.extend_from_slice(&(block as u16).to_le_bytes());
    bytes.extend_from_slice(&32u16.to_le_bytes());
    bytes.extend_from_slice(b"data");
    bytes.extend_from_slice(&data_bytes.to_le_bytes());
    for s in samples {
        bytes.extend_from_slice(&s.to_le_bytes());
    }
    Ok(bytes)
}

/// Writes [`encode_wav`]'s file at `path` through a temporary name renamed into place.
pub fn write_wav(
    path: &Path,
    sample_rate: u32,
    channels: u16,
    samples: &[f32],
) -> Result<(), WavError> {
    let bytes = encode_wav(sample_rate, channels, samples)?;
    super::write_atomically(path, &bytes).map_err(|source| WavError::Io {
        what: "writing",
        path: path.to_path_buf(),
        source,
    })
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Decodes a WAV file of 32-bit float (format 3) or 16-bit integer (format 1) PCM, walking its chunks (unknown
/// chunks such as `LIST` are skipped); at most [`MAX_DECODED_SAMPLES`] samples are allocated.
pub fn decode_wav(file: &[u8]) -> Result<WavAudio, WavError> {
    if file.len() < 12 || &file[..4] != b"RIFF" || &file[8..12] != b"WAVE" {
        return invalid("not a RIFF/WAVE file");
    }
    let mut at = 12usize;
    let mut format: Option<(u16, u16, u32, u16)> = None;
    while at.checked_add(8).is_some_and(|end| end <= file.len()) {
        let id = &file[at..at + 4];
        let size = u32_at(file, at + 4) as usize;
        let body = at + 8;
        let end = body
            .checked_add(size)
            .filter(|&e| e <= file.len())
            .ok_or_else(|| {
                WavError::Invalid(format!(
                    "chunk {:?} of {size} B runs past the end of the file",
                    String::from_utf8_lossy(id)
                ))
            })?;
        match id {
            b"fmt " => {
                if size < 16 {
                    return invalid(format!("the fmt chunk is {size} B, under 16"));
                }
                format = Some((
                    u16_at(file, body),
                    u16_at(file, body + 2),
                    u32_at(file, body + 4),
                    u16_at(file, body + 14),
                ));
            }
            b"data" => {
                let Some((tag, channels, sample_rate, bits)) = format else {
                    return invalid("the data chunk comes before the fmt chunk");
                };
                check_format(sample_rate, channels)?;
                let data = &file[body..end];
                let samples = match (tag, bits) {
                    (3, 32) => {
                        let n = data.len() / 4;
                        if n > MAX_DECODED_SAMPLES {
                            return invalid(format!(
                                "{n} samples, more than the {MAX_DECODED_SAMPLES} this reader allocates"
                            ));
                        }
                        data.chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect::<Vec<f32>>()
                    }
                    (1, 16) => {
                        let n = data.len() / 2;
                        if n > MAX_DECODED_SAMPLES {
                            return invalid(format!(
                                "{n} samples, more than the {MAX_DECODED_SAMPLES} this reader allocates"
                            ));
                        }
                        data.chunks_exact(2)
                            .map(|c| f32::from(i16::from_le_bytes([c[0], c[1]])) / 32768.0)
                            .collect::<Vec<f32>>()
                    }
                    _ => {
                        return invalid(format!(
                            "format tag {tag} with {bits}-bit samples; this reader takes 32-bit float (3) and 16-bit \
                             PCM (1)"
                        ))
                    }
                };
                if !samples.len().is_multiple_of(usize::from(channels)) {
                    return invalid(format!(
                        "{} samples do not split into frames of {channels} channels",
                        samples.len()
                    ));
                }
                return Ok(WavAudio {
                    sample_rate,
                    channels,
                    samples,
                });
            }
            _ => {}
        }
        // Chunks are padded to an even size.
        at = end + (size & 1);
    }
    invalid("no data chunk")
}

/// Reads and decodes the WAV file at `path`.
pub fn read_wav(path: &Path) -> Result<WavAudio, WavError> {
    let bytes = std::fs::read(path).map_err(|source| WavError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    decode_wav(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_canonical() {
        let file = encode_wav(32000, 2, &[0.0, 1.0, -1.0, 0.5]).unwrap();
        assert_eq!(file.len(), 44 + 16);
        assert_eq!(&file[..4], b"RIFF");
        assert_eq!(u32_at(&file, 4), 36 + 16);
        assert_eq!(&file[8..16], b"WAVEfmt ");
        assert_eq!(u16_at(&file, 20), 3);
        assert_eq!(u16_at(&file, 22), 2);
        assert_eq!(u32_at(&file, 24), 32000);
        assert_eq!(u32_at(&file, 28), 32000 * 8);
        assert_eq!(u16_at(&file, 32), 8);
        assert_eq!(u16_at(&file, 34), 32);
        assert_eq!(&file[36..40], b"data");
        assert_eq!(u32_at(&file, 40), 16);
    }

    #[test]
    fn round_trip_and_channels() {
        let left: Vec<f32> = (0..100).map(|i| (i as f32 * 0.1).sin()).collect();
        let right: Vec<f32> = left.iter().map(|v| -v * 0.5).collect();
        let samples = interleave(&[&left, &right]).unwrap();
        let back = decode_wav(&encode_wav(8000, 2, &samples).unwrap()).unwrap();
        assert_eq!(back.frames(), 100);
        assert_eq!(back.channel(0), left);
        assert_eq!(back.channel(1), right);
    }

    #[test]
    fn sixteen_bit_files_and_extra_chunks_are_read() {
        let mut file = Vec::new();
        file.extend_from_slice(b"RIFF");
        file.extend_from_slice(&0u32.to_le_bytes());
        file.extend_from_slice(b"WAVE");
        file.extend_from_slice(b"LIST");
        file.extend_from_slice(&3u32.to_le_bytes());
        file.extend_from_slice(b"abc\0"); // odd chunk, padded
        file.extend_from_slice(b"fmt ");
        file.extend_from_slice(&16u32.to_le_bytes());
        file.extend_from_slice(&1u16.to_le_bytes());
        file.extend_from_slice(&1u16.to_le_bytes());
        file.extend_from_slice(&44100u32.to_le_bytes());
        file.extend_from_slice(&88200u32.to_le_bytes());
        file.extend_from_slice(&2u16.to_le_bytes());
        file.extend_from_slice(&16u16.to_le_bytes());
        file.extend_from_slice(b"data");
        file.extend_from_slice(&4u32.to_le_bytes());
        file.extend_from_slice(&16384i16.to_le_bytes());
        file.extend_from_slice(&(-32768i16).to_le_bytes());
        let back = decode_wav(&file).unwrap();
        assert_eq!(back.sample_rate, 44100);
        assert_eq!(back.samples, vec![0.5, -1.0]);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(encode_wav(0, 2, &[]).is_err());
        assert!(encode_wav(32000, 0, &[]).is_err());
        assert!(encode_wav(32000, 2, &[0.0]).is_err());
        assert!(encode_wav(32000, 1, &[f32::NAN]).is_err());
        assert!(interleave(&[&[0.0], &[0.0, 1.0]]).is_err());
        assert!(interleave(&[]).is_err());
        assert!(decode_wav(b"RIFF").is_err());
        let mut file = encode_wav(8000, 1, &[0.0; 4]).unwrap();
        file[40] = 0xff; // data size past the end
        assert!(decode_wav(&file).is_err());
        let mut file = encode_wav(8000, 1, &[0.0; 4]).unwrap();
        file[20] = 2; // ADPCM
        assert!(decode_wav(&file).is_err());
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(0u8..=255, 0..200)) {
            let mut file = b"RIFF\0\0\0\0WAVE".to_vec();
            file.extend_from_slice(&bytes);
            let _ = decode_wav(&file);
        }
    }
}
