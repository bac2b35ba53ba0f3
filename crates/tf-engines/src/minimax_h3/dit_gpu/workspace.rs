//! Per-shape workspaces of the H3 DiT step: the key a workspace (and its captured graph) is kept under, the byte
//! size of every buffer (checked arithmetic on request sizes), and the per-forward tables uploaded before each step
//! (row indices, adaLN rows, RoPE cos/sin in bf16, the sinusoid, the inputs). Everything that depends on the
//! inputs' values rather than their sizes is uploaded per forward, so one captured graph serves every request of
//! its shape.

use tf_cuda::{Context, DeviceBuffer, Stream};

use super::weights::Dims;
use super::{cuda_err, Engine, MAX_GRAPHS};
use crate::minimax_h3::config::MODALITIES;
use crate::minimax_h3::dit::{H3Error, H3Inputs, H3Rows};
use crate::nn::backend_error::gpu_error;
use crate::nn::gpu::attention_8bit::Attention8bitKernels;
use crate::nn::gpu::graph_cache::GraphCache;
use crate::nn::gpu::AttentionShape;
use crate::nn::host;
use crate::nn::weights::{le_bytes, ALIGN, BF16};

/// What a captured step graph records: the workspace's shape, and whether the timestep tables are remade in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepGraph {
    pub key: ShapeKey,
    pub tables: bool,
}

/// The sizes of one forward: what a workspace and its captured step depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShapeKey {
    pub batch: usize,
    /// Packed sequence rows per batch item.
    pub seq: usize,
    /// Video, audio and text rows per batch item.
    pub video: usize,
    pub audio: usize,
    pub text: usize,
    /// Distinct timesteps.
    pub timesteps: usize,
}

impl ShapeKey {
    /// The key of validated inputs.
    pub fn of(rows: &H3Rows) -> ShapeKey {
        ShapeKey {
            batch: rows.batch,
            seq: rows.seq_len,
            video: rows.video_rows.len(),
            audio: rows.audio_rows.len(),
            text: rows.text_rows.len(),
            timesteps: rows.timesteps.len(),
        }
    }
}

fn overflow(what: &str) -> H3Error {
    H3Error::Input(format!("the workspace's {what} does not fit in memory"))
}

fn product(what: &str, factors: &[usize]) -> Result<usize, H3Error> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| overflow(what))
}

/// The shape of a block's self-attention over `rows` rows of each of `batch` samples (the main rows, `key.seq`,
/// or the refiner's text rows): the step runs it, and the 8-bit attention's workspace is sized for the main rows'.
pub(super) fn self_attention_shape(dims: &Dims, batch: usize, rows: usize) -> AttentionShape {
    AttentionShape {
        batch,
        num_queries: rows,
        num_keys: rows,
        prefix_len: 0,
        num_heads: dims.heads,
        num_kv_heads: dims.heads,
    }
}

/// Bytes of every workspace buffer of one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WorkspaceSizes {
    /// Rows of the whole batch: batch x seq.
    pub rows: usize,
    /// Text rows of the whole batch.
    pub text_rows: usize,
    pub sinusoid: usize,
    pub time_hidden: usize,
    pub temb: usize,
    /// One block's adaLN table `[timesteps * 3, 6 * hp]` bf16, rounded up to the alignment.
    pub adaln_block: usize,
    pub adaln: usize,
    pub out_mod: usize,
    pub video_in: usize,
    pub audio_in: usize,
    pub text_in: usize,
    pub video_index: usize,
    pub audio_index: usize,
    pub text_index: usize,
    pub row_index: usize,
    pub rope: usize,
    pub tx: usize,
    pub x: usize,
    pub qkv: usize,
    pub attn: usize,
    pub ff: usize,
    pub act: usize,
    pub sample: usize,
    pub audio_sample: usize,
    /// FP8 runs only: the e4m3 rows a quantizing kernel writes for the next FP8 GEMM (`[rows, widest input]`,
    /// one buffer serves every group: each is read by the GEMM right after it) and their f32 row scales.
    pub q8: usize,
    pub q8_scales: usize,
    /// 8-bit attention runs only: the quantized Q, K, V and their scales of one main-row attention call.
    pub attn8: usize,
    /// 8-bit adaLN projections over more than [`ADALN_KERNEL_ROWS`] timesteps (a request's schedule): one block's
    /// projection dequantized to bf16, the weight of a bf16 GEMM (0 otherwise).
    pub adaln_w8: usize,
    /// INT8 `fc1` gate runs only: the INT8 rows of `fc1`'s input and their f32 row scales, and the gate GEMM's int32
    /// products `[rows, fp]` (0 otherwise).
    pub q8i: usize,
    pub q8i_scales: usize,
    pub gate_i32: usize,
}

