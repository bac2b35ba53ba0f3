//! 8-bit PNG files through the `png` crate: a writer for gray, gray+alpha, RGB and RGBA images, and a reader
//! (for tests and checks) with a bound on what a file may make it allocate.
//!
//! The writer compresses in one of two ways ([`PngCompression`]). `Fast`, the default, is `fdeflate` (the `png`
//! crate's fast deflate) over rows filtered with the Up filter: a 1024 x 1024 RGBA image in about 5 ms instead of
//! about 140 ms, and a smaller file for a model's smooth output (`cargo bench -p tf-engines --bench png_encode`;
//! docs/RESULTS.md). One fixed filter instead of the crate's per-row choice among five takes about a third less
//! time for a file 0.2% larger on smooth content, and the same size on noise.
//! `Compatible` emits the previous release's bytes exactly: the signature, one IHDR, one IDAT holding the zlib
//! stream (deflate level 6, as `flate2`'s default) of the rows each prefixed by filter byte 0 (no filter, no
//! adaptive choice), and IEND; that is [`png::Filter::NoFilter`] with [`png::DeflateCompression::Level`]`(6)`,
//! an IDAT split only past 2^31 - 1 bytes. A test encodes random images with a copy of the previous writer and
//! compares the bytes. Both are lossless: the pixels read back are the same.
//!
//! The reader accepts any non-animated PNG the crate decodes and returns it as 8-bit gray, gray+alpha, RGB or
//! RGBA (palettes and low bit depths expanded, 16-bit samples stripped to 8). A file whose decoded image would
//! exceed [`MAX_DECODED_BYTES`] (or the bound given to [`decode_png_limited`]) is refused from its header,
//! before the pixels are allocated; the crate's own buffers are bounded by the same figure.
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

use std::path::Path;

use thiserror::Error;

/// Largest side a PNG may state (the format's limit is 2^31 - 1).
const MAX_SIDE: usize = (1 << 31) - 1;
/// The deflate level of the previous release's writer (`flate2::Compression::default()`).
const ZLIB_LEVEL: u8 = 6;
/// Most bytes of decoded pixels [`decode_png`] allocates (1 GiB: a 16384 x 16384 RGBA image).
pub const MAX_DECODED_BYTES: usize = 1 << 30;

/// Errors of writing or reading a PNG.
#[derive(Debug, Error)]
pub enum PngError {
    #[error("PNG: {0}")]
    Invalid(String),
    #[error("PNG: encoding: {0}")]
    Encode(#[source] png::EncodingError),
    #[error("PNG: decoding: {0}")]
    Decode(#[source] png::DecodingError),
    #[error(
        "PNG: the image is {width}x{height} with {channels} channels ({bytes} B decoded), more than the \
         {limit} B this reader allocates; pass a larger limit to decode_png_limited if the file is trusted"
    )]
    TooLarge {
        width: u32,
        height: u32,
        channels: usize,
        bytes: u128,
        limit: usize,
    },
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

    fn to_png(self) -> png::ColorType {
        match self {
            ColorType::Gray => png::ColorType::Grayscale,
            ColorType::GrayAlpha => png::ColorType::GrayscaleAlpha,
            ColorType::Rgb => png::ColorType::Rgb,
            ColorType::Rgba => png::ColorType::Rgba,
        }
    }

