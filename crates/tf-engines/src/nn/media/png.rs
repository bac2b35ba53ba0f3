//! 8-bit PNG files: a writer for RGB and RGBA images, and a reader for files in the same form (for tests and
//! checks).
//!
//! The writer emits one IHDR, one IDAT (filter 0 on every row, zlib via `flate2`) and IEND; CRCs via `crc32fast`.
//! The reader accepts 8-bit gray, gray+alpha, RGB and RGBA, non-interlaced, with any row filter.
//!
//! ```
//! use tf_engines::nn::media::png::{decode_png, encode_png, ColorType};
//!
//! let pixels = vec![255u8, 0, 0, 255, 0, 255, 0, 128]; // 2 x 1 RGBA
//! let file = encode_png(2, 1, ColorType::Rgba, &pixels)?;
//! let back = decode_png(&file)?;
//! assert_eq!((back.width, back.height, back.pixels), (2, 1, pixels));
//! # Ok::<(), tf_engines::nn::media::png::PngError>(())
//! ```

use std::io::{Read, Write};
use std::path::Path;

use thiserror::Error;

/// PNG file signature.
const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];
/// Largest side a PNG may state (the format's limit is 2^31 - 1).
const MAX_SIDE: usize = (1 << 31) - 1;

/// Errors of writing or reading a PNG.
#[derive(Debug, Error)]
pub enum PngError {
    #[error("PNG: {0}")]
    Invalid(String),
    #[error("PNG: {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

fn invalid(why: impl Into<String>) -> PngError {
    PngError::Invalid(why.into())
}

/// Pixel layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColorType {
    Gray,
    GrayAlpha,
    Rgb,
    Rgba,
}

impl ColorType {
    /// Bytes per pixel.
    pub fn channels(self) -> usize {
        match self {
            ColorType::Gray => 1,
            ColorType::GrayAlpha => 2,
            ColorType::Rgb => 3,
            ColorType::Rgba => 4,
        }
    }

    /// The layout of `channels` interleaved 8-bit channels.
    pub fn from_channels(channels: usize) -> Result<ColorType, PngError> {
        match channels {
            1 => Ok(ColorType::Gray),
            2 => Ok(ColorType::GrayAlpha),
            3 => Ok(ColorType::Rgb),
            4 => Ok(ColorType::Rgba),
            n => Err(invalid(format!("{n} channels per pixel; PNG holds 1 to 4"))),
        }
    }

    fn code(self) -> u8 {
        match self {
            ColorType::Gray => 0,
            ColorType::GrayAlpha => 4,
            ColorType::Rgb => 2,
            ColorType::Rgba => 6,
        }
    }

    fn from_code(code: u8) -> Option<ColorType> {
        match code {
            0 => Some(ColorType::Gray),
            4 => Some(ColorType::GrayAlpha),
            2 => Some(ColorType::Rgb),
            6 => Some(ColorType::Rgba),
            _ => None,
        }
    }
}

