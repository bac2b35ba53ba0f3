//! The device-independent half of the GPU audio decoder: every weight laid out for the kernels in one f32 blob
//! ([`AudioVaeLayout`]), and a request turned into the list of kernel operations over named buffers
//! ([`DecodePlan`]). The unit tests run the plan through a host emulation of the kernels' arithmetic and compare it
//! with the host reference, so the phase decomposition, the weight orders, the buffer choreography and the epilogue
//! flags are checked without a GPU.

use super::ConvShape;
use crate::minimax_h3::vae_audio::{
    Activation, AudioVaeConfig, AudioVaeError, Conv, HostAudioVae, ACTIVATION_RATIO,
    ACTIVATION_TAPS, MAX_BATCH, MAX_FRAMES,
};
use crate::nn::backend_error::gpu_error;
use crate::nn::host::for_row_runs;
use crate::nn::tensor::TensorF32;

/// Elements of the largest buffer a decode may allocate (2^30 f32, 4 GiB).
pub const MAX_BUFFER_ELEMENTS: usize = 1 << 30;

/// A convolution's weights in the blob (f32 offsets) and its geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ConvW {
    wt: usize,
    bias: Option<usize>,
    cin: usize,
    cout: usize,
    k: usize,
    dil: usize,
    pad: usize,
    stride: usize,
}

/// One output phase of a transposed convolution: a plain convolution over `nq` reordered taps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PhaseW {
    wt: usize,
    rho: usize,
    nq: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct UpW {
    phases: Vec<PhaseW>,
    bias: usize,
    cin: usize,
    cout: usize,
    rate: usize,
    kernel: usize,
    pad: usize,
}