    fn from_png(color: png::ColorType) -> Option<ColorType> {
        match color {
            png::ColorType::Grayscale => Some(ColorType::Gray),
            png::ColorType::GrayscaleAlpha => Some(ColorType::GrayAlpha),
            png::ColorType::Rgb => Some(ColorType::Rgb),
            png::ColorType::Rgba => Some(ColorType::Rgba),
            png::ColorType::Indexed => None,
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

fn side(name: &str, value: usize) -> Result<u32, PngError> {
    u32::try_from(value)
        .ok()
        .filter(|&v| v > 0 && value <= MAX_SIDE)
        .ok_or_else(|| invalid(format!("{name} {value}: each side must be 1 to {MAX_SIDE}")))
}

/// How hard the writer compresses. Both are lossless; they differ in time and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PngCompression {
    /// `fdeflate` over Up-filtered rows: about 25 times faster to write than `Compatible` at 1024 x 1024, which
    /// matters on a request's critical path.
    #[default]
    Fast,
    /// zlib level 6, no filter: the previous release's bytes exactly (see the module doc).
    Compatible,
}

/// Encodes `pixels` (`height` rows of `width * channels` bytes) as a PNG file ([`PngCompression::Fast`]).
pub fn encode_png(
    width: usize,
    height: usize,
    color: ColorType,
    pixels: &[u8],
) -> Result<Vec<u8>, PngError> {
    encode_png_with(width, height, color, pixels, PngCompression::default())
}

/// Encodes `pixels` (`height` rows of `width * channels` bytes) as a PNG file, compressed as `compression` says.
pub fn encode_png_with(
    width: usize,
    height: usize,
    color: ColorType,
    pixels: &[u8],
    compression: PngCompression,
) -> Result<Vec<u8>, PngError> {
    let (w, h) = (side("width", width)?, side("height", height)?);
    let expected = width
        .checked_mul(color.channels())
        .and_then(|row| row.checked_mul(height))
        .ok_or_else(|| {
            invalid(format!(
                "a {width}x{height} image overflows the address space"
            ))
        })?;
    if pixels.len() != expected {
        return Err(invalid(format!(
            "{} bytes of pixels for a {width}x{height} image with {} channels (expected {expected})",
            pixels.len(),
            color.channels()
        )));
    }
    let mut out = Vec::with_capacity(expected / 2 + 64);
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(color.to_png());
    encoder.set_depth(png::BitDepth::Eight);
    match compression {
        PngCompression::Compatible => {
            encoder.set_filter(png::Filter::NoFilter);
            encoder.set_deflate_compression(png::DeflateCompression::Level(ZLIB_LEVEL));
        }
        PngCompression::Fast => {
            encoder.set_deflate_compression(png::DeflateCompression::FdeflateUltraFast);
            encoder.set_filter(png::Filter::Up);
        }
    }
    let mut writer = encoder.write_header().map_err(PngError::Encode)?;
    writer.write_image_data(pixels).map_err(PngError::Encode)?;
    writer.finish().map_err(PngError::Encode)?;
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

/// Decodes a PNG file to 8-bit gray, gray+alpha, RGB or RGBA, allocating at most [`MAX_DECODED_BYTES`] of
/// pixels.
pub fn decode_png(file: &[u8]) -> Result<PngImage, PngError> {
    decode_png_limited(file, MAX_DECODED_BYTES)
}

/// [`decode_png`] with another bound on the decoded pixels (and on the decoder's own buffers).
pub fn decode_png_limited(file: &[u8], max_bytes: usize) -> Result<PngImage, PngError> {
    let mut decoder =
        png::Decoder::new_with_limits(std::io::Cursor::new(file), png::Limits { bytes: max_bytes });
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    // The header alone says how large the image is: refuse an oversized one before reading further.
    let (width, height) = {
        let info = decoder.read_header_info().map_err(PngError::Decode)?;
        (info.width, info.height)
    };
    // After EXPAND and STRIP_16 a pixel is at most 4 bytes; the exact figure is checked again below.
    let bound = u128::from(width) * u128::from(height) * 4;
    if bound > max_bytes as u128 {
        return Err(PngError::TooLarge {
            width,
            height,
            channels: 4,
            bytes: bound,
            limit: max_bytes,
        });
    }
    let mut reader = decoder.read_info().map_err(PngError::Decode)?;
    let (png_color, depth) = reader.output_color_type();
    let color = ColorType::from_png(png_color)
        .filter(|_| depth == png::BitDepth::Eight)
        .ok_or_else(|| {
            invalid(format!(
                "decodes to {png_color:?} at {depth:?} bits, not 8-bit gray or RGB(A)"
            ))
        })?;
    let bytes = reader
        .output_buffer_size()
        .filter(|&n| n <= max_bytes)
        .ok_or(PngError::TooLarge {
            width,
            height,
            channels: color.channels(),
            bytes: u128::from(width) * u128::from(height) * color.channels() as u128,
            limit: max_bytes,
        })?;
    let mut pixels = vec![0u8; bytes];
    let frame = reader.next_frame(&mut pixels).map_err(PngError::Decode)?;
    pixels.truncate(frame.buffer_size());
    // The rest of the file up to IEND, so a truncated or corrupt tail is refused too.
    reader.finish().map_err(PngError::Decode)?;
    let (width, height) = (frame.width as usize, frame.height as usize);
    if pixels.len() != width * height * color.channels() {
        return Err(invalid(format!(
            "{} bytes decoded for a {width}x{height} image with {} channels",
            pixels.len(),
            color.channels()
        )));
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
    use std::io::Write;

    use super::*;
    use proptest::prelude::*;

    /// The previous release's writer, byte for byte: signature, IHDR, one IDAT of zlib (flate2's default level)
    /// over the rows each prefixed by filter byte 0, IEND; CRCs by crc32fast.
    mod previous {
        use std::io::Write;

        use super::ColorType;

        const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

        fn code(color: ColorType) -> u8 {
            match color {
                ColorType::Gray => 0,
                ColorType::GrayAlpha => 4,
                ColorType::Rgb => 2,
                ColorType::Rgba => 6,
            }
        }

        pub fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
            let len = u32::try_from(data.len()).unwrap();
            out.extend_from_slice(&len.to_be_bytes());
            let start = out.len();
            out.extend_from_slice(kind);
            out.extend_from_slice(data);
            let crc = crc32fast::hash(&out[start..]);
            out.extend_from_slice(&crc.to_be_bytes());
        }

        pub fn encode_png(width: usize, height: usize, color: ColorType, pixels: &[u8]) -> Vec<u8> {
            let row = width * color.channels();
            assert_eq!(pixels.len(), row * height);
            let mut raw = Vec::with_capacity(pixels.len() + height);
            for line in pixels.chunks_exact(row) {
                raw.push(0); // filter: none
                raw.extend_from_slice(line);
            }
            let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            z.write_all(&raw).unwrap();
            let idat = z.finish().unwrap();
            let mut ihdr = Vec::with_capacity(13);
            ihdr.extend_from_slice(&(width as u32).to_be_bytes());
            ihdr.extend_from_slice(&(height as u32).to_be_bytes());
            ihdr.extend_from_slice(&[8, code(color), 0, 0, 0]);
            let mut out = Vec::with_capacity(idat.len() + 64);
            out.extend_from_slice(&SIGNATURE);
            chunk(&mut out, b"IHDR", &ihdr);
            chunk(&mut out, b"IDAT", &idat);
            chunk(&mut out, b"IEND", &[]);
            out
        }

        /// A file of the previous layout with this IHDR and IDAT payload.
        pub fn file(ihdr: &[u8], idat: &[u8]) -> Vec<u8> {
            let mut out = SIGNATURE.to_vec();
            chunk(&mut out, b"IHDR", ihdr);
            chunk(&mut out, b"IDAT", idat);
            chunk(&mut out, b"IEND", &[]);
            out
        }
    }

    fn noise(seed: u64, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| {
                (crate::nn::sampling::noise::splitmix64(seed.wrapping_add(i as u64)) >> 56) as u8
            })
            .collect()
    }

    fn ihdr(width: u32, height: u32, color_code: u8) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&width.to_be_bytes());
        out.extend_from_slice(&height.to_be_bytes());
        out.extend_from_slice(&[8, color_code, 0, 0, 0]);
        out
    }

