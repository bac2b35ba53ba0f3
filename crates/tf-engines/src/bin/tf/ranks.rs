//! `--gpus N` (MiniMax H3): one process per GPU, through the library's launcher (`nn::launcher`).
//!
//! The user's `tf video` process becomes rank 0: it checks the degree against the model's heads and the visible
//! GPUs (before any GPU work), loads NCCL, makes the two NCCL unique ids, starts ranks `1..N` as `tf rank ... --
//! <the same command>` children, and joins both communicators (control and DiT) on its device. A child rank runs
//! the same command through the same code; its `tf video` notices it is a rank ([`begin`]) instead of launching.
//! Every rank checks that it parsed the request rank 0 validated ([`begin`] broadcasts rank 0's digest); every
//! rank runs the whole pipeline with the DiT sequence-parallel; only rank 0 writes the output
//! ([`writes_output`]). [`end`] closes the job on every exit path: rank 0 waits for the others after a success
//! and stops them after a failure; the watchdogs (children on rank 0, rank 0 on the others) abort the
//! communicators when a rank dies, so no rank waits for a dead one past its collective's deadline.
//!
//! The state of the job lives in one process-wide slot: a `tf` process runs at most one job.

use std::ffi::OsString;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tf_cuda::{Context, DeviceBuffer, Stream};
use tf_engines::minimax_h3::config::MiniMaxH3Config;
use tf_engines::minimax_h3::dit_gpu::parallel::{SequenceParallel, SpAttention};
use tf_engines::minimax_h3::pipeline::{Backend, Request};
use tf_engines::nn::launcher::{
    check_agreement, check_gpus, check_loaded, child_args, from_hex, request_digest, strip_flags,
    CommRegistry, LaunchError, RankArgs, RankGroup, SpawnOptions, Tee, Watchdog, EXIT_TIMEOUT,
    LOADED, MAX_GPUS, NOT_LOADED, WATCH_INTERVAL,
};
use tf_nccl::{Comm, CommOptions, DataType, Nccl, UniqueId};

/// How long a rank waits at the control communicator (the request agreement, the barrier after loading): other
/// ranks may still be loading a model of tens of GB. A dead rank is noticed by the watchdogs long before.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How long one DiT collective (and the wait for a step) may take: covers a rank that loads its DiT later than the
/// others (the sequential memory plan loads it per request) and a new shape's GEMM planning.
const DIT_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// The launcher's options of `tf video` (and `tf worker`).
#[derive(clap::Args, Clone, Debug)]
pub struct GpuArgs {
    /// GPUs of this host to spread the MiniMax H3 DiT over, one process each (sequence parallel over NCCL); must
    /// divide the model's attention heads (56: 1, 2, 4, 7 or 8) and not exceed the visible GPUs.
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Run through the multi-GPU (NCCL) path even with --gpus 1 (a check of that path against one GPU).
    #[arg(long = "force-nccl")]
    pub force_nccl: bool,
    /// How attention crosses GPUs: `ulysses` (all-to-all of Q, K, V to head groups) or `kv-gather` (all-gather of
    /// K and V).
    #[arg(long = "sp-attention", default_value = "ulysses", value_parser = parse_attention)]
    pub sp_attention: SpAttention,
}

fn parse_attention(text: &str) -> Result<SpAttention, String> {
    SpAttention::parse(text)
        .ok_or_else(|| format!("--sp-attention {text:?}: choose `ulysses` or `kv-gather`"))
}

