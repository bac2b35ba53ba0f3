//! The Zig package hash of a directory, as `zig fetch` (Zig 0.14 and later, checked against 0.17.0)
//! computes it.
//!
//! Algorithm:
//! 1. Walk the tree; keep regular files and symbolic links (directories only as containers, so empty
//!    folders do not count), with `/`-separated paths relative to the root, filtered by build.zig.zon's
//!    `paths` (a path is kept when it or one of its parent folders is listed; `""` or `"."` keeps all).
//! 2. Per entry: sha256 of the path, then for a file the two bytes `0, 0` (Zig hard-codes the executable
//!    bit as false) and the content; for a link, the link target text.
//! 3. Sort entries by path (bytewise) and take sha256 of the concatenated per-entry digests.
//! 4. Format `name-version-` + base64url (no padding) of: the fingerprint's low 32 bits (little endian),
//!    the total size of the kept files' contents as u32 (little endian, saturating), and the first 25
//!    bytes of the digest.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::util::read_text;
use crate::zon::{self, Value};
use crate::Error;

/// Digest bytes kept in the textual hash.
pub const DIGEST_BYTES_KEPT: usize = 25;

/// What build.zig.zon says that the hash depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackageInfo {
    pub name: String,
    pub version: String,
    pub fingerprint: u64,
    /// Empty means every file.
    pub paths: Vec<String>,
}

/// A computed package hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackageHash {
    /// `name-version-base64url`.
    pub text: String,
    /// The full sha256 over the sorted entries.
    pub digest: [u8; 32],
    /// Bytes of file content hashed.
    pub total_size: u64,
    /// Hashed entries: path and whether it is a link.
    pub entries: Vec<(String, bool)>,
}

/// Reads name, version, fingerprint and paths from `dir/build.zig.zon`.
pub fn package_info(dir: &Path) -> Result<PackageInfo, Error> {
    let path = dir.join("build.zig.zon");
    let text = read_text(&path)?;
    let value = zon::parse(&text).map_err(|e| Error::config(&path, e))?;
    let name = match value.field("name") {
        Some(Value::EnumLiteral(name)) | Some(Value::String(name)) => name.clone(),
        _ => {
            return Err(Error::config(
                &path,
                "no .name (an enum literal such as .tensorfold)",
            ))
        }
    };
    let version = match value.field("version") {
        Some(Value::String(version)) => version.clone(),
        _ => return Err(Error::config(&path, "no .version string")),
    };
    let fingerprint = match value.field("fingerprint") {
        Some(Value::Number(number)) => parse_u64(number)
            .ok_or_else(|| Error::config(&path, format!(".fingerprint {number} is not a u64")))?,
        _ => {
            return Err(Error::config(
                &path,
                "no .fingerprint: Zig 0.14+ package hashes need one",
            ))
        }
    };
    let paths = match value.field("paths") {
        None => {
            return Err(Error::config(
                &path,
                "no .paths: zig fetch requires the field (use .{\"\"} for everything)",
            ))
        }
        Some(Value::Tuple(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(p) => Ok(p.clone()),
                other => Err(Error::config(
                    &path,
                    format!(".paths item {other:?} is not a string"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Struct(fields)) if fields.is_empty() => Vec::new(),
        Some(other) => {
            return Err(Error::config(
                &path,
                format!(".paths is {other:?}, not a list"),
            ))
        }
    };
    Ok(PackageInfo {
        name,
        version,
        fingerprint,
        paths,
    })
}

fn parse_u64(text: &str) -> Option<u64> {
    let clean = text.replace('_', "");
    match clean.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => clean.parse().ok(),
    }
}

/// Whether `path` is kept by the `paths` filter.
pub fn included(paths: &[String], path: &str) -> bool {
    if paths.is_empty() || paths.iter().any(|p| p.is_empty() || p == "." || p == path) {
        return true;
    }
    let mut current = path;
    while let Some(slash) = current.rfind('/') {
        current = &current[..slash];
        if paths.iter().any(|p| p == current) {
            return true;
        }
    }
    false
}

enum Kind {
    File(PathBuf),
    Link(PathBuf),
}

fn walk(root: &Path, relative: &str, out: &mut Vec<(String, Kind)>) -> Result<(), Error> {
    let dir = if relative.is_empty() {
        root.to_path_buf()
    } else {
        root.join(relative)
    };
    let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("listing", &dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", &dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(Error::config(
                entry.path(),
                "file name is not UTF-8 (Zig package paths must be)",
            ));
        };
        let path = if relative.is_empty() {
            name.to_string()
        } else {
            format!("{relative}/{name}")
        };
        let kind = entry
            .file_type()
            .map_err(|e| Error::io("reading the type of", entry.path(), e))?;
        if kind.is_dir() {
            walk(root, &path, out)?;
        } else if kind.is_symlink() {
            out.push((path, Kind::Link(entry.path())));
        } else if kind.is_file() {
            out.push((path, Kind::File(entry.path())));
        } else {
            return Err(Error::config(
                entry.path(),
                "neither a file, a folder nor a symbolic link; zig fetch refuses such entries",
            ));
        }
    }
    Ok(())
}