/// A SnakeBeta's per-channel `exp(alpha)`, `1 / (exp(beta) + 1e-9)` and filters in the blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ActW {
    pub(super) freq: usize,
    pub(super) inv_mag: usize,
    pub(super) up: usize,
    pub(super) down: usize,
    pub(super) channels: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct UnitW {
    conv1: ConvW,
    conv2: ConvW,
    act1: ActW,
    act2: ActW,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct StageW {
    up: UpW,
    blocks: Vec<Vec<UnitW>>,
}

/// Every weight of the decoder in the kernels' layout, in one f32 blob, with the geometry of each step.
#[derive(Clone, Debug)]
pub struct AudioVaeLayout {
    pub(super) config: AudioVaeConfig,
    pub(super) mean: Vec<f32>,
    pub(super) std: Vec<f32>,
    pub(super) blob: Vec<f32>,
    dec_in: ConvW,
    conv_pre: ConvW,
    stages: Vec<StageW>,
    act_post: ActW,
    conv_post: ConvW,
}

fn layout_err(why: impl Into<String>) -> AudioVaeError {
    AudioVaeError::Gpu(gpu_error("laying out the audio VAE weights", why.into()))
}

/// Appends 16-byte aligned entries to the blob.
///
/// The values are allocated zeroed up front for the whole decoder when its size is known: such an allocation maps
/// pages that are first touched by the threads that fill them (a zero fill here would touch them all on this one).
struct Blob {
    values: Vec<f32>,
    len: usize,
}

impl Blob {
    /// A blob with room for `expected` values (none when that is beyond [`MAX_BLOB_PREALLOCATION`]).
    fn with_room(expected: usize) -> Blob {
        let room = if expected <= MAX_BLOB_PREALLOCATION {
            expected
        } else {
            0
        };
        Blob {
            values: vec![0.0; room],
            len: 0,
        }
    }

    fn push(&mut self, values: impl IntoIterator<Item = f32>) -> usize {
        let values: Vec<f32> = values.into_iter().collect();
        let (at, dst) = self.entry(values.len());
        dst.copy_from_slice(&values);
        at
    }

    /// A new aligned entry of `len` zeros to fill in place: its offset and its values.
    fn entry(&mut self, len: usize) -> (usize, &mut [f32]) {
        let at = self.len.next_multiple_of(4);
        let end = at + len;
        if self.values.len() < end {
            self.values.resize(end, 0.0);
        }
        self.len = end;
        (at, &mut self.values[at..end])
    }

    /// The values, without the unused room.
    fn into_values(mut self) -> Vec<f32> {
        self.values.truncate(self.len);
        self.values
    }

    /// A regular convolution `[cout, cin, k]` as `wt[(ci k + j) cout + co]`.
    fn conv(&mut self, conv: &Conv) -> Result<ConvW, AudioVaeError> {
        let g = conv.geo;
        let (cin, cout, k) = (g.in_channels, g.out_channels, g.kernel);
        if g.groups != 1 || conv.weight.len() != cin * cout * k {
            return Err(layout_err(format!(
                "a convolution of {cin} -> {cout} x {k} (groups {}) holds {} weights",
                g.groups,
                conv.weight.len()
            )));
        }
        // `[cout, cin k]` transposed: `(ci k + j)` indexes the rows of `wt`.
        let (wt, dst) = self.entry(conv.weight.len());
        transpose_into(dst, &conv.weight, cout, cin * k);
        let bias = conv.bias.as_ref().map(|b| self.push(b.iter().copied()));
        Ok(ConvW {
            wt,
            bias,
            cin,
            cout,
            k,
            dil: g.dilation,
            pad: g.padding,
            stride: g.stride,
        })
    }

    /// A transposed convolution `[cin, cout, k]` with stride `s` as `s` phase convolutions: phase `rho` has
    /// `nq = ceil((k - rho) / s)` taps, `wt[(ci nq + j') cout + co] = w[ci, co, rho + (nq - 1 - j') s]`.
    fn transposed(&mut self, conv: &Conv) -> Result<UpW, AudioVaeError> {
        let g = conv.geo;
        let (cin, cout, k, s) = (g.in_channels, g.out_channels, g.kernel, g.stride);
        if g.groups != 1 || g.dilation != 1 || k < s || conv.weight.len() != cin * cout * k {
            return Err(layout_err(format!(
                "a transposed convolution of {cin} -> {cout} x {k}, stride {s} holds {} weights",
                conv.weight.len()
            )));
        }
        let w = &conv.weight;
        let mut phases = Vec::with_capacity(s);
        for rho in 0..s {
            let nq = (k - rho).div_ceil(s);
            let (wt, dst) = self.entry(cin * nq * cout);
            for (rows, src) in dst
                .chunks_exact_mut(nq * cout)
                .zip(w.chunks_exact(cout * k))
            {
                for (jp, row) in rows.chunks_exact_mut(cout).enumerate() {
                    let j = rho + (nq - 1 - jp) * s;
                    for (o, taps) in row.iter_mut().zip(src.chunks_exact(k)) {
                        *o = taps[j];
                    }
                }
            }
            phases.push(PhaseW { wt, rho, nq });
        }
        let bias = conv
            .bias
            .as_ref()
            .map(|b| self.push(b.iter().copied()))
            .ok_or_else(|| layout_err("an up-sampler without a bias"))?;
        Ok(UpW {
            phases,
            bias,
            cin,
            cout,
            rate: s,
            kernel: k,
            pad: g.padding,
        })
    }

    fn activation(&mut self, a: &Activation, channels: usize) -> Result<ActW, AudioVaeError> {
        if a.alpha.len() != channels
            || a.beta.len() != channels
            || a.up.len() != ACTIVATION_TAPS
            || a.down.len() != ACTIVATION_TAPS
        {
            return Err(layout_err(format!(
                "a SnakeBeta of {channels} channels with {} / {} parameters and {} / {} taps",
                a.alpha.len(),
                a.beta.len(),
                a.up.len(),
                a.down.len()
            )));
        }
        // The host reference's expressions, so both sides use the same values.
        let freq = self.push(a.alpha.iter().map(|v| v.exp()));
        let inv_mag = self.push(a.beta.iter().map(|v| 1.0f32 / (v.exp() + 1e-9f32)));
        let up = self.push(a.up.iter().copied());
        let down = self.push(a.down.iter().copied());
        Ok(ActW {
            freq,
            inv_mag,
            up,
            down,
            channels,
        })
    }
}

/// Elements of alignment padding reserved beside the parameters (at most 3 an entry, a few hundred entries).
const BLOB_ALIGNMENT_SLACK: usize = 1 << 14;

/// The most values [`Blob::with_room`] allocates up front: a validated config's parameter count (at most 2^34) and
/// its slack.
const MAX_BLOB_PREALLOCATION: usize = (1 << 34) + BLOB_ALIGNMENT_SLACK;

/// Elements from which [`transpose_into`] splits its work over the host's threads.
const PARALLEL_TRANSPOSE_ELEMENTS: usize = 1 << 18;

/// `dst[c rows + r] = src[r cols + c]` for a row-major `rows x cols` `src`: in square tiles (both sides stay in
/// cache), and split by destination rows over the host's threads when large.
fn transpose_into(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    const TILE: usize = 32;
    debug_assert_eq!(src.len(), rows * cols);
    debug_assert_eq!(dst.len(), rows * cols);
    if rows == 0 || cols == 0 {
        return;
    }
    let tiles = |dst: &mut [f32], first_col: usize| {
        let cols_here = dst.len() / rows;
        for c0 in (0..cols_here).step_by(TILE) {
            let c1 = (c0 + TILE).min(cols_here);
            for r0 in (0..rows).step_by(TILE) {
                let r1 = (r0 + TILE).min(rows);
                for c in c0..c1 {
                    let out = &mut dst[c * rows + r0..c * rows + r1];
                    for (o, r) in out.iter_mut().zip(r0..r1) {
                        *o = src[r * cols + first_col + c];
                    }
                }
            }
        }
    };
    let parallel = dst.len() >= PARALLEL_TRANSPOSE_ELEMENTS;
    for_row_runs(dst, rows, parallel, |first_col, part| {
        tiles(part, first_col)
    });
}

impl AudioVaeLayout {
    /// Lays out the weights of a loaded host reference.
    pub fn from_host(host: &HostAudioVae) -> Result<AudioVaeLayout, AudioVaeError> {
        if ACTIVATION_RATIO != 2 || ACTIVATION_TAPS != 12 {
            return Err(layout_err(
                "the SnakeBeta kernel is built for ratio 2 and 12 taps",
            ));
        }
        // Room for every parameter and the entries' alignment at once (the blob grows on demand past it).
        let mut blob = Blob::with_room(
            host.config()
                .parameter_count()
                .saturating_add(BLOB_ALIGNMENT_SLACK),
        );
        let dec_in = blob.conv(&host.dec_in)?;
        let conv_pre = blob.conv(&host.conv_pre)?;
        let mut stages = Vec::with_capacity(host.stages.len());
        for stage in &host.stages {
            let up = blob.transposed(&stage.up)?;
            let c = up.cout;
            let mut blocks = Vec::with_capacity(stage.blocks.len());
            for block in &stage.blocks {
                let mut units = Vec::with_capacity(block.units.len());
                for (conv1, conv2, act1, act2) in &block.units {
                    units.push(UnitW {
                        conv1: blob.conv(conv1)?,
                        conv2: blob.conv(conv2)?,
                        act1: blob.activation(act1, c)?,
                        act2: blob.activation(act2, c)?,
                    });
                }
                if units.is_empty() {
                    return Err(layout_err("an AMP block without units"));
                }
                blocks.push(units);
            }
            if blocks.is_empty() {
                return Err(layout_err("a stage without AMP blocks"));
            }
            stages.push(StageW { up, blocks });
        }
        let c = host.conv_post.geo.in_channels;
        let act_post = blob.activation(&host.act_post, c)?;
        let conv_post = blob.conv(&host.conv_post)?;
        Ok(AudioVaeLayout {
            config: host.config().clone(),
            mean: host.mean.clone(),
            std: host.std.clone(),
            blob: blob.into_values(),
            dec_in,
            conv_pre,
            stages,
            act_post,
            conv_post,
        })
    }

    /// The f32 values uploaded to the device.
    pub fn blob_len(&self) -> usize {
        self.blob.len()
    }

    /// Output samples per item for `frames` latent frames (the up-samplers' lengths).
    pub fn output_len(&self, frames: usize) -> Result<usize, AudioVaeError> {
        let mut len = frames;
        for s in &self.stages {
            len = transposed_len(len, &s.up)?;
        }
        Ok(len)
    }
}

fn transposed_len(len: usize, up: &UpW) -> Result<usize, AudioVaeError> {
    len.checked_sub(1)
        .and_then(|l| l.checked_mul(up.rate))
        .and_then(|l| l.checked_add(up.kernel))
        .and_then(|l| l.checked_sub(2 * up.pad))
        .filter(|&l| l > 0)
        .ok_or_else(|| AudioVaeError::Input(format!("{len} frames give no up-sampled output")))
}

/// The buffers of a decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Buf {
    /// The de-normalized latents.
    Input,
    /// Activation outputs (and `dec_in_proj`'s).
    T1,
    /// The dilated convolutions' outputs.
    T2,
    /// The up-sampler's output.
    H,
    /// An AMP block's running state.
    Xb,
    /// The stage sum (and `conv_pre`'s output): the next stage's input.
    Acc,
    /// The waveform.
    Out,
}