/// A decoded image: interleaved 8-bit rows, top to bottom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PngImage {
    pub width: usize,
    pub height: usize,
    pub color: ColorType,
    pub pixels: Vec<u8>,
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) -> Result<(), PngError> {
    let len = u32::try_from(data.len()).map_err(|_| invalid("a chunk over 4 GiB"))?;
    out.extend_from_slice(&len.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
    Ok(())
}

fn check_size(width: usize, height: usize) -> Result<(), PngError> {
    if width == 0 || height == 0 || width > MAX_SIDE || height > MAX_SIDE {
        return Err(invalid(format!(
            "size {width}x{height}: each side must be 1 to {MAX_SIDE}"
        )));
    }
    Ok(())
}

/// Encodes `pixels` (`height` rows of `width * channels` bytes) as a PNG file.
pub fn encode_png(
    width: usize,
    height: usize,
    color: ColorType,
    pixels: &[u8],
) -> Result<Vec<u8>, PngError> {
    check_size(width, height)?;
    let row = width
        .checked_mul(color.channels())
        .ok_or_else(|| invalid("row size overflows"))?;
    let expected = row
        .checked_mul(height)
        .ok_or_else(|| invalid("image size overflows"))?;
    if pixels.len() != expected {
        return Err(invalid(format!(
            "{} bytes of pixels for a {width}x{height} image with {} channels (expected {expected})",
            pixels.len(),
            color.channels()
        )));
    }
    let mut raw = Vec::with_capacity(expected + height);
    for line in pixels.chunks_exact(row) {
        raw.push(0); // filter: none
        raw.extend_from_slice(line);
    }
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(&raw)
        .map_err(|e| invalid(format!("compressing: {e}")))?;
    let idat = z
        .finish()
        .map_err(|e| invalid(format!("compressing: {e}")))?;

    let mut ihdr = Vec::with_capacity(13);
    // Sides fit in u32: checked above.
    ihdr.extend_from_slice(&(width as u32).to_be_bytes());
    ihdr.extend_from_slice(&(height as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, color.code(), 0, 0, 0]);
    let mut out = Vec::with_capacity(idat.len() + 64);
    out.extend_from_slice(&SIGNATURE);
    chunk(&mut out, b"IHDR", &ihdr)?;
    chunk(&mut out, b"IDAT", &idat)?;
    chunk(&mut out, b"IEND", &[])?;
    Ok(out)
}

/// Writes `pixels` as a PNG file at `path`.
pub fn write_png(
    path: &Path,
    width: usize,
    height: usize,
    color: ColorType,
    pixels: &[u8],
) -> Result<(), PngError> {
    let bytes = encode_png(width, height, color, pixels)?;
    std::fs::write(path, bytes).map_err(|source| PngError::Io {
        what: "writing",
        path: path.to_path_buf(),
        source,
    })
}

fn be_u32(bytes: &[u8], at: usize) -> Result<u32, PngError> {
    bytes
        .get(at..at + 4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_be_bytes)
        .ok_or_else(|| invalid("truncated file"))
}

fn paeth(a: u8, b: u8, c: u8) -> u8 {
    let (ia, ib, ic) = (i16::from(a), i16::from(b), i16::from(c));
    let p = ia + ib - ic;
    let (pa, pb, pc) = ((p - ia).abs(), (p - ib).abs(), (p - ic).abs());
    if pa <= pb && pa <= pc {
        a
    } else if pb <= pc {
        b
    } else {
        c
    }
}

/// Decodes an 8-bit, non-interlaced PNG (gray, gray+alpha, RGB, RGBA), checking every chunk CRC.
pub fn decode_png(file: &[u8]) -> Result<PngImage, PngError> {
    if !file.starts_with(&SIGNATURE) {
        return Err(invalid("not a PNG file (bad signature)"));
    }
    let mut at = SIGNATURE.len();
    let mut header: Option<(usize, usize, ColorType)> = None;
    let mut compressed = Vec::new();
    let mut ended = false;
    while at < file.len() && !ended {
        let len = be_u32(file, at)? as usize;
        let body_end = at
            .checked_add(8 + len)
            .filter(|&e| e + 4 <= file.len())
            .ok_or_else(|| invalid("a chunk runs past the end of the file"))?;
        let kind = &file[at + 4..at + 8];
        let data = &file[at + 8..body_end];
        let crc = be_u32(file, body_end)?;
        if crc32fast::hash(&file[at + 4..body_end]) != crc {
            return Err(invalid(format!(
                "CRC mismatch in chunk {}",
                String::from_utf8_lossy(kind)
            )));
        }
        match kind {
            b"IHDR" => {
                if data.len() != 13 {
                    return Err(invalid("IHDR is not 13 bytes"));
                }
                let width = be_u32(data, 0)? as usize;
                let height = be_u32(data, 4)? as usize;
                check_size(width, height)?;
                let (depth, code, interlace) = (data[8], data[9], data[12]);
                let color = ColorType::from_code(code)
                    .filter(|_| depth == 8 && interlace == 0)
                    .ok_or_else(|| {
                        invalid(format!(
                            "only 8-bit non-interlaced gray/RGB(A) is read (depth {depth}, color type {code}, \
                             interlace {interlace})"
                        ))
                    })?;
                header = Some((width, height, color));
            }
            b"IDAT" => compressed.extend_from_slice(data),
            b"IEND" => ended = true,
            _ => {}
        }
        at = body_end + 4;
    }
    let (width, height, color) = header.ok_or_else(|| invalid("no IHDR chunk"))?;
    if !ended {
        return Err(invalid("no IEND chunk"));
    }
    let bpp = color.channels();
    let row = width * bpp;
    let expected = (row + 1)
        .checked_mul(height)
        .ok_or_else(|| invalid("image size overflows"))?;
    let mut raw = Vec::with_capacity(expected);
    flate2::read::ZlibDecoder::new(compressed.as_slice())
        .take(expected as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| invalid(format!("decompressing: {e}")))?;
    if raw.len() != expected {
        return Err(invalid(format!(
            "image data holds {} bytes, expected {expected}",
            raw.len()
        )));
    }
    let mut pixels = vec![0u8; row * height];
    let mut prev = vec![0u8; row];
    for (y, line) in raw.chunks_exact(row + 1).enumerate() {
        let (filter, src) = (line[0], &line[1..]);
        let mut cur = vec![0u8; row];
        for x in 0..row {
            let a = if x >= bpp { cur[x - bpp] } else { 0 };
            let b = prev[x];
            let c = if x >= bpp { prev[x - bpp] } else { 0 };
            let predictor = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((u16::from(a) + u16::from(b)) / 2) as u8,
                4 => paeth(a, b, c),
                f => return Err(invalid(format!("row {y} has unknown filter {f}"))),
            };
            cur[x] = src[x].wrapping_add(predictor);
        }
        pixels[y * row..(y + 1) * row].copy_from_slice(&cur);
        prev = cur;
    }
    Ok(PngImage {
        width,
        height,
        color,
        pixels,
    })
}

