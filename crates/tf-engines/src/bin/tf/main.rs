//! `tf`: the command-line front end (doctor, tokenize, forward, image, video, bench, worker).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod doctor;
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
