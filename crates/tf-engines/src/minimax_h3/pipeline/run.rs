//! One request through the components, in the reference's order: the prompt features, the noise (video, then
//! audio), the steps (one forward over the packed sequence, then the video rows stepped down the video schedule and
//! the audio rows down the audio schedule), the unpacking of the rows into latents, the video decode and the audio
//! decode. Resident components run in place; in the sequential mode each one is loaded, run and freed before the
//! next is loaded.
//!
//! On a multi-GPU job (`LoadOptions::sequence_parallel`) the DiT runs sequence-parallel, the video decode is
//! spread over the ranks (each decodes its groups of clips and rank 0 blends them all, `GpuVideoVae::decode_spread`),
//! and the audio decode (a small part of a request) runs on rank 0 only: rank 0's [`Generation`] holds the frames
//! and the audio, the other ranks' hold no frame and no audio.

use std::time::Instant;

use super::components::{Components, Resident};
use super::{
    secs, Generation, H3Pipeline, PipelineError, Plan, Progress, Request, StepLatents, StereoAudio,
    Timings,
};
use crate::minimax_h3::dit::{H3DitBackend, H3Inputs};
use crate::minimax_h3::dit_gpu::parallel::SequenceParallel;
use crate::minimax_h3::layout::{StepTimesteps, AUDIO_CHANNELS};
use crate::minimax_h3::noise::{patchify, H3Noise};
use crate::minimax_h3::text::H3TextBackend;
use crate::minimax_h3::vae_audio::AudioVaeDecoder;
use crate::minimax_h3::vae_video::{VideoFrames, VideoVaeBackend};
use crate::nn::sampling::noise::draw_beside;
use crate::nn::sampling::scheduler::Scheduler;
use crate::nn::tensor::{Tensor, TensorF32};

/// The unpacked latents and what the run kept of the rows.
struct Denoised {
    video: TensorF32,
    audio: TensorF32,
    initial: Option<StepLatents>,
    steps: Vec<StepLatents>,
}

pub(super) fn generate(
    pipeline: &mut H3Pipeline,
    plan: &Plan,
    request: &Request,
    progress: &mut dyn FnMut(Progress),
) -> Result<Generation, PipelineError> {
    let started = Instant::now();
    let mut timings = Timings::default();
    let layer = pipeline.options.text.layer;
    let keep = pipeline.keep_step_latents;
    let parallel = pipeline.options.sequence_parallel.clone();
    // Rank 0 (or the one GPU) holds the output; the audio is decoded there only.
    let holds_output = parallel.as_ref().is_none_or(|sp| sp.comm.rank() == 0);
    let device = pipeline.device.as_ref();
    let (prompt_embeds, denoised, frames, audio) = match &mut pipeline.components {
        Components::Resident(held) => {
            let Resident {
                text,
                dit,
                video_vae,
                audio_vae,
            } = &mut **held;
            // The seeded noise is drawn on the host while the text encoder runs on the device.
            let (embeds, rows) = draw_beside(
                || initial_rows(plan, request),
                || encode(&mut **text, plan, layer),
            )?;
            let (embeds, rows) = (embeds?, rows?);
            timings.encode = secs(started.elapsed());
            progress(Progress::Encoded {
                seconds: timings.encode,
            });
            if let Some(sp) = &parallel {
                dit.attach_sequence_parallel(sp)?;
            }
            let denoised = denoise(
                &mut **dit,
                plan,
                &embeds,
                rows,
                keep,
                &mut timings,
                progress,
            )?;
            // The peak is the resident weights plus the largest working set, not the DiT's and the decoder's
            // together: each frees its buffers after its phase (remaking them costs a graph capture, ~40 ms).
            dit.release_workspaces();
            let frames = decode_video(
                &mut **video_vae,
                plan,
                &denoised.video,
                parallel.as_ref(),
                &mut timings,
                progress,
            );
            video_vae.release_workspace();
            let frames = frames?;
            let audio = if plan.audio && holds_output {
                Some(decode_audio(
                    &mut **audio_vae,
                    &denoised.audio,
                    &mut timings,
                    progress,
                )?)
            } else {
                None
            };
            (embeds, denoised, frames, audio)
        }
        Components::Sequential(folders) => {
            let t = Instant::now();
            let mut text = folders.text_encoder(device)?;
            timings.loads.text_encoder = secs(t.elapsed());
            let embeds = encode(&mut *text, plan, layer)?;
            timings.loads.text_encoder += free_timed(text);
            let rows = initial_rows(plan, request)?;
            timings.encode = (secs(started.elapsed()) - timings.loads.text_encoder).max(0.0);
            progress(Progress::Encoded {
                seconds: timings.encode,
            });

            let t = Instant::now();
            let mut dit = folders.dit(device)?;
            if let Some(sp) = &parallel {
                dit.attach_sequence_parallel(sp)?;
            }
            timings.loads.dit = secs(t.elapsed());
            let denoised = denoise(&mut *dit, plan, &embeds, rows, keep, &mut timings, progress)?;
            timings.loads.dit += free_timed(dit);

            let t = Instant::now();
            let mut vae = folders.video_vae(device)?;
            timings.loads.video_vae = secs(t.elapsed());
            let frames = decode_video(
                &mut *vae,
                plan,
                &denoised.video,
                parallel.as_ref(),
                &mut timings,
                progress,
            )?;
            timings.loads.video_vae += free_timed(vae);

            let audio = if plan.audio && holds_output {
                let t = Instant::now();
                let mut vae = folders.audio_vae(device)?;
                timings.loads.audio_vae = secs(t.elapsed());
                let audio = decode_audio(&mut *vae, &denoised.audio, &mut timings, progress)?;
                timings.loads.audio_vae += free_timed(vae);
                Some(audio)
            } else {
                None
            };
            (embeds, denoised, frames, audio)
        }
    };
    timings.total = secs(started.elapsed());
    let [_, rows, width] = prompt_embeds.dims::<3>("prompt features")?;
    Ok(Generation {
        frames,
        fps: crate::minimax_h3::layout::FPS as u32,
        audio,
        requested_frames: plan.sizes.requested_frames,
        prompt_ids: plan.prompt_ids.clone(),
        prompt_embeds: TensorF32::new(vec![rows, width], prompt_embeds.into_data())?,
        initial_latents: denoised.initial,
        step_latents: denoised.steps,
        video_latents: denoised.video,
        audio_latents: denoised.audio,
        seed: request.seed,
        timings,
    })
}

