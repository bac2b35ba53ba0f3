//! `cargo xtask sass-check`: resource usage and SASS checks of the built fatbins.
//!
//! For every set in `manifest.json`: `cuobjdump -res-usage` gives registers, shared, local memory and stack
//! per kernel and architecture; kernels marked hot fail on any local memory (spills) or stack frame.
//! `cuobjdump -sass` of the sm_90a code checks that each tensor-core kernel contains its SASS family.

use std::collections::BTreeMap;
use std::path::Path;

use crate::kernels::{Manifest, SetRecord};
use crate::toolchain::{self, Tool};
use crate::util::run_captured;
use crate::Error;

/// Resource usage of one kernel on one architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub arch: String,
    pub kernel: String,
    pub registers: u64,
    pub shared: u64,
    pub local: u64,
    pub stack: u64,
}

/// Parses `cuobjdump -res-usage` output.
pub fn parse_res_usage(text: &str) -> Vec<Usage> {
    let mut arch = String::new();
    let mut kernel: Option<String> = None;
    let mut usages = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("arch = ") {
            arch = rest.trim().to_string();
        } else if let Some(rest) = line.strip_prefix("Function ") {
            kernel = Some(rest.trim_end_matches(':').trim().to_string());
        } else if let (Some(name), true) = (&kernel, line.starts_with("REG:")) {
            let mut fields = BTreeMap::new();
            for pair in line.split_whitespace() {
                if let Some((key, value)) = pair.split_once(':') {
                    fields.insert(key.to_string(), value.parse::<u64>().unwrap_or(0));
                }
            }
            let get = |key: &str| fields.get(key).copied().unwrap_or(0);
            usages.push(Usage {
                arch: arch.clone(),
                kernel: name.clone(),
                registers: get("REG"),
                shared: get("SHARED"),
                local: get("LOCAL"),
                stack: get("STACK"),
            });
            kernel = None;
        }
    }
    usages
}

/// Parses `cuobjdump -sass` output into kernel -> opcodes (first word of each instruction).
pub fn parse_sass(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut kernels: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix("Function : ") {
            let name = rest.trim().to_string();
            kernels.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        // Instruction lines look like `/*0160*/  @!P0 HMMA.16816.F32.BF16 R16, ... ;  /* 0x... */`.
        let Some(name) = &current else { continue };
        let Some(rest) = trimmed.strip_prefix("/*") else {
            continue;
        };
        let Some((_, body)) = rest.split_once("*/") else {
            continue;
        };
        let mut words = body.split_whitespace();
        let mut opcode = words.next().unwrap_or("");
        if opcode.starts_with('@') {
            opcode = words.next().unwrap_or("");
        }
        if opcode.is_empty() || opcode.starts_with("/*") {
            continue;
        }
        if let Some(list) = kernels.get_mut(name) {
            list.push(opcode.trim_end_matches(';').to_string());
        }
    }
    kernels
}

/// Whether `kernel` matches a pattern (exact, or `prefix*`).
pub fn matches(pattern: &str, kernel: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => kernel.starts_with(prefix),
        None => kernel == pattern,
    }
}

/// Whether an opcode belongs to a family (`HMMA` matches `HMMA.16816.F32.BF16`, not `HGMMA`).
pub fn in_family(opcode: &str, family: &str) -> bool {
    opcode == family || opcode.starts_with(&format!("{family}."))
}

/// Checks one set from parsed cuobjdump output; returns failure lines.
pub fn check_set(
    set: &SetRecord,
    usages: &[Usage],
    sass_90a: &BTreeMap<String, Vec<String>>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for pattern in &set.hot {
        let hits: Vec<&Usage> = usages
            .iter()
            .filter(|u| matches(pattern, &u.kernel))
            .collect();
        if hits.is_empty() {
            failures.push(format!(
                "set {}: hot kernel pattern {pattern:?} matches no kernel in the fatbin (renamed?)",
                set.name
            ));
        }
        for usage in hits {
            if usage.local > 0 || usage.stack > 0 {
                failures.push(format!(
                    "set {}: hot kernel {} on {} uses {} bytes of local memory and a {}-byte stack frame (register spills): reduce register pressure or tile size, or drop it from `hot`",
                    set.name, usage.kernel, usage.arch, usage.local, usage.stack
                ));
            }
        }
    }
    if !usages.iter().any(|u| u.arch == "sm_90a") {
        failures.push(format!("set {}: the fatbin has no sm_90a code", set.name));
    }
    for (pattern, family) in &set.tensor_core {
        let hits: Vec<(&String, &Vec<String>)> = sass_90a
            .iter()
            .filter(|(k, _)| matches(pattern, k))
            .collect();
        if hits.is_empty() {
            failures.push(format!(
                "set {}: tensor-core kernel pattern {pattern:?} matches no sm_90a kernel",
                set.name
            ));
        }
        for (kernel, opcodes) in hits {
            if !opcodes.iter().any(|op| in_family(op, family)) {
                failures.push(format!(
                    "set {}: {kernel} has no {family} instruction in its sm_90a SASS (tensor cores not used)",
                    set.name
                ));
            }
        }
    }
    failures
}

/// Formats the resource table.
pub fn table(set: &SetRecord, usages: &[Usage]) -> String {
    let mut text = format!(
        "{:<24} {:<40} {:>8} {:>5} {:>8} {:>6} {:>6} {}\n",
        "set", "kernel", "arch", "regs", "shared", "local", "stack", "marks"
    );
    for usage in usages {
        let mut marks = Vec::new();
        if set.hot.iter().any(|p| matches(p, &usage.kernel)) {
            marks.push("hot".to_string());
        }
        if let Some((_, family)) = set
            .tensor_core
            .iter()
            .find(|(p, _)| matches(p, &usage.kernel))
        {
            marks.push(family.clone());
        }
        text.push_str(&format!(
            "{:<24} {:<40} {:>8} {:>5} {:>8} {:>6} {:>6} {}\n",
            set.name,
            usage.kernel,
            usage.arch,
            usage.registers,
            usage.shared,
            usage.local,
            usage.stack,
            marks.join(",")
        ));
    }
    text
}