/// Timestep rows up to which the weight-only kernel makes an 8-bit block's adaLN table (it reads the codes once and
/// holds them in registers); past it each block's projection is dequantized to bf16 and multiplied by a GEMM, whose
/// tensor cores take the many rows of a request's schedule (about 100) at a fraction of the kernel's time.
pub(super) const ADALN_KERNEL_ROWS: usize = 8;

impl WorkspaceSizes {
    /// Sizes for `key` at `dims`, every product checked.
    pub(super) fn of(dims: &Dims, key: &ShapeKey) -> Result<WorkspaceSizes, H3Error> {
        let rows = product("row count", &[key.batch, key.seq])?;
        let text_rows = product("text row count", &[key.batch, key.text])?;
        let video_rows = product("video row count", &[key.batch, key.video])?;
        let audio_rows = product("audio row count", &[key.batch, key.audio])?;
        // The kernels index rows with 32-bit ints.
        if rows > i32::MAX as usize {
            return Err(H3Error::Input(format!(
                "{rows} rows over the batch exceed what the kernels index"
            )));
        }
        let adaln_block = product(
            "adaLN table",
            &[key.timesteps, MODALITIES, dims.adaln_row(), BF16],
        )?
        .checked_next_multiple_of(ALIGN)
        .ok_or_else(|| overflow("adaLN table"))?;
        Ok(WorkspaceSizes {
            rows,
            text_rows,
            sinusoid: product("sinusoid", &[key.timesteps, dims.freq, 4])?,
            time_hidden: product("time embedder", &[key.timesteps, dims.time_hidden, 4])?,
            temb: product("time embedding", &[key.timesteps, dims.temb_p, BF16])?,
            adaln_block,
            adaln: product("adaLN tables", &[adaln_block, dims.layers])?,
            out_mod: product("output modulation", &[key.timesteps, 2, dims.hp, BF16])?,
            video_in: product("video input", &[video_rows, dims.video, 4])?,
            audio_in: product("audio input", &[audio_rows, dims.audio, 4])?,
            text_in: product("text input", &[text_rows, dims.text_p, BF16])?,
            video_index: product("video index", &[video_rows, 4])?,
            audio_index: product("audio index", &[audio_rows, 4])?,
            text_index: product("text index", &[text_rows, 4])?,
            row_index: product("row index", &[rows, 4])?,
            rope: product("RoPE table", &[rows, dims.rotated / 2, BF16])?,
            tx: product("text stream", &[text_rows, dims.hp, BF16])?,
            x: product("residual stream", &[rows, dims.hp, BF16])?,
            qkv: product("qkv", &[rows, 3, dims.width, BF16])?,
            attn: product("attention output", &[rows, dims.width, BF16])?,
            ff: product("feed-forward", &[rows, 2, dims.fp, BF16])?,
            act: product("feed-forward activation", &[rows, dims.fp, BF16])?,
            sample: product("video output", &[video_rows, dims.video, 4])?,
            audio_sample: product("audio output", &[audio_rows, dims.audio, 4])?,
            q8: if dims.fp8 {
                product("FP8 rows", &[rows, dims.hp.max(dims.width).max(dims.fp)])?
            } else {
                0
            },
            q8_scales: if dims.fp8 {
                product("FP8 row scales", &[rows, 4])?
            } else {
                0
            },
            attn8: if dims.attention8 {
                Attention8bitKernels::workspace_bytes(self_attention_shape(
                    dims, key.batch, key.seq,
                ))
                .map_err(cuda_err("sizing the 8-bit attention workspace"))?
            } else {
                0
            },
            adaln_w8: if dims.adaln8 && key.timesteps > ADALN_KERNEL_ROWS {
                product(
                    "dequantized adaLN projection",
                    &[MODALITIES, dims.adaln_row(), dims.temb_p, BF16],
                )?
            } else {
                0
            },
            q8i: if dims.gate_int8 {
                product("INT8 rows", &[rows, dims.hp])?
            } else {
                0
            },
            q8i_scales: if dims.gate_int8 {
                product("INT8 row scales", &[rows, 4])?
            } else {
                0
            },
            gate_i32: if dims.gate_int8 {
                product("INT8 gate products", &[rows, dims.fp, 4])?
            } else {
                0
            },
        })
    }

