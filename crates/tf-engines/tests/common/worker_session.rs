//! A `tf worker` session for the integration tests: spawn the command with piped streams, write the protocol lines,
//! close its input, and collect what it wrote and how it ended.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// Starts `worker` (a `tf worker` command line) with piped streams, writes `lines` and closes its input, and returns
/// what it wrote and how it ended.
pub fn session(mut worker: Command, lines: &[Value]) -> Output {
    let mut child = worker
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tf worker");
    {
        let mut stdin = child.stdin.take().expect("the worker's stdin");
        for line in lines {
            writeln!(stdin, "{line}").expect("write a protocol line");
        }
    }
    child.wait_with_output().expect("wait for tf worker")
}
