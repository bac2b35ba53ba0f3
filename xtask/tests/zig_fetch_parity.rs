//! The Zig package hash of `cargo xtask zig-hash` equals `zig fetch`'s (Zig 0.17.0) on generated trees with
//! nested folders, executables, symbolic links, empty files and folders, and `paths` filters.
//!
//! Zig comes from `$ZIG` or the pip package ziglang==0.17.0 installed into `.tools/zig` on first use (the
//! first fetch also compiles Zig's fetch tool into `.tools/zig-cache`, which takes minutes once).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use xtask::zighash;

/// A small deterministic generator (the trees must be the same on every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
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

fn write(path: &Path, bytes: &[u8], executable: bool) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
    let mode = if executable { 0o755 } else { 0o644 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Builds tree `index` under `dir`; returns a description for failure messages.
fn generate(dir: &Path, index: u64) -> String {
    let mut rng = Rng(index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDEAD_BEEF);
    let name = format!("pkg{index}");
    let version = match index % 3 {
        0 => format!("0.{index}.1"),
        1 => format!("1.0.{index}-rc.1"),
        _ => "2.17.0".to_string(),
    };
    // Sibling names chosen to exercise bytewise sorting: '-' < '.' < '/' < '0' < 'A' < '_' < 'a'.
    let names = [
        "a",
        "a-b",
        "a.b",
        "a0",
        "B",
        "_x",
        "src",
        "lib",
        "deep",
        "empty.txt",
        "run.sh",
        "tool",
    ];
    let mut files: Vec<String> = Vec::new();
    let count = 3 + rng.below(25);
    for _ in 0..count {
        let depth = rng.below(4);
        let mut parts: Vec<String> = (0..depth)
            .map(|_| names[rng.below(names.len() as u64) as usize].to_string())
            .collect();
        parts.push(format!(
            "{}{}",
            names[rng.below(names.len() as u64) as usize],
            rng.below(3)
        ));
        let path = parts.join("/");
        if files.iter().any(|f| {
            f.starts_with(&format!("{path}/")) || path.starts_with(&format!("{f}/")) || *f == path
        }) {
            continue;
        }
        let size = match rng.below(5) {
            0 => 0,
            1 => rng.below(16),
            2 => 8000 + rng.below(9000),
            _ => rng.below(3000),
        };
        let mut bytes: Vec<u8> = (0..size).map(|_| rng.next() as u8).collect();
        let kind = rng.below(6);
        if kind == 0 && bytes.len() >= 2 {
            bytes[..2].copy_from_slice(b"#!");
        } else if kind == 1 && bytes.len() >= 4 {
            bytes[..4].copy_from_slice(b"\x7fELF");
        }
        write(&dir.join(&path), &bytes, kind <= 2);
        files.push(path);
    }
    for links in 0..rng.below(4) {
        let link = format!("link{links}");
        let target = match rng.below(3) {
            0 => files[rng.below(files.len() as u64) as usize].clone(),
            1 => "src".to_string(),
            _ => "does/not/exist".to_string(),
        };
        symlink(&target, dir.join(&link)).unwrap();
        files.push(link);
    }
    if rng.below(2) == 0 {
        std::fs::create_dir_all(dir.join("empty_dir/inner")).unwrap();
    }
    if index.is_multiple_of(5) {
        write(&dir.join(".git/HEAD"), b"ref: refs/heads/main\n", false);
    }
    let paths: Vec<String> = match index % 4 {
        0 => vec![String::new()],
        1 => vec![".".to_string()],
        _ => {
            let mut chosen: Vec<String> = Vec::new();
            for f in &files {
                if rng.below(2) == 0 {
                    continue;
                }
                // Sometimes list the parent folder instead of the file.
                match (rng.below(2), f.rsplit_once('/')) {
                    (0, Some((parent, _))) => chosen.push(parent.to_string()),
                    _ => chosen.push(f.clone()),
                }
            }
            chosen.push("not/there".to_string());
            if index % 8 == 2 {
                chosen.push("build.zig.zon".to_string());
            }
            chosen.sort();
            chosen.dedup();
            chosen
        }
    };
    let fingerprint = (u64::from(crc32(name.as_bytes())) << 32) | (rng.next() & 0xffff_ffff);
    let listed: Vec<String> = paths.iter().map(|p| format!("\"{p}\"")).collect();
    let zon = format!(
        ".{{\n    .name = .{name},\n    .version = \"{version}\",\n    .fingerprint = 0x{fingerprint:x},\n    .minimum_zig_version = \"0.17.0\",\n    .dependencies = .{{}},\n    // generated tree {index}\n    .paths = .{{ {} }},\n}}\n",
        listed.join(", ")
    );
    write(&dir.join("build.zig.zon"), zon.as_bytes(), false);
    format!(
        "tree {index}: {} entries, paths {:?}",
        files.len() + 1,
        paths
    )
}

fn zig_fetch(root: &Path, dir: &Path) -> Result<String, String> {
    let mut command = xtask::toolchain::zig(root).map_err(|e| e.to_string())?;
    let output = command
        .arg("fetch")
        .arg(dir)
        .output()
        .map_err(|e| format!("cannot run zig: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "zig fetch failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xtask-zig-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn zig_hash_equals_zig_fetch_on_generated_trees() {
    let root = xtask::paths::repo_root().unwrap();
    let base = scratch("trees");
    let mut mismatches = Vec::new();
    let trees = 24;
    for index in 0..trees {
        let dir = base.join(format!("t{index}"));
        let description = generate(&dir, index);
        let ours = zighash::package_hash(&dir)
            .map(|h| h.text)
            .map_err(|e| e.to_string());
        let theirs = zig_fetch(&root, &dir);
        println!("{description}\n  zig fetch: {theirs:?}\n  zig-hash:  {ours:?}");
        match (&ours, &theirs) {
            (Ok(a), Ok(b)) if a == b => {}
            _ => mismatches.push(format!(
                "{description}: zig fetch {theirs:?}, zig-hash {ours:?}"
            )),
        }
    }
    let _ = std::fs::remove_dir_all(&base);
    assert!(
        mismatches.is_empty(),
        "{} of {trees} trees differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn a_missing_paths_field_is_refused_like_zig_fetch() {
    let root = xtask::paths::repo_root().unwrap();
    let dir = scratch("nopaths");
    let fingerprint = (u64::from(crc32(b"nopaths")) << 32) | 7;
    let zon = format!(
        ".{{ .name = .nopaths, .version = \"1.0.0\", .fingerprint = 0x{fingerprint:x} }}\n"
    );
    write(&dir.join("build.zig.zon"), zon.as_bytes(), false);
    write(&dir.join("a.txt"), b"a", false);
    let ours = zighash::package_hash(&dir);
    let theirs = zig_fetch(&root, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        theirs.is_err(),
        "zig fetch accepted a package without .paths: {theirs:?}"
    );
    let message = ours
        .expect_err("zig-hash accepted a package without .paths")
        .to_string();
    assert!(message.contains(".paths"), "{message}");
}

#[test]
fn content_change_changes_the_hash() {
    let dir = scratch("change");
    generate(&dir, 4);
    let before = zighash::package_hash(&dir).unwrap();
    write(&dir.join("extra.txt"), b"x", false);
    let after = zighash::package_hash(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(before.text, after.text);
}
