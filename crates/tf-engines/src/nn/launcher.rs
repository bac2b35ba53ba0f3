//! One process per GPU for a job spread over the GPUs of one host: what a multi-GPU command checks before any GPU
//! work, how rank 0 starts the other ranks, and how every rank notices that another one died.
//!
//! - **Degree** ([`check_gpus`]): the number of GPUs must divide the attention heads (Ulysses gives every rank the
//!   same whole number of heads; 56 heads: 2, 4, 7 or 8), be at most [`MAX_GPUS`] and at most the GPUs visible.
//!   The refusal names the flag and the degrees that work.
//! - **Devices** ([`device_ordinals`]): rank `r` uses the `r`-th visible device; every process sees the same
//!   devices (so NCCL may use peer-to-peer paths between them), and picks its own by ordinal.
//! - **Start** ([`RankGroup`]): the user's process is rank 0. It makes the NCCL unique ids (one for the control
//!   communicator, one for the DiT's), then starts ranks `1..N` as children running the hidden `tf rank`
//!   subcommand with [`RankArgs`] on their command line (rank, world size, device, both ids as hex, rank 0's
//!   process id) followed by the user's own command with the launcher's flags removed ([`strip_flags`]).
//! - **Agreement** ([`request_digest`]): every rank parses the same command, and rank 0 broadcasts the digest of
//!   the request it validated; a rank whose own digest differs stops with an error naming both.
//! - **Failure**: a [`Watchdog`] thread on rank 0 polls the children (a child that exits early or fails ends the
//!   job), and on the other ranks watches rank 0's process (a rank whose parent is gone stops). Either aborts the
//!   rank's communicators ([`CommRegistry`]), so the collective that waits fails at once instead of at its
//!   deadline; every collective has a deadline anyway (tf-nccl). Dropping a [`RankGroup`] kills and reaps the
//!   children still running, so a failed rank 0 leaves no orphans.

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::nn::parallel::{HeadPartition, MAX_DEGREE};

/// The most GPUs a job spans (one host).
pub const MAX_GPUS: usize = MAX_DEGREE;
/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = tf_nccl::ffi::UNIQUE_ID_BYTES;
/// The hidden subcommand a child rank runs.
pub const RANK_SUBCOMMAND: &str = "rank";
/// How often a watchdog looks.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(200);
/// How long rank 0 waits for the other ranks to exit once its own work is done.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a multi-GPU job cannot start or had to stop.
#[derive(Debug, Error)]
pub enum LaunchError {
    /// The degree does not fit the model or the machine; found before any GPU work.
    #[error("{flag} {gpus}: {why}")]
    Degree {
        flag: String,
        gpus: usize,
        why: String,
    },
    /// A rank's arguments are malformed (the hidden subcommand is only meant for rank 0 to call).
    #[error("rank arguments: {0}")]
    Arguments(String),
    /// A child rank could not be started.
    #[error("starting rank {rank} ({}): {source}", program.display())]
    Spawn {
        rank: usize,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A rank ended before the job did, or failed.
    #[error("rank {rank} {status}; the job is stopped on every rank (its own error is in its output above)")]
    RankEnded { rank: usize, status: String },
    /// Rank 0's process is gone; this rank stops.
    #[error("rank {rank}: rank 0 (process {parent}) is gone; stopping this rank")]
    ParentGone { rank: usize, parent: u32 },
    /// The ranks parsed different requests.
    #[error(
        "rank {rank}: its request digest {mine} differs from rank 0's {root}: every rank must run the same \
         command (same tf binary, same arguments, same model folder)"
    )]
    Disagreement {
        rank: usize,
        mine: String,
        root: String,
    },
    /// A rank could not load the model; every rank drops what it loaded, and rank 0 answers with this.
    #[error(
        "rank(s) {ranks:?} could not load the model (each rank's own error is in its log); the model is not \
         loaded on any rank"
    )]
    LoadFailed { ranks: Vec<usize> },
    /// Waiting for the other ranks to exit took too long; they were killed.
    #[error(
        "ranks {ranks:?} did not exit within {waited:?} after the job ended; they were killed"
    )]
    ExitTimeout { ranks: Vec<usize>, waited: Duration },
}