    /// Bytes of all buffers (each rounded up to the alignment, as the allocator places them).
    pub(super) fn total(&self) -> usize {
        let up = |b: usize| b.div_ceil(ALIGN) * ALIGN;
        [
            self.sinusoid,
            self.time_hidden,
            self.temb,
            self.adaln,
            self.out_mod,
            self.video_in,
            self.audio_in,
            self.text_in,
            self.video_index,
            self.audio_index,
            self.text_index,
            2 * self.row_index,
            2 * self.rope,
            self.tx,
            3 * self.x,
            self.qkv,
            self.attn,
            self.ff,
            self.act,
            self.sample,
            self.audio_sample,
            self.q8,
            self.q8_scales,
            self.attn8,
            self.adaln_w8,
            self.q8i,
            self.q8i_scales,
            self.gate_i32,
        ]
        .iter()
        .map(|&b| up(b))
        .sum()
    }
}

/// Per-row tables of a forward, over the whole batch (item `b`'s rows follow item `b - 1`'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RowTables {
    /// Rows of x each input video / audio / text row is written to: `b * seq + row`.
    pub video: Vec<i32>,
    pub audio: Vec<i32>,
    pub text: Vec<i32>,
    /// Per row of x: its adaLN table row (`timestep_index * 3 + tag`) and its timestep row.
    pub adaln: Vec<i32>,
    pub timestep: Vec<i32>,
}

fn to_i32(v: usize) -> Result<i32, H3Error> {
    i32::try_from(v)
        .map_err(|_| H3Error::Input(format!("row {v} exceeds the kernels' 32-bit indices")))
}

impl RowTables {
    pub(super) fn of(rows: &H3Rows) -> Result<RowTables, H3Error> {
        let seq = rows.seq_len;
        let scatter = |src: &[usize]| -> Result<Vec<i32>, H3Error> {
            let mut out = Vec::with_capacity(rows.batch * src.len());
            for b in 0..rows.batch {
                for &r in src {
                    out.push(to_i32(b * seq + r)?);
                }
            }
            Ok(out)
        };
        let repeat = |src: &[usize]| -> Result<Vec<i32>, H3Error> {
            let one = src
                .iter()
                .map(|&v| to_i32(v))
                .collect::<Result<Vec<i32>, H3Error>>()?;
            Ok(one.repeat(rows.batch))
        };
        Ok(RowTables {
            video: scatter(&rows.video_rows)?,
            audio: scatter(&rows.audio_rows)?,
            text: scatter(&rows.text_rows)?,
            adaln: repeat(&rows.adaln_rows)?,
            timestep: repeat(&rows.timestep_rows)?,
        })
    }
}

/// The input rows of one forward as uploaded: video, audio and text rows, f32, row-major.
pub(super) struct InputRows<'a> {
    pub video: &'a [f32],
    pub audio: &'a [f32],
    pub text: &'a [f32],
}

/// The RoPE cos/sin tables of every row over the batch, bf16 bits `[batch * seq, 3 * rope_freq]`: for axis `a` and
/// frequency `j`, the angle `f32(position[a]) * inv_freq[j]` in f32, its cosine and sine rounded to f32 and then
/// to bf16 (as a bfloat16 run of the reference casts its tables to the activations' dtype).
pub(super) fn rope_tables(rows: &H3Rows, rope_freq: usize, theta: f32) -> (Vec<u16>, Vec<u16>) {
    let inv = host::rope_inverse_frequencies(2 * rope_freq, theta);
    let (cos, sin) = host::rope_tables_bf16(&rows.positions, &inv);
    (cos.repeat(rows.batch), sin.repeat(rows.batch))
}