/// Reads and decodes the PNG at `path`.
pub fn read_png(path: &Path) -> Result<PngImage, PngError> {
    let bytes = std::fs::read(path).map_err(|source| PngError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    decode_png(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn crc_matches_the_png_spec_value() {
        // The IEND chunk's CRC is the same in every PNG.
        let mut out = Vec::new();
        chunk(&mut out, b"IEND", &[]).unwrap();
        assert_eq!(&out[8..], &[0xAE, 0x42, 0x60, 0x82]);
    }

    #[test]
    fn wrong_pixel_count_is_refused() {
        assert!(encode_png(2, 2, ColorType::Rgb, &[0; 11]).is_err());
        assert!(encode_png(0, 2, ColorType::Rgb, &[]).is_err());
    }

    #[test]
    fn corrupt_files_are_refused() {
        let good = encode_png(3, 2, ColorType::Rgba, &[7; 24]).unwrap();
        assert!(decode_png(&good[..good.len() - 3]).is_err());
        let mut flipped = good.clone();
        flipped[20] ^= 1; // inside IHDR
        assert!(decode_png(&flipped).is_err());
        assert!(decode_png(b"not a png").is_err());
    }

    #[test]
    fn filtered_rows_decode() {
        // A 2x2 gray image written with the Sub filter on row 0 and Up on row 1, by hand.
        let raw = [1u8, 10, 5, 2, 1, 1];
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&raw).unwrap();
        let idat = z.finish().unwrap();
        let mut file = SIGNATURE.to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&2u32.to_be_bytes());
        ihdr.extend_from_slice(&2u32.to_be_bytes());
        ihdr.extend_from_slice(&[8, 0, 0, 0, 0]);
        chunk(&mut file, b"IHDR", &ihdr).unwrap();
        chunk(&mut file, b"IDAT", &idat).unwrap();
        chunk(&mut file, b"IEND", &[]).unwrap();
        let image = decode_png(&file).unwrap();
        assert_eq!(image.pixels, vec![10, 15, 11, 16]);
    }

    proptest! {
        #[test]
        fn round_trip(width in 1usize..20, height in 1usize..20, channels in 1usize..5, seed in any::<u64>()) {
            let color = ColorType::from_channels(channels).unwrap();
            let pixels: Vec<u8> = (0..width * height * channels)
                .map(|i| (crate::nn::sampling::noise::splitmix64(seed.wrapping_add(i as u64)) >> 56) as u8)
                .collect();
            let file = encode_png(width, height, color, &pixels).unwrap();
            let back = decode_png(&file).unwrap();
            prop_assert_eq!(back.width, width);
            prop_assert_eq!(back.height, height);
            prop_assert_eq!(back.color, color);
            prop_assert_eq!(back.pixels, pixels);
        }
    }
}