fn degree_err(flag: &str, gpus: usize, why: String) -> LaunchError {
    LaunchError::Degree {
        flag: flag.to_string(),
        gpus,
        why,
    }
}

/// Checks a multi-GPU degree before any GPU work: `gpus` must be 1 to [`MAX_GPUS`], divide `heads` (Ulysses
/// attention) and be at most `visible` (when known). `flag` names the option in the refusal.
pub fn check_gpus(
    flag: &str,
    gpus: usize,
    heads: usize,
    visible: Option<usize>,
) -> Result<(), LaunchError> {
    let valid: Vec<String> = HeadPartition::valid_degrees(heads)
        .into_iter()
        .map(|d| d.to_string())
        .collect();
    if gpus == 0 || gpus > MAX_GPUS || HeadPartition::new(heads, gpus).is_err() {
        return Err(degree_err(
            flag,
            gpus,
            format!(
                "the sequence-parallel degree must divide the model's {heads} attention heads and be at most \
                 {MAX_GPUS} (one host); use one of {}",
                valid.join(", ")
            ),
        ));
    }
    if let Some(visible) = visible {
        if gpus > visible {
            return Err(degree_err(
                flag,
                gpus,
                format!(
                    "only {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES and the driver decide); ask for at \
                     most {visible}"
                ),
            ));
        }
    }
    Ok(())
}

/// The device ordinal of every rank: rank `r` uses visible device `r`.
pub fn device_ordinals(world: usize) -> Vec<usize> {
    (0..world).collect()
}

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from lowercase or uppercase hex.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// What a child rank is told on its command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankArgs {
    pub rank: usize,
    pub world: usize,
    pub device: usize,
    /// The control communicator's NCCL unique id (request agreement).
    pub control_id: Vec<u8>,
    /// The DiT communicator's NCCL unique id.
    pub dit_id: Vec<u8>,
    /// Rank 0's process id (watched: a rank whose rank 0 is gone stops).
    pub parent: u32,
}

impl RankArgs {
    /// The hidden subcommand's arguments, without the subcommand's name.
    pub fn to_args(&self) -> Vec<OsString> {
        [
            ("--rank", self.rank.to_string()),
            ("--world", self.world.to_string()),
            ("--device", self.device.to_string()),
            ("--control-id", to_hex(&self.control_id)),
            ("--dit-id", to_hex(&self.dit_id)),
            ("--parent", self.parent.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [OsString::from(k), OsString::from(v)])
        .collect()
    }

    /// Checks parsed values (from [`RankArgs::to_args`]): rank below world, world 2 to [`MAX_GPUS`], ids of
    /// [`NCCL_ID_BYTES`] bytes.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.world < 2 || self.world > MAX_GPUS || self.rank == 0 || self.rank >= self.world {
            return Err(LaunchError::Arguments(format!(
                "rank {} of {}: a child rank is 1 to world - 1, the world 2 to {MAX_GPUS}",
                self.rank, self.world
            )));
        }
        for (what, id) in [("control", &self.control_id), ("DiT", &self.dit_id)] {
            if id.len() != NCCL_ID_BYTES {
                return Err(LaunchError::Arguments(format!(
                    "the {what} NCCL id has {} bytes, {NCCL_ID_BYTES} expected",
                    id.len()
                )));
            }
        }
        Ok(())
    }

    /// An id as the fixed-size array NCCL takes.
    pub fn id_array(id: &[u8]) -> Result<[u8; NCCL_ID_BYTES], LaunchError> {
        id.try_into().map_err(|_| {
            LaunchError::Arguments(format!(
                "an NCCL id has {} bytes, {NCCL_ID_BYTES} expected",
                id.len()
            ))
        })
    }
}

/// The user's command line without the launcher's own options (`--gpus N`, `--gpus=N`), so a child rank runs the
/// same command as one rank of the job. `args` excludes the program name.
pub fn strip_flags(args: &[OsString], flags: &[&str]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
            continue;
        }
        let text = a.to_string_lossy();
        if flags.iter().any(|f| text == *f) {
            skip_value = true;
            continue;
        }
        if flags.iter().any(|f| {
            text.strip_prefix(f)
                .is_some_and(|rest| rest.starts_with('='))
        }) {
            continue;
        }
        out.push(a.clone());
    }
    out
}