/// The hidden subcommand of a child rank: its place in the job, then `--` and the command it runs.
#[derive(clap::Args, Debug)]
pub struct RankCommand {
    #[arg(long)]
    rank: usize,
    #[arg(long)]
    world: usize,
    #[arg(long)]
    device: usize,
    #[arg(long = "control-id")]
    control_id: String,
    #[arg(long = "dit-id")]
    dit_id: String,
    #[arg(long)]
    parent: u32,
    /// The command this rank runs (`video ...`).
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

/// One rank's part in the job.
struct Ranked {
    rank: usize,
    world: usize,
    control: Arc<Comm>,
    dit: Arc<Comm>,
    registry: CommRegistry,
    /// Rank 0's children.
    group: Option<Arc<Mutex<RankGroup>>>,
    /// Stopped (joined) before the group is waited for or dropped.
    watchdog: Option<Watchdog>,
}

/// The job of this process, if it is one rank of several (or forced through NCCL).
static JOB: Mutex<Option<Ranked>> = Mutex::new(None);

fn job() -> std::sync::MutexGuard<'static, Option<Ranked>> {
    JOB.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn launch_err(e: LaunchError) -> String {
    e.to_string()
}

fn nccl_err(what: &str) -> impl FnOnce(tf_nccl::NcclError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn cuda_err(what: &str) -> impl FnOnce(tf_cuda::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The DiT's attention head count from `model/transformer/config.json`.
fn heads_of(model: &Path) -> Result<usize, String> {
    let path = model.join("transformer").join("config.json");
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    MiniMaxH3Config::from_json_file(&value, &path)
        .map(|c| c.num_attention_heads)
        .map_err(|e| e.to_string())
}

/// Joins both communicators of rank `rank` on device `device`, control first (every rank in the same order). The
/// context made here is the process's one context: the pipeline loads into the DiT communicator's context
/// ([`SequenceParallel::context`]) rather than opening another.
fn connect(
    nccl: &Arc<Nccl>,
    rank: usize,
    world: usize,
    device: usize,
    ids: (&UniqueId, &UniqueId),
) -> Result<(Arc<Comm>, Arc<Comm>), String> {
    let driver = tf_cuda::open_driver().map_err(cuda_err("opening the CUDA driver"))?;
    let ordinal = i32::try_from(device).map_err(|_| format!("device {device}"))?;
    let ctx = Context::new(driver, ordinal).map_err(cuda_err(&format!(
        "rank {rank}: a context on device {device}"
    )))?;
    let mut comms = Vec::with_capacity(2);
    for (what, id, op_timeout) in [
        ("control", ids.0, CONTROL_TIMEOUT),
        ("DiT", ids.1, DIT_TIMEOUT),
    ] {
        // Blocking, as a pipeline's stream is: the DiT communicator's stream is the one the rank's pipeline runs
        // every component on.
        let stream = Arc::new(Stream::new(&ctx, true).map_err(cuda_err("creating a stream"))?);
        let options = CommOptions {
            op_timeout,
            ..CommOptions::default()
        };
        let comm = Comm::init_rank(nccl, stream, id, rank, world, options).map_err(nccl_err(
            &format!("rank {rank}: joining the {what} communicator"),
        ))?;
        comms.push(Arc::new(comm));
    }
    let dit = comms.pop().ok_or("internal: no DiT communicator")?;
    let control = comms.pop().ok_or("internal: no control communicator")?;
    Ok((control, dit))
}

fn open_nccl() -> Result<Arc<Nccl>, String> {
    Nccl::open_with_python_packages().map_err(|e| {
        format!(
            "--gpus needs NCCL (TF_NCCL, libnccl.so.2 or the nvidia-nccl-cu13 Python wheel): {e}"
        )
    })
}

/// What the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One `tf video` request.
    Video,
    /// `tf worker`: rank 0 forwards its stdin to the children, whose stdout goes nowhere; a dead rank ends the
    /// worker (the supervisor restarts it).
    Worker,
}

/// Rank 0 of a `gpus`-rank job: checks, starts the children, joins.
fn launch(gpu: &GpuArgs, model: &Path, mode: Mode) -> Result<Ranked, String> {
    let heads = heads_of(model)?;
    let driver = tf_cuda::open_driver().map_err(cuda_err("--gpus: opening the CUDA driver"))?;
    let visible = driver
        .device_count()
        .map(|n| usize::try_from(n).unwrap_or(0))
        .map_err(|e| format!("--gpus: counting the visible GPUs: {e}"))?;
    check_gpus("--gpus", gpu.gpus, heads, Some(visible)).map_err(launch_err)?;
    let nccl = open_nccl()?;
    let control_id = nccl.unique_id().map_err(nccl_err("making the NCCL id"))?;
    let dit_id = nccl.unique_id().map_err(nccl_err("making the NCCL id"))?;
    let registry = CommRegistry::default();
    let (group, watchdog) = if gpu.gpus > 1 {
        let program = std::env::current_exe()
            .map_err(|e| format!("--gpus: finding this tf binary to start the other ranks: {e}"))?;
        let user: Vec<OsString> = std::env::args_os().skip(1).collect();
        let command = strip_flags(&user, &["--gpus"]);
        let parent = std::process::id();
        let (control_bytes, dit_bytes) = (control_id.to_bytes(), dit_id.to_bytes());
        let args = |rank: usize| {
            let me = RankArgs {
                rank,
                world: gpu.gpus,
                device: rank,
                control_id: control_bytes.to_vec(),
                dit_id: dit_bytes.to_vec(),
                parent,
            };
            child_args(&me, &command)
        };
        let options = SpawnOptions {
            // The children's parent is rank 0, not the supervisor that started it.
            env_remove: &["LOCALROUTER_PARENT"],
            piped_stdin: mode == Mode::Worker,
            null_stdout: mode == Mode::Worker,
            ..SpawnOptions::default()
        };
        let group = RankGroup::spawn(&program, 1..gpu.gpus, args, &options).map_err(launch_err)?;
        let group = Arc::new(Mutex::new(group));
        let seen = registry.clone();
        let held = Arc::clone(&group);
        let watchdog = Watchdog::start(
            WATCH_INTERVAL,
            Watchdog::children_check(Arc::clone(&group)),
            move |why| {
                eprintln!("tf: {why}");
                seen.abort_all(&why);
                if mode == Mode::Worker {
                    // A worker serves many requests; with a rank gone none of them can run. End it, and the
                    // other ranks, so the supervisor starts a fresh one.
                    held.lock().unwrap_or_else(|p| p.into_inner()).kill_all();
                    std::process::exit(3);
                }
            },
        );
        eprintln!(
            "tf: rank 0 of {} on device 0; ranks 1..{} started",
            gpu.gpus, gpu.gpus
        );
        (Some(group), Some(watchdog))
    } else {
        eprintln!("tf: one rank through NCCL (--force-nccl)");
        (None, None)
    };
    let (control, dit) = connect(&nccl, 0, gpu.gpus, 0, (&control_id, &dit_id))?;
    registry.add(&control);
    registry.add(&dit);
    Ok(Ranked {
        rank: 0,
        world: gpu.gpus,
        control,
        dit,
        registry,
        group,
        watchdog,
    })
}

/// The digest of what must agree across ranks: the request (the noise by its bits) and the load options.
fn canonical(request: &Request, options: &str) -> Vec<u8> {
    let plain = Request {
        noise: None,
        ..request.clone()
    };
    let mut text = format!("{plain:?}|{options}");
    if let Some(noise) = &request.noise {
        let bits: Vec<u8> = noise
            .video
            .data()
            .iter()
            .chain(noise.audio.data())
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        text.push_str(&format!("|noise {:016x}", request_digest(&bits)));
    }
    text.into_bytes()
}

impl Ranked {
    /// Rank 0 broadcasts its digest over the control communicator; every rank compares it with its own.
    fn agree(&self, digest: u64) -> Result<(), String> {
        let comm = &self.control;
        let ctx = comm.stream().context();
        let mut buf = DeviceBuffer::from_slice(&ctx, &[digest])
            .map_err(cuda_err("the request digest's buffer"))?;
        // SAFETY: the buffer was made in the communicator's context and lives past the synchronize below.
        unsafe { comm.broadcast_in_place(buf.view_mut(), 8, DataType::U8, 0) }
            .map_err(nccl_err("broadcasting rank 0's request digest"))?;
        comm.synchronize()
            .map_err(nccl_err("broadcasting rank 0's request digest"))?;
        let root: Vec<u64> = buf
            .to_vec()
            .map_err(cuda_err("reading rank 0's request digest"))?;
        let root = root.first().copied().ok_or("internal: an empty digest")?;
        check_agreement(self.rank, digest, root).map_err(launch_err)
    }
}

/// For the MiniMax H3 pipeline of `tf video`: `None` for one GPU; otherwise this rank's sequence-parallel setup
/// (rank 0 launches the job here; a child rank was set up by `tf rank`), after every rank agreed on `request`
/// and `options` (the load options' text).
pub fn begin(
    gpu: &GpuArgs,
    model: &Path,
    backend: Backend,
    request: &Request,
    options: &str,
) -> Result<Option<SequenceParallel>, String> {
    let mut slot = job();
    if slot.is_none() {
        if gpu.gpus == 1 && !gpu.force_nccl {
            return Ok(None);
        }
        // The degree against the model's heads first: it is wrong whatever the machine.
        check_gpus("--gpus", gpu.gpus, heads_of(model)?, None).map_err(launch_err)?;
        if backend == Backend::Host {
            return Err(format!(
                "--gpus {} needs the GPU backend (--backend gpu or auto on a GPU machine)",
                gpu.gpus
            ));
        }
        *slot = Some(launch(gpu, model, Mode::Video)?);
    }
    let ranked = slot.as_ref().ok_or("internal: no job")?;
    ranked.agree(request_digest(&canonical(request, options)))?;
    eprintln!(
        "tf: rank {} of {} agrees on the request",
        ranked.rank, ranked.world
    );
    Ok(Some(SequenceParallel {
        comm: Arc::clone(&ranked.dit),
        attention: gpu.sp_attention,
    }))
}

/// For the MiniMax H3 worker: `None` for one GPU; otherwise this rank's sequence-parallel setup (rank 0
/// launches the other ranks here), after every rank agreed on `options` (the load options' text). Requests reach
/// the other ranks through [`tee_stdin`].
pub fn begin_worker(
    gpu: &GpuArgs,
    model: &Path,
    host: bool,
    options: &str,
) -> Result<Option<SequenceParallel>, String> {
    let mut slot = job();
    if slot.is_none() {
        if gpu.gpus == 1 && !gpu.force_nccl {
            return Ok(None);
        }
        check_gpus("--gpus", gpu.gpus, heads_of(model)?, None).map_err(launch_err)?;
        if host {
            return Err(format!(
                "--gpus {} needs the GPU backend (--backend gpu or auto on a GPU machine)",
                gpu.gpus
            ));
        }
        *slot = Some(launch(gpu, model, Mode::Worker)?);
    }
    let ranked = slot.as_ref().ok_or("internal: no job")?;
    ranked.agree(request_digest(options.as_bytes()))?;
    Ok(Some(SequenceParallel {
        comm: Arc::clone(&ranked.dit),
        attention: gpu.sp_attention,
    }))
}

/// True in a child rank (`tf rank`).
pub fn is_child() -> bool {
    job().as_ref().is_some_and(|r| r.rank != 0)
}

/// Rank 0's stdin for the worker: every line it reads also goes to the other ranks (none on one GPU).
pub fn tee_stdin<R: std::io::BufRead>(input: R) -> Tee<R> {
    let outs = job()
        .as_ref()
        .and_then(|r| r.group.as_ref())
        .map(|g| g.lock().unwrap_or_else(|p| p.into_inner()).take_stdins())
        .unwrap_or_default();
    Tee::new(input, outs)
}

/// After the pipeline's load, successful or not (`loaded`): every rank's status byte is all-gathered on the control
/// communicator (its deadline), so the DiT's first collective does not wait out another rank's load and every rank
/// learns whether all of them loaded. Rank 0 answers with the ranks that failed, named; every rank gets the same
/// verdict, so all of them keep the model or none does. Nothing on one GPU.
pub fn ready(loaded: bool) -> Result<(), String> {
    let slot = job();
    let Some(ranked) = slot.as_ref() else {
        return Ok(());
    };
    let what = "waiting for every rank to load the model";
    let comm = &ranked.control;
    let ctx = comm.stream().context();
    let mine = if loaded { LOADED } else { NOT_LOADED };
    let send = DeviceBuffer::from_slice(&ctx, &[mine]).map_err(cuda_err("the barrier's buffer"))?;
    let mut all =
        DeviceBuffer::alloc(&ctx, ranked.world.max(1)).map_err(cuda_err("the barrier's buffer"))?;
    // SAFETY: both buffers were made in the communicator's context and live past the synchronize below.
    unsafe { comm.all_gather(send.view(), all.view_mut(), 1, DataType::U8) }
        .map_err(nccl_err(what))?;
    comm.synchronize().map_err(nccl_err(what))?;
    let statuses: Vec<u8> = all.to_vec().map_err(cuda_err(what))?;
    check_loaded(&statuses).map_err(launch_err)
}

/// Whether this process writes the job's output (one GPU, or rank 0).
pub fn writes_output() -> bool {
    job().as_ref().is_none_or(|r| r.rank == 0)
}

/// Ends the job of this process with `result`: after a success rank 0 waits for the other ranks (their failure
/// fails the job); after a failure it stops them. A failure names why a watchdog stopped the job, if one did.
pub fn end(result: Result<(), String>) -> Result<(), String> {
    let Some(mut ranked) = job().take() else {
        return result;
    };
    // The watchdog stops first, so it cannot report the children this function itself ends.
    drop(ranked.watchdog.take());
    let result = result.map_err(|e| match ranked.registry.reason() {
        Some(why) => format!("{e}\n(the job was stopped because {why})"),
        None => e,
    });
    let group = ranked.group.take();
    match (result, group) {
        (Ok(()), Some(group)) => {
            let mut g = group.lock().unwrap_or_else(|p| p.into_inner());
            g.wait_all(EXIT_TIMEOUT).map_err(launch_err)
        }
        (Err(e), Some(group)) => {
            ranked.registry.abort_all(&e);
            group.lock().unwrap_or_else(|p| p.into_inner()).kill_all();
            Err(e)
        }
        (result, None) => {
            if result.is_err() {
                ranked.registry.abort_all("this rank failed");
            }
            result
        }
    }
}

/// `tf rank`: joins the job as a child rank, then runs its command (`video ...`) as that rank.
pub fn run_child(args: RankCommand) -> Result<Vec<OsString>, String> {
    let parse =
        |what: &str, hex: &str| from_hex(hex).ok_or_else(|| format!("--{what}-id is not hex"));
    let me = RankArgs {
        rank: args.rank,
        world: args.world,
        device: args.device,
        control_id: parse("control", &args.control_id)?,
        dit_id: parse("dit", &args.dit_id)?,
        parent: args.parent,
    };
    me.validate().map_err(launch_err)?;
    if me.world > MAX_GPUS {
        return Err(format!("world {} above {MAX_GPUS}", me.world));
    }
    let registry = CommRegistry::default();
    let seen = registry.clone();
    #[cfg(unix)]
    let watchdog = Watchdog::start(
        WATCH_INTERVAL,
        Watchdog::parent_check(me.rank, me.parent),
        move |why| {
            eprintln!("tf: {why}");
            seen.abort_all(&why);
            // Nothing this rank does matters once rank 0 is gone; leave now rather than at the next deadline.
            std::process::exit(1);
        },
    );
    let nccl = open_nccl()?;
    let control_id = UniqueId::from_bytes(RankArgs::id_array(&me.control_id).map_err(launch_err)?);
    let dit_id = UniqueId::from_bytes(RankArgs::id_array(&me.dit_id).map_err(launch_err)?);
    let (control, dit) = connect(&nccl, me.rank, me.world, me.device, (&control_id, &dit_id))?;
    registry.add(&control);
    registry.add(&dit);
    *job() = Some(Ranked {
        rank: me.rank,
        world: me.world,
        control,
        dit,
        registry,
        group: None,
        #[cfg(unix)]
        watchdog: Some(watchdog),
        #[cfg(not(unix))]
        watchdog: None,
    });
    eprintln!(
        "tf: rank {} of {} on device {}",
        me.rank, me.world, me.device
    );
    let mut command = vec![OsString::from("tf")];
    command.extend(args.command);
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_digest_covers_every_field_and_the_options() {
        let a = Request::new("a cat");
        let base = request_digest(&canonical(&a, "bf16"));
        assert_eq!(base, request_digest(&canonical(&a.clone(), "bf16")));
        let mut b = a.clone();
        b.seed = 1;
        assert_ne!(base, request_digest(&canonical(&b, "bf16")));
        assert_ne!(base, request_digest(&canonical(&a, "fp8")));
    }

    #[test]
    fn attention_names_parse_and_others_are_refused() {
        assert_eq!(parse_attention("kv-gather"), Ok(SpAttention::KvGather));
        assert!(parse_attention("ring")
            .unwrap_err()
            .contains("--sp-attention"));
    }
}
