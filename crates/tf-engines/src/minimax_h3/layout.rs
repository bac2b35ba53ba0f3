//! The MiniMax H3 packed layout, in one place: the sizes a request resolves to, and the one-dimensional sequence
//! the DiT runs full attention over.
//!
//! - Sizes ([`Geometry`]): 24 fps; frame counts snap up to `17 n + 5` (what the video VAE encodes), which gives
//!   `5 n + 2` latent frames; the soundtrack has `A = round(F / 24 * 40)` latents per stereo channel; the canvas is
//!   a multiple of 32 pixels (VAE factor 16 x patch 2). [`SizeRules::PIPELINE`] adds the pipeline's 5 to 15 second
//!   window; [`SizeRules::TRANSFORMER`] only what the transformer itself needs.
//! - Rows ([`PackedLayout`]): `[text | conditioning video (keyframes) | target audio (channel-major: left A rows,
//!   then right) | target video]`, with modality tags (video 0, text 1, audio 2; a keyframe's vision rows inside
//!   the text are tagged video), the index of every row of each modality, and float64 fractional RoPE positions:
//!   - text row `i`: `(i, 0, 0)`;
//!   - video latent frame `k`: time `L + sum_{j<k} 5/3 * (1, 4, 4, 4, 4)[j mod 5]` (summed in order), with the
//!     spatial grid of the frame: per axis `linspace(left, left + ratio, n, endpoint = false) * 32` where
//!     `ratio = dim / sqrt(lat_h * lat_w)` and `left = (1 - ratio) / 2`, `n = dim / patch`;
//!   - a keyframe block: the frame grid at time `L` (`"first"`) or `L + S - 5/3` (`"last"`, with `S` the sum of
//!     all frame spans in numpy's pairwise order, as the reference computes that anchor);
//!   - audio latent `k` of either channel: `(L + k, 0, w)`, `w` the first width coordinate for the left channel
//!     and the last for the right.
//! - Timesteps ([`PackedLayout::row_timesteps`]): text and target video rows take the video `t`, target audio the
//!   audio `t`, keyframe rows their own (the pipeline holds them at `max(t, 0.999)`); the distinct values sorted,
//!   and the index of every row into them.
//!
//! Every size a request can reach is checked here with an error that names the rule ([`Rule`]); the sums that
//! size the sequence use checked arithmetic and are bounded by [`MAX_SEQUENCE_ROWS`].

use std::fmt;

use thiserror::Error;

/// Modality tag of a video row (and of a keyframe's vision rows inside the text).
pub const VIDEO_TAG: u8 = 0;
/// Modality tag of a text row.
pub const TEXT_TAG: u8 = 1;
/// Modality tag of an audio row.
pub const AUDIO_TAG: u8 = 2;

/// Frames per second of everything MiniMax H3 generates.
pub const FPS: usize = 24;
/// Audio latents per second (32 kHz, 800-sample hop).
pub const AUDIO_LATENTS_PER_SECOND: usize = 40;
/// Stereo: two channel-major blocks of audio rows.
pub const AUDIO_CHANNELS: usize = 2;
/// Pixel frames per video VAE chunk.
pub const FRAMES_PER_CHUNK: usize = 17;
/// Latent frames per video VAE chunk (and the remainder of an encodable frame count).
pub const LATENTS_PER_CHUNK: usize = 5;
/// Spatial compression of the video VAE.
pub const VAE_SPATIAL_FACTOR: usize = 16;
/// The timestep a keyframe (conditioning) row is held at, at least: just short of clean.
pub const KEYFRAME_TIMESTEP: f32 = 0.999;
/// Keyframe blocks a layout may anchor (one at each end).
pub const MAX_KEYFRAMES: usize = 2;

/// Rows of a packed sequence, at most (the longest pipeline request, 15 s at 768x1344, has about 110,000).
pub const MAX_SEQUENCE_ROWS: usize = 1 << 20;
/// Text rows, at most.
pub const MAX_TEXT_ROWS: usize = 1 << 16;
/// Pixel frames, at most (45 minutes at 24 fps).
pub const MAX_FRAMES: usize = 1 << 16;
/// Canvas side in pixels, at most.
pub const MAX_CANVAS_SIDE: usize = 1 << 15;

