//! 8-bit PNG files: a writer for gray, gray+alpha, RGB and RGBA images (through the `png` crate, or for large
//! images its own parallel one), and a reader through the `png` crate (for tests and checks) with a bound on
//! what a file may make it allocate.
//!
//! The writer compresses in one of two ways ([`PngCompression`]). `Fast`, the default, filters rows with the Up
//! filter; one fixed filter instead of the `png` crate's per-row choice among five takes about a third less
//! time for a file 0.2% larger on smooth content, and the same size on noise. An image of fewer than
//! [`PARALLEL_MIN_BYTES`] of pixels is then deflated by `fdeflate` (the `png` crate's fast deflate) on the
//! calling thread. A larger one, such as the pipelines' 1024 x 1024 outputs, would hold that thread for 6 to 9
//! ms on a request's critical path, so it is deflated on all cores instead: the filtered rows are cut into bands
//! of whole rows, each band is deflated (raw deflate at level 1 by `flate2`) and checksummed on its own thread,
//! and the bands' streams, each but the last ended by a sync flush, are joined into one zlib stream whose
//! Adler-32 is combined from theirs, in one IDAT (split only past 2^31 - 1 bytes). The bands are chosen from the
//! image's size alone, never from the number of threads. Level 1 costs about five times fdeflate's CPU time per
//! byte, so this pays off only with many cores: on two cores it is about 2.5 times slower than one thread of
//! fdeflate, and it is taken only on a machine of [`PARALLEL_MIN_THREADS`] or more. So a file's bytes depend on
//! the pixels and on which side of that line the machine is; the pixels read back are the same either way. Its files are about as large as fdeflate's
//! on RGB and noise, and about 11% larger on smooth RGBA. Timings and sizes: `cargo bench -p tf-engines --bench
//! png_encode` (docs/RESULTS.md).
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

use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use thiserror::Error;

/// Largest side a PNG may state (the format's limit is 2^31 - 1).
const MAX_SIDE: usize = (1 << 31) - 1;
/// Fewest bytes of pixels that [`PngCompression::Fast`] deflates in parallel bands; below it the `png` crate's
/// single-threaded `fdeflate` is done about as soon as threads would start.
pub const PARALLEL_MIN_BYTES: usize = 256 << 10;
/// Fewest threads the machine must offer for [`PngCompression::Fast`] to deflate in bands: with fewer, one
/// thread of fdeflate is faster (two cores took 2.5 times as long in bands).
pub const PARALLEL_MIN_THREADS: usize = 8;
/// About how many filtered bytes one band holds before the count is rounded (bands hold whole rows). A band
/// restarts deflate's 32 KiB window, so much smaller bands cost size; 64 KiB bands cost about 0.1%.
const BAND_BYTES: usize = 64 << 10;
/// The band count is a multiple of this (at most one band per row), so that 2, 4, 8 or 16 threads get equal
/// shares of a 1024 x 1024 image; the count comes from the image alone, so the bytes are the same anywhere.
const BAND_MULTIPLE: usize = 16;
/// The deflate level of a band. Level 1 (miniz_oxide's fast path) is the fastest of `flate2`'s levels on
/// filtered images: levels 2 and 3 took 1.5 and 3 times as long for no smaller file on RGB, and zlib-rs's
/// levels were no faster.
const BAND_LEVEL: u32 = 1;
/// Longest chunk payload PNG allows (2^31 - 1 bytes).
const MAX_CHUNK: usize = (1 << 31) - 1;
/// Every PNG file's first eight bytes.
const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];
/// A zlib header: deflate with a 32 KiB window (CMF 0x78), the fastest level's flag, no dictionary; 0x7801 is a
/// multiple of 31 as the format asks.
const ZLIB_HEADER: [u8; 2] = [0x78, 0x01];
/// The Up filter's byte before each filtered row.
const FILTER_UP: u8 = 2;
/// Adler-32's modulus.
const ADLER_MOD: u64 = 65521;
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

    /// The colour type IHDR states for this layout.
    fn ihdr_code(self) -> u8 {
        match self {
            ColorType::Gray => 0,
            ColorType::Rgb => 2,
            ColorType::GrayAlpha => 4,
            ColorType::Rgba => 6,
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
    /// Up-filtered rows, deflated by `fdeflate` on the calling thread or, from [`PARALLEL_MIN_BYTES`] of
    /// pixels, in bands on as many threads as the machine has (see the module doc): many times faster to write
    /// than `Compatible` at 1024 x 1024, which matters on a request's critical path.
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
    match compression {
        PngCompression::Fast => encode_png_fast(width, height, color, pixels, FastPath::Auto),
        PngCompression::Compatible => {
            let (w, h) = checked_sides(width, height, color, pixels)?;
            encode_with_png_crate(w, h, color, pixels, compression)
        }
    }
}

/// Which way [`encode_png_fast`] deflates.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastPath {
    /// What [`PngCompression::Fast`] does: bands from [`PARALLEL_MIN_BYTES`] of pixels on a machine of
    /// [`PARALLEL_MIN_THREADS`] or more, else fdeflate on the calling thread.
    Auto,
    /// Parallel bands, whatever the size and the machine.
    Bands,
    /// fdeflate on the calling thread.
    OneThread,
}

