//! The H3 DiT step sequence-parallel over the GPUs of one host (one process and one NCCL rank per GPU).
//!
//! Rows: the packed sequence of `S` rows is split into contiguous blocks ([`RowPartition`]: rank `r` holds rows
//! `start_r..end_r` of every batch item, the first `S mod d` ranks one row more). Every rank holds the text, audio
//! and video rows that fall in its block, as the index sets of the inputs place them; the per-row work (input
//! projections, adaLN modulation, norms, the q|k|v, `to_out`, `fc1` and `fc2` GEMMs, SwiGLU, the output heads)
//! runs on those rows only, through the same step code as one GPU ([`Engine::enqueue_step`]) over a workspace
//! sized for the block.
//!
//! Attention of the main rows crosses ranks, one of two ways ([`SpAttention`]):
//! - **Ulysses** (default): Q, K and V of the block are packed head-group-major and exchanged all-to-all
//!   ([`UlyssesPlan`]), so each rank holds every row for `heads / d` heads; attention runs on those heads over the
//!   whole sequence; a second all-to-all sends each output row back to its rank. The degree must divide the
//!   head count (56 heads: 1, 2, 4, 7 or 8 ranks).
//! - **K/V all-gather** ([`KvGatherPlan`]): each rank gathers K and V of every row (blocks padded to `ceil(S/d)`
//!   rows for NCCL's fixed-count all-gather, then compacted) and attends with its own queries over all heads.
//!   More bytes per rank than Ulysses, fewer and larger transfers; any degree works.
//!
//! Every copy between the step's buffers and the exchange buffers, and every byte range a collective sends and
//! receives, is planned in `moves` (pure arithmetic); its tests run those plans on host arrays through
//! `nn::parallel`'s model of the exchanges for degrees 1 to 8, uneven blocks and two batch items.
//!
//! The text path is replicated: every rank runs the token refiner over all text rows (a few hundred rows, a
//! fraction of a percent of a step), and its final norm writes only the text rows in the rank's block (the
//! others carry index -1, which the scatter skips). Replicating costs less than a broadcast would, and each row
//! still has exactly one owner, so ranks never disagree about a value.
//!
//! Outputs: each rank's video and audio velocity rows are all-gathered (blocks padded to the largest rank's
//! count) and scattered back into input order on the host, so every rank returns the full [`H3Output`]: the
//! sampler loop above the DiT then runs the same host arithmetic on every rank and the ranks' latents stay equal
//! without further messages.
//!
//! Collectives run on the step's stream (the communicator is bound to it) in stream order with the kernels, and
//! every one has the communicator's deadline (a dead rank or a lost context aborts it and ends the forward with
//! an error on every live rank). The parallel step runs eagerly: NCCL's non-blocking communicators poll from the
//! host while a collective is enqueued, which does not mix with stream capture, so no CUDA graph is captured in
//! this mode. With one rank the exchanges are self-copies and the result equals the one-GPU step bit for bit
//! (the GPU test `gpu_h3_parallel` checks it).

use std::ops::Range;
use std::sync::Arc;

use tf_cuda::{copy_2d, DeviceBuffer, DeviceViewMut, Stream};

mod moves;
use moves::{KvBytes, OutputBytes, RowCopy, UlyssesBytes};
use tf_nccl::{AllToAllCounts, Comm, DataType};

use super::step::NoProbe;
use super::workspace::{InputRows, RowTables, ShapeKey, Workspace};
use super::{cuda_err, gpu_err, Engine, GpuH3Dit, FIRST_USE_GEMM_BUDGET};
use crate::minimax_h3::dit::{H3Error, H3Inputs, H3Output, H3Rows};
use crate::nn::backend_error::gpu_error;
use crate::nn::gpu::{AttentionInputs, AttentionShape, Strides, HEAD_DIM};
use crate::nn::parallel::{Exchange, HeadPartition, KvGatherPlan, RowPartition, UlyssesPlan};
use crate::nn::tensor::Tensor;
use crate::nn::weights::BF16;

/// How the main rows' attention crosses ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpAttention {
    /// All-to-all of Q, K, V to head groups and of the output back (the degree divides the heads).
    #[default]
    Ulysses,
    /// All-gather of K and V; every rank keeps all heads (any degree).
    KvGather,
}

impl SpAttention {
    /// The option value naming this choice (`ulysses`, `kv-gather`).
    pub fn name(self) -> &'static str {
        match self {
            SpAttention::Ulysses => "ulysses",
            SpAttention::KvGather => "kv-gather",
        }
    }

    /// Parses [`SpAttention::name`]'s values.
    pub fn parse(value: &str) -> Option<SpAttention> {
        match value {
            "ulysses" => Some(SpAttention::Ulysses),
            "kv-gather" => Some(SpAttention::KvGather),
            _ => None,
        }
    }
}

/// What a pipeline hands its DiT to run sequence-parallel: this rank's communicator for the DiT (made once per
/// process on a stream of the rank's device; the DiT's step moves onto that stream) and the attention choice.
#[derive(Clone, Debug)]
pub struct SequenceParallel {
    pub comm: Arc<Comm>,
    pub attention: SpAttention,
}

impl SequenceParallel {
    /// The device ordinal of this rank (its communicator's).
    pub fn device(&self) -> i32 {
        self.comm.stream().context().ordinal()
    }

