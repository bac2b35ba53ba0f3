//! Small helpers: hashing, file I/O with context, running commands.

use std::path::Path;
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

use crate::Error;

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
    text
}

/// sha256 of `bytes`, as lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// sha256 of a file's content, as lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String, Error> {
    Ok(sha256_hex(&read(path)?))
}

/// Reads a file, naming it on failure.
pub fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| Error::io("reading", path, e))
}

/// Reads a UTF-8 file, naming it on failure.
pub fn read_text(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))
}

/// Writes a file through a temporary sibling and a rename, so readers never see half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("creating", parent, e))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io("writing", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("renaming into place", path, e))
}

/// A command line as text, for messages.
pub fn describe(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Runs `command`, capturing output; fails (with the output) unless it exits 0.
pub fn run_captured(command: &mut Command) -> Result<Output, Error> {
    let output = command.output().map_err(|e| Error::CommandFailed {
        command: describe(command),
        status: "could not start".to_string(),
        output: e.to_string(),
    })?;
    if output.status.success() {
        return Ok(output);
    }
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    Err(Error::CommandFailed {
        command: describe(command),
        status: output.status.to_string(),
        output: text,
    })
}

/// Runs `command` with inherited output; fails unless it exits 0.
pub fn run_inherited(command: &mut Command) -> Result<(), Error> {
    let status = command.status().map_err(|e| Error::CommandFailed {
        command: describe(command),
        status: "could not start".to_string(),
        output: e.to_string(),
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::CommandFailed {
            command: describe(command),
            status: status.to_string(),
            output: "(output above)".to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_abc_is_the_standard_vector() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn hex_encodes_every_nibble() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
    }
}