/// [`PngCompression::Fast`] along `path`. For tests and benchmarks; not a stable API.
#[doc(hidden)]
pub fn encode_png_fast(
    width: usize,
    height: usize,
    color: ColorType,
    pixels: &[u8],
    path: FastPath,
) -> Result<Vec<u8>, PngError> {
    let (w, h) = checked_sides(width, height, color, pixels)?;
    let threads = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    // Level 1 costs about five times fdeflate's CPU per byte: the bands win only on large images and enough cores.
    let bands = match path {
        FastPath::Auto => pixels.len() >= PARALLEL_MIN_BYTES && threads >= PARALLEL_MIN_THREADS,
        FastPath::Bands => true,
        FastPath::OneThread => false,
    };
    if !bands {
        return encode_with_png_crate(w, h, color, pixels, PngCompression::Fast);
    }
    encode_in_bands(w, h, color, pixels, threads, MAX_CHUNK)
}

/// The sides as IHDR states them, once `pixels` is known to hold `height` rows of `width` pixels.
fn checked_sides(
    width: usize,
    height: usize,
    color: ColorType,
    pixels: &[u8],
) -> Result<(u32, u32), PngError> {
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
    Ok((w, h))
}

/// The `png` crate's writer: `Compatible`, or `Fast` on one thread.
fn encode_with_png_crate(
    w: u32,
    h: u32,
    color: ColorType,
    pixels: &[u8],
    compression: PngCompression,
) -> Result<Vec<u8>, PngError> {
    let mut out = Vec::with_capacity(pixels.len() / 2 + 64);
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

/// A failure of the encoder's own deflate, as the `png` crate's encoding errors read.
fn encode_error(why: String) -> PngError {
    PngError::Encode(png::EncodingError::from(std::io::Error::other(why)))
}

/// One band of rows, filtered, deflated and checksummed by a worker.
struct Band {
    /// Raw deflate: a sync flush ends it, or the final block if it is the last band.
    deflated: Vec<u8>,
    /// CRC-32 state over `deflated`, for the IDAT chunk's CRC.
    crc: crc32fast::Hasher,
    /// Adler-32 and length of the band's filtered bytes, for the zlib stream's checksum.
    adler: u32,
    filtered_len: u64,
}

/// The parallel `Fast` writer (see the module doc), on at most `threads` threads, with IDAT chunks of at most
/// `max_chunk` bytes. The bytes depend on neither.
fn encode_in_bands(
    w: u32,
    h: u32,
    color: ColorType,
    pixels: &[u8],
    threads: usize,
    max_chunk: usize,
) -> Result<Vec<u8>, PngError> {
    let overflow = || invalid(format!("a {w}x{h} image overflows the address space"));
    let rows = usize::try_from(h).map_err(|_| overflow())?;
    let row = usize::try_from(w)
        .ok()
        .and_then(|w| w.checked_mul(color.channels()))
        .filter(|&row| row > 0 && row.checked_mul(rows) == Some(pixels.len()))
        .ok_or_else(|| {
            invalid(format!(
                "{} bytes of pixels for a {w}x{h} image",
                pixels.len()
            ))
        })?;
    let bands = band_count(rows, row).ok_or_else(overflow)?;
    let bands = deflate_bands(pixels, row, rows, bands, threads)?;
    let adler = bands.iter().fold(1, |adler, band| {
        adler32_combine(adler, band.adler, band.filtered_len)
    });
    let zlib_len = bands
        .iter()
        .try_fold(ZLIB_HEADER.len() + 4, |len, band| {
            len.checked_add(band.deflated.len())
        })
        .ok_or_else(overflow)?;
    let max_chunk = max_chunk.clamp(1, MAX_CHUNK);
    let capacity = (zlib_len / max_chunk + 1)
        .checked_mul(12)
        .and_then(|chunks| chunks.checked_add(zlib_len))
        .and_then(|n| n.checked_add(SIGNATURE.len() + 25 + 12))
        .ok_or_else(overflow)?;
    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(&SIGNATURE);
    let mut ihdr = [0u8; 13];
    ihdr[..4].copy_from_slice(&w.to_be_bytes());
    ihdr[4..8].copy_from_slice(&h.to_be_bytes());
    ihdr[8..].copy_from_slice(&[8, color.ihdr_code(), 0, 0, 0]);
    write_chunk(&mut out, b"IHDR", &ihdr)?;
    let adler = adler.to_be_bytes();
    if zlib_len <= max_chunk {
        // One IDAT, its CRC combined from the bands' (hashed on their threads) around the header and checksum.
        let mut crc = crc32fast::Hasher::new();
        crc.update(b"IDAT");
        crc.update(&ZLIB_HEADER);
        out.extend_from_slice(
            &u32::try_from(zlib_len)
                .map_err(|_| overflow())?
                .to_be_bytes(),
        );
        out.extend_from_slice(b"IDAT");
        out.extend_from_slice(&ZLIB_HEADER);
        for band in &bands {
            crc.combine(&band.crc);
            out.extend_from_slice(&band.deflated);
        }
        crc.update(&adler);
        out.extend_from_slice(&adler);
        out.extend_from_slice(&crc.finalize().to_be_bytes());
    } else {
        let mut pieces = Vec::with_capacity(bands.len() + 2);
        pieces.push(&ZLIB_HEADER[..]);
        pieces.extend(bands.iter().map(|band| &band.deflated[..]));
        pieces.push(&adler[..]);
        write_split_idat(&mut out, &pieces, zlib_len, max_chunk)?;
    }
    write_chunk(&mut out, b"IEND", &[])?;
    Ok(out)
}

/// How many bands `rows` rows of `row` bytes are cut into: about [`BAND_BYTES`] of filtered bytes each, a
/// multiple of [`BAND_MULTIPLE`], at most one per row. `None` if the filtered size overflows.
fn band_count(rows: usize, row: usize) -> Option<usize> {
    let filtered = row.checked_add(1)?.checked_mul(rows)?;
    let bands = filtered
        .div_ceil(BAND_BYTES)
        .checked_next_multiple_of(BAND_MULTIPLE)
        .unwrap_or(usize::MAX);
    Some(bands.clamp(1, rows.max(1)))
}

/// The rows `first..end` of band `band` of `bands` over `rows` rows: the first `rows % bands` bands hold one
/// row more than the others.
fn band_rows(rows: usize, bands: usize, band: usize) -> (usize, usize) {
    let (base, extra) = (rows / bands, rows % bands);
    let first = band * base + band.min(extra);
    (first, first + base + usize::from(band < extra))
}

/// Filters, checksums and deflates the `bands` bands on up to `threads` scoped threads, which take bands in
/// turn from a shared counter; returns them in order. A thread that panics or fails makes this an error.
fn deflate_bands(
    pixels: &[u8],
    row: usize,
    rows: usize,
    bands: usize,
    threads: usize,
) -> Result<Vec<Band>, PngError> {
    let next = AtomicUsize::new(0);
    let work = || -> Result<Vec<(usize, Band)>, PngError> {
        let mut done = Vec::new();
        let mut compressor = flate2::Compress::new(flate2::Compression::new(BAND_LEVEL), false);
        let mut filtered = Vec::new();
        loop {
            let band = next.fetch_add(1, Ordering::Relaxed);
            if band >= bands {
                return Ok(done);
            }
            let (first, end) = band_rows(rows, bands, band);
            let result = filter_up(pixels, row, first, end, &mut filtered)
                .and_then(|()| deflate_band(&mut compressor, &filtered, band + 1 == bands));
            match result {
                Ok(deflated) => {
                    let mut crc = crc32fast::Hasher::new();
                    crc.update(&deflated);
                    let mut adler = simd_adler32::Adler32::new();
                    adler.write(&filtered);
                    let filtered_len = u64::try_from(filtered.len())
                        .map_err(|_| invalid("a band longer than 2^64 bytes"))?;
                    done.push((
                        band,
                        Band {
                            deflated,
                            crc,
                            adler: adler.finish(),
                            filtered_len,
                        },
                    ));
                }
                Err(err) => {
                    // Leave the other bands to nobody: the file fails anyway.
                    next.store(bands, Ordering::Relaxed);
                    return Err(err);
                }
            }
        }
    };
    let finished = std::thread::scope(|scope| {
        let mut workers = Vec::new();
        for _ in 0..threads.min(bands).max(1) {
            // A thread the system refuses leaves its bands to the others (the calling thread if none starts).
            match std::thread::Builder::new()
                .name("png-deflate".into())
                .spawn_scoped(scope, work)
            {
                Ok(worker) => workers.push(worker),
                Err(_) => break,
            }
        }
        if workers.is_empty() {
            return vec![work()];
        }
        // Every thread is joined, so none of their panics reaches the scope.
        workers
            .into_iter()
            .map(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|_| Err(encode_error("a deflate thread panicked".into())))
            })
            .collect::<Vec<_>>()
    });
    let mut slots: Vec<Option<Band>> = std::iter::repeat_with(|| None).take(bands).collect();
    for done in finished {
        for (band, deflated) in done? {
            if let Some(slot) = slots.get_mut(band) {
                *slot = Some(deflated);
            }
        }
    }
    slots
        .into_iter()
        .collect::<Option<Vec<Band>>>()
        .ok_or_else(|| encode_error("a band was left undone".into()))
}

