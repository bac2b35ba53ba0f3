//! `tf`: the command-line front end (doctor, tokenize, forward, image, video, bench, worker).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod doctor;
mod energy;
mod forward;
mod image;
mod ranks;
mod tokenize;
mod video;
mod worker;

#[derive(Parser)]
#[command(name = "tf", version, about = "TensorFold CUDA runtime and engines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Open the CUDA driver and report the GPU, its capabilities and memory.
    Doctor(doctor::Args),
    /// Tokenize TEXT with a tokenizer.json and print the ids as a JSON array.
    Tokenize(tokenize::Args),
    /// Run one DiT forward from an input bundle and write `sample`.
    Forward(forward::Args),
    /// Generate an image from a prompt with a Qwen-Image 2.1 model folder and write a PNG.
    Image(image::Args),
    /// Generate a video with stereo audio from a prompt (MiniMax H3) and write an MP4.
    Video(video::Args),
    /// Benchmarks on the GPU, side by side with the reference.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Serve an engine over LocalRouter's worker protocol (JSON lines on stdin/stdout).
    Worker(worker::Args),
    /// One rank of a multi-GPU job, started by rank 0 (`tf video --gpus N`, `tf worker --gpus N`); not for
    /// direct use.
    #[command(hide = true)]
    Rank(ranks::RankCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Doctor(a) => doctor::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Forward(a) => forward::run(a),
        Command::Image(a) => image::run(a),
        Command::Video(a) => video::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Worker(a) => worker::run(a),
        Command::Rank(a) => rank(a),
    }
}

/// The largest `--device-budget` accepted: 16 TiB.
const MAX_BUDGET_BYTES: u64 = 16 << 40;

/// `--device-budget SIZE` (`40GiB`, `512MiB`, `600KiB`, `1048576B`): a cap on the memory plan's budget, in bytes.
pub(crate) fn parse_budget(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: u64 = match unit.trim() {
        "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => {
            return Err(format!(
                "`{text}`: give a whole number with a unit: B, KiB, MiB, GiB or TiB (say 40GiB)"
            ))
        }
    };
    let bytes = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|&b| (1..=MAX_BUDGET_BYTES).contains(&b))
        .ok_or_else(|| format!("`{text}`: the budget is 1 B to 16 TiB"))?;
    Ok(bytes)
}

/// A child rank: joins the job, then runs its command (`video ...` or `worker ...`) as that rank.
fn rank(args: ranks::RankCommand) -> ExitCode {
    let failed = |e: String| {
        eprintln!("tf rank: {e}");
        let _ = ranks::end(Err(e));
        ExitCode::FAILURE
    };
    let command = match ranks::run_child(args) {
        Ok(c) => c,
        Err(e) => return failed(e),
    };
    match Cli::try_parse_from(command) {
        Ok(Cli {
            command: Command::Video(a),
        }) => video::run(a),
        Ok(Cli {
            command: Command::Worker(a),
        }) => worker::run(a),
        Ok(_) => failed("only `tf video` and `tf worker` run as a rank of a multi-GPU job".into()),
        Err(e) => failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_with_their_unit_and_are_bounded() {
        assert_eq!(parse_budget("40GiB"), Ok(40 << 30));
        assert_eq!(parse_budget(" 512MiB "), Ok(512 << 20));
        assert_eq!(parse_budget("600KiB"), Ok(600 << 10));
        assert_eq!(parse_budget("1048576B"), Ok(1 << 20));
        assert_eq!(parse_budget("16TiB"), Ok(16 << 40));
        assert_eq!(parse_budget("3 GiB"), Ok(3 << 30));
        for bad in [
            "",
            "40",
            "GiB",
            "40GB",
            "-1GiB",
            "0B",
            "17TiB",
            "99999999999999999999B",
            "1.5GiB",
        ] {
            let err = parse_budget(bad).unwrap_err();
            assert!(
                err.contains("GiB") || err.contains("16 TiB"),
                "{bad}: {err}"
            );
        }
    }
}
