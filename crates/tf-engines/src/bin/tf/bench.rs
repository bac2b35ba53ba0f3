//! `tf bench`.
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Bench {}

pub fn run(b: Bench) -> ExitCode {
    match b {}
}