/// Appends rows `first..end` of `pixels` (rows of `row` bytes) to the cleared `out`, each as the Up filter's
/// byte then the row less the row above it (zeros above the first row), bytewise modulo 256.
fn filter_up(
    pixels: &[u8],
    row: usize,
    first: usize,
    end: usize,
    out: &mut Vec<u8>,
) -> Result<(), PngError> {
    let outside = || {
        invalid(format!(
            "rows {first}..{end} of {row} bytes lie outside the pixels"
        ))
    };
    let start = first.checked_mul(row).ok_or_else(outside)?;
    let stop = end.checked_mul(row).ok_or_else(outside)?;
    let band = pixels.get(start..stop).ok_or_else(outside)?;
    let mut above = match start.checked_sub(row) {
        Some(above) if first > 0 => Some(pixels.get(above..start).ok_or_else(outside)?),
        _ => None,
    };
    out.clear();
    out.reserve((end - first).saturating_mul(row + 1));
    for line in band.chunks_exact(row) {
        out.push(FILTER_UP);
        match above {
            Some(above) => out.extend(line.iter().zip(above).map(|(&x, &b)| x.wrapping_sub(b))),
            None => out.extend_from_slice(line),
        }
        above = Some(line);
    }
    Ok(())
}

/// Raw deflate of one band at [`BAND_LEVEL`]: ended by a sync flush (byte-aligned, not final), or by the
/// final block if `last`.
fn deflate_band(
    compressor: &mut flate2::Compress,
    data: &[u8],
    last: bool,
) -> Result<Vec<u8>, PngError> {
    let flush = if last {
        flate2::FlushCompress::Finish
    } else {
        flate2::FlushCompress::Sync
    };
    compressor.reset();
    // Room for incompressible input (stored blocks add 5 bytes per 64 KiB), so one call usually does.
    let mut out = Vec::with_capacity(data.len().saturating_add(data.len() / 64 + 256));
    loop {
        let before = (compressor.total_in(), compressor.total_out());
        let rest = usize::try_from(before.0)
            .ok()
            .and_then(|consumed| data.get(consumed..))
            .ok_or_else(|| encode_error("deflate consumed more than its input".into()))?;
        let status = compressor
            .compress_vec(rest, &mut out, flush)
            .map_err(|err| encode_error(format!("deflate: {err}")))?;
        let consumed_all = usize::try_from(compressor.total_in()) == Ok(data.len());
        let room_left = out.len() < out.capacity();
        match status {
            flate2::Status::StreamEnd if last => return Ok(out),
            // A sync flush is complete once all input is in and the output was not filled.
            _ if !last && consumed_all && room_left => return Ok(out),
            _ => {}
        }
        if before == (compressor.total_in(), compressor.total_out()) && room_left {
            return Err(encode_error(format!("deflate stopped with {status:?}")));
        }
        out.reserve(out.capacity().max(1024));
    }
}

