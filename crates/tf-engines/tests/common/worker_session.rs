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

/// The final replies (the lines with `ok`) of a session's standard output, progress lines left out.
#[allow(dead_code)]
pub fn final_replies(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line from the worker"))
        .filter(|v: &Value| v.get("ok").is_some())
        .collect()
}

/// A session of a load, the one `generate` request and an exit through `worker`, a `tf worker` with a device budget
/// below its components' sum: it ends cleanly with three ok replies, and its log (standard error) names the
/// sequential plan and how long the request spent loading its components.
#[allow(dead_code)]
pub fn assert_budgeted_session_loads_per_request(worker: Command, generate: Value) {
    let out = session(
        worker,
        &[
            serde_json::json!({"op": "load"}),
            generate,
            serde_json::json!({"op": "exit"}),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let replies = final_replies(&out);
    assert_eq!(replies.len(), 3, "{replies:?}");
    assert!(
        replies.iter().all(|r| r["ok"] == true),
        "{replies:?} / {stderr}"
    );
    assert!(stderr.contains("load, run and free in turn"), "{stderr}");
    assert!(
        stderr.contains("component loads in the request"),
        "{stderr}"
    );
}