/// Base64 with the URL-safe alphabet and no padding.
pub fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut text = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b0 = u32::from(chunk[0]);
        let b1 = u32::from(chunk.get(1).copied().unwrap_or(0));
        let b2 = u32::from(chunk.get(2).copied().unwrap_or(0));
        let n = (b0 << 16) | (b1 << 8) | b2;
        let sextets = [(n >> 18) & 63, (n >> 12) & 63, (n >> 6) & 63, n & 63];
        for sextet in &sextets[..chunk.len() + 1] {
            text.push(char::from(ALPHABET[*sextet as usize]));
        }
    }
    text
}

/// Decodes URL-safe base64 without padding; None on a bad character or length.
pub fn base64url_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => return None,
        } as u32)
    };
    if text.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.as_bytes().chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c)? << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    Some(out)
}

/// Formats the textual hash from its parts.
pub fn format_hash(
    name: &str,
    version: &str,
    fingerprint: u64,
    total_size: u64,
    digest: &[u8; 32],
) -> String {
    let mut binary = Vec::with_capacity(8 + DIGEST_BYTES_KEPT);
    binary.extend_from_slice(&(fingerprint as u32).to_le_bytes());
    binary.extend_from_slice(&u32::try_from(total_size).unwrap_or(u32::MAX).to_le_bytes());
    binary.extend_from_slice(&digest[..DIGEST_BYTES_KEPT]);
    format!("{name}-{version}-{}", base64url(&binary))
}

/// The parts of a textual hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedHash {
    pub name: String,
    pub version: String,
    /// Low 32 bits of the package fingerprint.
    pub id: u32,
    pub size: u32,
    pub digest_prefix: Vec<u8>,
}

/// Splits `name-version-base64url` (the name cannot contain `-`, the version may).
pub fn parse_hash(text: &str) -> Result<ParsedHash, String> {
    // The encoded part has a fixed length and may itself contain '-'; the name cannot.
    let encoded_len = (8 + DIGEST_BYTES_KEPT).div_ceil(3) * 4;
    let split = text
        .len()
        .checked_sub(encoded_len + 1)
        .filter(|&at| text.is_char_boundary(at) && text.as_bytes()[at] == b'-')
        .ok_or_else(|| {
            format!("{text:?} is not name-version-hash (hash part of {encoded_len} characters)")
        })?;
    let (name_version, encoded) = (&text[..split], &text[split + 1..]);
    let (name, version) = name_version
        .split_once('-')
        .ok_or_else(|| format!("{text:?} is not name-version-hash"))?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(format!(
            "{text:?}: package name {name:?} is not a Zig identifier"
        ));
    }
    if version.is_empty() {
        return Err(format!("{text:?}: empty version"));
    }
    let binary = base64url_decode(encoded)
        .ok_or_else(|| format!("{text:?}: {encoded:?} is not base64url"))?;
    if binary.len() != 8 + DIGEST_BYTES_KEPT {
        return Err(format!(
            "{text:?}: the hash part decodes to {} bytes, expected {}",
            binary.len(),
            8 + DIGEST_BYTES_KEPT
        ));
    }
    let word = |at: usize| {
        u32::from_le_bytes([binary[at], binary[at + 1], binary[at + 2], binary[at + 3]])
    };
    Ok(ParsedHash {
        name: name.to_string(),
        version: version.to_string(),
        id: word(0),
        size: word(4),
        digest_prefix: binary[8..].to_vec(),
    })
}