/// `rows` rows of `cols` f32 values as bf16 bytes in rows of `stride` (zero padding past `cols`).
pub(super) fn padded_bf16(values: &[f32], cols: usize, stride: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / cols.max(1) * stride * BF16);
    for row in values.chunks(cols.max(1)) {
        for &v in row {
            out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
        }
        out.resize(out.len() + (stride - row.len().min(stride)) * BF16, 0);
    }
    out
}

/// Device buffers of one shape.
pub(super) struct Workspace {
    pub key: ShapeKey,
    pub sizes: WorkspaceSizes,
    pub sinusoid: DeviceBuffer,
    pub time_hidden: DeviceBuffer,
    pub temb: DeviceBuffer,
    pub adaln: DeviceBuffer,
    pub out_mod: DeviceBuffer,
    pub video_in: DeviceBuffer,
    pub audio_in: DeviceBuffer,
    pub text_in: DeviceBuffer,
    pub video_index: DeviceBuffer,
    pub audio_index: DeviceBuffer,
    pub text_index: DeviceBuffer,
    pub adaln_index: DeviceBuffer,
    pub timestep_index: DeviceBuffer,
    pub rope_cos: DeviceBuffer,
    pub rope_sin: DeviceBuffer,
    /// The token refiner's residual stream (text rows).
    pub tx: DeviceBuffer,
    /// The residual stream, the normed rows and the output projections' rows.
    pub x: DeviceBuffer,
    pub h: DeviceBuffer,
    pub y: DeviceBuffer,
    pub qkv: DeviceBuffer,
    pub attn: DeviceBuffer,
    pub ff: DeviceBuffer,
    pub act: DeviceBuffer,
    pub sample: DeviceBuffer,
    pub audio_sample: DeviceBuffer,
    /// FP8 runs: the quantized GEMM input rows and their scales (empty otherwise).
    pub q8: DeviceBuffer,
    pub q8_scales: DeviceBuffer,
    /// 8-bit attention runs: its quantized operands (empty otherwise).
    pub attn8: DeviceBuffer,
    /// 8-bit adaLN projections over a schedule: one block's projection in bf16 (empty otherwise).
    pub adaln_w8: DeviceBuffer,
    /// INT8 `fc1` gate runs: the INT8 input rows, their scales and the int32 products (empty otherwise).
    pub q8i: DeviceBuffer,
    pub q8i_scales: DeviceBuffer,
    pub gate_i32: DeviceBuffer,
    /// True once an eager step ran (cuBLASLt plans are built; capture is safe).
    pub warmed: bool,
    /// The row positions whose RoPE tables `rope_cos` / `rope_sin` hold (the steps of a request share them).
    pub rope_positions: Option<Vec<[f32; 3]>>,
    /// The timestep values (f32 bits, in table order) whose tables the adaLN and output-modulation buffers hold,
    /// once a step made them; `None` before, or while a step that remakes them may not have finished enqueuing.
    pub tables_for: Option<Vec<u32>>,
    /// The captured step: whole, and without the timestep tables.
    pub graphs: GraphCache<StepGraph>,
    /// A sequence-parallel rank's plan and exchange buffers (`None` on one GPU).
    pub parallel: Option<super::parallel::SpBuffers>,
}

fn alloc(ctx: &Context, bytes: usize, what: &str) -> Result<DeviceBuffer, H3Error> {
    DeviceBuffer::alloc(ctx, bytes).map_err(|e| {
        H3Error::Gpu(gpu_error(
            format!("allocating the {what} workspace ({bytes} B)"),
            e,
        ))
    })
}