/// The full command line of child rank `rank`: `tf rank <rank args> -- <the user's command>`.
pub fn child_args(rank: &RankArgs, command: &[OsString]) -> Vec<OsString> {
    let mut out = vec![OsString::from(RANK_SUBCOMMAND)];
    out.extend(rank.to_args());
    out.push(OsString::from("--"));
    out.extend(command.iter().cloned());
    out
}

/// A 64-bit FNV-1a digest of the request's canonical bytes, as 16 hex digits: what the ranks compare.
pub fn request_digest(canonical: &[u8]) -> u64 {
    canonical.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Compares this rank's digest with rank 0's.
pub fn check_agreement(rank: usize, mine: u64, root: u64) -> Result<(), LaunchError> {
    if mine != root {
        return Err(LaunchError::Disagreement {
            rank,
            mine: format!("{mine:016x}"),
            root: format!("{root:016x}"),
        });
    }
    Ok(())
}

/// Status bytes of the after-load barrier: what each rank contributes to the all-gather.
pub const LOADED: u8 = 1;
pub const NOT_LOADED: u8 = 0;

/// The verdict of the after-load barrier from every rank's status byte (rank order, as the all-gather lays them
/// out): every rank loaded, or the ranks that did not, named. Any byte but [`LOADED`] counts as a failure.
pub fn check_loaded(statuses: &[u8]) -> Result<(), LaunchError> {
    let ranks: Vec<usize> = statuses
        .iter()
        .enumerate()
        .filter(|&(_, &s)| s != LOADED)
        .map(|(r, _)| r)
        .collect();
    if ranks.is_empty() {
        Ok(())
    } else {
        Err(LaunchError::LoadFailed { ranks })
    }
}

fn describe(status: ExitStatus) -> String {
    match status.code() {
        Some(0) => "exited (status 0)".into(),
        Some(code) => format!("failed (exit status {code})"),
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                if let Some(signal) = status.signal() {
                    return format!("was killed by signal {signal}");
                }
            }
            "ended without an exit status".into()
        }
    }
}

/// Rank 0's children (ranks `1..world`). Dropping the group kills and reaps those still running.
#[derive(Debug)]
pub struct RankGroup {
    /// `(rank, child)`, the children not reaped yet.
    children: Vec<(usize, Child)>,
    /// Their stdin pipes, until taken.
    stdins: Vec<(usize, ChildStdin)>,
}

/// How [`RankGroup::spawn`] starts the children.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpawnOptions<'a> {
    /// Variables set in every child.
    pub env: &'a [(&'a OsStr, &'a OsStr)],
    /// Variables removed from every child's environment (e.g. a supervisor's parent check meant for rank 0).
    pub env_remove: &'a [&'a str],
    /// Give every child a stdin pipe ([`RankGroup::take_stdins`]); otherwise stdin is closed.
    pub piped_stdin: bool,
    /// Send the children's stdout to /dev/null (when rank 0's stdout is a protocol channel).
    pub null_stdout: bool,
}

/// A reader that copies every byte its user consumes to the children's stdin pipes: rank 0 of a multi-GPU worker
/// reads its requests through it, so every rank sees the same lines in the same order. A pipe that fails (its
/// child died) is dropped; the watchdog reports the child.
#[derive(Debug)]
pub struct Tee<R> {
    inner: R,
    outs: Vec<(usize, ChildStdin)>,
}

impl<R: BufRead> Tee<R> {
    pub fn new(inner: R, outs: Vec<(usize, ChildStdin)>) -> Tee<R> {
        Tee { inner, outs }
    }
}