pub(super) const BUFS: [Buf; 7] = [
    Buf::Input,
    Buf::T1,
    Buf::T2,
    Buf::H,
    Buf::Xb,
    Buf::Acc,
    Buf::Out,
];

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct ConvOp {
    pub(super) x: Buf,
    pub(super) out: Buf,
    pub(super) res: Option<Buf>,
    pub(super) wt: usize,
    pub(super) bias: Option<usize>,
    pub(super) shape: ConvShape,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct SnakeOp {
    pub(super) x: Buf,
    pub(super) y: Buf,
    pub(super) act: ActW,
    pub(super) rows: usize,
    pub(super) len: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Op {
    Conv(ConvOp),
    Snake(SnakeOp),
}

/// The operations of one decode over named buffers, and the buffers' sizes.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct DecodePlan {
    pub(super) batch: usize,
    pub(super) frames: usize,
    pub(super) out_len: usize,
    /// f32 elements of each buffer, indexed like [`BUFS`].
    pub(super) elems: [usize; 7],
    pub(super) ops: Vec<Op>,
}

pub(super) fn index_of(buf: Buf) -> usize {
    buf as usize
}

fn elems_of(factors: &[usize]) -> Result<usize, AudioVaeError> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .filter(|&n| n <= MAX_BUFFER_ELEMENTS)
        .ok_or_else(|| {
            AudioVaeError::Input(format!(
                "an intermediate of {factors:?} values is above the GPU limit of {MAX_BUFFER_ELEMENTS}; decode fewer frames"
            ))
        })
}