/// One latent frame spans `5/3 x (1, 4, 4, 4, 4)[k mod 5]` rotary time units.
const FRAME_RESCALE: f64 = 5.0 / 3.0;
const FRAMES_PER_LATENT: [f64; 5] = [1.0, 4.0, 4.0, 4.0, 4.0];
const SPATIAL_SCALE: f64 = 32.0;

/// The layout rule a request broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A frame count is positive and at most [`MAX_FRAMES`].
    FrameCount,
    /// The video VAE encodes `17 n + 5` frames (`5 n + 2` latent frames).
    FrameForm,
    /// The pipeline generates between its minimum and maximum duration.
    Duration,
    /// Height and width are positive multiples of the canvas multiple (32), at most [`MAX_CANVAS_SIDE`].
    CanvasMultiple,
    /// Latent height and width are positive multiples of the patch.
    PatchDivides,
    /// The patch is `(1, ph, pw)` with positive `ph`, `pw`.
    Patch,
    /// At least one and at most [`MAX_TEXT_ROWS`] text rows.
    TextRows,
    /// Text rows are tagged text (1) or, for a keyframe's vision rows, video (0).
    TextTag,
    /// At most one `"first"` and one `"last"` keyframe.
    Keyframes,
    /// The packed sequence has at most [`MAX_SEQUENCE_ROWS`] rows.
    SequenceLength,
    /// Timesteps are finite and in `[0, 1]` (1 = clean).
    Timestep,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rule::FrameCount => "a frame count is between 1 and 65536",
            Rule::FrameForm => "frame counts are 17n+5 (5n+2 latent frames)",
            Rule::Duration => "the duration is inside the allowed window",
            Rule::CanvasMultiple => {
                "height and width are positive multiples of the canvas multiple"
            }
            Rule::PatchDivides => "latent height and width are multiples of the patch",
            Rule::Patch => "the patch is (1, ph, pw)",
            Rule::TextRows => "the text has 1 to 65536 rows",
            Rule::TextTag => "text rows are tagged text (1) or keyframe vision (0)",
            Rule::Keyframes => "at most one \"first\" and one \"last\" keyframe",
            Rule::SequenceLength => "the packed sequence has at most 1048576 rows",
            Rule::Timestep => "timesteps are finite and in [0, 1]",
        })
    }
}

/// A request the layout cannot take: the rule and what broke it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("MiniMax H3 layout: {detail} (rule: {rule})")]
pub struct LayoutError {
    pub rule: Rule,
    pub detail: String,
}

fn fail<T>(rule: Rule, detail: impl Into<String>) -> Result<T, LayoutError> {
    Err(LayoutError {
        rule,
        detail: detail.into(),
    })
}

fn check_frames(num_frames: usize) -> Result<(), LayoutError> {
    if num_frames == 0 || num_frames > MAX_FRAMES {
        return fail(Rule::FrameCount, format!("{num_frames} frames requested"));
    }
    Ok(())
}

/// Snaps a frame count up to the next `17 n + 5`.
pub fn align_num_frames(num_frames: usize) -> Result<usize, LayoutError> {
    check_frames(num_frames)?;
    let rem = num_frames % FRAMES_PER_CHUNK;
    let aligned = if rem <= LATENTS_PER_CHUNK {
        num_frames - rem + LATENTS_PER_CHUNK
    } else {
        num_frames - rem + FRAMES_PER_CHUNK + LATENTS_PER_CHUNK
    };
    if aligned > MAX_FRAMES {
        return fail(
            Rule::FrameCount,
            format!("{num_frames} frames align up to {aligned}"),
        );
    }
    Ok(aligned)
}

/// Latent frames of an aligned frame count: `17 n + 5` frames give `5 n + 2`.
pub fn latent_frames(num_frames: usize) -> Result<usize, LayoutError> {
    check_frames(num_frames)?;
    if num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK {
        return fail(
            Rule::FrameForm,
            format!(
                "{num_frames} frames is not of the form 17n+5 (the next one is {})",
                align_num_frames(num_frames).map_or_else(|_| "too large".into(), |a| a.to_string())
            ),
        );
    }
    Ok((num_frames - LATENTS_PER_CHUNK) / FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2)
}