    /// The context of this rank's communicator: the process's one context, which the pipeline loads into, since
    /// the DiT's step runs on the communicator's stream.
    pub fn context(&self) -> tf_cuda::Context {
        self.comm.stream().context()
    }

    /// The communicator's stream: the rank's pipeline runs every component on it, so the DiT's collectives
    /// and every kernel of a request run in one order.
    pub fn stream(&self) -> Arc<tf_cuda::Stream> {
        Arc::clone(self.comm.stream())
    }
}

impl PartialEq for SequenceParallel {
    /// The same communicator and the same attention choice.
    fn eq(&self, other: &SequenceParallel) -> bool {
        Arc::ptr_eq(&self.comm, &other.comm) && self.attention == other.attention
    }
}

/// A rank's communicator and attention choice, held by the engine while it runs sequence-parallel.
pub(super) struct SpState {
    comm: Arc<Comm>,
    attention: SpAttention,
}

fn collective(what: &'static str) -> impl FnOnce(tf_nccl::NcclError) -> H3Error {
    move |e| H3Error::Gpu(gpu_error(what, e))
}

fn internal(why: &str) -> H3Error {
    H3Error::Backend(format!("internal (sequence parallel): {why}"))
}

fn overflow(what: &str) -> H3Error {
    H3Error::Input(format!(
        "sequence parallel: the {what} does not fit in memory"
    ))
}

fn mul(what: &str, factors: &[usize]) -> Result<usize, H3Error> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| overflow(what))
}

/// One rank's share of one forward: its block of rows, the shapes of its workspace and which input rows of each
/// rank's block are video and audio rows (for the output gather). Pure host arithmetic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RankPlan {
    pub rank: usize,
    pub world: usize,
    pub rows: RowPartition,
    /// This rank's sequence rows (per batch item).
    pub block: Range<usize>,
    /// The whole forward's shape.
    pub global: ShapeKey,
    /// This rank's workspace shape: its block's rows, video and audio rows, and all text rows (the refiner runs
    /// on every rank).
    pub local: ShapeKey,
    /// Per rank, the video (audio) input rows whose sequence rows it holds, ascending.
    pub video: Vec<Vec<usize>>,
    pub audio: Vec<Vec<usize>>,
}

impl RankPlan {
    /// The share of `rank` of `world` ranks of the validated `rows`.
    pub(super) fn new(rows: &H3Rows, rank: usize, world: usize) -> Result<RankPlan, H3Error> {
        let partition = RowPartition::new(rows.seq_len, world)
            .map_err(|e| H3Error::Input(format!("sequence parallel: {e}")))?;
        if rank >= world {
            return Err(internal(&format!("rank {rank} of {world}")));
        }
        if rows.seq_len < world {
            return Err(H3Error::Input(format!(
                "the packed sequence has {} rows, fewer than the {world} ranks; run it on fewer GPUs",
                rows.seq_len
            )));
        }
        let owners = |positions: &[usize]| -> Vec<Vec<usize>> {
            let mut per_rank = vec![Vec::new(); world];
            for (i, &row) in positions.iter().enumerate() {
                if let Some(r) = partition.rank_of(row) {
                    per_rank[r].push(i);
                }
            }
            per_rank
        };
        let video = owners(&rows.video_rows);
        let audio = owners(&rows.audio_rows);
        let global = ShapeKey::of(rows);
        let block = partition.rows(rank);
        let local = ShapeKey {
            seq: block.len(),
            video: video[rank].len(),
            audio: audio[rank].len(),
            ..global
        };
        Ok(RankPlan {
            rank,
            world,
            rows: partition,
            block,
            global,
            local,
            video,
            audio,
        })
    }

    /// The most video (audio) rows any rank holds: the padded block of the output gather.
    pub(super) fn max_video(&self) -> usize {
        self.video.iter().map(Vec::len).max().unwrap_or(0)
    }