/// Frees a component (its `Drop` waits for the work still queued on its stream) and times it.
fn free_timed<T: ?Sized>(component: Box<T>) -> f64 {
    let t = Instant::now();
    drop(component);
    secs(t.elapsed())
}

/// `hidden_states[layer]` of the prompt, `[1, tokens, text_dim]`.
fn encode(
    text: &mut dyn H3TextBackend,
    plan: &Plan,
    layer: usize,
) -> Result<TensorF32, PipelineError> {
    let features = text.features_at(&plan.prompt_ids, layer)?;
    let [rows, width] = features.dims::<2>("prompt features")?;
    if rows != plan.prompt_ids.len() {
        return Err(PipelineError::Internal(format!(
            "the text encoder returned {rows} rows for {} tokens",
            plan.prompt_ids.len()
        )));
    }
    Ok(TensorF32::new(vec![1, rows, width], features.into_data())?)
}

/// The generated rows before the first step: the patched video noise `[1, Nv, C * ph * pw]` and the audio noise
/// `[1, 2 A, C_a]`, drawn video first from the request's seed, or injected.
fn initial_rows(plan: &Plan, request: &Request) -> Result<(TensorF32, TensorF32), PipelineError> {
    let noise = match &request.noise {
        Some(given) => given.clone(),
        None => H3Noise::generate(request.seed, &plan.sizes.noise_shape)?,
    };
    let video = patchify(&noise.video, plan.patch)?;
    let [n, d] = video.dims::<2>("video rows")?;
    let [na, ca] = noise.audio.dims::<2>("audio rows")?;
    Ok((
        TensorF32::new(vec![1, n, d], video.into_data())?,
        TensorF32::new(vec![1, na, ca], noise.audio.into_data())?,
    ))
}

