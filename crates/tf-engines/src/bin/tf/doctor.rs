//! `tf doctor`.
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> ExitCode {
    eprintln!("tf doctor: not available in this build");
    ExitCode::FAILURE
}