    pub(super) fn max_audio(&self) -> usize {
        self.audio.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The rows of this rank's block as a forward of their own: positions, modulation rows and the video and audio
    /// rows relative to the block (for the sinusoid, the RoPE tables and [`RowTables::of`]).
    pub(super) fn local_rows(&self, rows: &H3Rows) -> H3Rows {
        let start = self.block.start;
        let local = |all: &[usize], mine: &[usize]| mine.iter().map(|&i| all[i] - start).collect();
        H3Rows {
            batch: rows.batch,
            seq_len: self.block.len(),
            video_rows: local(&rows.video_rows, &self.video[self.rank]),
            audio_rows: local(&rows.audio_rows, &self.audio[self.rank]),
            text_rows: rows
                .text_rows
                .iter()
                .filter(|r| self.block.contains(r))
                .map(|&r| r - start)
                .collect(),
            timesteps: rows.timesteps.clone(),
            adaln_rows: rows.adaln_rows[self.block.clone()].to_vec(),
            timestep_rows: rows.timestep_rows[self.block.clone()].to_vec(),
            positions: rows.positions[self.block.clone()].to_vec(),
        }
    }

    /// The row tables of this rank: its block's, except the text index, which lists every text row (the refiner
    /// runs on all of them) with -1 for those outside the block (the refiner's final norm skips them).
    pub(super) fn tables(&self, rows: &H3Rows) -> Result<RowTables, H3Error> {
        let mut tables = RowTables::of(&self.local_rows(rows))?;
        let n = self.block.len();
        let mut text = Vec::with_capacity(rows.batch * rows.text_rows.len());
        for b in 0..rows.batch {
            for &r in &rows.text_rows {
                text.push(if self.block.contains(&r) {
                    i32::try_from(b * n + r - self.block.start)
                        .map_err(|_| overflow("text row index"))?
                } else {
                    -1
                });
            }
        }
        tables.text = text;
        Ok(tables)
    }

    /// This rank's rows of a `[batch, rows, cols]` input: the rows `mine` of every item.
    fn select(data: &[f32], batch: usize, rows: usize, cols: usize, mine: &[usize]) -> Vec<f32> {
        let mut out = Vec::with_capacity(batch * mine.len() * cols);
        for b in 0..batch {
            for &i in mine {
                let at = (b * rows + i) * cols;
                out.extend_from_slice(&data[at..at + cols]);
            }
        }
        out
    }

    /// The video and audio input rows of this rank, item by item.
    pub(super) fn local_inputs(&self, inputs: &H3Inputs) -> (Vec<f32>, Vec<f32>) {
        let take = |t: &Tensor<f32>, mine: &[usize]| {
            let s = t.shape();
            let (rows, cols) = (
                s.get(1).copied().unwrap_or(0),
                s.get(2).copied().unwrap_or(0),
            );
            RankPlan::select(t.data(), self.global.batch, rows, cols, mine)
        };
        (
            take(&inputs.hidden_states, &self.video[self.rank]),
            take(&inputs.audio_hidden_states, &self.audio[self.rank]),
        )
    }

    /// Elements of one rank's slot of the output gather: its video rows, then its audio rows, each padded to the
    /// largest rank's count, for every item.
    pub(super) fn gather_slot(
        &self,
        video_cols: usize,
        audio_cols: usize,
    ) -> Result<usize, H3Error> {
        let v = mul(
            "output gather",
            &[self.global.batch, self.max_video(), video_cols],
        )?;
        let a = mul(
            "output gather",
            &[self.global.batch, self.max_audio(), audio_cols],
        )?;
        v.checked_add(a).ok_or_else(|| overflow("output gather"))
    }

    /// The full outputs from the gathered slots of every rank (`slots[r]` is rank `r`'s slot).
    pub(super) fn scatter_outputs(
        &self,
        gathered: &[f32],
        video_cols: usize,
        audio_cols: usize,
    ) -> Result<H3Output, H3Error> {
        let batch = self.global.batch;
        let slot = self.gather_slot(video_cols, audio_cols)?;
        if gathered.len() != slot * self.world {
            return Err(internal(&format!(
                "the output gather holds {} values, {} ranks x {slot} expected",
                gathered.len(),
                self.world
            )));
        }
        let (mv, ma) = (self.max_video(), self.max_audio());
        let mut sample = vec![0f32; batch * self.global.video * video_cols];
        let mut audio = vec![0f32; batch * self.global.audio * audio_cols];
        for (r, data) in gathered
            .chunks_exact(slot.max(1))
            .enumerate()
            .take(self.world)
        {
            let (vpart, apart) = data.split_at(batch * mv * video_cols);
            for b in 0..batch {
                for (j, &i) in self.video[r].iter().enumerate() {
                    let src = (b * mv + j) * video_cols;
                    let dst = (b * self.global.video + i) * video_cols;
                    sample[dst..dst + video_cols].copy_from_slice(&vpart[src..src + video_cols]);
                }
                for (j, &i) in self.audio[r].iter().enumerate() {
                    let src = (b * ma + j) * audio_cols;
                    let dst = (b * self.global.audio + i) * audio_cols;
                    audio[dst..dst + audio_cols].copy_from_slice(&apart[src..src + audio_cols]);
                }
            }
        }
        Ok(H3Output {
            sample: Tensor::new(vec![batch, self.global.video, video_cols], sample)?,
            audio_sample: Tensor::new(vec![batch, self.global.audio, audio_cols], audio)?,
        })
    }
}

/// The exchange buffers of one attention strategy.
enum ExchangeBuffers {
    Ulysses {
        plan: UlyssesPlan,
        /// `[q|k|v][batch][rank][block rows][group]`, reused as `[batch][rank][block rows][group]` for the way
        /// back.
        send: DeviceBuffer,
        /// `[q|k|v][batch][S][group]`: every row of this rank's heads.
        recv: DeviceBuffer,
        /// `[batch][S][group]`: the attention output of this rank's heads.
        out: DeviceBuffer,
    },
    KvGather {
        plan: KvGatherPlan,
        /// `[k|v][batch][padded rows][width]`.
        send: DeviceBuffer,
        /// `[rank][k|v][batch][padded rows][width]`.
        gathered: DeviceBuffer,
        /// `[k|v][batch][S][width]`: the compacted keys and values.
        full: DeviceBuffer,
    },
}

/// A sequence-parallel workspace's plan and exchange buffers.
pub(super) struct SpBuffers {
    plan: RankPlan,
    exchange: ExchangeBuffers,
    /// This rank's slot of the output gather and every rank's slots (f32).
    out_send: DeviceBuffer,
    out_recv: DeviceBuffer,
}

fn alloc(ctx: &tf_cuda::Context, bytes: usize, what: &str) -> Result<DeviceBuffer, H3Error> {
    DeviceBuffer::alloc(ctx, bytes.max(1)).map_err(|e| {
        H3Error::Gpu(gpu_error(
            format!("allocating the sequence-parallel {what} buffer ({bytes} B)"),
            e,
        ))
    })
}

/// Runs one planned copy ([`moves::RowCopy`]) from `src` into `dst` on `stream`.
fn copy_rows(
    dst: &mut DeviceBuffer,
    src: &DeviceBuffer,
    c: &RowCopy,
    stream: &Stream,
) -> Result<(), H3Error> {
    if c.width == 0 || c.height == 0 {
        return Ok(());
    }
    let span = |pitch: usize| {
        (c.height - 1)
            .checked_mul(pitch)
            .and_then(|v| v.checked_add(c.width))
            .ok_or_else(|| overflow("row copy"))
    };
    let what = "copying rows between the step and the exchange buffers";
    let from = src
        .slice(c.src, span(c.src_pitch)?)
        .map_err(cuda_err(what))?;
    let mut to = dst
        .slice_mut(c.dst, span(c.dst_pitch)?)
        .map_err(cuda_err(what))?;
    copy_2d(
        &mut to,
        c.dst_pitch,
        from,
        c.src_pitch,
        c.width,
        c.height,
        stream,
    )
    .map_err(cuda_err(what))
}

/// Runs every copy of `copies`.
fn copy_all(
    dst: &mut DeviceBuffer,
    src: &DeviceBuffer,
    copies: &[RowCopy],
    stream: &Stream,
) -> Result<(), H3Error> {
    copies
        .iter()
        .try_for_each(|c| copy_rows(dst, src, c, stream))
}

/// Writable views of the byte ranges `ranges` of `buf`, which must be ascending and disjoint.
fn views_mut(
    buf: &mut DeviceBuffer,
    ranges: impl Iterator<Item = Range<usize>>,
) -> Result<Vec<DeviceViewMut<'_>>, H3Error> {
    let what = "splitting an exchange buffer";
    let mut rest = buf.view_mut();
    let mut at = 0;
    let mut out = Vec::new();
    for r in ranges {
        let skip = r
            .start
            .checked_sub(at)
            .ok_or_else(|| internal("overlapping receive ranges"))?;
        let (_, tail) = rest.split_at(skip).map_err(cuda_err(what))?;
        let (piece, tail) = tail.split_at(r.len()).map_err(cuda_err(what))?;
        out.push(piece);
        rest = tail;
        at = r.end;
    }
    Ok(out)
}