impl DecodePlan {
    pub(super) fn new(
        layout: &AudioVaeLayout,
        shape: &[usize],
    ) -> Result<DecodePlan, AudioVaeError> {
        let lc = layout.config.latent_channels;
        let &[batch, c, frames] = shape else {
            return Err(AudioVaeError::Input(format!(
                "latents must be [batch, {lc}, frames], got shape {shape:?}"
            )));
        };
        if c != lc {
            return Err(AudioVaeError::Input(format!(
                "latents have {c} channels; this VAE takes {lc} (shape [batch, channels, frames])"
            )));
        }
        if batch == 0 || batch > MAX_BATCH {
            return Err(AudioVaeError::Input(format!(
                "batch {batch} must be 1..={MAX_BATCH} (stereo is 2)"
            )));
        }
        if frames == 0 || frames > MAX_FRAMES {
            return Err(AudioVaeError::Input(format!(
                "{frames} latent frames: the decode takes 1..={MAX_FRAMES}"
            )));
        }
        let mut plan = DecodePlan {
            batch,
            frames,
            out_len: 0,
            elems: [0; 7],
            ops: Vec::new(),
        };
        plan.grow(Buf::Input, &[batch, lc, frames])?;
        // Adds one convolution over `len` input samples; returns its output length.
        let conv = |plan: &mut DecodePlan,
                    w: &ConvW,
                    (x, out, res): (Buf, Buf, Option<Buf>),
                    len: usize,
                    (scale, accumulate, clamp): (f32, bool, bool)|
         -> Result<usize, AudioVaeError> {
            let n_out = w
                .dil
                .checked_mul(w.k.saturating_sub(1))
                .and_then(|span| {
                    len.checked_add(w.pad.checked_mul(2)?)?
                        .checked_sub(span.checked_add(1)?)
                })
                .filter(|_| w.k > 0 && w.stride > 0)
                .map(|v| v / w.stride + 1)
                .ok_or_else(|| {
                    AudioVaeError::Input(format!("{len} samples are too short for a convolution"))
                })?;
            plan.grow(out, &[batch, w.cout, n_out])?;
            plan.ops.push(Op::Conv(ConvOp {
                x,
                out,
                res,
                wt: w.wt,
                bias: w.bias,
                shape: ConvShape {
                    batch,
                    cin: w.cin,
                    cout: w.cout,
                    k: w.k,
                    dil: w.dil,
                    in_len: len,
                    in_offset: -(w.pad as i64),
                    in_stride: w.stride,
                    n_out,
                    out_offset: 0,
                    out_stride: 1,
                    out_len: n_out,
                    scale,
                    accumulate,
                    clamp,
                },
            }));
            Ok(n_out)
        };
        let plain = (1.0f32, false, false);
        conv(
            &mut plan,
            &layout.dec_in,
            (Buf::Input, Buf::T1, None),
            frames,
            plain,
        )?;
        conv(
            &mut plan,
            &layout.conv_pre,
            (Buf::T1, Buf::Acc, None),
            frames,
            plain,
        )?;
        let mut len = frames;
        for stage in &layout.stages {
            let up = &stage.up;
            let out_len = transposed_len(len, up)?;
            plan.grow(Buf::H, &[batch, up.cout, out_len])?;
            for phase in &up.phases {
                // Output t = s u + rho - p for the u whose t lies in [0, out_len).
                let (s, p, rho) = (up.rate as i64, up.pad as i64, phase.rho as i64);
                let u_min = if p > rho { (p - rho + s - 1) / s } else { 0 };
                let u_max = (out_len as i64 - 1 + p - rho).div_euclid(s);
                if u_max < u_min {
                    continue;
                }
                let n_out = (u_max - u_min + 1) as usize;
                let out_offset = usize::try_from(s * u_min + rho - p)
                    .map_err(|_| layout_err("a phase starts before the output"))?;
                plan.ops.push(Op::Conv(ConvOp {
                    x: Buf::Acc,
                    out: Buf::H,
                    res: None,
                    wt: phase.wt,
                    bias: Some(up.bias),
                    shape: ConvShape {
                        batch,
                        cin: up.cin,
                        cout: up.cout,
                        k: phase.nq,
                        dil: 1,
                        in_len: len,
                        in_offset: u_min - (phase.nq as i64 - 1),
                        in_stride: 1,
                        n_out,
                        out_offset,
                        out_stride: up.rate,
                        out_len,
                        scale: 1.0,
                        accumulate: false,
                        clamp: false,
                    },
                }));
            }
            len = out_len;
            let blocks = stage.blocks.len();
            for (j, units) in stage.blocks.iter().enumerate() {
                for (m, unit) in units.iter().enumerate() {
                    let src = if m == 0 { Buf::H } else { Buf::Xb };
                    plan.snake(src, Buf::T1, unit.act1, len)?;
                    let n1 = conv(&mut plan, &unit.conv1, (Buf::T1, Buf::T2, None), len, plain)?;
                    plan.snake(Buf::T2, Buf::T1, unit.act2, len)?;
                    let (out, flags) = if m + 1 < units.len() {
                        (Buf::Xb, plain)
                    } else {
                        (Buf::Acc, (1.0 / blocks as f32, j > 0, false))
                    };
                    let n2 = conv(
                        &mut plan,
                        &unit.conv2,
                        (Buf::T1, out, Some(src)),
                        len,
                        flags,
                    )?;
                    if n1 != len || n2 != len {
                        return Err(layout_err(format!(
                            "an AMP unit maps {len} samples to {n1} and {n2}; its convolutions must keep the length"
                        )));
                    }
                }
            }
        }
        plan.snake(Buf::Acc, Buf::T1, layout.act_post, len)?;
        conv(
            &mut plan,
            &layout.conv_post,
            (Buf::T1, Buf::Out, None),
            len,
            (1.0, false, true),
        )?;
        plan.out_len = match plan.ops.last() {
            Some(Op::Conv(last)) => last.shape.out_len,
            _ => return Err(layout_err("the plan does not end with conv_post")),
        };
        Ok(plan)
    }