/// Computes the package hash of `dir` with the name, version, fingerprint and paths of its build.zig.zon.
pub fn package_hash(dir: &Path) -> Result<PackageHash, Error> {
    let info = package_info(dir)?;
    hash_tree(dir, &info)
}

/// Computes the package hash of `dir` for the given package info.
pub fn hash_tree(dir: &Path, info: &PackageInfo) -> Result<PackageHash, Error> {
    let mut found = Vec::new();
    walk(dir, "", &mut found)?;
    found.retain(|(path, _)| included(&info.paths, path));
    found.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut combined = Sha256::new();
    let mut total_size = 0u64;
    let mut entries = Vec::with_capacity(found.len());
    for (path, kind) in &found {
        let mut hasher = Sha256::new();
        hasher.update(path.as_bytes());
        match kind {
            Kind::File(full) => {
                let bytes = std::fs::read(full).map_err(|e| Error::io("reading", full, e))?;
                hasher.update([0u8, 0u8]);
                hasher.update(&bytes);
                total_size += bytes.len() as u64;
                entries.push((path.clone(), false));
            }
            Kind::Link(full) => {
                let target =
                    std::fs::read_link(full).map_err(|e| Error::io("reading the link", full, e))?;
                let target = target.to_string_lossy().replace('\\', "/");
                hasher.update(target.as_bytes());
                entries.push((path.clone(), true));
            }
        }
        combined.update(hasher.finalize());
    }
    let digest: [u8; 32] = combined.finalize().into();
    Ok(PackageHash {
        text: format_hash(
            &info.name,
            &info.version,
            info.fingerprint,
            total_size,
            &digest,
        ),
        digest,
        total_size,
        entries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_spec_hashes_parse_and_share_the_package_id() {
        let current =
            parse_hash("tensorfold-1.1.4-CphTLduviwLsoiZR_ltHyW5xZtYz0ZnoMMJIxn1J6X13").unwrap();
        let previous =
            parse_hash("tensorfold-1.0.7-CphTLULywQAUe2LxgT29-AserW8gMmK9C-ltOxIaw1pG").unwrap();
        assert_eq!(current.name, "tensorfold");
        assert_eq!(current.version, "1.1.4");
        assert_eq!(previous.version, "1.0.7");
        // The fingerprint 0xb6dc5a482d53980a of TensorFold's build.zig.zon: low word is the id.
        assert_eq!(current.id, 0x2d53980a);
        assert_eq!(previous.id, current.id);
    }

    #[test]
    fn filter_keeps_listed_files_and_folders() {
        let paths = vec!["build.zig".to_string(), "zig/src".to_string()];
        assert!(included(&paths, "build.zig"));
        assert!(included(&paths, "zig/src/cuda/driver.zig"));
        assert!(!included(&paths, "zig/srcx/a.zig"));
        assert!(!included(&paths, "README.md"));
        assert!(included(&[], "anything"));
        assert!(included(&["".to_string()], "anything"));
    }

    proptest! {
        #[test]
        fn base64url_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let text = base64url(&bytes);
            prop_assert!(!text.contains('=') && !text.contains('+') && !text.contains('/'));
            prop_assert_eq!(base64url_decode(&text), Some(bytes));
        }

        #[test]
        fn formatted_hashes_parse_back(id in any::<u32>(), size in 0u64..10_000_000, seed in any::<u8>()) {
            let digest = [seed; 32];
            let text = format_hash("pkg_x", "1.2.3-rc.1", u64::from(id) | (7u64 << 32), size, &digest);
            let parsed = parse_hash(&text).unwrap();
            prop_assert_eq!(parsed.id, id);
            prop_assert_eq!(u64::from(parsed.size), size);
            prop_assert_eq!(parsed.version, "1.2.3-rc.1");
            prop_assert_eq!(parsed.digest_prefix, digest[..DIGEST_BYTES_KEPT].to_vec());
        }
    }
}