impl Workspace {
    /// Allocates every buffer of `key`.
    pub(super) fn new(ctx: &Context, dims: &Dims, key: ShapeKey) -> Result<Workspace, H3Error> {
        let z = WorkspaceSizes::of(dims, &key)?;
        Ok(Workspace {
            key,
            sinusoid: alloc(ctx, z.sinusoid, "timestep")?,
            time_hidden: alloc(ctx, z.time_hidden, "timestep")?,
            temb: alloc(ctx, z.temb, "timestep")?,
            adaln: alloc(ctx, z.adaln, "adaLN")?,
            out_mod: alloc(ctx, z.out_mod, "adaLN")?,
            video_in: alloc(ctx, z.video_in, "input")?,
            audio_in: alloc(ctx, z.audio_in, "input")?,
            text_in: alloc(ctx, z.text_in, "input")?,
            video_index: alloc(ctx, z.video_index, "index")?,
            audio_index: alloc(ctx, z.audio_index, "index")?,
            text_index: alloc(ctx, z.text_index, "index")?,
            adaln_index: alloc(ctx, z.row_index, "index")?,
            timestep_index: alloc(ctx, z.row_index, "index")?,
            rope_cos: alloc(ctx, z.rope, "RoPE")?,
            rope_sin: alloc(ctx, z.rope, "RoPE")?,
            tx: alloc(ctx, z.tx, "text stream")?,
            x: alloc(ctx, z.x, "activation")?,
            h: alloc(ctx, z.x, "activation")?,
            y: alloc(ctx, z.x, "activation")?,
            qkv: alloc(ctx, z.qkv, "qkv")?,
            attn: alloc(ctx, z.attn, "attention")?,
            ff: alloc(ctx, z.ff, "feed-forward")?,
            act: alloc(ctx, z.act, "feed-forward")?,
            sample: alloc(ctx, z.sample, "output")?,
            audio_sample: alloc(ctx, z.audio_sample, "output")?,
            q8: alloc(ctx, z.q8, "FP8 activation")?,
            q8_scales: alloc(ctx, z.q8_scales, "FP8 activation")?,
            attn8: alloc(ctx, z.attn8, "8-bit attention")?,
            adaln_w8: alloc(ctx, z.adaln_w8, "dequantized adaLN")?,
            q8i: alloc(ctx, z.q8i, "INT8 activation")?,
            q8i_scales: alloc(ctx, z.q8i_scales, "INT8 activation")?,
            gate_i32: alloc(ctx, z.gate_i32, "INT8 gate products")?,
            sizes: z,
            warmed: false,
            rope_positions: None,
            tables_for: None,
            graphs: GraphCache::new(MAX_GRAPHS),
            parallel: None,
        })
    }
}

/// Asynchronous upload of `bytes` to the start of `buf` on `stream` (nothing for an empty buffer).
fn put(
    buf: &mut DeviceBuffer,
    bytes: &[u8],
    stream: &Stream,
    what: &'static str,
) -> Result<(), H3Error> {
    if bytes.is_empty() {
        return Ok(());
    }
    if bytes.len() != buf.len() {
        return Err(H3Error::Backend(format!(
            "internal: {what} holds {} B, its workspace buffer {} B",
            bytes.len(),
            buf.len()
        )));
    }
    buf.upload_async(0, bytes, stream).map_err(cuda_err(what))
}

impl Engine {
    /// Uploads everything of one forward that depends on the inputs' values (on the stream, before the step).
    pub(super) fn upload_inputs(
        &self,
        ws: &mut Workspace,
        rows: &H3Rows,
        inputs: &H3Inputs,
    ) -> Result<(), H3Error> {
        let tables = RowTables::of(rows)?;
        let parts = InputRows {
            video: inputs.hidden_states.data(),
            audio: inputs.audio_hidden_states.data(),
            text: inputs.encoder_hidden_states.data(),
        };
        self.upload_parts(ws, rows, &tables, &parts)
    }

