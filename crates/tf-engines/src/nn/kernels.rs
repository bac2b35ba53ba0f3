//! Kernel images built by `cargo xtask kernels` and embedded at compile time.
//!
//! Each kernel set of `kernels/kernels.toml` is one fatbin (SASS for the set's targets plus PTX for forward
//! compatibility), 16-byte aligned so it can be handed to `cuModuleLoadData` as is. A build made before
//! `cargo xtask kernels` has no sets: every lookup then fails with [`KernelsMissing`], whose message says
//! how to fix it. Nothing here touches the GPU.
//!
//! ```
//! match tf_engines::nn::kernels::image("smoke") {
//!     Ok(fatbin) => assert!(!fatbin.is_empty()),
//!     Err(missing) => eprintln!("{missing}"), // "... run `cargo xtask kernels` ..."
//! }
//! ```

/// One embedded kernel set, with what the build recorded about it.
#[derive(Debug)]
pub struct KernelSet {
    /// The set's name in kernels/kernels.toml.
    pub name: &'static str,
    /// The fatbin (16-byte aligned).
    pub image: &'static [u8],
    /// sha256 of `image`, hex.
    pub sha256: &'static str,
    /// SASS targets, e.g. `sm_90a`.
    pub targets: &'static [&'static str],
    /// The virtual architecture whose PTX is embedded, if any.
    pub ptx: Option<&'static str>,
    /// Kernels (symbol or `prefix*`) that must not spill.
    pub hot: &'static [&'static str],
    /// Tensor-core kernels and their SASS family on sm_90a.
    pub tensor_core: &'static [(&'static str, &'static str)],
}

impl KernelSet {
    /// Whether this set carries SASS for `sm_XX` / `sm_XXa` of the given compute capability.
    pub fn has_sass_for(&self, major: u32, minor: u32) -> bool {
        let plain = format!("sm_{major}{minor}");
        let specific = format!("{plain}a");
        self.targets.iter().any(|t| *t == plain || *t == specific)
    }
}

/// A kernel set that is not embedded in this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelsMissing {
    /// No kernel set at all: tf-engines was compiled before the kernels were built.
    #[error(
        "kernel set `{set}` is not embedded: this build has no kernels; run `cargo xtask kernels`, then rebuild"
    )]
    NotBuilt { set: String },
    /// Some sets are embedded, but not this one.
    #[error(
        "kernel set `{set}` is not embedded (this build has: {available}); check its name in kernels/kernels.toml, run `cargo xtask kernels`, then rebuild"
    )]
    UnknownSet { set: String, available: String },
}

#[repr(C, align(16))]
struct Aligned<T: ?Sized>(T);

include!(concat!(env!("OUT_DIR"), "/kernels_embedded.rs"));

/// Every embedded set, in kernels.toml order (empty before `cargo xtask kernels`).
pub fn sets() -> &'static [KernelSet] {
    SETS
}

/// The embedded set named `name`.
pub fn set(name: &str) -> Result<&'static KernelSet, KernelsMissing> {
    if let Some(found) = SETS.iter().find(|s| s.name == name) {
        return Ok(found);
    }
    if SETS.is_empty() {
        return Err(KernelsMissing::NotBuilt {
            set: name.to_string(),
        });
    }
    let available: Vec<&str> = SETS.iter().map(|s| s.name).collect();
    Err(KernelsMissing::UnknownSet {
        set: name.to_string(),
        available: available.join(", "),
    })
}

/// The fatbin of the set named `name`, ready for `cuModuleLoadData`.
pub fn image(name: &str) -> Result<&'static [u8], KernelsMissing> {
    set(name).map(|s| s.image)
}

/// The build manifest (`manifest.json`: nvcc version, flags, input digests), when kernels are embedded.
pub fn manifest_json() -> Option<&'static str> {
    MANIFEST_JSON
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_set_error_says_how_to_fix_it() {
        let err = set("no_such_set_anywhere").unwrap_err();
        assert!(err.to_string().contains("cargo xtask kernels"), "{err}");
        assert!(err.to_string().contains("no_such_set_anywhere"), "{err}");
    }

    /// The set names `kernels/kernels.toml` declares.
    fn declared_sets() -> Vec<String> {
        let toml = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../kernels/kernels.toml"
        ));
        toml.split("[[set]]")
            .skip(1)
            .filter_map(|block| {
                let line = block.lines().find(|l| l.trim_start().starts_with("name"))?;
                Some(line.split('"').nth(1)?.to_string())
            })
            .collect()
    }

    #[test]
    fn embedded_images_are_aligned_and_named_uniquely() {
        if !KERNELS_TABLE_FOUND {
            // Visible, not a silent pass: this build was made before `cargo xtask kernels`.
            println!("SKIPPED: no kernels were built for this build (run `cargo xtask kernels`, then rebuild)");
            assert!(sets().is_empty());
            return;
        }
        let declared = declared_sets();
        assert!(!declared.is_empty(), "kernels/kernels.toml declares no set");
        for name in &declared {
            assert!(
                set(name).is_ok(),
                "kernel set {name} of kernels.toml is not embedded: rerun `cargo xtask kernels`, then rebuild"
            );
        }
        assert!(manifest_json().is_some());
        for (i, s) in sets().iter().enumerate() {
            assert_eq!(
                s.image.as_ptr() as usize % 16,
                0,
                "{} is not 16-byte aligned",
                s.name
            );
            assert!(!s.image.is_empty(), "{} is empty", s.name);
            assert!(s.targets.contains(&"sm_90a"), "{} lacks sm_90a", s.name);
            assert!(sets()[..i].iter().all(|o| o.name != s.name));
            assert!(manifest_json().is_some());
            assert_eq!(image(s.name).map(|b| b.len()), Ok(s.image.len()));
        }
    }

    #[test]
    fn sass_lookup_accepts_plain_and_arch_specific_targets() {
        let s = KernelSet {
            name: "t",
            image: &[],
            sha256: "",
            targets: &["sm_80", "sm_90a"],
            ptx: None,
            hot: &[],
            tensor_core: &[],
        };
        assert!(s.has_sass_for(9, 0));
        assert!(s.has_sass_for(8, 0));
        assert!(!s.has_sass_for(12, 0));
    }
}
