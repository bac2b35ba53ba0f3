//! `cargo xtask kernels` rebuilds a set only when its inputs change (content, not mtime): sources, included
//! headers, flags, nvcc version. nvcc is replaced by a script (`$NVCC`) that concatenates the source and
//! its header into the "fatbin" and writes a dependency file, so this runs without CUDA.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use xtask::kernels::{build, BuildOptions, Outcome};

const FAKE_NVCC: &str = r#"#!/bin/sh
if [ "$1" = "--version" ]; then cat "$(dirname "$0")/version"; exit 0; fi
out=""; dep=""; src=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -MF) dep="$2"; shift ;;
    -I) shift ;;
    *.cu) src="$1" ;;
  esac
  shift
done
dir="$(dirname "$src")"
cat "$src" "$dir/common.cuh" > "$out"
printf '%s : %s \\\n    %s \\\n    /usr/include/stdio.h\n' "$out" "$src" "$dir/common.cuh" > "$dep"
"#;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn outcomes(root: &Path, out: &Path) -> Vec<(String, bool)> {
    let (_, done) = build(root, out, &BuildOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let mut done: Vec<(String, bool)> = done
        .into_iter()
        .map(|(name, outcome)| (name, matches!(outcome, Outcome::Built { .. })))
        .collect();
    done.sort();
    done
}

#[test]
fn only_changed_sets_are_rebuilt() {
    let root = std::env::temp_dir().join(format!("xtask-kernels-inc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let tools = root.join("fake-cuda");
    write(&tools.join("nvcc"), FAKE_NVCC);
    std::fs::set_permissions(tools.join("nvcc"), std::fs::Permissions::from_mode(0o755)).unwrap();
    write(&tools.join("version"), "fake nvcc 1\n");
    std::env::set_var("NVCC", tools.join("nvcc"));

    let config = |flags: &str| {
        format!(
            "[defaults]\nflags = [{flags}]\ntargets = [\"sm_90a\"]\nptx = \"compute_90\"\n\
             [[set]]\nname = \"one\"\nsource = \"one/one.cu\"\n[[set]]\nname = \"two\"\nsource = \"two/two.cu\"\n"
        )
    };
    write(&root.join("kernels/kernels.toml"), &config("\"-O3\""));
    for set in ["one", "two"] {
        write(
            &root.join(format!("kernels/{set}/{set}.cu")),
            &format!("// {set}\n"),
        );
        write(
            &root.join(format!("kernels/{set}/common.cuh")),
            "// header\n",
        );
    }
    let out = root.join("out");
    let all_built = vec![("one".to_string(), true), ("two".to_string(), true)];
    let none_built = vec![("one".to_string(), false), ("two".to_string(), false)];

    assert_eq!(outcomes(&root, &out), all_built, "first build");
    assert_eq!(outcomes(&root, &out), none_built, "nothing changed");

    // Same content rewritten (new mtime): still up to date.
    write(&root.join("kernels/one/one.cu"), "// one\n");
    assert_eq!(outcomes(&root, &out), none_built, "mtime only");

    // An included header changes: only its set rebuilds, and the fatbin follows.
    write(&root.join("kernels/two/common.cuh"), "// header v2\n");
    let done = outcomes(&root, &out);
    assert_eq!(
        done,
        vec![("one".to_string(), false), ("two".to_string(), true)],
        "header"
    );
    let fatbin = std::fs::read_to_string(out.join("two.fatbin")).unwrap();
    assert!(fatbin.contains("header v2"), "{fatbin}");
    let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(
        manifest.contains("kernels/two/common.cuh"),
        "headers are recorded: {manifest}"
    );
    assert!(
        !manifest.contains("stdio.h"),
        "system headers are not: {manifest}"
    );

    // Flags and the nvcc version are part of every key.
    write(&root.join("kernels/kernels.toml"), &config("\"-O2\""));
    assert_eq!(outcomes(&root, &out), all_built, "flags");
    write(&tools.join("version"), "fake nvcc 2\n");
    assert_eq!(outcomes(&root, &out), all_built, "nvcc version");

    // A damaged output is rebuilt.
    write(&out.join("one.fatbin"), "garbage");
    assert_eq!(
        outcomes(&root, &out),
        vec![("one".to_string(), true), ("two".to_string(), false)],
        "damaged output"
    );
    let table = std::fs::read_to_string(out.join("embed.tsv")).unwrap();
    assert_eq!(
        table.lines().filter(|l| !l.starts_with('#')).count(),
        2,
        "{table}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