impl<R: BufRead> Read for Tee<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = {
            let available = self.fill_buf()?;
            let n = available.len().min(buf.len());
            buf[..n].copy_from_slice(&available[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl<R: BufRead> BufRead for Tee<R> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        self.inner.fill_buf()
    }

    fn consume(&mut self, amt: usize) {
        if amt > 0 && !self.outs.is_empty() {
            if let Ok(buf) = self.inner.fill_buf() {
                let bytes = &buf[..amt.min(buf.len())];
                self.outs
                    .retain_mut(|(_, out)| out.write_all(bytes).and_then(|()| out.flush()).is_ok());
            }
        }
        self.inner.consume(amt);
    }
}

impl RankGroup {
    /// Starts `program` once per rank of `ranks` with `args(rank)`, stderr inherited and stdin and stdout as
    /// `options` say. A failed start kills the children already started.
    pub fn spawn(
        program: &Path,
        ranks: Range<usize>,
        args: impl Fn(usize) -> Vec<OsString>,
        options: &SpawnOptions<'_>,
    ) -> Result<RankGroup, LaunchError> {
        let mut group = RankGroup {
            children: Vec::new(),
            stdins: Vec::new(),
        };
        for rank in ranks {
            let mut cmd = Command::new(program);
            cmd.args(args(rank));
            cmd.stdin(if options.piped_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            });
            if options.null_stdout {
                cmd.stdout(Stdio::null());
            }
            for (k, v) in options.env {
                cmd.env(k, v);
            }
            for k in options.env_remove {
                cmd.env_remove(k);
            }
            let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
                rank,
                program: program.to_path_buf(),
                source,
            })?;
            if let Some(stdin) = child.stdin.take() {
                group.stdins.push((rank, stdin));
            }
            group.children.push((rank, child));
        }
        Ok(group)
    }

    /// The children's stdin pipes (when started with [`SpawnOptions::piped_stdin`]), handed out once.
    pub fn take_stdins(&mut self) -> Vec<(usize, ChildStdin)> {
        std::mem::take(&mut self.stdins)
    }

    /// The ranks still running.
    pub fn running(&self) -> Vec<usize> {
        self.children.iter().map(|(r, _)| *r).collect()
    }

    /// Looks at every child without waiting: a child that failed (a non-zero status, a signal) is an error naming
    /// it. A child that exited with status 0 finished its part (ranks end at about the same time as rank 0, which
    /// may still be writing the output) and is reaped quietly; had it left early, rank 0's next collective fails.
    pub fn poll(&mut self) -> Result<(), LaunchError> {
        let mut i = 0;
        while i < self.children.len() {
            let (rank, child) = &mut self.children[i];
            let rank = *rank;
            match child.try_wait() {
                Ok(None) => i += 1,
                Ok(Some(status)) if status.success() => {
                    self.children.remove(i);
                }
                Ok(Some(status)) => {
                    self.children.remove(i);
                    return Err(LaunchError::RankEnded {
                        rank,
                        status: describe(status),
                    });
                }
                Err(e) => {
                    return Err(LaunchError::RankEnded {
                        rank,
                        status: format!("could not be watched ({e})"),
                    })
                }
            }
        }
        Ok(())
    }

    /// After rank 0's work succeeded: waits up to `timeout` for every child to exit; a failed child is an error,
    /// and children still running at the deadline are killed.
    pub fn wait_all(&mut self, timeout: Duration) -> Result<(), LaunchError> {
        let deadline = Instant::now() + timeout;
        let mut first_failure = None;
        while !self.children.is_empty() {
            let mut i = 0;
            while i < self.children.len() {
                let (rank, child) = &mut self.children[i];
                match child.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() && first_failure.is_none() {
                            first_failure = Some(LaunchError::RankEnded {
                                rank: *rank,
                                status: describe(status),
                            });
                        }
                        self.children.remove(i);
                    }
                    Ok(None) => i += 1,
                    Err(_) => {
                        self.children.remove(i);
                    }
                }
            }
            if self.children.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let ranks = self.running();
                self.kill_all();
                return Err(LaunchError::ExitTimeout {
                    ranks,
                    waited: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        first_failure.map_or(Ok(()), Err)
    }

    /// Kills and reaps every child still running.
    pub fn kill_all(&mut self) {
        for (_, mut child) in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// The communicators of this rank, aborted together when the job must stop (weak: a dropped communicator is
/// skipped).
#[derive(Clone, Default)]
pub struct CommRegistry {
    comms: Arc<Mutex<Vec<Weak<tf_nccl::Comm>>>>,
    reason: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for CommRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommRegistry")
            .field("reason", &self.reason())
            .finish_non_exhaustive()
    }
}

impl CommRegistry {
    /// Adds a communicator.
    pub fn add(&self, comm: &Arc<tf_nccl::Comm>) {
        if let Ok(mut v) = self.comms.lock() {
            v.push(Arc::downgrade(comm));
        }
    }

    /// Records why the job stops (the first reason wins) and aborts every live communicator.
    pub fn abort_all(&self, reason: &str) {
        if let Ok(mut r) = self.reason.lock() {
            r.get_or_insert_with(|| reason.to_string());
        }
        if let Ok(v) = self.comms.lock() {
            for comm in v.iter().filter_map(Weak::upgrade) {
                comm.abort();
            }
        }
    }

    /// Why the job was stopped, if a watchdog stopped it.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

/// A thread that calls `check` every `interval` until it returns a failure, then calls `on_failure` once with
/// it and ends. Stops (and is joined) on drop.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub fn start(
        interval: Duration,
        mut check: impl FnMut() -> Option<String> + Send + 'static,
        on_failure: impl FnOnce(String) + Send + 'static,
    ) -> Watchdog {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if let Some(why) = check() {
                    on_failure(why);
                    return;
                }
                std::thread::sleep(interval);
            }
        });
        Watchdog {
            stop,
            thread: Some(thread),
        }
    }

    /// A check for ranks 1..N: fails once this process's parent is no longer `parent`.
    #[cfg(unix)]
    pub fn parent_check(rank: usize, parent: u32) -> impl FnMut() -> Option<String> + Send {
        move || {
            (std::os::unix::process::parent_id() != parent)
                .then(|| LaunchError::ParentGone { rank, parent }.to_string())
        }
    }

    /// A check for rank 0: fails once a child ended.
    pub fn children_check(group: Arc<Mutex<RankGroup>>) -> impl FnMut() -> Option<String> + Send {
        move || match group.lock() {
            Ok(mut g) => g.poll().err().map(|e| e.to_string()),
            Err(_) => Some("the rank group's lock was poisoned".into()),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn degrees_that_split_56_heads_pass_and_others_name_the_flag() {
        for gpus in [1, 2, 4, 7, 8] {
            check_gpus("--gpus", gpus, 56, Some(8)).unwrap();
        }
        for gpus in [0, 3, 5, 6, 9, 16] {
            let err = check_gpus("--gpus", gpus, 56, Some(16))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("--gpus {gpus}: ")), "{err}");
            assert!(err.contains("1, 2, 4, 7, 8"), "{err}");
        }
        let err = check_gpus("--gpus", 4, 56, Some(2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("only 2 GPU(s) are visible"), "{err}");
        // Unknown visibility is not refused here (the ranks' contexts will be).
        check_gpus("--gpus", 8, 56, None).unwrap();
        // A tiny model's heads decide.
        assert!(check_gpus("--gpus", 2, 3, None).is_err());
        assert_eq!(device_ordinals(4), vec![0, 1, 2, 3]);
    }

    #[test]
    fn rank_args_round_trip_through_hex_and_validate() {
        let rank = RankArgs {
            rank: 1,
            world: 2,
            device: 1,
            control_id: (0..128).map(|i| i as u8).collect(),
            dit_id: vec![0xab; 128],
            parent: 4242,
        };
        let args = rank.to_args();
        let text: Vec<String> = args.iter().map(|a| a.to_string_lossy().into()).collect();
        assert_eq!(&text[..6], ["--rank", "1", "--world", "2", "--device", "1"]);
        assert_eq!(from_hex(&text[7]).unwrap(), rank.control_id);
        assert_eq!(from_hex(&text[9]).unwrap(), rank.dit_id);
        assert_eq!(text[11], "4242");
        rank.validate().unwrap();
        assert_eq!(RankArgs::id_array(&rank.dit_id).unwrap(), [0xab; 128]);
        for bad in [
            RankArgs {
                rank: 0,
                ..rank.clone()
            },
            RankArgs {
                rank: 2,
                ..rank.clone()
            },
            RankArgs {
                world: 9,
                rank: 1,
                ..rank.clone()
            },
            RankArgs {
                dit_id: vec![1; 3],
                ..rank.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert_eq!(from_hex("0aFf"), Some(vec![10, 255]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }

    #[test]
    fn a_child_runs_the_users_command_without_the_launch_flags() {
        let user = os(&[
            "video", "--prompt", "a cat", "--gpus", "2", "--size", "768x448", "--gpus=2", "--seed",
            "3",
        ]);
        let stripped = strip_flags(&user, &["--gpus"]);
        assert_eq!(
            stripped,
            os(&["video", "--prompt", "a cat", "--size", "768x448", "--seed", "3"])
        );
        // A prompt that merely contains the flag's text is kept.
        let kept = strip_flags(&os(&["--prompt", "--gpus-like"]), &["--gpus"]);
        assert_eq!(kept, os(&["--prompt", "--gpus-like"]));
        let rank = RankArgs {
            rank: 1,
            world: 2,
            device: 1,
            control_id: vec![0; 128],
            dit_id: vec![1; 128],
            parent: 7,
        };
        let args = child_args(&rank, &stripped);
        assert_eq!(args[0], "rank");
        let dashes = args.iter().position(|a| a == "--").unwrap();
        assert_eq!(&args[dashes + 1..], &stripped[..]);
    }

    #[test]
    fn digests_agree_only_on_equal_requests() {
        let a = request_digest(b"{\"prompt\":\"a cat\",\"seed\":3}");
        let b = request_digest(b"{\"prompt\":\"a cat\",\"seed\":4}");
        assert_ne!(a, b);
        check_agreement(1, a, a).unwrap();
        let err = check_agreement(1, a, b).unwrap_err().to_string();
        assert!(err.contains("differs from rank 0's"), "{err}");
        // FNV-1a's published value for the empty input.
        assert_eq!(request_digest(b""), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn the_load_barrier_names_every_rank_that_failed() {
        check_loaded(&[LOADED]).unwrap();
        check_loaded(&[LOADED; MAX_GPUS]).unwrap();
        let err = check_loaded(&[LOADED, NOT_LOADED, LOADED, NOT_LOADED]).unwrap_err();
        assert!(
            matches!(&err, LaunchError::LoadFailed { ranks } if ranks == &[1, 3]),
            "{err:?}"
        );
        assert!(err.to_string().contains("[1, 3]"), "{err}");
        // A byte that is neither status (a torn buffer) is a failure too, and rank 0's own failure is named.
        let err = check_loaded(&[7, LOADED]).unwrap_err();
        assert!(matches!(&err, LaunchError::LoadFailed { ranks } if ranks == &[0]));
    }

    #[cfg(unix)]
    fn sh(script: &str) -> impl Fn(usize) -> Vec<OsString> + '_ {
        move |rank| os(&["-c", script, "sh", &rank.to_string()])
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_rank_is_named_and_the_others_are_killed() {
        // Rank 2 fails at once; ranks 1 and 3 would run for a minute.
        let script = "if [ \"$1\" = 2 ]; then exit 3; fi; sleep 60";
        let group = RankGroup::spawn(
            Path::new("/bin/sh"),
            1..4,
            sh(script),
            &SpawnOptions::default(),
        )
        .unwrap();
        let group = Arc::new(Mutex::new(group));
        let registry = CommRegistry::default();
        let seen = registry.clone();
        let started = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        let _dog = Watchdog::start(
            Duration::from_millis(10),
            Watchdog::children_check(Arc::clone(&group)),
            move |why| {
                seen.abort_all(&why);
                let _ = tx.send(());
            },
        );
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let why = registry.reason().unwrap();
        assert!(why.contains("rank 2 failed (exit status 3)"), "{why}");
        assert!(started.elapsed() < Duration::from_secs(10));
        let mut g = group.lock().unwrap();
        assert_eq!(g.running(), vec![1, 3]);
        g.kill_all();
        assert!(g.running().is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn a_rank_that_finished_is_reaped_quietly() {
        let mut group = RankGroup::spawn(
            Path::new("/bin/sh"),
            1..3,
            sh("[ \"$1\" = 1 ] && exit 0; sleep 60"),
            &SpawnOptions::default(),
        )
        .unwrap();
        let started = Instant::now();
        while group.running().len() == 2 && started.elapsed() < Duration::from_secs(10) {
            group.poll().unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(group.running(), vec![2]);
    }

    #[cfg(unix)]
    #[test]
    fn dropping_the_group_leaves_no_child_running() {
        let mut group = RankGroup::spawn(
            Path::new("/bin/sh"),
            1..3,
            sh("echo $$ > /dev/null; sleep 60"),
            &SpawnOptions::default(),
        )
        .unwrap();
        let pids: Vec<u32> = group.children.iter().map(|(_, c)| c.id()).collect();
        group.poll().unwrap();
        drop(group);
        for pid in pids {
            // Reaped children have no /proc entry (or a new process reuses none this fast).
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "process {pid} still exists"
            );
        }
    }

    #[cfg(unix)]
    #[test]
    fn ranks_that_finish_are_waited_for_and_a_late_failure_is_reported() {
        let mut ok = RankGroup::spawn(
            Path::new("/bin/sh"),
            1..3,
            sh("exit 0"),
            &SpawnOptions::default(),
        )
        .unwrap();
        ok.wait_all(Duration::from_secs(10)).unwrap();
        let mut bad = RankGroup::spawn(
            Path::new("/bin/sh"),
            1..3,
            sh("[ \"$1\" = 1 ] && exit 0; exit 5"),
            &SpawnOptions::default(),
        )
        .unwrap();
        let err = bad
            .wait_all(Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 2 failed (exit status 5)"), "{err}");
        let mut stuck = RankGroup::spawn(
            Path::new("/bin/sh"),
            1..2,
            sh("sleep 60"),
            &SpawnOptions::default(),
        )
        .unwrap();
        let err = stuck
            .wait_all(Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(err.contains("did not exit within"), "{err}");
        assert!(stuck.running().is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn a_rank_notices_its_parent_is_gone() {
        let me = std::process::id();
        let mut check = Watchdog::parent_check(1, std::os::unix::process::parent_id());
        assert_eq!(check(), None);
        let mut wrong = Watchdog::parent_check(1, me);
        let why = wrong().unwrap();
        assert!(why.contains("rank 0 (process"), "{why}");
    }

    #[cfg(unix)]
    #[test]
    fn the_tee_gives_every_child_the_lines_rank_0_reads() {
        // Each child copies its stdin to a file of its own; rank 0 reads two lines through the tee.
        let dir = std::env::temp_dir().join(format!("tf-tee-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!("cat > {}/rank$1", dir.display());
        let options = SpawnOptions {
            piped_stdin: true,
            null_stdout: true,
            env_remove: &["LOCALROUTER_PARENT"],
            ..SpawnOptions::default()
        };
        let mut group =
            RankGroup::spawn(Path::new("/bin/sh"), 1..3, sh(&script), &options).unwrap();
        let outs = group.take_stdins();
        assert_eq!(outs.len(), 2);
        assert!(group.take_stdins().is_empty(), "handed out once");
        let input: &[u8] = b"{\"load\":1}\n{\"exit\":1}\n";
        let mut tee = Tee::new(std::io::BufReader::new(input), outs);
        let mut lines = Vec::new();
        let mut line = String::new();
        while tee.read_line(&mut line).unwrap() > 0 {
            lines.push(std::mem::take(&mut line));
        }
        assert_eq!(lines.len(), 2);
        drop(tee); // closes the pipes: the children's cat ends
        group.wait_all(Duration::from_secs(10)).unwrap();
        for rank in 1..3 {
            let got = std::fs::read(dir.join(format!("rank{rank}"))).unwrap();
            assert_eq!(got, input, "rank {rank}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_program_is_a_spawn_error_naming_the_rank() {
        let err = RankGroup::spawn(
            Path::new("/nonexistent/tf"),
            1..3,
            |_| Vec::new(),
            &SpawnOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("starting rank 1 (/nonexistent/tf)"),
            "{err}"
        );
    }
}