/// The Adler-32 of a stream of bytes followed by another, from their two checksums and the second's length
/// (zlib's `adler32_combine`). Of Adler-32's two sums, `s1` is 1 plus the bytes and `s2` the sum of `s1` after
/// each byte: the second part's `s1` counts the 1 again, and each of its bytes adds the first part's bytes to
/// `s2`.
fn adler32_combine(first: u32, second: u32, second_len: u64) -> u32 {
    let (a1, a2) = (u64::from(first & 0xffff), u64::from(first >> 16));
    let (b1, b2) = (u64::from(second & 0xffff), u64::from(second >> 16));
    let n = second_len % ADLER_MOD;
    let s1 = (a1 + b1 + ADLER_MOD - 1) % ADLER_MOD;
    let s2 = (a2 + b2 + n * ((a1 + ADLER_MOD - 1) % ADLER_MOD)) % ADLER_MOD;
    ((s2 << 16) | s1) as u32
}

/// Appends a chunk: length, type, data, CRC-32 of type and data.
fn write_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) -> Result<(), PngError> {
    let len = u32::try_from(data.len())
        .ok()
        .filter(|&len| len as usize <= MAX_CHUNK)
        .ok_or_else(|| invalid(format!("a chunk of {} bytes", data.len())))?;
    out.extend_from_slice(&len.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
    Ok(())
}

/// Appends the concatenation of `pieces` (`total` bytes) as IDAT chunks of at most `max_chunk` bytes.
fn write_split_idat(
    out: &mut Vec<u8>,
    pieces: &[&[u8]],
    total: usize,
    max_chunk: usize,
) -> Result<(), PngError> {
    let mut pieces = pieces.iter().copied();
    let mut current: &[u8] = &[];
    let mut left = total;
    while left > 0 {
        let len = left.min(max_chunk);
        out.extend_from_slice(
            &u32::try_from(len)
                .map_err(|_| invalid("an IDAT over 4 GiB"))?
                .to_be_bytes(),
        );
        let start = out.len();
        out.extend_from_slice(b"IDAT");
        let mut need = len;
        while need > 0 {
            if current.is_empty() {
                current = pieces.next().ok_or_else(|| {
                    encode_error("the zlib stream is shorter than counted".into())
                })?;
            }
            let (take, rest) = current.split_at(need.min(current.len()));
            out.extend_from_slice(take);
            need -= take.len();
            current = rest;
        }
        let crc = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
        left -= len;
    }
    Ok(())
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

    /// Smooth rows (gradients with a little grain, which deflate finds matches in) or noise.
    fn picture(width: usize, height: usize, channels: usize, seed: u64, smooth: bool) -> Vec<u8> {
        let grain = noise(seed, width * height * channels);
        if !smooth {
            return grain;
        }
        (0..width * height * channels)
            .map(|j| {
                let (pixel, c) = (j / channels, j % channels);
                let (x, y) = (pixel % width, pixel / width);
                ((x * 3 + y + c * 40) / 4 + usize::from(grain[j] >> 6)) as u8
            })
            .collect()
    }

    /// The rows as the Up filter writes them, straight from the PNG specification.
    fn up_filtered(pixels: &[u8], row: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut above = vec![0u8; row];
        for line in pixels.chunks_exact(row) {
            out.push(2);
            out.extend(line.iter().zip(&above).map(|(x, b)| x.wrapping_sub(*b)));
            above = line.to_vec();
        }
        out
    }

    /// Checks a file of the parallel writer chunk by chunk (signature, IHDR, IDATs of at most `max_chunk`
    /// bytes, IEND; every CRC), inflates its zlib stream with a decoder that checks the Adler-32 (the png
    /// crate's skips it) against the Up-filtered rows, and decodes it back to `pixels`. Returns the zlib stream.
    fn check_banded_file(
        file: &[u8],
        (width, height, color): (usize, usize, ColorType),
        pixels: &[u8],
        max_chunk: usize,
    ) -> Vec<u8> {
        use std::io::Read;
        assert_eq!(&file[..8], &SIGNATURE);
        let (mut at, mut kinds, mut zlib) = (8, Vec::new(), Vec::new());
        while at < file.len() {
            let len = u32::from_be_bytes(file[at..at + 4].try_into().unwrap()) as usize;
            let body = &file[at + 4..at + 8 + len];
            let crc = u32::from_be_bytes(file[at + 8 + len..at + 12 + len].try_into().unwrap());
            assert_eq!(crc32fast::hash(body), crc);
            let (kind, data) = body.split_at(4);
            if kind == b"IDAT" {
                assert!(len <= max_chunk, "an IDAT of {len} bytes");
                zlib.extend_from_slice(data);
            }
            kinds.push(kind.to_vec());
            at += 12 + len;
        }
        assert_eq!(kinds.first().unwrap(), b"IHDR");
        assert_eq!(kinds.last().unwrap(), b"IEND");
        let expected_ihdr = ihdr(width as u32, height as u32, color.ihdr_code());
        assert_eq!(&file[16..29], &expected_ihdr[..]);
        assert_eq!(&zlib[..2], &ZLIB_HEADER);
        let mut inflated = Vec::new();
        flate2::read::ZlibDecoder::new(&zlib[..])
            .read_to_end(&mut inflated)
            .unwrap();
        assert!(inflated == up_filtered(pixels, width * color.channels()));
        let back = decode_png(file).unwrap();
        assert_eq!(
            (back.width, back.height, back.color),
            (width, height, color)
        );
        assert!(back.pixels == pixels);
        zlib
    }

    #[test]
    fn fast_mode_writes_large_images_in_bands_and_small_ones_on_one_thread() {
        let t = PARALLEL_MIN_BYTES;
        let cases = [
            (1usize, 1usize, ColorType::Gray),
            (512, 512, ColorType::Gray), // exactly the threshold
            (511, 513, ColorType::Gray), // 262143 bytes: one short
            (256, 512, ColorType::GrayAlpha),
            (362, 362, ColorType::GrayAlpha),
            (1023, 517, ColorType::Rgb),
            (1, 87_382, ColorType::Rgb),
            (256, 256, ColorType::Rgba),
            (2048, 3, ColorType::Rgba),
            (5, 70_000, ColorType::Gray),
        ];
        for (i, &(w, h, color)) in cases.iter().enumerate() {
            let pixels = picture(w, h, color.channels(), i as u64, i % 2 == 0);
            let file = encode_png(w, h, color, &pixels).unwrap();
            let banded = encode_png_fast(w, h, color, &pixels, FastPath::Bands).unwrap();
            let single = encode_png_fast(w, h, color, &pixels, FastPath::OneThread).unwrap();
            let many_cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
                >= PARALLEL_MIN_THREADS;
            let expected = if pixels.len() >= t && many_cores {
                &banded
            } else {
                &single
            };
            assert!(&file == expected, "{w}x{h} {color:?}: took the wrong path");
            check_banded_file(&banded, (w, h, color), &pixels, MAX_CHUNK);
            assert_eq!(
                decode_png(&single).unwrap().pixels,
                pixels,
                "{w}x{h} {color:?}"
            );
        }
    }

    #[test]
    fn the_banded_writer_is_deterministic() {
        // The same bytes twice, and on any number of threads: the bands come from the image alone.
        let (w, h, color) = (1024usize, 300usize, ColorType::Rgb);
        let pixels = picture(w, h, 3, 7, true);
        let file = encode_png_fast(w, h, color, &pixels, FastPath::Bands).unwrap();
        assert!(file == encode_png_fast(w, h, color, &pixels, FastPath::Bands).unwrap());
        for threads in [1, 2, 5, 16, 64] {
            let other = encode_in_bands(w as u32, h as u32, color, &pixels, threads, MAX_CHUNK);
            assert!(other.unwrap() == file, "{threads} threads");
        }
        // 300 rows of 3073 filtered bytes: 15 bands of about 64 KiB, rounded up to 16.
        assert_eq!(band_count(h, w * 3), Some(16));
    }

    #[test]
    fn bands_cover_the_rows_in_order() {
        for (rows, row) in [
            (1usize, 1usize),
            (3, 8192),
            (517, 3069),
            (70_000, 5),
            (1024, 4096),
        ] {
            let bands = band_count(rows, row).unwrap();
            assert!(bands <= rows && (bands == rows || bands.is_multiple_of(BAND_MULTIPLE)));
            let mut next = 0;
            for band in 0..bands {
                let (first, end) = band_rows(rows, bands, band);
                assert_eq!(first, next);
                assert!(end - first == rows / bands || end - first == rows / bands + 1);
                next = end;
            }
            assert_eq!(next, rows);
        }
        assert_eq!(band_count(1024, 4096), Some(80)); // 1024 x 1024 RGBA: 4 MiB in 80 bands
        assert_eq!(band_count(usize::MAX / 2, 4), None);
    }

    #[test]
    fn adler32_combines_like_one_pass() {
        fn one_pass(data: &[u8]) -> u32 {
            let mut adler = simd_adler32::Adler32::new();
            adler.write(data);
            adler.finish()
        }
        assert_eq!(one_pass(b"Wikipedia"), 0x11E6_0398);
        let data = noise(5, 200_000);
        for split in [
            0, 1, 2, 1000, 65_520, 65_521, 65_522, 131_043, 199_999, 200_000,
        ] {
            let (a, b) = data.split_at(split);
            let combined = adler32_combine(one_pass(a), one_pass(b), b.len() as u64);
            assert_eq!(combined, one_pass(&data), "split at {split}");
        }
        // Bytes of 255 drive both sums to their largest; three parts combine in either grouping.
        let ones = vec![255u8; 150_000];
        let (a, rest) = ones.split_at(70_000);
        let (b, c) = rest.split_at(33_333);
        let (ha, hb, hc) = (one_pass(a), one_pass(b), one_pass(c));
        let left = adler32_combine(adler32_combine(ha, hb, b.len() as u64), hc, c.len() as u64);
        let right = adler32_combine(ha, adler32_combine(hb, hc, c.len() as u64), 80_000);
        assert_eq!((left, right), (one_pass(&ones), one_pass(&ones)));
        assert_eq!(adler32_combine(1, ha, a.len() as u64), ha);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn the_banded_writer_round_trips(
            width in 1usize..300,
            height in 1usize..200,
            channels in 1usize..5,
            seed in any::<u64>(),
            smooth in any::<bool>(),
            threads in 1usize..6,
            max_chunk in prop_oneof![Just(MAX_CHUNK), 1usize..5000],
        ) {
            let color = ColorType::from_channels(channels).unwrap();
            let pixels = picture(width, height, channels, seed, smooth);
            let file = encode_in_bands(width as u32, height as u32, color, &pixels, threads, max_chunk)
                .unwrap();
            let zlib = check_banded_file(&file, (width, height, color), &pixels, max_chunk);
            // How the stream is cut into chunks and shared among threads leaves it the same.
            let forced = encode_png_fast(width, height, color, &pixels, FastPath::Bands).unwrap();
            prop_assert!(check_banded_file(&forced, (width, height, color), &pixels, MAX_CHUNK) == zlib);
        }
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
