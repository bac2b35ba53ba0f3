//! A dependency-free 8-bit RGBA PNG writer for the worker's outputs.
//!
//! The pixel data goes into zlib "stored" (uncompressed) deflate blocks: larger files than a compressing
//! encoder makes, but exact, fast and with nothing to go wrong. Every PNG reader accepts it.

use std::io::{self, Write};
use std::path::Path;

use super::RgbaImage;

const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];
/// Largest payload of one stored deflate block.
const STORED_BLOCK: usize = 65_535;

/// Writes `image` to `path` as an RGBA PNG (through a temporary file renamed into place, so a reader never
/// sees half a file).
pub fn write_rgba(path: &Path, image: &RgbaImage) -> io::Result<()> {
    let bytes = encode_rgba(image)?;
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let written = std::fs::File::create(&partial)
        .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_data()))
        .and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// The PNG file bytes of `image`.
pub fn encode_rgba(image: &RgbaImage) -> io::Result<Vec<u8>> {
    let width = image.width() as usize;
    let row_bytes = width * 4;
    let mut raw = Vec::with_capacity((row_bytes + 1) * image.height() as usize);
    for row in image.pixels().chunks_exact(row_bytes.max(1)) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    let mut out = Vec::with_capacity(raw.len() + raw.len() / STORED_BLOCK * 5 + 64);
    out.extend_from_slice(&SIGNATURE);
    let mut header = Vec::with_capacity(13);
    header.extend_from_slice(&image.width().to_be_bytes());
    header.extend_from_slice(&image.height().to_be_bytes());
    header.extend_from_slice(&[8, 6, 0, 0, 0]); // 8 bits, RGBA, deflate, adaptive filters, no interlace
    chunk(&mut out, b"IHDR", &header)?;
    chunk(&mut out, b"IDAT", &zlib_stored(&raw))?;
    chunk(&mut out, b"IEND", &[])?;
    Ok(out)
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) -> io::Result<()> {
    let len = u32::try_from(data.len()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the image is too large for one PNG chunk (over 4 GiB)",
        )
    })?;
    out.extend_from_slice(&len.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
    Ok(())
}

fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + data.len() / STORED_BLOCK * 5 + 11);
    out.extend_from_slice(&[0x78, 0x01]); // deflate, 32 KiB window, no dictionary; (0x7801 % 31 == 0)
    let mut blocks = data.chunks(STORED_BLOCK).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(block) = blocks.next() {
        let last = u8::from(blocks.peek().is_none());
        let len = block.len() as u16; // at most STORED_BLOCK
        out.push(last);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for block in data.chunks(5552) {
        for &byte in block {
            a += u32::from(byte);
            b += a;
        }
        a %= 65_521;
        b %= 65_521;
    }
    (b << 16) | a
}

/// Reads back a PNG this module wrote (stored blocks only): `(width, height, rgba)`. For tests and checks.
pub fn decode_stored_rgba(bytes: &[u8]) -> Result<(u32, u32, Vec<u8>), String> {
    let rest = bytes
        .strip_prefix(&SIGNATURE)
        .ok_or("not a PNG: the signature is wrong")?;
    let mut at = 0usize;
    let (mut width, mut height) = (0u32, 0u32);
    let mut idat = Vec::new();
    loop {
        let len_bytes = rest.get(at..at + 4).ok_or("truncated chunk length")?;
        let len =
            u32::from_be_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]) as usize;
        let body = rest.get(at + 4..at + 8 + len).ok_or("truncated chunk")?;
        let stored_crc = rest
            .get(at + 8 + len..at + 12 + len)
            .ok_or("truncated chunk CRC")?;
        if crc32(body).to_be_bytes() != stored_crc {
            return Err("chunk CRC mismatch".into());
        }
        let (kind, data) = body.split_at(4);
        match kind {
            b"IHDR" => {
                let field = |i: usize| -> Result<u32, String> {
                    data.get(i..i + 4)
                        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                        .ok_or_else(|| "short IHDR".to_string())
                };
                width = field(0)?;
                height = field(4)?;
                if data.get(8..10) != Some(&[8, 6]) {
                    return Err("not 8-bit RGBA".into());
                }
            }
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        at += 12 + len;
    }
    let mut raw = Vec::new();
    let mut pos = 2usize;
    loop {
        let head = idat.get(pos..pos + 5).ok_or("truncated deflate block")?;
        if head[0] & 0b110 != 0 {
            return Err("a compressed deflate block: not written by this module".into());
        }
        let len = u16::from_le_bytes([head[1], head[2]]) as usize;
        raw.extend_from_slice(
            idat.get(pos + 5..pos + 5 + len)
                .ok_or("truncated stored block")?,
        );
        pos += 5 + len;
        if head[0] & 1 == 1 {
            break;
        }
    }
    let row = width as usize * 4 + 1;
    if raw.len() != row * height as usize {
        return Err(format!("{} pixel bytes for {width}x{height}", raw.len()));
    }
    let mut rgba = Vec::with_capacity(width as usize * height as usize * 4);
    for line in raw.chunks_exact(row) {
        if line[0] != 0 {
            return Err("a filtered row: not written by this module".into());
        }
        rgba.extend_from_slice(&line[1..]);
    }
    Ok((width, height, rgba))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_and_adler_match_known_values() {
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn large_image_spans_several_stored_blocks() {
        let (w, h) = (300u32, 200u32);
        let pixels: Vec<u8> = (0..w * h * 4).map(|i| (i * 7 % 251) as u8).collect();
        let image = RgbaImage::new(w, h, pixels.clone()).unwrap();
        let bytes = encode_rgba(&image).unwrap();
        assert!(bytes.len() > pixels.len());
        assert_eq!(decode_stored_rgba(&bytes).unwrap(), (w, h, pixels));
    }

    proptest::proptest! {
        #[test]
        fn round_trips(w in 1u32..40, h in 1u32..40, seed in 0u8..255) {
            let pixels: Vec<u8> = (0..w * h * 4).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let image = RgbaImage::new(w, h, pixels.clone()).unwrap();
            let decoded = decode_stored_rgba(&encode_rgba(&image).unwrap()).unwrap();
            proptest::prop_assert_eq!(decoded, (w, h, pixels));
        }

        #[test]
        fn decoder_never_panics_on_corrupt_bytes(flip in 0usize..400, value in 0u8..255) {
            let image = RgbaImage::new(5, 4, vec![9; 80]).unwrap();
            let mut bytes = encode_rgba(&image).unwrap();
            let at = flip % bytes.len();
            bytes[at] = value;
            let _ = decode_stored_rgba(&bytes);
            bytes.truncate(at);
            let _ = decode_stored_rgba(&bytes);
        }
    }
}