/// Read-only views of the byte ranges `ranges` of `buf`.
fn views(
    buf: &DeviceBuffer,
    ranges: impl Iterator<Item = Range<usize>>,
) -> Result<Vec<tf_cuda::DeviceView<'_>>, H3Error> {
    ranges
        .map(|r| buf.slice(r.start, r.len()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(cuda_err("addressing an exchange buffer"))
}

fn counts(x: &Exchange) -> AllToAllCounts {
    AllToAllCounts {
        send_counts: x.send_counts.clone(),
        send_offsets: x.send_offsets.clone(),
        recv_counts: x.recv_counts.clone(),
        recv_offsets: x.recv_offsets.clone(),
    }
}

impl SpBuffers {
    fn new(engine: &Engine, plan: RankPlan, attention: SpAttention) -> Result<SpBuffers, H3Error> {
        let d = &engine.dims;
        let ctx = &engine.ctx;
        let (batch, s, n, world) = (
            plan.global.batch,
            plan.global.seq,
            plan.block.len(),
            plan.world,
        );
        let planned = |e: crate::nn::parallel::PartitionError| {
            H3Error::Input(format!("sequence parallel: {e}"))
        };
        let exchange = match attention {
            SpAttention::Ulysses => {
                let u = UlyssesPlan::new(&plan.rows, d.heads, HEAD_DIM).map_err(planned)?;
                let group = u.heads().count() * HEAD_DIM;
                // The checked products first; the layout's lengths below are then in range.
                mul("Ulysses send", &[3, batch, world, n, group, BF16])?;
                mul("Ulysses receive", &[3, batch, s, group, BF16])?;
                let m = UlyssesBytes {
                    batch,
                    world,
                    rows: n,
                    seq: s,
                    width: d.width * BF16,
                    group: group * BF16,
                };
                ExchangeBuffers::Ulysses {
                    send: alloc(ctx, m.send_len(), "Ulysses send")?,
                    recv: alloc(ctx, m.recv_len(), "Ulysses receive")?,
                    out: alloc(ctx, m.plane_len(), "Ulysses output")?,
                    plan: u,
                }
            }
            SpAttention::KvGather => {
                let g = KvGatherPlan::new(&plan.rows, d.heads, HEAD_DIM).map_err(planned)?;
                let padded = g.padded_rows();
                let send = mul("K/V send", &[2, batch, padded, d.width, BF16])?;
                ExchangeBuffers::KvGather {
                    send: alloc(ctx, send, "K/V send")?,
                    gathered: alloc(ctx, mul("K/V gather", &[world, send])?, "K/V gather")?,
                    full: alloc(ctx, mul("K/V", &[2, batch, s, d.width, BF16])?, "K/V")?,
                    plan: g,
                }
            }
        };
        let slot = plan.gather_slot(d.video, d.audio)?;
        Ok(SpBuffers {
            out_send: alloc(ctx, mul("output gather", &[slot, 4])?, "output gather")?,
            out_recv: alloc(
                ctx,
                mul("output gather", &[world, slot, 4])?,
                "output gather",
            )?,
            exchange,
            plan,
        })
    }
}

impl Engine {
    /// The main rows' attention across ranks when the engine runs sequence-parallel; `false` (nothing done) on one
    /// GPU or for the refiner's rows, which attend locally.
    pub(super) fn sequence_parallel_attention(
        &self,
        ws: &mut Workspace,
        main: bool,
    ) -> Result<bool, H3Error> {
        let Some(sp) = self.parallel.as_ref() else {
            return Ok(false);
        };
        if !main {
            return Ok(false);
        }
        let Workspace {
            qkv,
            attn,
            parallel,
            key,
            ..
        } = ws;
        let bufs = parallel
            .as_mut()
            .ok_or_else(|| internal("a sequence-parallel step without its exchange buffers"))?;
        let plan = &bufs.plan;
        match &mut bufs.exchange {
            ExchangeBuffers::Ulysses {
                plan: u,
                send,
                recv,
                out,
            } => self.ulysses(&sp.comm, plan, u, qkv, attn, send, recv, out, key.batch),
            ExchangeBuffers::KvGather {
                plan: g,
                send,
                gathered,
                full,
            } => self.kv_gather(
                &sp.comm, plan, g, qkv, attn, send, gathered, full, key.batch,
            ),
        }?;
        Ok(true)
    }

    /// Ulysses: pack Q, K, V head-group-major, all-to-all to head groups, attention over every row of this rank's
    /// heads, all-to-all back, unpack into the block's attention rows.
    #[allow(clippy::too_many_arguments)]
    fn ulysses(
        &self,
        comm: &Comm,
        plan: &RankPlan,
        u: &UlyssesPlan,
        qkv: &DeviceBuffer,
        attn: &mut DeviceBuffer,
        send: &mut DeviceBuffer,
        recv: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
        batch: usize,
    ) -> Result<(), H3Error> {
        let d = &self.dims;
        let s = plan.global.seq;
        let heads = u.heads().count();
        let group = heads * HEAD_DIM;
        let m = UlyssesBytes {
            batch,
            world: plan.world,
            rows: plan.block.len(),
            seq: s,
            width: d.width * BF16,
            group: group * BF16,
        };
        let st = &self.stream;
        copy_all(send, qkv, &m.pack(), st)?;
        let to_heads = u
            .to_heads(plan.rank)
            .ok_or_else(|| internal("no Ulysses exchange for this rank"))?;
        {
            let ranges = m.heads_exchange();
            let sends = views(send, ranges.iter().map(|(s, _)| s.clone()))?;
            let recvs = views_mut(recv, ranges.iter().map(|(_, r)| r.clone()))?;
            let mut pairs: Vec<_> = sends.into_iter().zip(recvs).collect();
            // SAFETY: every view lies in buffers of this engine's context, the communicator's (its stream is the
            // engine's stream); the buffers live in the workspace, which outlives the queued work (the forward
            // waits for the stream before returning, and the engine's Drop synchronizes it).
            unsafe { comm.all_to_all(&mut pairs, &counts(to_heads), DataType::Bf16) }
                .map_err(collective("Ulysses all-to-all to head groups"))?;
        }
        {
            let what = "addressing the head-sharded Q, K, V";
            let plane = m.plane_len();
            let q = recv.slice(0, plane).map_err(cuda_err(what))?;
            let k = recv.slice(plane, plane).map_err(cuda_err(what))?;
            let v = recv.slice(2 * plane, plane).map_err(cuda_err(what))?;
            let strides = Strides {
                batch: s * group,
                row: group,
            };
            let scale = 1.0 / (d.head_dim as f32).sqrt();
            let inputs = AttentionInputs::self_attention(&q, &k, &v, strides, scale);
            let shape = AttentionShape {
                batch,
                num_queries: s,
                num_keys: s,
                prefix_len: 0,
                num_heads: heads,
                num_kv_heads: heads,
            };
            let mut o = out.view_mut();
            self.kernels
                .attention_with(st, self.tile, shape, &inputs, &mut o, strides)
                .map_err(gpu_err("attention over this rank's heads"))?;
        }
        let to_rows = u
            .to_rows(plan.rank)
            .ok_or_else(|| internal("no Ulysses exchange for this rank"))?;
        {
            let ranges = m.rows_exchange();
            let sends = views(out, ranges.iter().map(|(s, _)| s.clone()))?;
            let recvs = views_mut(send, ranges.iter().map(|(_, r)| r.clone()))?;
            let mut pairs: Vec<_> = sends.into_iter().zip(recvs).collect();
            // SAFETY: as for the exchange to head groups.
            unsafe { comm.all_to_all(&mut pairs, &counts(&to_rows), DataType::Bf16) }
                .map_err(collective("Ulysses all-to-all back to row blocks"))?;
        }
        copy_all(attn, send, &m.unpack(), st)
    }

    /// K/V all-gather: pack this block's K and V (padded), gather every rank's, compact them into the whole
    /// sequence, attend with the block's queries over all heads.
    #[allow(clippy::too_many_arguments)]
    fn kv_gather(
        &self,
        comm: &Comm,
        plan: &RankPlan,
        g: &KvGatherPlan,
        qkv: &DeviceBuffer,
        attn: &mut DeviceBuffer,
        send: &mut DeviceBuffer,
        gathered: &mut DeviceBuffer,
        full: &mut DeviceBuffer,
        batch: usize,
    ) -> Result<(), H3Error> {
        let d = &self.dims;
        let (n, s) = (plan.block.len(), plan.global.seq);
        let m = KvBytes {
            batch,
            world: plan.world,
            rows: n,
            seq: s,
            padded: g.padded_rows(),
            width: d.width * BF16,
        };
        let st = &self.stream;
        copy_all(send, qkv, &m.pack(), st)?;
        let count = m.send_len() / BF16;
        // SAFETY: as for the Ulysses exchange: buffers of the engine's context, alive past the queued work.
        unsafe { comm.all_gather(send.view(), gathered.view_mut(), count, DataType::Bf16) }
            .map_err(collective("all-gather of K and V"))?;
        copy_all(full, gathered, &m.compact(&plan.rows), st)?;
        let what = "addressing the gathered K and V";
        let plane = m.plane_len();
        let q = qkv.view();
        let k = full.slice(0, plane).map_err(cuda_err(what))?;
        let v = full.slice(plane, plane).map_err(cuda_err(what))?;
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let mut inputs = AttentionInputs::self_attention(
            &q,
            &k,
            &v,
            Strides {
                batch: s * d.width,
                row: d.width,
            },
            scale,
        );
        inputs.q_strides = Strides {
            batch: n * 3 * d.width,
            row: 3 * d.width,
        };
        let shape = AttentionShape {
            batch,
            num_queries: n,
            num_keys: s,
            prefix_len: 0,
            num_heads: d.heads,
            num_kv_heads: d.heads,
        };
        let mut o = attn.view_mut();
        let o_strides = Strides {
            batch: n * d.width,
            row: d.width,
        };
        self.kernels
            .attention_with(st, self.tile, shape, &inputs, &mut o, o_strides)
            .map_err(gpu_err(
                "attention of the block's queries over the gathered keys",
            ))
    }
}

impl GpuH3Dit {
    /// The stream every step runs on.
    pub fn stream(&self) -> Arc<Stream> {
        Arc::clone(&self.engine.stream)
    }

    /// Runs every later forward sequence-parallel as rank `comm.rank()` of `comm.world_size()` (see the module
    /// documentation); every rank must call [`super::H3DitBackend::forward`] with the same inputs. The step moves
    /// onto the communicator's stream (once the current stream is idle), so collectives and kernels run in one
    /// order; the communicator must live on this model's device. Refuses a degree the attention choice cannot
    /// split (Ulysses: the degree must divide the heads). Drops the workspaces made so far (their shapes were
    /// whole sequences).
    pub fn set_sequence_parallel(
        &mut self,
        comm: Arc<Comm>,
        attention: SpAttention,
    ) -> Result<(), H3Error> {
        if self.engine.dims.attention8 {
            return Err(H3Error::Backend(
                "the 8-bit attention (attn=int8-fp8) runs on one GPU only; drop attn=int8-fp8 from the \
                 precision to run sequence-parallel"
                    .into(),
            ));
        }
        let comm_ctx = comm.stream().context();
        let device = comm_ctx.ordinal();
        if device != self.engine.ctx.ordinal() {
            return Err(H3Error::Backend(format!(
                "the sequence-parallel communicator lives on device {device}, the DiT on device {}",
                self.engine.ctx.ordinal()
            )));
        }
        // The step's GEMMs and buffers belong to the DiT's context; the communicator's stream must too.
        if !comm_ctx.same_as(&self.engine.ctx) {
            return Err(H3Error::Backend(
                "the sequence-parallel communicator's stream was made in another context than the DiT's; \
                 load the DiT into the communicator's context (one context per process)"
                    .into(),
            ));
        }
        let world = comm.world_size();
        if attention == SpAttention::Ulysses {
            HeadPartition::new(self.engine.config.num_attention_heads, world)
                .map_err(|e| H3Error::Input(format!("sequence parallel: {e}")))?;
        }
        RowPartition::new(1, world)
            .map_err(|e| H3Error::Input(format!("sequence parallel: {e}")))?;
        self.workspaces.clear();
        if !Arc::ptr_eq(comm.stream(), &self.engine.stream) {
            self.engine.stream.synchronize().map_err(cuda_err(
                "finishing the work queued before sequence parallelism",
            ))?;
            self.engine.stream = Arc::clone(comm.stream());
        }
        self.engine.parallel = Some(SpState { comm, attention });
        Ok(())
    }

    /// [`GpuH3Dit::set_sequence_parallel`] unless this engine already runs with `sp`'s communicator and choice.
    pub fn attach(&mut self, sp: &SequenceParallel) -> Result<(), H3Error> {
        if let Some(held) = &self.engine.parallel {
            if Arc::ptr_eq(&held.comm, &sp.comm) && held.attention == sp.attention {
                return Ok(());
            }
        }
        self.set_sequence_parallel(Arc::clone(&sp.comm), sp.attention)
    }

    /// This engine's `(rank, world size, attention)` when it runs sequence-parallel.
    pub fn sequence_parallel(&self) -> Option<(usize, usize, SpAttention)> {
        self.engine
            .parallel
            .as_ref()
            .map(|sp| (sp.comm.rank(), sp.comm.world_size(), sp.attention))
    }

    /// Back to one GPU: forgets the communicator (dropping the engine's reference) and the parallel workspaces.
    pub fn clear_sequence_parallel(&mut self) {
        if self.engine.parallel.take().is_some() {
            self.workspaces.clear();
        }
    }

    /// The workspace of this rank's share of a forward, made (with its exchange buffers, its GEMMs planned) on
    /// first use.
    fn parallel_workspace(&mut self, plan: RankPlan) -> Result<usize, H3Error> {
        let attention = self
            .engine
            .parallel
            .as_ref()
            .map(|sp| sp.attention)
            .ok_or_else(|| internal("no communicator"))?;
        let engine = &self.engine;
        self.workspaces.find_or_make(
            |w| w.key == plan.local && w.parallel.as_ref().is_some_and(|p| p.plan == plan),
            || {
                let shapes = engine.gemm_shapes(&plan.local)?;
                engine
                    .gemms
                    .prepare_first_use(&shapes, FIRST_USE_GEMM_BUDGET, &engine.stream)
                    .map_err(gpu_err("planning the step's GEMMs"))?;
                let mut ws = Workspace::new(&engine.ctx, &engine.dims, plan.local)?;
                ws.parallel = Some(SpBuffers::new(engine, plan.clone(), attention)?);
                Ok(ws)
            },
        )
    }

    /// One sequence-parallel forward: this rank's rows through the step, attention across ranks, every rank's
    /// outputs gathered.
    pub(super) fn forward_parallel(&mut self, inputs: &H3Inputs) -> Result<H3Output, H3Error> {
        let (comm, rank, world) = match self.engine.parallel.as_ref() {
            Some(sp) => (Arc::clone(&sp.comm), sp.comm.rank(), sp.comm.world_size()),
            None => return Err(internal("no communicator")),
        };
        let rows = H3Rows::build(&self.engine.config, inputs)?;
        let plan = RankPlan::new(&rows, rank, world)?;
        let local_rows = plan.local_rows(&rows);
        let tables = plan.tables(&rows)?;
        let (video, audio) = plan.local_inputs(inputs);
        let index = self.parallel_workspace(plan)?;
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        let parts = InputRows {
            video: &video,
            audio: &audio,
            text: inputs.encoder_hidden_states.data(),
        };
        engine.upload_parts(ws, &local_rows, &tables, &parts)?;
        engine.enqueue_step(ws, &mut NoProbe)?;
        ws.warmed = true;
        let d = &engine.dims;
        let Workspace {
            sample,
            audio_sample,
            parallel,
            ..
        } = ws;
        let bufs = parallel
            .as_mut()
            .ok_or_else(|| internal("a sequence-parallel workspace without its buffers"))?;
        let plan = &bufs.plan;
        let m = OutputBytes {
            batch: plan.global.batch,
            video_rows: plan.local.video,
            audio_rows: plan.local.audio,
            max_video: plan.max_video(),
            max_audio: plan.max_audio(),
            video_row: d.video * 4,
            audio_row: d.audio * 4,
        };
        let st = &engine.stream;
        copy_all(&mut bufs.out_send, sample, &m.video(), st)?;
        copy_all(&mut bufs.out_send, audio_sample, &m.audio(), st)?;
        let slot = plan.gather_slot(d.video, d.audio)?;
        // SAFETY: both buffers belong to this workspace (the communicator's context); the wait below precedes any
        // drop.
        unsafe {
            comm.all_gather(
                bufs.out_send.view(),
                bufs.out_recv.view_mut(),
                slot,
                DataType::F32,
            )
        }
        .map_err(collective("all-gather of the output rows"))?;
        // The communicator's wait has a deadline (a plain stream wait would not).
        comm.synchronize()
            .map_err(collective("running the sequence-parallel H3 DiT step"))?;
        let gathered: Vec<f32> = bufs
            .out_recv
            .slice(0, world * slot * 4)
            .and_then(|v| v.to_vec())
            .map_err(cuda_err("downloading the gathered outputs"))?;
        plan.scatter_outputs(&gathered, d.video, d.audio)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 text rows, 3 video rows, 2 audio rows interleaved over 7 rows; 2 timesteps; batch 2.
    fn rows() -> H3Rows {
        H3Rows {
            batch: 2,
            seq_len: 7,
            video_rows: vec![2, 3, 6],
            audio_rows: vec![4, 5],
            text_rows: vec![0, 1],
            timesteps: vec![0.25, 0.999],
            adaln_rows: vec![1, 1, 3, 3, 2, 2, 0],
            timestep_rows: vec![0, 0, 1, 1, 0, 0, 0],
            positions: (0..7)
                .map(|i| [i as f32, 0.5 * i as f32, -(i as f32)])
                .collect(),
        }
    }

    #[test]
    fn one_rank_holds_everything_with_the_one_gpu_tables() {
        let r = rows();
        let plan = RankPlan::new(&r, 0, 1).unwrap();
        assert_eq!(plan.local, plan.global);
        assert_eq!(plan.local_rows(&r), r);
        assert_eq!(plan.tables(&r).unwrap(), RowTables::of(&r).unwrap());
    }

    #[test]
    fn every_row_has_one_owner_for_every_degree() {
        let r = rows();
        for world in 1..=7 {
            let plans: Vec<RankPlan> = (0..world)
                .map(|rank| RankPlan::new(&r, rank, world).unwrap())
                .collect();
            // Blocks tile the sequence; the uneven ones differ by one row.
            let total: usize = plans.iter().map(|p| p.block.len()).sum();
            assert_eq!(total, 7, "world {world}");
            let sizes: Vec<usize> = plans.iter().map(|p| p.block.len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            // Every text row is written by exactly one rank, at its local row of every item.
            for b in 0..2 {
                for (t, &row) in r.text_rows.iter().enumerate() {
                    let writers: Vec<(usize, i32)> = plans
                        .iter()
                        .map(|p| (p.rank, p.tables(&r).unwrap().text[b * 2 + t]))
                        .filter(|&(_, v)| v >= 0)
                        .collect();
                    assert_eq!(writers.len(), 1, "world {world}: text row {row}");
                    let (owner, local) = writers[0];
                    let p = &plans[owner];
                    assert!(p.block.contains(&row));
                    assert_eq!(local as usize, b * p.block.len() + row - p.block.start);
                }
            }
            // Video and audio inputs are split without loss, each to the rank holding its row.
            let mut video: Vec<usize> = plans[0].video.iter().flatten().copied().collect();
            video.sort_unstable();
            assert_eq!(video, vec![0, 1, 2]);
            for p in &plans {
                assert_eq!(
                    p.video, plans[0].video,
                    "every rank knows every rank's rows"
                );
                for &i in &p.video[p.rank] {
                    assert!(p.block.contains(&r.video_rows[i]));
                }
                let local = p.local_rows(&r);
                assert_eq!(local.positions, r.positions[p.block.clone()].to_vec());
                assert_eq!(local.adaln_rows.len(), p.block.len());
                assert_eq!(p.local.video, local.video_rows.len());
                assert!(local.video_rows.iter().all(|&v| v < p.block.len()));
            }
        }
    }

    #[test]
    fn outputs_gathered_from_every_rank_come_back_in_input_order() {
        let r = rows();
        let (cv, ca) = (2, 3);
        for world in 1..=7 {
            let plans: Vec<RankPlan> = (0..world)
                .map(|rank| RankPlan::new(&r, rank, world).unwrap())
                .collect();
            let slot = plans[0].gather_slot(cv, ca).unwrap();
            let (mv, ma) = (plans[0].max_video(), plans[0].max_audio());
            // Each rank fills its slot with the value its rows would have: item * 1000 + input row * 10 + column.
            let mut gathered = vec![f32::NAN; world * slot];
            for p in &plans {
                let base = p.rank * slot;
                for b in 0..2 {
                    for (j, &i) in p.video[p.rank].iter().enumerate() {
                        for c in 0..cv {
                            gathered[base + (b * mv + j) * cv + c] = (b * 1000 + i * 10 + c) as f32;
                        }
                    }
                    for (j, &i) in p.audio[p.rank].iter().enumerate() {
                        for c in 0..ca {
                            gathered[base + 2 * mv * cv + (b * ma + j) * ca + c] =
                                (b * 1000 + i * 10 + c) as f32 + 0.5;
                        }
                    }
                }
            }
            let out = plans[0].scatter_outputs(&gathered, cv, ca).unwrap();
            assert_eq!(out.sample.shape(), &[2, 3, cv]);
            for b in 0..2 {
                for i in 0..3 {
                    for c in 0..cv {
                        assert_eq!(
                            out.sample.data()[(b * 3 + i) * cv + c],
                            (b * 1000 + i * 10 + c) as f32
                        );
                    }
                }
                for i in 0..2 {
                    for c in 0..ca {
                        assert_eq!(
                            out.audio_sample.data()[(b * 2 + i) * ca + c],
                            (b * 1000 + i * 10 + c) as f32 + 0.5
                        );
                    }
                }
            }
            assert!(plans[0].scatter_outputs(&gathered[1..], cv, ca).is_err());
        }
    }

    #[test]
    fn local_inputs_are_the_rows_of_the_block() {
        let r = rows();
        // hidden_states [2, 3, 2]: value = item * 100 + row * 10 + column.
        let video: Vec<f32> = (0..2)
            .flat_map(|b| {
                (0..3).flat_map(move |i| (0..2).map(move |c| (b * 100 + i * 10 + c) as f32))
            })
            .collect();
        let plan = RankPlan::new(&r, 1, 2).unwrap();
        // Rank 1 holds rows 4..7: video input row 2 (row 6), audio input rows 0 and 1 (rows 4, 5).
        assert_eq!(plan.block, 4..7);
        assert_eq!(plan.video[1], vec![2]);
        assert_eq!(plan.audio[1], vec![0, 1]);
        assert_eq!(
            RankPlan::select(&video, 2, 3, 2, &plan.video[1]),
            vec![20.0, 21.0, 120.0, 121.0]
        );
    }

    #[test]
    fn more_ranks_than_rows_are_refused() {
        let mut r = rows();
        r.seq_len = 7;
        let err = RankPlan::new(&r, 0, 8).unwrap_err().to_string();
        assert!(err.contains("fewer than the 8 ranks"), "{err}");
        assert!(RankPlan::new(&r, 3, 2).is_err());
        assert!(RankPlan::new(&r, 0, 9).is_err());
    }

    #[test]
    fn attention_choices_parse_by_name() {
        for a in [SpAttention::Ulysses, SpAttention::KvGather] {
            assert_eq!(SpAttention::parse(a.name()), Some(a));
        }
        assert_eq!(SpAttention::parse("ring"), None);
        assert_eq!(SpAttention::default(), SpAttention::Ulysses);
    }
}
