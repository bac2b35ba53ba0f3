//! The host "kernels" a fake module image can list, and the fake module image format.

use std::ffi::CStr;

use tf_sys::types::{code, CUresult};

/// One built-in kernel: its name and the byte size of each parameter, in order.
pub struct KernelSpec {
    pub name: &'static str,
    pub c_name: &'static CStr,
    pub param_sizes: &'static [usize],
}

/// The built-in kernels (see the crate doc for what each does).
pub const KERNELS: &[KernelSpec] = &[
    KernelSpec {
        name: "fill_u32",
        c_name: c"fill_u32",
        param_sizes: &[8, 4, 8],
    },
    KernelSpec {
        name: "add_f32",
        c_name: c"add_f32",
        param_sizes: &[8, 8, 8, 8],
    },
    KernelSpec {
        name: "scale_f32",
        c_name: c"scale_f32",
        param_sizes: &[8, 4, 8],
    },
    KernelSpec {
        name: "write_oob",
        c_name: c"write_oob",
        param_sizes: &[8],
    },
    KernelSpec {
        name: "trap",
        c_name: c"trap",
        param_sizes: &[],
    },
];

/// Names of the built-in kernels.
pub fn kernel_names() -> impl Iterator<Item = &'static str> {
    KERNELS.iter().map(|k| k.name)
}

/// Index of a kernel by name.
pub fn kernel_index(name: &str) -> Option<usize> {
    KERNELS.iter().position(|k| k.name == name)
}

/// Offset of parameter `index` in the C layout of the kernel's parameter list (each parameter
/// aligned to its own size).
pub fn param_offset(spec: &KernelSpec, index: usize) -> Option<usize> {
    let mut offset = 0usize;
    for (i, size) in spec.param_sizes.iter().enumerate() {
        offset = offset.next_multiple_of(*size);
        if i == index {
            return Some(offset);
        }
        offset += size;
    }
    None
}

/// First line of every fake module image.
pub const MODULE_MAGIC: &str = "TFTD-MODULE 1";

/// A fake module image listing `kernels` (NUL-terminated, ready for `cuModuleLoadData`).
pub fn module_image(kernels: &[&str]) -> Vec<u8> {
    module_image_with(kernels, &[], None)
}

/// A fake module image with kernels, module globals (`name`, bytes) and, optionally, a JIT error:
/// loading an image with a JIT error fails with `CUDA_ERROR_INVALID_PTX` (218) and writes the text
/// into the error log buffer passed to `cuModuleLoadDataEx`.
pub fn module_image_with(
    kernels: &[&str],
    globals: &[(&str, usize)],
    jit_error: Option<&str>,
) -> Vec<u8> {
    let mut text = format!("{MODULE_MAGIC}\n");
    for k in kernels {
        text.push_str(&format!("kernel {k}\n"));
    }
    for (name, bytes) in globals {
        text.push_str(&format!("global {name} {bytes}\n"));
    }
    if let Some(message) = jit_error {
        text.push_str(&format!("jit-error {}\n", message.replace('\n', " ")));
    }
    let mut bytes = text.into_bytes();
    bytes.retain(|b| *b != 0);
    bytes.push(0);
    bytes
}

/// What a parsed image declares.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ParsedImage {
    pub kernels: Vec<usize>,
    pub globals: Vec<(String, usize)>,
    pub jit_error: Option<String>,
}

/// Parses image text (without the NUL). Anything malformed is `CUDA_ERROR_INVALID_IMAGE`.
pub(crate) fn parse_image(text: &str) -> Result<ParsedImage, CUresult> {
    let mut lines = text.lines();
    if lines.next().map(str::trim_end) != Some(MODULE_MAGIC) {
        return Err(code::INVALID_IMAGE);
    }
    let mut parsed = ParsedImage::default();
    for line in lines {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (directive, rest) = line.split_once(' ').unwrap_or((line, ""));
        match directive {
            "kernel" => {
                let index = kernel_index(rest.trim()).ok_or(code::INVALID_IMAGE)?;
                if !parsed.kernels.contains(&index) {
                    parsed.kernels.push(index);
                }
            }
            "global" => {
                let mut parts = rest.split_whitespace();
                let name = parts.next().ok_or(code::INVALID_IMAGE)?;
                let bytes: usize = parts
                    .next()
                    .and_then(|b| b.parse().ok())
                    .filter(|b| *b > 0 && *b <= 1 << 30)
                    .ok_or(code::INVALID_IMAGE)?;
                parsed.globals.push((name.to_string(), bytes));
            }
            "jit-error" => parsed.jit_error = Some(rest.trim().to_string()),
            _ => return Err(code::INVALID_IMAGE),
        }
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_round_trips() {
        let image = module_image_with(&["fill_u32", "add_f32"], &[("step", 16)], Some("boom"));
        assert_eq!(image.last(), Some(&0));
        let text = std::str::from_utf8(&image[..image.len() - 1]).unwrap();
        let parsed = parse_image(text).unwrap();
        assert_eq!(parsed.kernels, vec![0, 1]);
        assert_eq!(parsed.globals, vec![("step".to_string(), 16)]);
        assert_eq!(parsed.jit_error.as_deref(), Some("boom"));
    }

    #[test]
    fn malformed_images_are_invalid() {
        assert_eq!(parse_image("garbage"), Err(code::INVALID_IMAGE));
        assert_eq!(
            parse_image("TFTD-MODULE 1\nkernel nope\n"),
            Err(code::INVALID_IMAGE)
        );
        assert_eq!(
            parse_image("TFTD-MODULE 1\nglobal x 0\n"),
            Err(code::INVALID_IMAGE)
        );
        assert_eq!(
            parse_image("TFTD-MODULE 1\nbogus\n"),
            Err(code::INVALID_IMAGE)
        );
    }

    #[test]
    fn param_offsets_follow_c_alignment() {
        let fill = &KERNELS[0];
        assert_eq!(param_offset(fill, 0), Some(0));
        assert_eq!(param_offset(fill, 1), Some(8));
        assert_eq!(param_offset(fill, 2), Some(16));
        assert_eq!(param_offset(fill, 3), None);
    }
}