/// Audio latents per channel for `num_frames` frames: `round(F / 24 * 40)`. (`40 F / 24 = 5 F / 3` is never
/// halfway between two integers, so the rounding mode does not matter.)
pub fn audio_latents(num_frames: usize) -> Result<usize, LayoutError> {
    check_frames(num_frames)?;
    let a = (num_frames as f64 / FPS as f64 * AUDIO_LATENTS_PER_SECOND as f64).round();
    Ok(a as usize)
}

/// Size limits of a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeRules {
    /// Height and width are multiples of this (VAE factor x spatial patch).
    pub canvas_multiple: usize,
    /// Shortest duration of the aligned frame count, in seconds.
    pub min_seconds: f64,
    /// Longest duration of the aligned frame count, in seconds.
    pub max_seconds: f64,
}

impl SizeRules {
    /// What the MiniMax H3 pipeline accepts: 32-pixel canvas, 5 to 15 seconds.
    pub const PIPELINE: SizeRules = SizeRules {
        canvas_multiple: 32,
        min_seconds: 5.0,
        max_seconds: 15.0,
    };
    /// What the transformer itself needs: 32-pixel canvas, any duration.
    pub const TRANSFORMER: SizeRules = SizeRules {
        canvas_multiple: 32,
        min_seconds: 0.0,
        max_seconds: f64::INFINITY,
    };
}

/// The sizes a request resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Pixel frames, `17 n + 5`.
    pub num_frames: usize,
    /// Video latent frames, `5 n + 2`.
    pub latent_frames: usize,
    pub latent_height: usize,
    pub latent_width: usize,
    /// Audio latents per channel.
    pub audio_latents: usize,
}

impl Geometry {
    /// Resolves a pixel request: the canvas must be a multiple of `rules.canvas_multiple`; the frame count snaps
    /// up to `17 n + 5` and its duration must be inside the rules' window.
    pub fn for_request(
        height: usize,
        width: usize,
        num_frames: usize,
        rules: &SizeRules,
    ) -> Result<Geometry, LayoutError> {
        let m = rules.canvas_multiple;
        for (what, side) in [("height", height), ("width", width)] {
            if m == 0 || side == 0 || side > MAX_CANVAS_SIDE || !side.is_multiple_of(m) {
                return fail(
                    Rule::CanvasMultiple,
                    format!(
                        "{what} {side} is not a positive multiple of {m} up to {MAX_CANVAS_SIDE}"
                    ),
                );
            }
        }
        let aligned = align_num_frames(num_frames)?;
        let seconds = aligned as f64 / FPS as f64;
        if !(rules.min_seconds <= seconds && seconds <= rules.max_seconds) {
            return fail(
                Rule::Duration,
                format!(
                    "{num_frames} frames (aligned to {aligned}) last {seconds:.3} s, outside {} to {} s at {FPS} fps",
                    rules.min_seconds, rules.max_seconds
                ),
            );
        }
        Geometry::from_latents(
            aligned,
            height / VAE_SPATIAL_FACTOR,
            width / VAE_SPATIAL_FACTOR,
        )
    }

    /// The geometry of an already aligned frame count (`17 n + 5`, not snapped) and a latent grid.
    pub fn from_latents(
        num_frames: usize,
        latent_height: usize,
        latent_width: usize,
    ) -> Result<Geometry, LayoutError> {
        let latent_frames = latent_frames(num_frames)?;
        let max_side = MAX_CANVAS_SIDE / VAE_SPATIAL_FACTOR;
        for (what, side) in [
            ("latent height", latent_height),
            ("latent width", latent_width),
        ] {
            if side == 0 || side > max_side {
                return fail(
                    Rule::PatchDivides,
                    format!("{what} {side} must be between 1 and {max_side}"),
                );
            }
        }
        Ok(Geometry {
            num_frames,
            latent_frames,
            latent_height,
            latent_width,
            audio_latents: audio_latents(num_frames)?,
        })
    }
}

/// Which end of the video a keyframe block is anchored to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyframeAnchor {
    First,
    Last,
}

impl std::str::FromStr for KeyframeAnchor {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "first" => Ok(KeyframeAnchor::First),
            "last" => Ok(KeyframeAnchor::Last),
            other => fail(
                Rule::Keyframes,
                format!("keyframe anchor {other:?} is neither \"first\" nor \"last\""),
            ),
        }
    }
}

