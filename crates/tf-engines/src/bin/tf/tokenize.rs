//! `tf tokenize`.
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> ExitCode {
    eprintln!("tf tokenize: not available in this build");
    ExitCode::FAILURE
}