    fn grow(&mut self, buf: Buf, factors: &[usize]) -> Result<(), AudioVaeError> {
        let n = elems_of(factors)?;
        let slot = &mut self.elems[index_of(buf)];
        *slot = (*slot).max(n);
        Ok(())
    }

    fn snake(&mut self, x: Buf, y: Buf, act: ActW, len: usize) -> Result<(), AudioVaeError> {
        let rows = self
            .batch
            .checked_mul(act.channels)
            .ok_or_else(|| layout_err("rows overflow"))?;
        self.grow(y, &[rows, len])?;
        self.ops.push(Op::Snake(SnakeOp {
            x,
            y,
            act,
            rows,
            len,
        }));
        Ok(())
    }
}

/// De-normalizes `[batch, channels, frames]` latents: `z * std + mean` per channel, in f32 as the host reference.
pub(super) fn denormalize(
    latents: &TensorF32,
    mean: &[f32],
    std: &[f32],
    frames: usize,
) -> Vec<f32> {
    let channels = mean.len();
    let mut z = latents.data().to_vec();
    for (i, row) in z.chunks_exact_mut(frames.max(1)).enumerate() {
        let ch = i % channels.max(1);
        let (s, m) = (
            std.get(ch).copied().unwrap_or(1.0),
            mean.get(ch).copied().unwrap_or(0.0),
        );
        row.iter_mut().for_each(|v| *v = *v * s + m);
    }
    z
}