    /// [`Engine::upload_inputs`] from its parts: `rows` gives the sinusoid and the RoPE tables, `tables` the row
    /// indices (a sequence-parallel rank passes its own rows and tables, see [`super::parallel`]).
    pub(super) fn upload_parts(
        &self,
        ws: &mut Workspace,
        rows: &H3Rows,
        tables: &RowTables,
        inputs: &InputRows<'_>,
    ) -> Result<(), H3Error> {
        let d = &self.dims;
        let st = &self.stream;
        let mut sinusoid = vec![0f32; rows.timesteps.len() * d.freq];
        host::sinusoidal_embedding(&rows.timesteps, d.freq, &mut sinusoid)?;
        put(
            &mut ws.sinusoid,
            &le_bytes(&sinusoid, f32::to_le_bytes),
            st,
            "uploading the sinusoid",
        )?;
        let i32s = |v: &[i32]| le_bytes(v, i32::to_le_bytes);
        put(
            &mut ws.video_index,
            &i32s(&tables.video),
            st,
            "uploading the video rows",
        )?;
        put(
            &mut ws.audio_index,
            &i32s(&tables.audio),
            st,
            "uploading the audio rows",
        )?;
        put(
            &mut ws.text_index,
            &i32s(&tables.text),
            st,
            "uploading the text rows",
        )?;
        put(
            &mut ws.adaln_index,
            &i32s(&tables.adaln),
            st,
            "uploading the adaLN rows",
        )?;
        put(
            &mut ws.timestep_index,
            &i32s(&tables.timestep),
            st,
            "uploading the timestep rows",
        )?;
        // The steps of a request share their rows' positions: their tables are made and uploaded once.
        if ws.rope_positions.as_deref() != Some(&rows.positions[..]) {
            ws.rope_positions = None;
            let (cos, sin) = rope_tables(rows, d.rope_freq, d.rope_theta);
            let u16s = |v: &[u16]| le_bytes(v, u16::to_le_bytes);
            put(
                &mut ws.rope_cos,
                &u16s(&cos),
                st,
                "uploading the RoPE tables",
            )?;
            put(
                &mut ws.rope_sin,
                &u16s(&sin),
                st,
                "uploading the RoPE tables",
            )?;
            ws.rope_positions = Some(rows.positions.clone());
        }
        put(
            &mut ws.video_in,
            &le_bytes(inputs.video, f32::to_le_bytes),
            st,
            "uploading hidden_states",
        )?;
        put(
            &mut ws.audio_in,
            &le_bytes(inputs.audio, f32::to_le_bytes),
            st,
            "uploading audio_hidden_states",
        )?;
        put(
            &mut ws.text_in,
            &padded_bf16(inputs.text, d.text, d.text_p),
            st,
            "uploading encoder_hidden_states",
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::minimax_h3::config::MiniMaxH3Config;

    fn rows() -> H3Rows {
        // 2 text, 3 video, 2 audio rows interleaved; 2 timesteps; batch 2.
        H3Rows {
            batch: 2,
            seq_len: 7,
            video_rows: vec![2, 3, 6],
            audio_rows: vec![4, 5],
            text_rows: vec![0, 1],
            timesteps: vec![0.25, 0.999],
            adaln_rows: vec![1, 1, 3, 3, 2, 2, 0],
            timestep_rows: vec![0, 0, 1, 1, 0, 0, 0],
            positions: vec![
                [0.0, 0.0, 0.0],
                [1.0, 0.0, 0.0],
                [2.0, 3.5, -1.25],
                [2.0, 3.5, 7.0],
                [2.0, 0.0, -1.25],
                [3.0, 0.0, 7.0],
                [3.5, 3.5, -1.25],
            ],
        }
    }

    #[test]
    fn row_tables_scatter_per_batch_item_and_repeat_the_modulation_rows() {
        let t = RowTables::of(&rows()).unwrap();
        assert_eq!(t.video, vec![2, 3, 6, 9, 10, 13]);
        assert_eq!(t.audio, vec![4, 5, 11, 12]);
        assert_eq!(t.text, vec![0, 1, 7, 8]);
        assert_eq!(t.adaln, [1, 1, 3, 3, 2, 2, 0].repeat(2));
        assert_eq!(t.timestep, [0, 0, 1, 1, 0, 0, 0].repeat(2));
        // Every row of x is written by exactly one input row.
        let mut all: Vec<i32> = t
            .video
            .iter()
            .chain(&t.audio)
            .chain(&t.text)
            .copied()
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..14).collect::<Vec<i32>>());
    }

    #[test]
    fn rope_tables_compute_each_distinct_value_once_with_the_same_bits() {
        let mut r = rows();
        // Fractional, repeated and distinct values on every axis, -0.0 beside 0.0.
        r.positions = (0..40)
            .map(|i| {
                [
                    (i / 7) as f32 * 5.0 / 3.0,
                    (i % 5) as f32 * 0.37,
                    if i % 2 == 0 { -0.0 } else { i as f32 * 1.25 },
                ]
            })
            .collect();
        let (cos, sin) = rope_tables(&r, 8, 10000.0);
        let inv = host::rope_inverse_frequencies(16, 10000.0);
        let bits = |v: f64| half::bf16::from_f32(v as f32).to_bits();
        let mut k = 0;
        for _ in 0..r.batch {
            for p in &r.positions {
                for &axis in p {
                    for &w in &inv {
                        let angle = f64::from(axis * w);
                        assert_eq!((cos[k], sin[k]), (bits(angle.cos()), bits(angle.sin())));
                        k += 1;
                    }
                }
            }
        }
        assert_eq!((k, sin.len()), (cos.len(), cos.len()));
    }