fn dump(tool: &Tool, args: &[&str], fatbin: &Path) -> Result<String, Error> {
    let output = run_captured(tool.command().args(args).arg(fatbin))?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs the check over the built sets (all, or `only`).
pub fn run(root: &Path, out_dir: &Path, only: &[String]) -> Result<(), Error> {
    let manifest = Manifest::load(out_dir)?.ok_or_else(|| Error::ToolMissing {
        tool: "kernel fatbins",
        detail: format!(
            "no manifest.json in {}; run `cargo xtask kernels` first",
            out_dir.display()
        ),
    })?;
    let tool = toolchain::cuobjdump(root)?;
    let mut failures = Vec::new();
    for set in manifest
        .sets
        .iter()
        .filter(|s| only.is_empty() || only.contains(&s.name))
    {
        let fatbin = out_dir.join(&set.fatbin);
        let usages = parse_res_usage(&dump(&tool, &["-res-usage"], &fatbin)?);
        let sass = if set.tensor_core.is_empty() {
            BTreeMap::new()
        } else {
            parse_sass(&dump(&tool, &["-sass", "-arch", "sm_90a"], &fatbin)?)
        };
        print!("{}", table(set, &usages));
        failures.extend(check_set(set, &usages, &sass));
    }
    if failures.is_empty() {
        println!("sass-check: ok");
        Ok(())
    } else {
        Err(Error::CheckFailed {
            check: "sass-check",
            failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RES_USAGE: &str = "\nFatbin elf code:\n================\narch = sm_90a\ncode version = [1,8]\n\nResource usage:\n Common:\n  GLOBAL:0\n Function spiller:\n  REG:255 STACK:16 SHARED:0 LOCAL:24 CONSTANT[0]:548 TEXTURE:0 SURFACE:0 SAMPLER:0\n Function mma_tile:\n  REG:22 STACK:0 SHARED:4096 LOCAL:0 CONSTANT[0]:552 TEXTURE:0 SURFACE:0 SAMPLER:0\n";

    const SASS: &str = "\n\tcode for sm_90a\n\t\tFunction : mma_tile\n\t.headerflags\t@\"EF_CUDA_SM90\"\n        /*0000*/                   LDC R1, c[0x0][0x28] ;             /* 0x00000a00ff017b82 */\n        /*0160*/              @!P0 HMMA.16816.F32.BF16 R16, R4.reuse, R12, RZ ;     /* 0x0000000c0410723c */\n        /*0170*/                   EXIT ;  /* 0x000000000000794d */\n\t\tFunction : spiller\n        /*0000*/                   STL [R1], R2 ;  /* 0x0000000201007387 */\n";

    fn record(hot: &[&str], tensor_core: &[(&str, &str)]) -> SetRecord {
        SetRecord {
            name: "t".into(),
            fatbin: "t.fatbin".into(),
            fatbin_sha256: String::new(),
            fatbin_bytes: 0,
            source: String::new(),
            args: vec![],
            targets: vec!["sm_90a".into()],
            ptx: None,
            hot: hot.iter().map(|s| s.to_string()).collect(),
            tensor_core: tensor_core
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            inputs: vec![],
            key: String::new(),
        }
    }

    #[test]
    fn parses_resource_usage_per_kernel() {
        let usages = parse_res_usage(RES_USAGE);
        assert_eq!(usages.len(), 2);
        assert_eq!(usages[0].kernel, "spiller");
        assert_eq!(
            (usages[0].registers, usages[0].local, usages[0].stack),
            (255, 24, 16)
        );
        assert_eq!(
            (usages[1].arch.as_str(), usages[1].shared),
            ("sm_90a", 4096)
        );
    }

    #[test]
    fn parses_opcodes_including_predicated_ones() {
        let sass = parse_sass(SASS);
        assert_eq!(sass["mma_tile"], vec!["LDC", "HMMA.16816.F32.BF16", "EXIT"]);
        assert_eq!(sass["spiller"], vec!["STL"]);
    }

    #[test]
    fn hot_spills_and_missing_tensor_cores_fail() {
        let usages = parse_res_usage(RES_USAGE);
        let sass = parse_sass(SASS);
        assert!(check_set(
            &record(&["mma_tile"], &[("mma_tile", "HMMA")]),
            &usages,
            &sass
        )
        .is_empty());
        let spill = check_set(&record(&["spill*"], &[]), &usages, &sass);
        assert!(
            spill.len() == 1 && spill[0].contains("local memory"),
            "{spill:?}"
        );
        let wrong_family = check_set(&record(&[], &[("mma_tile", "HGMMA")]), &usages, &sass);
        assert!(
            wrong_family.len() == 1 && wrong_family[0].contains("HGMMA"),
            "{wrong_family:?}"
        );
        let renamed = check_set(&record(&["gone"], &[("gone*", "HMMA")]), &usages, &sass);
        assert_eq!(renamed.len(), 2, "{renamed:?}");
    }

    #[test]
    fn families_do_not_match_each_other() {
        assert!(in_family("HMMA.16816.F32.BF16", "HMMA"));
        assert!(!in_family("HGMMA.64x128x16.F32.BF16", "HMMA"));
        assert!(in_family("HGMMA.64x128x16.F32.BF16", "HGMMA"));
        assert!(matches("k*", "k_1") && !matches("k", "k_1"));
    }
}