/// The steps: one forward per step over the packed sequence, then both Euler steps in f32. The DiT is told every
/// timestep value of the request first (so that it can make their tables once), and forgets them after.
fn denoise(
    dit: &mut dyn H3DitBackend,
    plan: &Plan,
    embeds: &TensorF32,
    (video, audio): (TensorF32, TensorF32),
    keep: bool,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<Denoised, PipelineError> {
    let layout = &plan.layout;
    let (vs, aus) = (&plan.video_schedule, &plan.audio_schedule);
    let steps = vs.steps();
    let levels = |k: usize| StepTimesteps::pipeline(vs.timesteps()[k], aus.timesteps()[k]);
    let mut schedule = Vec::new();
    for k in 0..steps {
        schedule.extend(layout.row_timesteps(levels(k))?.unique);
    }
    dit.set_timestep_schedule(&schedule)?;
    let denoised = (|| -> Result<Denoised, PipelineError> {
        let first = layout.row_timesteps(levels(0))?;
        let initial = keep.then(|| rows_of(&video, &audio)).transpose()?;
        let mut inputs = H3Inputs::from_layout(layout, &first, video, audio, embeds.clone())?;
        let [_, nv, d] = inputs.hidden_states.dims::<3>("video rows")?;
        let [_, na, ca] = inputs.audio_hidden_states.dims::<3>("audio rows")?;
        let cond = layout.condition_video_rows * d;
        let mut kept = Vec::with_capacity(if keep { steps } else { 0 });
        for k in 0..steps {
            let t = Instant::now();
            if k > 0 {
                let rt = layout.row_timesteps(levels(k))?;
                inputs.timestep = Tensor::new(vec![rt.unique.len()], rt.unique)?;
                let indices: Vec<i64> = rt.indices.iter().map(|&i| i as i64).collect();
                inputs.timestep_indices = Tensor::new(vec![indices.len()], indices)?;
            }
            let out = dit.forward(&inputs)?;
            if out.sample.shape() != [1, nv, d] || out.audio_sample.shape() != [1, na, ca] {
                return Err(PipelineError::Internal(format!(
                    "the DiT returned {:?} and {:?} for {:?} and {:?}",
                    out.sample.shape(),
                    out.audio_sample.shape(),
                    [1, nv, d],
                    [1, na, ca]
                )));
            }
            vs.step_f32(
                k,
                &mut inputs.hidden_states.data_mut()[cond..],
                &out.sample.data()[cond..],
            )?;
            aus.step_f32(
                k,
                inputs.audio_hidden_states.data_mut(),
                out.audio_sample.data(),
            )?;
            if keep {
                kept.push(rows_of(&inputs.hidden_states, &inputs.audio_hidden_states)?);
            }
            let seconds = secs(t.elapsed());
            timings.steps.push(seconds);
            progress(Progress::Step {
                step: k + 1,
                steps,
                seconds,
            });
        }
        let g = &plan.sizes.geometry;
        let cond_rows = layout.condition_video_rows;
        let [_, ph, pw] = plan.patch;
        let video = unpatchify(
            &inputs.hidden_states.data()[cond_rows * d..],
            [g.latent_frames, g.latent_height, g.latent_width],
            [ph, pw],
            d,
        )?;
        let audio = unpack_audio(inputs.audio_hidden_states.data(), g.audio_latents, ca)?;
        Ok(Denoised {
            video,
            audio,
            initial,
            steps: kept,
        })
    })();
    dit.set_timestep_schedule(&[])?;
    denoised
}

/// A copy of the rows without the batch axis.
fn rows_of(video: &TensorF32, audio: &TensorF32) -> Result<StepLatents, PipelineError> {
    let [_, nv, d] = video.dims::<3>("video rows")?;
    let [_, na, ca] = audio.dims::<3>("audio rows")?;
    Ok(StepLatents {
        video: TensorF32::new(vec![nv, d], video.data().to_vec())?,
        audio: TensorF32::new(vec![na, ca], audio.data().to_vec())?,
    })
}

/// The inverse of the video patchify: rows `[F * H/ph * W/pw, C * ph * pw]` (frame-major, then row, then
/// column; feature `(c * ph + y) * pw + x`) to latents `[1, C, F, H, W]`.
pub fn unpatchify(
    rows: &[f32],
    [f, h, w]: [usize; 3],
    [ph, pw]: [usize; 2],
    row_dim: usize,
) -> Result<TensorF32, PipelineError> {
    if ph == 0
        || pw == 0
        || !h.is_multiple_of(ph)
        || !w.is_multiple_of(pw)
        || !row_dim.is_multiple_of(ph * pw)
    {
        return Err(PipelineError::Internal(format!(
            "cannot unpatch a {f}x{h}x{w} grid by {ph}x{pw} with rows of {row_dim}"
        )));
    }
    let c = row_dim / (ph * pw);
    let (gh, gw) = (h / ph, w / pw);
    if rows.len() != f * gh * gw * row_dim {
        return Err(PipelineError::Internal(format!(
            "{} values of video rows for {f} frames of {gh}x{gw} rows of {row_dim}",
            rows.len()
        )));
    }
    let mut out = vec![0f32; c * f * h * w];
    for (r, row) in rows.chunks_exact(row_dim).enumerate() {
        let (fi, rest) = (r / (gh * gw), r % (gh * gw));
        let (yi, xi) = (rest / gw, rest % gw);
        for ci in 0..c {
            for y in 0..ph {
                for x in 0..pw {
                    let value = row[(ci * ph + y) * pw + x];
                    out[((ci * f + fi) * h + yi * ph + y) * w + xi * pw + x] = value;
                }
            }
        }
    }
    Ok(TensorF32::new(vec![1, c, f, h, w], out)?)
}

/// Audio rows `[2 A, C]` (left channel's `A` rows, then the right's) to the audio VAE's `[2, C, A]`.
fn unpack_audio(rows: &[f32], a: usize, c: usize) -> Result<TensorF32, PipelineError> {
    if rows.len() != AUDIO_CHANNELS * a * c {
        return Err(PipelineError::Internal(format!(
            "{} values of audio rows for 2 x {a} latents of {c}",
            rows.len()
        )));
    }
    let mut out = vec![0f32; rows.len()];
    for ch in 0..AUDIO_CHANNELS {
        for k in 0..a {
            for ci in 0..c {
                out[(ch * c + ci) * a + k] = rows[(ch * a + k) * c + ci];
            }
        }
    }
    Ok(TensorF32::new(vec![AUDIO_CHANNELS, c, a], out)?)
}

/// The video decode: on one GPU whole; on a multi-GPU job spread over the ranks, and a rank other than 0 returns
/// no frame (of the video's size).
fn decode_video(
    vae: &mut dyn VideoVaeBackend,
    plan: &Plan,
    latents: &TensorF32,
    parallel: Option<&SequenceParallel>,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<VideoFrames, PipelineError> {
    let t = Instant::now();
    let g = &plan.sizes.geometry;
    let frames = match parallel {
        None => vae.decode(latents)?,
        Some(sp) => match vae.decode_spread(latents, &sp.comm)? {
            Some(frames) => frames,
            None => {
                timings.decode_video = secs(t.elapsed());
                progress(Progress::DecodedVideo {
                    seconds: timings.decode_video,
                });
                return Ok(VideoFrames {
                    frames: 0,
                    height: plan.sizes.height,
                    width: plan.sizes.width,
                    rgb: Vec::new(),
                    pixels: Vec::new(),
                });
            }
        },
    };
    if (frames.frames, frames.height, frames.width)
        != (g.num_frames, plan.sizes.height, plan.sizes.width)
    {
        return Err(PipelineError::Internal(format!(
            "the video VAE decoded {} frames of {}x{} for {} frames of {}x{}",
            frames.frames,
            frames.width,
            frames.height,
            g.num_frames,
            plan.sizes.width,
            plan.sizes.height
        )));
    }
    timings.decode_video = secs(t.elapsed());
    progress(Progress::DecodedVideo {
        seconds: timings.decode_video,
    });
    Ok(frames)
}

fn decode_audio(
    vae: &mut dyn AudioVaeDecoder,
    latents: &TensorF32,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<StereoAudio, PipelineError> {
    let t = Instant::now();
    let wave = vae.decode(latents)?;
    let [b, one, samples] = wave.dims::<3>("decoded audio")?;
    if b != AUDIO_CHANNELS || one != 1 {
        return Err(PipelineError::Internal(format!(
            "the audio VAE returned {:?}; stereo is [2, 1, samples]",
            wave.shape()
        )));
    }
    let sample_rate = u32::try_from(vae.config().sampling_rate).map_err(|_| {
        PipelineError::Internal(format!("sampling rate {}", vae.config().sampling_rate))
    })?;
    let (left, right) = wave.data().split_at(samples);
    let audio = StereoAudio {
        sample_rate,
        left: left.to_vec(),
        right: right.to_vec(),
    };
    timings.decode_audio = secs(t.elapsed());
    progress(Progress::DecodedAudio {
        seconds: timings.decode_audio,
    });
    Ok(audio)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpatchify_inverts_patchify() {
        let (c, f, h, w) = (3, 2, 4, 6);
        let data: Vec<f32> = (0..c * f * h * w).map(|i| i as f32).collect();
        let latents = Tensor::new(vec![1, c, f, h, w], data).unwrap();
        let rows = patchify(&latents, [1, 2, 2]).unwrap();
        let back = unpatchify(rows.data(), [f, h, w], [2, 2], c * 4).unwrap();
        assert_eq!(back, latents);
        assert!(unpatchify(rows.data(), [f, h, w], [2, 2], c * 4 + 1).is_err());
        assert!(unpatchify(&rows.data()[1..], [f, h, w], [2, 2], c * 4).is_err());
    }

    #[test]
    fn audio_rows_unpack_channel_major() {
        // A = 2, C = 3: rows l0 l1 r0 r1.
        let rows: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let t = unpack_audio(&rows, 2, 3).unwrap();
        assert_eq!(t.shape(), &[2, 3, 2]);
        // left, channel 0: l0[0], l1[0] = 0, 3; right, channel 2: r0[2], r1[2] = 8, 11.
        assert_eq!(&t.data()[..2], &[0.0, 3.0]);
        assert_eq!(&t.data()[10..], &[8.0, 11.0]);
        assert!(unpack_audio(&rows, 3, 3).is_err());
    }
}