    #[test]
    fn rope_tables_are_the_f32_angles_rounded_to_bf16() {
        let r = rows();
        let (cos, sin) = rope_tables(&r, 2, 10000.0);
        assert_eq!(cos.len(), 2 * 7 * 6);
        // Row 2, axis h (3.5), frequency 1 (1 / 10000^(2/4) = 0.01).
        let inv = host::rope_inverse_frequencies(4, 10000.0);
        let angle = f64::from(3.5f32 * inv[1]);
        let at = 2 * 6 + 2 + 1;
        assert_eq!(cos[at], half::bf16::from_f32(angle.cos() as f32).to_bits());
        assert_eq!(sin[at], half::bf16::from_f32(angle.sin() as f32).to_bits());
        // The second batch item repeats the first.
        assert_eq!(cos[..42], cos[42..]);
        assert_eq!(half::bf16::from_bits(cos[0]).to_f32(), 1.0);
    }

    #[test]
    fn text_rows_are_padded_with_zeros() {
        let v: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let out = padded_bf16(&v, 3, 8);
        assert_eq!(out.len(), 2 * 8 * 2);
        let at = |i: usize| {
            half::bf16::from_bits(u16::from_le_bytes([out[2 * i], out[2 * i + 1]])).to_f32()
        };
        assert_eq!(
            (at(0), at(2), at(3), at(7), at(8), at(10), at(11)),
            (0.0, 2.0, 0.0, 0.0, 3.0, 5.0, 0.0)
        );
    }

    #[test]
    fn workspace_sizes_follow_the_shape_and_refuse_overflow() {
        let dims = Dims::of(&MiniMaxH3Config::default_full_size()).unwrap();
        // 448x768 at 56 frames: 128 text + 186 audio + 5712 video rows, three timesteps.
        let key = ShapeKey {
            batch: 1,
            seq: 6026,
            video: 5712,
            audio: 186,
            text: 128,
            timesteps: 3,
        };
        let z = WorkspaceSizes::of(&dims, &key).unwrap();
        assert_eq!(z.rows, 6026);
        assert_eq!(z.x, 6026 * 5376 * 2);
        assert_eq!(z.qkv, 6026 * 3 * 7168 * 2);
        assert_eq!(z.ff, 6026 * 28672 * 2);
        assert_eq!(z.rope, 6026 * 48 * 2);
        assert_eq!(z.adaln_block, 3 * 3 * 6 * 5376 * 2);
        assert_eq!(z.adaln, 50 * z.adaln_block);
        assert_eq!(z.sample, 5712 * 96 * 4);
        assert_eq!(
            z.adaln_w8, 0,
            "bf16 adaLN projections need no dequantized copy"
        );
        // 8-bit adaLN projections: none for a step's few timesteps, one block's in bf16 for a schedule's many.
        let adaln8 = Dims {
            adaln8: true,
            ..dims
        };
        assert_eq!(WorkspaceSizes::of(&adaln8, &key).unwrap().adaln_w8, 0);
        let schedule = ShapeKey {
            timesteps: 97,
            ..key
        };
        let z8 = WorkspaceSizes::of(&adaln8, &schedule).unwrap();
        assert_eq!(z8.adaln_w8, 3 * 6 * 5376 * 2688 * 2);
        assert_eq!(
            z8.total() - WorkspaceSizes::of(&dims, &schedule).unwrap().total(),
            z8.adaln_w8.div_ceil(ALIGN) * ALIGN
        );
        // About 1.2 GB at this size.
        assert!(
            z.total() > 1_000_000_000 && z.total() < 1_400_000_000,
            "{}",
            z.total()
        );
        let huge = ShapeKey {
            batch: usize::MAX / 4,
            ..key
        };
        assert!(WorkspaceSizes::of(&dims, &huge).is_err());
        let odd = ShapeKey {
            timesteps: 1,
            ..key
        };
        assert_eq!(
            WorkspaceSizes::of(&dims, &odd).unwrap().adaln_block % ALIGN,
            0
        );
    }
}