    #[test]
    fn the_writer_emits_the_previous_releases_bytes() {
        // Noise (incompressible), smooth gradients and flat fields (long matches), up to an image like the
        // pipeline's output, in every colour type.
        let mut cases: Vec<(usize, usize, ColorType, Vec<u8>)> = Vec::new();
        for (i, &(w, h)) in [(1usize, 1usize), (3, 2), (64, 64), (257, 31), (512, 512)]
            .iter()
            .enumerate()
        {
            for channels in 1..=4 {
                let color = ColorType::from_channels(channels).unwrap();
                let n = w * h * channels;
                cases.push((w, h, color, noise(i as u64 * 10 + channels as u64, n)));
                let gradient: Vec<u8> = (0..n)
                    .map(|j| ((j / channels) % w * 255 / w) as u8)
                    .collect();
                cases.push((w, h, color, gradient));
                cases.push((w, h, color, vec![(i * 37) as u8; n]));
            }
        }
        // The pipeline's full-size output: 1024 x 1024 RGB, smooth with noise (a photo-like mix).
        let (w, h) = (1024usize, 1024usize);
        let grain = noise(99, w * h * 3);
        let photo: Vec<u8> = (0..w * h * 3)
            .map(|j| (((j / 3) % w + (j / 3) / w) / 8 + usize::from(grain[j] >> 5)) as u8)
            .collect();
        cases.push((w, h, ColorType::Rgb, photo));
        for (w, h, color, pixels) in &cases {
            let ours = encode_png_with(*w, *h, *color, pixels, PngCompression::Compatible).unwrap();
            let before = previous::encode_png(*w, *h, *color, pixels);
            assert!(
                ours == before,
                "{w}x{h} {color:?}: {} B against {} B",
                ours.len(),
                before.len()
            );
            // The default (fast) mode writes other bytes for the same pixels.
            let fast = encode_png(*w, *h, *color, pixels).unwrap();
            assert_eq!(
                &decode_png(&fast).unwrap().pixels,
                pixels,
                "{w}x{h} {color:?}"
            );
        }
    }

