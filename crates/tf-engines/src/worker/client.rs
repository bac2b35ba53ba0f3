//! A small client for a worker process: starts it, sends command lines, collects progress lines and the final
//! reply, with a deadline on every wait so a stuck worker fails the caller instead of hanging it. Used by the
//! protocol tests and handy for scripting a worker by hand.
//!
//! ```no_run
//! use std::time::Duration;
//! use tf_engines::worker::client::WorkerProcess;
//!
//! let mut worker = WorkerProcess::spawn("tf", &["worker", "--engine", "testpattern"])?;
//! let loaded = worker.call(r#"{"op":"load"}"#, Duration::from_secs(60))?;
//! assert_eq!(loaded.reply["ok"], true);
//! let status = worker.exit(Duration::from_secs(10))?;
//! assert!(status.success());
//! # Ok::<(), tf_engines::worker::client::ClientError>(())
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::Value;

/// What went wrong talking to a worker process.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The program could not be started.
    #[error("could not start `{program}`: {source}; check the path to the tf binary")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// Writing a command to the worker's stdin failed.
    #[error("could not send a command to the worker (it probably exited): {0}")]
    Send(std::io::Error),
    /// The worker closed its stdout before answering.
    #[error("the worker closed its output before answering `{command}`")]
    Closed { command: String },
    /// No final reply within the deadline.
    #[error("no reply to `{command}` within {waited:?}; the worker is stuck or too slow")]
    Timeout { command: String, waited: Duration },
    /// A line from the worker is not JSON.
    #[error("the worker wrote a line that is not JSON ({source}): {line}")]
    NotJson {
        line: String,
        source: serde_json::Error,
    },
    /// Waiting for the process failed.
    #[error("waiting for the worker process failed: {0}")]
    Wait(std::io::Error),
}

/// One command's answer: the progress lines (the `progress` objects) and the final reply (the line with `ok`).
#[derive(Debug, Clone)]
pub struct Exchange {
    /// The `progress` objects, in order.
    pub progress: Vec<Value>,
    /// The final reply.
    pub reply: Value,
}

/// A running worker process.
pub struct WorkerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl WorkerProcess {
    /// Starts `program args...` with piped stdin/stdout (stderr is inherited: the worker's log).
    pub fn spawn(program: &str, args: &[&str]) -> Result<WorkerProcess, ClientError> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| ClientError::Spawn {
                program: program.to_string(),
                source,
            })?;
        let stdin = child.stdin.take();
        let (sender, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if sender.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(WorkerProcess {
            child,
            stdin,
            lines,
        })
    }

    /// The worker's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `command` (one JSON line) and waits up to `deadline` for its final reply.
    pub fn call(&mut self, command: &str, deadline: Duration) -> Result<Exchange, ClientError> {
        self.send_raw(command)?;
        self.await_reply(command, deadline)
    }

    /// Sends `text` plus a newline as is (it need not be JSON).
    pub fn send_raw(&mut self, text: &str) -> Result<(), ClientError> {
        let stdin = self.stdin.as_mut().ok_or_else(|| {
            ClientError::Send(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "stdin already closed",
            ))
        })?;
        stdin
            .write_all(format!("{text}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(ClientError::Send)
    }

    /// Waits for the final reply to the last command, collecting progress lines.
    pub fn await_reply(
        &mut self,
        command: &str,
        deadline: Duration,
    ) -> Result<Exchange, ClientError> {
        let started = Instant::now();
        let mut progress = Vec::new();
        loop {
            let left = deadline.saturating_sub(started.elapsed());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(ClientError::Timeout {
                        command: command.to_string(),
                        waited: deadline,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ClientError::Closed {
                        command: command.to_string(),
                    })
                }
            };
            let value: Value = serde_json::from_str(&line)
                .map_err(|source| ClientError::NotJson { line, source })?;
            if value.get("ok").is_some() {
                return Ok(Exchange {
                    progress,
                    reply: value,
                });
            }
            if let Some(p) = value.get("progress") {
                progress.push(p.clone());
            }
        }
    }

    /// Sends `{"op":"exit"}`, checks it is answered, and waits for the process to end.
    pub fn exit(mut self, deadline: Duration) -> Result<ExitStatus, ClientError> {
        self.call(r#"{"op":"exit"}"#, deadline)?;
        self.wait(deadline)
    }

    /// Sends `{"op":"exit"}` and returns its reply, then waits for the process to end.
    pub fn exit_with_reply(
        mut self,
        deadline: Duration,
    ) -> Result<(Value, ExitStatus), ClientError> {
        let exchange = self.call(r#"{"op":"exit"}"#, deadline)?;
        let status = self.wait(deadline)?;
        Ok((exchange.reply, status))
    }

    /// Closes stdin (end of input for the worker) and waits for the process to end.
    pub fn close_input(mut self, deadline: Duration) -> Result<ExitStatus, ClientError> {
        self.stdin = None;
        self.wait(deadline)
    }

    /// Waits up to `deadline` for the process to end; kills it when the deadline passes.
    pub fn wait(&mut self, deadline: Duration) -> Result<ExitStatus, ClientError> {
        self.stdin = None;
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().map_err(ClientError::Wait)? {
                return Ok(status);
            }
            if started.elapsed() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(ClientError::Timeout {
                    command: "exit".to_string(),
                    waited: deadline,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // A test that failed midway must not leave a worker (and its GPU memory) behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