#[cfg(test)]
mod tests {
    use super::super::SNAKE_TILE;
    use super::*;
    use crate::nn::sampling::seeded::SplitMix64;
    use crate::nn::tensor::relative_l2;
    use crate::nn::weights::{write_f32_safetensors, ModelDir};
    use std::path::{Path, PathBuf};

    /// What audio.cu computes, op by op on the host: each convolution as the kernels' formula (the same f32
    /// fused multiply-adds in the same order as the tiled and direct kernels), the SnakeBeta tile by tile with the
    /// kernel's staged windows and index arithmetic.
    fn emulate(layout: &AudioVaeLayout, plan: &DecodePlan, input: &[f32]) -> Vec<f32> {
        let mut bufs: Vec<Vec<f32>> = plan.elems.iter().map(|&n| vec![0f32; n]).collect();
        bufs[index_of(Buf::Input)][..input.len()].copy_from_slice(input);
        let w = &layout.blob;
        for op in &plan.ops {
            match op {
                Op::Conv(c) => {
                    let s = &c.shape;
                    let x = bufs[index_of(c.x)].clone();
                    let res = c.res.map(|r| bufs[index_of(r)].clone());
                    let out = &mut bufs[index_of(c.out)];
                    for b in 0..s.batch {
                        for co in 0..s.cout {
                            for n in 0..s.n_out {
                                let mut acc = 0f32;
                                for ci in 0..s.cin {
                                    for j in 0..s.k {
                                        let p = (n * s.in_stride) as i64
                                            + s.in_offset
                                            + (j * s.dil) as i64;
                                        if p >= 0 && (p as usize) < s.in_len {
                                            let xv = x[(b * s.cin + ci) * s.in_len + p as usize];
                                            acc = w[c.wt + (ci * s.k + j) * s.cout + co]
                                                .mul_add(xv, acc);
                                        }
                                    }
                                }
                                let t = s.out_offset + n * s.out_stride;
                                let idx = (b * s.cout + co) * s.out_len + t;
                                let mut v = acc;
                                if let Some(bi) = c.bias {
                                    v += w[bi + co];
                                }
                                if let Some(r) = &res {
                                    v += r[idx];
                                }
                                v *= s.scale;
                                if s.accumulate {
                                    v += out[idx];
                                }
                                if s.clamp {
                                    v = v.clamp(-1.0, 1.0);
                                }
                                out[idx] = v;
                            }
                        }
                    }
                }
                Op::Snake(sn) => {
                    let a = sn.act;
                    let x = bufs[index_of(sn.x)].clone();
                    let y = &mut bufs[index_of(sn.y)];
                    let (fu, fd) = (&w[a.up..a.up + 12], &w[a.down..a.down + 12]);
                    let (t_len, len) = (SNAKE_TILE as i64, sn.len as i64);
                    let mut xs = vec![0f32; SNAKE_TILE + 11];
                    let mut ss = vec![0f32; 2 * SNAKE_TILE + 10];
                    for row in 0..sn.rows {
                        let c = row % a.channels;
                        let (fr, im) = (w[a.freq + c], w[a.inv_mag + c]);
                        let xr = &x[row * sn.len..(row + 1) * sn.len];
                        for t0 in (0..len).step_by(SNAKE_TILE) {
                            for (i, v) in xs.iter_mut().enumerate() {
                                *v = xr[(t0 - 6 + i as i64).clamp(0, len - 1) as usize];
                            }
                            for (m, v) in ss.iter_mut().enumerate() {
                                let n = (2 * t0 - 5 + m as i64).clamp(0, 2 * len - 1);
                                let mut u = 0f32;
                                let mut j = (n + 1) & 1;
                                while j < 12 {
                                    let xi = (n + 15 - j) / 2 - 5;
                                    u = fu[j as usize].mul_add(xs[(xi - t0 + 6) as usize], u);
                                    j += 2;
                                }
                                u *= 2.0;
                                let s = (fr * u).sin();
                                *v = im.mul_add(s * s, u);
                            }
                            for i in 0..t_len {
                                let t = t0 + i;
                                if t >= len {
                                    break;
                                }
                                let mut v = 0f32;
                                for j in 0..12 {
                                    v = fd[j].mul_add(ss[2 * i as usize + j], v);
                                }
                                y[row * sn.len + t as usize] = v;
                            }
                        }
                    }
                }
            }
        }
        bufs[index_of(Buf::Out)][..plan.batch * plan.out_len].to_vec()
    }

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/minimax_h3_audio_vae/model")
    }

    fn random_latents(shape: Vec<usize>, seed: u64) -> TensorF32 {
        let n = shape.iter().product();
        TensorF32::new(shape, SplitMix64::new(seed).uniform_vec(n, -1.5, 1.5)).unwrap()
    }

    /// The emulated kernels against the host reference on `host`, for each latent shape.
    fn check(host: &HostAudioVae, shapes: &[Vec<usize>]) {
        let layout = AudioVaeLayout::from_host(host).unwrap();
        for (i, shape) in shapes.iter().enumerate() {
            let z = random_latents(shape.clone(), 40 + i as u64);
            let plan = DecodePlan::new(&layout, z.shape()).unwrap();
            let input = denormalize(&z, &layout.mean, &layout.std, shape[2]);
            let ours = emulate(&layout, &plan, &input);
            let want = host.decode(&z).unwrap();
            assert_eq!(
                [plan.batch, 1, plan.out_len],
                [want.shape()[0], want.shape()[1], want.shape()[2]]
            );
            let err = relative_l2(&ours, want.data()).unwrap();
            println!(
                "{shape:?}: {} samples, emulated kernels vs host relative L2 {err:.3e}",
                ours.len()
            );
            assert!(err < 1e-5, "{shape:?}: {err:e}");
            assert!(ours.iter().all(|v| v.is_finite() && v.abs() <= 1.0));
            // Most samples are inside the clamp, so the comparison sees the convolutions.
            let clamped = want.data().iter().filter(|v| v.abs() >= 1.0).count();
            println!("  {clamped} of {} samples clamped", ours.len());
            assert!(clamped * 4 < ours.len(), "{clamped} samples clamped");
        }
    }

    /// The tiled transpose against the plain formula, on shapes around the tile, and on one past the size where it
    /// splits over threads (an uneven split).
    #[test]
    fn transpose_into_matches_the_formula_tiled_and_split() {
        let mut rng = SplitMix64::new(7);
        for (rows, cols) in [
            (1, 1),
            (1, 33),
            (33, 1),
            (31, 32),
            (32, 31),
            (65, 97),
            (1031, 1019),
        ] {
            let src = rng.uniform_vec(rows * cols, -1.0, 1.0);
            let mut dst = vec![f32::NAN; rows * cols];
            transpose_into(&mut dst, &src, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        dst[c * rows + r].to_bits(),
                        src[r * cols + c].to_bits(),
                        "{rows}x{cols} at ({r}, {c})"
                    );
                }
            }
        }
        const { assert!(1031 * 1019 >= PARALLEL_TRANSPOSE_ELEMENTS) };
    }

    #[test]
    fn the_kernels_arithmetic_matches_the_host_on_the_fixture() {
        let host = HostAudioVae::load(&ModelDir::open(&fixture()).unwrap()).unwrap();
        let c = host.config().latent_channels;
        // Stereo as the pipeline, one item, one frame, and a length that crosses a SnakeBeta tile (9 frames give
        // 111 samples; 60 give 711 after the last up-sampler).
        check(
            &host,
            &[vec![2, c, 9], vec![1, c, 9], vec![2, c, 1], vec![2, c, 60]],
        );
    }

    /// A decoder with the released rates, kernels and AMP blocks at a small width, random weights, written to a
    /// scratch folder.
    fn released_shape_model() -> (HostAudioVae, PathBuf) {
        let dir = std::env::temp_dir().join(format!("h3_audio_gpu_plan_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut rng = SplitMix64::new(77);
        let lc = 4;
        let json = serde_json::json!({
            "_class_name": "AutoencoderKLMiniMaxH3Audio", "encoder_dim": 4, "latent_dim": 16,
            "latent_channels": lc, "num_attention_heads": 2, "decoder_dim": 128,
            "latents_mean": rng.uniform_vec(lc, -0.5, 0.5), "latents_std": rng.uniform_vec(lc, 0.5, 1.5)
        });
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
        let config = AudioVaeConfig::from_json(&json).unwrap();
        let tensors: Vec<(String, TensorF32)> = config
            .tensor_specs()
            .into_iter()
            .map(|spec| {
                let n = spec.shape.iter().product();
                let values = if spec.name == "decoder.conv_post.weight_g" {
                    // Keeps most output samples inside the clamp.
                    rng.uniform_vec(n, 0.02, 0.03)
                } else if spec.name.ends_with("weight_g") {
                    rng.uniform_vec(n, 0.6, 1.4)
                } else if spec.name.ends_with(".alpha") || spec.name.ends_with(".beta") {
                    rng.uniform_vec(n, -0.5, 0.5)
                } else if spec.name.ends_with("filter") {
                    let raw = rng.uniform_vec(n, 0.0, 1.0);
                    let sum: f32 = raw.iter().sum();
                    raw.iter().map(|v| v / sum).collect()
                } else {
                    rng.uniform_vec(n, -0.5, 0.5)
                };
                (spec.name, TensorF32::new(spec.shape, values).unwrap())
            })
            .collect();
        write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
        let host = HostAudioVae::load(&ModelDir::open(&dir).unwrap()).unwrap();
        (host, dir)
    }

    #[test]
    fn the_kernels_arithmetic_matches_the_host_at_the_released_rates() {
        let (host, dir) = released_shape_model();
        assert_eq!(host.config().decoder_rates, vec![5, 5, 2, 2, 2, 2, 2]);
        check(&host, &[vec![2, 4, 3], vec![1, 4, 1]]);
        let layout = AudioVaeLayout::from_host(&host).unwrap();
        let plan = DecodePlan::new(&layout, &[2, 4, 3]).unwrap();
        // dec_in, conv_pre, 7 up-samplers (5 + 5 + 5 x 2 phases), 7 x 3 blocks x 3 units x 4 ops, act_post, conv_post.
        assert_eq!(plan.ops.len(), 2 + 20 + 7 * 3 * 3 * 4 + 2);
        assert_eq!(plan.out_len, 3 * 800);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn requests_are_bounded_before_anything_is_allocated() {
        let host = HostAudioVae::load(&ModelDir::open(&fixture()).unwrap()).unwrap();
        let layout = AudioVaeLayout::from_host(&host).unwrap();
        let c = host.config().latent_channels;
        for bad in [
            vec![2, c],
            vec![2, c + 1, 4],
            vec![0, c, 4],
            vec![MAX_BATCH + 1, c, 4],
            vec![2, c, 0],
            vec![2, c, MAX_FRAMES + 1],
        ] {
            let err = DecodePlan::new(&layout, &bad).unwrap_err();
            assert!(err.is_invalid_request(), "{bad:?}: {err}");
            assert!(err.to_string().contains("input"), "{err}");
        }
        // Buffers hold what the plan writes into them.
        let plan = DecodePlan::new(&layout, &[2, c, 9]).unwrap();
        for op in &plan.ops {
            if let Op::Conv(conv) = op {
                let s = &conv.shape;
                assert!(plan.elems[index_of(conv.out)] >= s.batch * s.cout * s.out_len);
                assert!(plan.elems[index_of(conv.x)] >= s.batch * s.cin * s.in_len);
            }
        }
    }
}