    #[test]
    fn wrong_pixel_count_is_refused() {
        assert!(encode_png(2, 2, ColorType::Rgb, &[0; 11]).is_err());
        assert!(encode_png(0, 2, ColorType::Rgb, &[]).is_err());
        assert!(encode_png(1 << 31, 1, ColorType::Gray, &[]).is_err());
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
    fn a_huge_header_is_refused_before_allocating() {
        // 2^20 x 2^20 RGBA claims 4 TiB; the file itself is a few dozen bytes.
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&[0u8; 64]).unwrap();
        let file = previous::file(&ihdr(1 << 20, 1 << 20, 6), &z.finish().unwrap());
        let err = decode_png(&file).unwrap_err();
        assert!(matches!(err, PngError::TooLarge { .. }), "{err}");
        assert!(err.to_string().contains("1048576x1048576"), "{err}");
        // The bound is the caller's: a small image over a small limit is refused the same way.
        let small = encode_png(16, 16, ColorType::Rgb, &[1; 768]).unwrap();
        assert!(matches!(
            decode_png_limited(&small, 700).unwrap_err(),
            PngError::TooLarge { .. }
        ));
        assert_eq!(decode_png_limited(&small, 1024).unwrap().pixels.len(), 768);
    }

    #[test]
    fn filtered_rows_decode() {
        // A 2x2 gray image written with the Sub filter on row 0 and Up on row 1, by hand.
        let raw = [1u8, 10, 5, 2, 1, 1];
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&raw).unwrap();
        let file = previous::file(&ihdr(2, 2, 0), &z.finish().unwrap());
        let image = decode_png(&file).unwrap();
        assert_eq!(image.pixels, vec![10, 15, 11, 16]);
    }

    #[test]
    fn crc_matches_the_png_spec_value() {
        // The IEND chunk's CRC is the same in every PNG, and the writer ends with it.
        let mut out = Vec::new();
        previous::chunk(&mut out, b"IEND", &[]);
        assert_eq!(&out[8..], &[0xAE, 0x42, 0x60, 0x82]);
        let file = encode_png(1, 1, ColorType::Gray, &[9]).unwrap();
        assert_eq!(&file[file.len() - 12..], &out[..]);
    }

    proptest! {
        #[test]
        fn both_modes_round_trip_and_compatible_keeps_the_previous_bytes(
            width in 1usize..40,
            height in 1usize..40,
            channels in 1usize..5,
            seed in any::<u64>(),
        ) {
            let color = ColorType::from_channels(channels).unwrap();
            let pixels = noise(seed, width * height * channels);
            let compatible =
                encode_png_with(width, height, color, &pixels, PngCompression::Compatible).unwrap();
            prop_assert!(compatible == previous::encode_png(width, height, color, &pixels));
            for file in [compatible, encode_png(width, height, color, &pixels).unwrap()] {
                let back = decode_png(&file).unwrap();
                prop_assert_eq!(back.width, width);
                prop_assert_eq!(back.height, height);
                prop_assert_eq!(back.color, color);
                prop_assert_eq!(&back.pixels, &pixels);
            }
        }
    }
}