/// What a packed layout is built from.
#[derive(Debug, Clone, Copy)]
pub struct LayoutRequest<'a> {
    /// Modality tag of every text row ([`TEXT_TAG`], or [`VIDEO_TAG`] for a keyframe's vision rows).
    pub text_tags: &'a [u8],
    pub geometry: Geometry,
    /// The transformer's `(t, h, w)` patch (`config.patch_size`).
    pub patch: [usize; 3],
    /// One entry per keyframe block, in packed order.
    pub keyframes: &'a [KeyframeAnchor],
}

/// The packed sequence of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedLayout {
    /// Rows in all (S).
    pub seq_len: usize,
    /// Rows of one latent frame (patched).
    pub rows_per_frame: usize,
    /// `(t, h, w)` RoPE position of every row, float64.
    pub positions: Vec<[f64; 3]>,
    /// Modality tag of every row.
    pub tags: Vec<u8>,
    /// Sequence positions of the video rows: conditioning rows first, then the target.
    pub video_indices: Vec<usize>,
    /// Sequence positions of the audio rows (left channel, then right).
    pub audio_indices: Vec<usize>,
    /// Sequence positions of the text rows.
    pub text_indices: Vec<usize>,
    /// Leading video rows that are conditioning (keyframe) rows.
    pub condition_video_rows: usize,
    /// Leading audio rows that are reference rows (none in this layout).
    pub condition_audio_rows: usize,
}

/// Per-row timesteps reduced to what the DiT takes.
#[derive(Debug, Clone, PartialEq)]
pub struct RowTimesteps {
    /// The distinct timesteps, ascending.
    pub unique: Vec<f32>,
    /// Index of every row's timestep in `unique`.
    pub indices: Vec<usize>,
}

/// The four noise levels of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimesteps {
    /// Target video rows and text rows.
    pub video: f32,
    /// Target audio rows.
    pub audio: f32,
    /// Keyframe rows (the pipeline uses `max(video, 0.999)`).
    pub condition_video: f32,
    /// Reference audio rows (the pipeline uses 1).
    pub condition_audio: f32,
}

impl StepTimesteps {
    /// The pipeline's levels for a step at video `t` and audio `t`: keyframes held at `max(t, 0.999)`, reference
    /// audio clean.
    pub fn pipeline(video: f32, audio: f32) -> StepTimesteps {
        StepTimesteps {
            video,
            audio,
            condition_video: video.max(KEYFRAME_TIMESTEP),
            condition_audio: 1.0,
        }
    }
}

/// The spatial grid of one axis: `dim / patch` points of `linspace(left, left + ratio, endpoint = false) * 32`,
/// computed as numpy does (`start + i * ((stop - start) / n)`).
fn spatial_axis(dim: usize, patch: usize, sqrt_area: f64) -> Vec<f64> {
    let n = dim / patch;
    let ratio = dim as f64 / sqrt_area;
    let left = (1.0 - ratio) / 2.0;
    let stop = left + ratio;
    let step = (stop - left) / n as f64;
    (0..n)
        .map(|i| (i as f64 * step + left) * SPATIAL_SCALE)
        .collect()
}

fn frame_span(k: usize) -> f64 {
    FRAME_RESCALE * FRAMES_PER_LATENT[k % FRAMES_PER_LATENT.len()]
}

