//! `cargo xtask`: see `cargo xtask help` and kernels/README.md.

use std::path::PathBuf;
use std::process::ExitCode;

use xtask::paths::{kernels_out_dir, repo_root};
use xtask::Error;

const HELP: &str = "\
cargo xtask <command> [options]

  kernels [--set NAME]... [--force] [--jobs N]
      Compile kernels/kernels.toml's sets with nvcc into target/fatbins/<set>.fatbin (SASS per target +
      PTX) and target/fatbins/manifest.json. Only sets whose sources, included headers, flags or nvcc
      version changed are rebuilt. nvcc: $NVCC, $CUDA_HOME/bin, PATH, else pip-installed into .tools/cuda.
      Output dir: $TF_KERNELS_DIR if set.

  sass-check [--set NAME]...
      Dump the built fatbins with cuobjdump; print registers, shared/local memory and stack per kernel;
      fail on local memory (spills) or a stack frame in kernels marked hot, and on sm_90a tensor-core
      kernels lacking their SASS family (HMMA/HGMMA/QGMMA/IGMMA). cuobjdump: $CUOBJDUMP, $CUDA_HOME/bin, PATH,
      else pip-installed into .tools/sass.

  verify-pin [--upstream DIR] [--record-kernels]
      Check pins/tensorfold.json (fields, ABI contract == tf-sys ENTRIES, local kernel digests, README.md
      and docs/RUNTIME-PIN.md stating the pin), pins/chat-qwen38-27b.json and pins/drama3.json.
      --upstream DIR: also compute DIR's Zig package hash, compare it with the pin, and report each
      consumed file as byte-identical / changed / unknown against the previous pin.
      --record-kernels: rewrite the local kernel digests in pins/tensorfold.json from the files present.

  zig-hash DIR
      Print the Zig package hash of DIR (as `zig fetch DIR` does), honouring build.zig.zon's name,
      version, fingerprint and paths.

  gpu-bundle [--out DIR] [--skip-kernels] [--only STEP,...]
      Build the kernels, the `tf` binary and every gpu_* integration test (cargo profile `bundle`) and
      assemble DIR (default ./bundle, < 64 MiB) with run.sh: `bundle/run.sh [OUTDIR] [STEP]...` runs the
      steps of xtask/bundle-steps.toml with timeouts, appends output to OUTDIR/bundle.log and writes
      OUTDIR/summary.json (OUTDIR: first argument, else $OUT, else ./bundle-out).
      --only: a slim bundle of these steps alone: `tf` and the test executables they run, the kernel
      manifest without the fatbins (embedded in the executables), and where DIR lies inside the
      repository, relative links to its folders instead of copies of the steps' files; small enough to
      travel with the checkout.

  help
      This text.

Every command works on the checkout it is run in: the nearest folder at or above the current
directory with a workspace Cargo.toml and xtask/ (or $TF_REPO_ROOT when set).
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Pops the value of an option that takes one.
fn value(args: &[String], at: &mut usize, option: &str) -> Result<String, Error> {
    *at += 1;
    args.get(*at)
        .cloned()
        .ok_or_else(|| Error::Usage(format!("{option} needs a value")))
}

fn run(args: &[String]) -> Result<(), Error> {
    let Some(command) = args.first() else {
        print!("{HELP}");
        return Ok(());
    };
    if matches!(command.as_str(), "help" | "--help" | "-h") {
        print!("{HELP}");
        return Ok(());
    }
    // Found at run time (TF_REPO_ROOT or walking up from here), so a moved checkout or a shared
    // target folder reads this checkout's files.
    let root = repo_root()?;
    let rest = &args[1..];
    match command.as_str() {
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        "kernels" => {
            let mut options = xtask::kernels::BuildOptions::default();
            let mut at = 0;
            while at < rest.len() {
                match rest[at].as_str() {
                    "--set" => options.only.push(value(rest, &mut at, "--set")?),
                    "--force" => options.force = true,
                    "--jobs" => {
                        let text = value(rest, &mut at, "--jobs")?;
                        let jobs = text
                            .parse()
                            .map_err(|_| Error::Usage(format!("--jobs {text}: not a number")))?;
                        options.jobs = Some(jobs);
                    }
                    other => return Err(Error::Usage(format!("kernels: unknown option {other}"))),
                }
                at += 1;
            }
            let out_dir = kernels_out_dir(&root);
            let (manifest, outcomes) = xtask::kernels::build(&root, &out_dir, &options)?;
            for (name, outcome) in outcomes {
                match outcome {
                    xtask::kernels::Outcome::UpToDate => println!("{name}: up to date"),
                    xtask::kernels::Outcome::Built { seconds } => {
                        println!("{name}: built in {seconds:.1} s")
                    }
                }
            }
            println!(
                "{} kernel set(s) in {} ({})",
                manifest.sets.len(),
                out_dir.display(),
                manifest.nvcc_version.lines().last().unwrap_or("")
            );
            Ok(())
        }
        "sass-check" => {
            let mut only = Vec::new();
            let mut at = 0;
            while at < rest.len() {
                match rest[at].as_str() {
                    "--set" => only.push(value(rest, &mut at, "--set")?),
                    other => {
                        return Err(Error::Usage(format!("sass-check: unknown option {other}")))
                    }
                }
                at += 1;
            }
            xtask::sass::run(&root, &kernels_out_dir(&root), &only)
        }
        "verify-pin" => {
            let mut upstream = None;
            let mut record = false;
            let mut at = 0;
            while at < rest.len() {
                match rest[at].as_str() {
                    "--upstream" => upstream = Some(path_arg(&value(rest, &mut at, "--upstream")?)),
                    "--record-kernels" => record = true,
                    other => {
                        return Err(Error::Usage(format!("verify-pin: unknown option {other}")))
                    }
                }
                at += 1;
            }
            if record {
                for line in xtask::pin::record_kernels(&root)? {
                    println!("recorded {line}");
                }
            }
            let report = xtask::pin::verify(&root)?;
            for line in report.lines {
                println!("{line}");
            }
            if let Some(dir) = upstream {
                for line in xtask::pin::verify_upstream(&root, &dir)?.lines {
                    println!("{line}");
                }
            }
            println!("verify-pin: ok");
            Ok(())
        }
        "gpu-bundle" => {
            let mut options = xtask::bundle::BundleOptions::default();
            let mut at = 0;
            while at < rest.len() {
                match rest[at].as_str() {
                    "--out" => options.out = Some(path_arg(&value(rest, &mut at, "--out")?)),
                    "--skip-kernels" => options.skip_kernels = true,
                    "--only" => {
                        options.only = value(rest, &mut at, "--only")?
                            .split(',')
                            .filter(|s| !s.is_empty())
                            .map(str::to_string)
                            .collect();
                        if options.only.is_empty() {
                            return Err(Error::Usage("gpu-bundle: --only needs step names".into()));
                        }
                    }
                    other => {
                        return Err(Error::Usage(format!("gpu-bundle: unknown option {other}")))
                    }
                }
                at += 1;
            }
            xtask::bundle::build(&root, &options).map(|_| ())
        }
        "zig-hash" => {
            let [dir] = rest else {
                return Err(Error::Usage("zig-hash takes one directory".to_string()));
            };
            let hash = xtask::zighash::package_hash(&path_arg(dir))?;
            println!("{}", hash.text);
            Ok(())
        }
        _ => Err(Error::Usage(format!("unknown command {command:?}"))),
    }
}

fn path_arg(text: &str) -> PathBuf {
    PathBuf::from(text)
}