/// numpy's pairwise summation of a float64 array (what `ndarray.sum()` computes): sequential below 8 elements,
/// eight interleaved partial sums up to 128, halves (on a multiple of 8) above.
pub fn numpy_pairwise_sum(a: &[f64]) -> f64 {
    let n = a.len();
    if n < 8 {
        a.iter().fold(0.0, |acc, &v| acc + v)
    } else if n <= 128 {
        let mut r = [0f64; 8];
        r.copy_from_slice(&a[..8]);
        let full = n - n % 8;
        let mut i = 8;
        while i < full {
            for (j, acc) in r.iter_mut().enumerate() {
                *acc += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &v in &a[i..] {
            res += v;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        numpy_pairwise_sum(&a[..n2]) + numpy_pairwise_sum(&a[n2..])
    }
}

fn checked_sum(parts: &[usize]) -> Result<usize, LayoutError> {
    let total = parts
        .iter()
        .try_fold(0usize, |acc, &p| acc.checked_add(p))
        .filter(|&s| s <= MAX_SEQUENCE_ROWS);
    total.map_or_else(
        || {
            fail(
                Rule::SequenceLength,
                format!("text, conditioning, audio and video rows {parts:?} add up to more than {MAX_SEQUENCE_ROWS}"),
            )
        },
        Ok,
    )
}

fn checked_mul(a: usize, b: usize, what: &str) -> Result<usize, LayoutError> {
    a.checked_mul(b)
        .filter(|&p| p <= MAX_SEQUENCE_ROWS)
        .map_or_else(
            || {
                fail(
                    Rule::SequenceLength,
                    format!("{what} ({a} x {b}) exceed {MAX_SEQUENCE_ROWS} rows"),
                )
            },
            Ok,
        )
}

impl PackedLayout {
    /// Validates `request` and builds `[text | keyframes | target audio | target video]`.
    pub fn build(request: &LayoutRequest<'_>) -> Result<PackedLayout, LayoutError> {
        let g = request.geometry;
        let [pt, ph, pw] = request.patch;
        if pt != 1 || ph == 0 || pw == 0 {
            return fail(Rule::Patch, format!("patch {:?}", request.patch));
        }
        if !g.latent_height.is_multiple_of(ph) || !g.latent_width.is_multiple_of(pw) {
            return fail(
                Rule::PatchDivides,
                format!(
                    "latent grid {}x{} is not divisible by the patch {ph}x{pw}",
                    g.latent_height, g.latent_width
                ),
            );
        }
        let text_rows = request.text_tags.len();
        if text_rows == 0 || text_rows > MAX_TEXT_ROWS {
            return fail(Rule::TextRows, format!("{text_rows} text rows"));
        }
        if let Some((i, &t)) = request
            .text_tags
            .iter()
            .enumerate()
            .find(|(_, &t)| t != TEXT_TAG && t != VIDEO_TAG)
        {
            return fail(Rule::TextTag, format!("text row {i} is tagged {t}"));
        }
        let keyframes = request.keyframes;
        let firsts = keyframes
            .iter()
            .filter(|&&k| k == KeyframeAnchor::First)
            .count();
        if keyframes.len() > MAX_KEYFRAMES || firsts > 1 || keyframes.len() - firsts > 1 {
            return fail(Rule::Keyframes, format!("keyframe anchors {keyframes:?}"));
        }
        let max_side = MAX_CANVAS_SIDE / VAE_SPATIAL_FACTOR;
        if g.latent_height == 0
            || g.latent_width == 0
            || g.latent_height > max_side
            || g.latent_width > max_side
        {
            return fail(
                Rule::PatchDivides,
                format!(
                    "latent grid {}x{} must have sides between 1 and {max_side}",
                    g.latent_height, g.latent_width
                ),
            );
        }
        if g.latent_frames == 0 || g.audio_latents == 0 {
            return fail(
                Rule::FrameForm,
                format!(
                    "{} latent frames and {} audio latents",
                    g.latent_frames, g.audio_latents
                ),
            );
        }

        let (grid_h, grid_w) = (g.latent_height / ph, g.latent_width / pw);
        let rows_per_frame = checked_mul(grid_h, grid_w, "rows of one latent frame")?;
        let condition_rows = checked_mul(keyframes.len(), rows_per_frame, "keyframe rows")?;
        let audio_rows = checked_mul(g.audio_latents, AUDIO_CHANNELS, "audio rows")?;
        let video_rows = checked_mul(g.latent_frames, rows_per_frame, "target video rows")?;
        let seq_len = checked_sum(&[text_rows, condition_rows, audio_rows, video_rows])?;
        let condition_start = text_rows;
        let audio_start = condition_start + condition_rows;
        let video_start = audio_start + audio_rows;

        // The frame grid, row-major (h, then w), and the temporal origin of the media rows.
        let sqrt_area = ((g.latent_height * g.latent_width) as f64).sqrt();
        let h_axis = spatial_axis(g.latent_height, ph, sqrt_area);
        let w_axis = spatial_axis(g.latent_width, pw, sqrt_area);
        let frame_grid: Vec<[f64; 2]> = h_axis
            .iter()
            .flat_map(|&h| w_axis.iter().map(move |&w| [h, w]))
            .collect();
        let origin = text_rows as f64;

        let mut positions = Vec::with_capacity(seq_len);
        positions.extend((0..text_rows).map(|i| [i as f64, 0.0, 0.0]));
        for anchor in keyframes {
            let time = match anchor {
                KeyframeAnchor::First => origin,
                KeyframeAnchor::Last => {
                    let spans: Vec<f64> = (0..g.latent_frames).map(frame_span).collect();
                    origin + numpy_pairwise_sum(&spans) - FRAME_RESCALE
                }
            };
            positions.extend(frame_grid.iter().map(|&[h, w]| [time, h, w]));
        }
        let (w_first, w_last) = (
            w_axis.first().copied().unwrap_or(0.0),
            w_axis.last().copied().unwrap_or(0.0),
        );
        for w in [w_first, w_last] {
            positions.extend((0..g.audio_latents).map(|k| [origin + k as f64, 0.0, w]));
        }
        let mut elapsed = 0f64;
        for k in 0..g.latent_frames {
            let time = origin + elapsed;
            positions.extend(frame_grid.iter().map(|&[h, w]| [time, h, w]));
            elapsed += frame_span(k);
        }

        let mut tags = Vec::with_capacity(seq_len);
        tags.extend_from_slice(request.text_tags);
        tags.extend(std::iter::repeat_n(VIDEO_TAG, condition_rows));
        tags.extend(std::iter::repeat_n(AUDIO_TAG, audio_rows));
        tags.extend(std::iter::repeat_n(VIDEO_TAG, video_rows));

        Ok(PackedLayout {
            seq_len,
            rows_per_frame,
            positions,
            tags,
            video_indices: (condition_start..audio_start)
                .chain(video_start..seq_len)
                .collect(),
            audio_indices: (audio_start..video_start).collect(),
            text_indices: (0..text_rows).collect(),
            condition_video_rows: condition_rows,
            condition_audio_rows: 0,
        })
    }

    /// Per-row timesteps for one step, reduced to the distinct values (ascending) and every row's index into
    /// them. Each level must be finite and in `[0, 1]`.
    pub fn row_timesteps(&self, t: StepTimesteps) -> Result<RowTimesteps, LayoutError> {
        for (what, v) in [
            ("video", t.video),
            ("audio", t.audio),
            ("condition video", t.condition_video),
            ("condition audio", t.condition_audio),
        ] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return fail(Rule::Timestep, format!("{what} timestep {v}"));
            }
        }
        let mut row_t = vec![t.video; self.seq_len];
        let cond_v = &self.video_indices[..self.condition_video_rows.min(self.video_indices.len())];
        let (cond_a, target_a) = self
            .audio_indices
            .split_at(self.condition_audio_rows.min(self.audio_indices.len()));
        for &r in cond_v {
            row_t[r] = t.condition_video;
        }
        for &r in target_a {
            row_t[r] = t.audio;
        }
        for &r in cond_a {
            row_t[r] = t.condition_audio;
        }
        Ok(unique_inverse(&row_t))
    }
}

/// Sorted distinct values of `values` (finite) and the index of each value into them.
pub fn unique_inverse(values: &[f32]) -> RowTimesteps {
    let mut unique = values.to_vec();
    unique.sort_by(f32::total_cmp);
    unique.dedup();
    let indices = values
        .iter()
        .map(|v| unique.partition_point(|u| u < v))
        .collect();
    RowTimesteps { unique, indices }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_and_audio_sizes() {
        assert_eq!(align_num_frames(48).unwrap(), 56);
        assert_eq!(align_num_frames(56).unwrap(), 56);
        assert_eq!(align_num_frames(1).unwrap(), 5);
        assert_eq!(align_num_frames(6).unwrap(), 22);
        assert_eq!(align_num_frames(120).unwrap(), 124);
        assert_eq!(latent_frames(56).unwrap(), 17);
        assert_eq!(latent_frames(124).unwrap(), 37);
        assert_eq!(latent_frames(22).unwrap(), 7);
        assert_eq!(latent_frames(5).unwrap(), 2);
        assert_eq!(audio_latents(56).unwrap(), 93);
        assert_eq!(audio_latents(124).unwrap(), 207);
        assert_eq!(audio_latents(22).unwrap(), 37);
        let e = latent_frames(48).unwrap_err();
        assert_eq!(e.rule, Rule::FrameForm);
        assert!(e.to_string().contains("next one is 56"), "{e}");
        assert_eq!(align_num_frames(0).unwrap_err().rule, Rule::FrameCount);
        assert_eq!(
            align_num_frames(MAX_FRAMES).unwrap_err().rule,
            Rule::FrameCount
        );
    }

    #[test]
    fn pipeline_geometry_and_refusals() {
        let g = Geometry::for_request(448, 768, 120, &SizeRules::PIPELINE).unwrap();
        assert_eq!(
            (
                g.num_frames,
                g.latent_frames,
                g.latent_height,
                g.latent_width,
                g.audio_latents
            ),
            (124, 37, 28, 48, 207)
        );
        let short = Geometry::for_request(448, 768, 48, &SizeRules::PIPELINE).unwrap_err();
        assert_eq!(short.rule, Rule::Duration);
        assert!(Geometry::for_request(448, 768, 48, &SizeRules::TRANSFORMER).is_ok());
        let long = Geometry::for_request(448, 768, 360, &SizeRules::PIPELINE).unwrap_err();
        assert_eq!(long.rule, Rule::Duration, "362 frames last 15.08 s");
        for (h, w) in [(440, 768), (0, 768), (448, 1 << 20)] {
            let e = Geometry::for_request(h, w, 124, &SizeRules::PIPELINE).unwrap_err();
            assert_eq!(e.rule, Rule::CanvasMultiple, "{h}x{w}");
        }
    }

    fn tiny(text: &[u8], keyframes: &[KeyframeAnchor]) -> PackedLayout {
        PackedLayout::build(&LayoutRequest {
            text_tags: text,
            geometry: Geometry::from_latents(22, 4, 6).unwrap(),
            patch: [1, 2, 2],
            keyframes,
        })
        .unwrap()
    }

    #[test]
    fn rows_tags_and_indices() {
        let text = [1, 1, 0, 0, 0, 1, 1, 1];
        let l = tiny(&text, &[KeyframeAnchor::First]);
        // 8 text, 6 keyframe rows, 2 x 37 audio, 7 x 6 video.
        assert_eq!(l.seq_len, 130);
        assert_eq!(l.rows_per_frame, 6);
        assert_eq!(l.video_indices.len(), 48);
        assert_eq!(l.video_indices[..6], [8, 9, 10, 11, 12, 13]);
        assert_eq!(l.video_indices[6], 88);
        assert_eq!(l.audio_indices, (14..88).collect::<Vec<_>>());
        assert_eq!(l.tags[..8], text);
        assert!(l.tags[8..14].iter().all(|&t| t == VIDEO_TAG));
        assert!(l.tags[14..88].iter().all(|&t| t == AUDIO_TAG));
        assert!(l.tags[88..].iter().all(|&t| t == VIDEO_TAG));
        // Text positions, keyframe at L, audio pinned to the width extremes, video frames 5/3-spaced.
        assert_eq!(l.positions[3], [3.0, 0.0, 0.0]);
        assert_eq!(l.positions[8][0], 8.0);
        let w = (l.positions[14][2], l.positions[14 + 37][2]);
        assert_eq!(l.positions[8][2], w.0);
        assert_eq!(l.positions[13][2], w.1);
        assert_eq!(l.positions[14 + 36][0], 8.0 + 36.0);
        assert_eq!(l.positions[88][0], 8.0);
        assert_eq!(l.positions[88 + 6][0], 8.0 + 5.0 / 3.0);
        assert!((l.positions[88 + 12][0] - (8.0 + 25.0 / 3.0)).abs() < 1e-12);
    }

    #[test]
    fn spatial_grid_is_centred_and_aspect_normalised() {
        // 28x48 latents (448x768): h starts at 3.7798, w spans -4.9489 .. 35.2032.
        let s = ((28 * 48) as f64).sqrt();
        let h = spatial_axis(28, 2, s);
        let w = spatial_axis(48, 2, s);
        assert_eq!((h.len(), w.len()), (14, 24));
        assert!((h[0] - 3.7798).abs() < 1e-4 && (h[1] - 5.5255).abs() < 1e-4);
        assert!((w[0] + 4.9489).abs() < 1e-4 && (w[23] - 35.2032).abs() < 1e-4);
        // A square grid spans [0, 32).
        let sq = spatial_axis(8, 2, 8.0);
        assert_eq!(sq, vec![0.0, 8.0, 16.0, 24.0]);
    }

    #[test]
    fn last_keyframe_uses_the_pairwise_sum() {
        let l = tiny(&[1, 1], &[KeyframeAnchor::Last, KeyframeAnchor::First]);
        // 7 latent frames: spans 5/3 x (1 4 4 4 4 1 4) = 5/3 x 22; the anchor is L + that - 5/3.
        let t = l.positions[2][0];
        assert!((t - (2.0 + 5.0 / 3.0 * 21.0)).abs() < 1e-12, "{t}");
        assert_eq!(l.positions[2 + 6][0], 2.0);
        // Eight or more terms use the interleaved partial sums.
        let a: Vec<f64> = (0..20).map(|k| frame_span(k) + 1e-9 * k as f64).collect();
        let seq: f64 = a.iter().sum();
        assert!((numpy_pairwise_sum(&a) - seq).abs() < 1e-12);
        assert_eq!(numpy_pairwise_sum(&[]), 0.0);
    }

    #[test]
    fn row_timesteps_unique_and_inverse() {
        let l = tiny(&[1, 0, 1], &[KeyframeAnchor::First]);
        let r = l
            .row_timesteps(StepTimesteps::pipeline(0.4, 0.1429))
            .unwrap();
        assert_eq!(r.unique, vec![0.1429, 0.4, 0.999]);
        assert_eq!(r.indices[0], 1, "text takes the video t");
        assert_eq!(r.indices[3], 2, "keyframe rows held at 0.999");
        assert_eq!(r.indices[3 + 6], 0, "audio");
        assert_eq!(*r.indices.last().unwrap(), 1, "target video");
        // Equal levels collapse.
        let r = l.row_timesteps(StepTimesteps::pipeline(1.0, 1.0)).unwrap();
        assert_eq!(r.unique, vec![1.0]);
        for bad in [f32::NAN, -0.1, 1.5] {
            let e = l
                .row_timesteps(StepTimesteps::pipeline(0.5, bad))
                .unwrap_err();
            assert_eq!(e.rule, Rule::Timestep);
        }
    }

    #[test]
    fn layout_refusals_name_the_rule() {
        let g = Geometry::from_latents(22, 4, 6).unwrap();
        let build = |text: &[u8], g: Geometry, patch: [usize; 3], k: &[KeyframeAnchor]| {
            PackedLayout::build(&LayoutRequest {
                text_tags: text,
                geometry: g,
                patch,
                keyframes: k,
            })
            .unwrap_err()
            .rule
        };
        use KeyframeAnchor::{First, Last};
        assert_eq!(build(&[], g, [1, 2, 2], &[]), Rule::TextRows);
        assert_eq!(build(&[1, 2], g, [1, 2, 2], &[]), Rule::TextTag);
        assert_eq!(build(&[1], g, [1, 2, 2], &[First, First]), Rule::Keyframes);
        assert_eq!(
            build(&[1], g, [1, 2, 2], &[First, Last, Last]),
            Rule::Keyframes
        );
        assert_eq!(build(&[1], g, [2, 2, 2], &[]), Rule::Patch);
        assert_eq!(build(&[1], g, [1, 4, 4], &[]), Rule::PatchDivides);
        let huge = Geometry::from_latents(align_num_frames(60000).unwrap(), 2048, 2048).unwrap();
        assert_eq!(build(&[1], huge, [1, 2, 2], &[]), Rule::SequenceLength);
        assert_eq!(
            Geometry::from_latents(22, 0, 6).unwrap_err().rule,
            Rule::PatchDivides
        );
        assert_eq!(
            "middle".parse::<KeyframeAnchor>().unwrap_err().rule,
            Rule::Keyframes
        );
        assert_eq!("last".parse::<KeyframeAnchor>().unwrap(), Last);
    }
}
