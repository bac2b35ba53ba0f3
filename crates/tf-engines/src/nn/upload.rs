//! The one way weights reach the device: a ring of pinned staging slots that host threads fill, chunk by
//! chunk, through a per-piece [`Transform`], while the GPU copies the previous slot into one allocation.
//!
//! - A [`Piece`] is source bytes (a view of the file map, or a host-built tensor), the transform that turns
//!   them into their device image, and the destination offset. [`Transform::Copy`] moves bytes as they are;
//!   [`Transform::ToBf16`] converts F32/F16 (or copies BF16) to bf16; [`Transform::Custom`] takes any
//!   [`ChunkTransform`] (the FP8 quantizer plugs in here, see the trait).
//! - [`pack`] splits the pieces into slot-sized jobs without splitting a transform's granule (a row, for
//!   per-row scales); it is pure and property-tested. [`fill_host`] applies the same jobs to a host buffer: the
//!   device image the ring would produce, for tests and host paths.
//! - [`upload_pieces`] streams every piece into a [`DeviceBuffer`]. The source of every device copy is a
//!   pinned [`HostBuffer`] (never the map). Slots are refilled only after the event recorded behind their copies
//!   has completed, and the ring waits for its stream before its pinned slots are freed on every path, the
//!   early error returns included (a guard whose `Drop` synchronizes the stream).

use std::time::Instant;

use tf_cuda::{Context, DeviceBuffer, Event, HostBuffer, Stream};
use thiserror::Error;

use crate::nn::weights::{Dtype, BF16};

/// Why an upload failed.
#[derive(Debug, Error)]
pub enum UploadError {
    #[error("weight upload: {what}: {source}")]
    Cuda {
        what: &'static str,
        #[source]
        source: tf_cuda::Error,
    },
    #[error("weight upload: tensor stored as {dtype}; the {transform} transform reads {accepts}")]
    Dtype {
        dtype: Dtype,
        transform: &'static str,
        accepts: &'static str,
    },
    #[error(
        "weight upload: a piece of {bytes} B is not a whole number of {unit}-byte source elements ({transform})"
    )]
    Ragged {
        bytes: usize,
        unit: usize,
        transform: &'static str,
    },
    #[error("weight upload: piece at device offset {offset} of {bytes} B runs past the {capacity} B allocation")]
    OutOfRange {
        offset: usize,
        bytes: usize,
        capacity: usize,
    },
    #[error(
        "weight upload: a {granule_bytes} B granule of the {transform} transform does not fit a {slot_bytes} B \
         staging slot; raise StagingConfig::slot_bytes"
    )]
    SlotTooSmall {
        granule_bytes: usize,
        slot_bytes: usize,
        transform: &'static str,
    },
    #[error("weight upload: {what} overflows usize")]
    Overflow { what: &'static str },
    #[error("weight upload: the {transform} transform failed: {why}")]
    Transform {
        transform: &'static str,
        why: String,
    },
    #[error("weight upload: a worker thread panicked while filling staging memory")]
    Worker,
    #[error(
        "weight upload: {UPLOAD_THREADS_ENV}={value:?} is not a thread count; set it to a whole number from 1 to \
         {MAX_FILL_THREADS}, or unset it for the default (the machine's cores, at most {DEFAULT_MAX_FILL_THREADS})"
    )]
    Threads { value: String },
}

/// The environment variable that sets how many host threads fill each staging slot (converting or quantizing
/// the weights), overriding [`StagingConfig::threads`].
pub const UPLOAD_THREADS_ENV: &str = "TF_UPLOAD_THREADS";

/// Most fill threads the default [`StagingConfig`] takes (the machine's cores up to this).
pub const DEFAULT_MAX_FILL_THREADS: usize = 16;

/// Most fill threads [`UPLOAD_THREADS_ENV`] may ask for.
pub const MAX_FILL_THREADS: usize = 64;

/// The fill threads of an upload: [`UPLOAD_THREADS_ENV`] when set (1 to [`MAX_FILL_THREADS`]), else `configured`.
pub fn fill_threads(configured: usize) -> Result<usize, UploadError> {
    parse_fill_threads(
        std::env::var(UPLOAD_THREADS_ENV).ok().as_deref(),
        configured,
    )
}

fn parse_fill_threads(value: Option<&str>, configured: usize) -> Result<usize, UploadError> {
    match value {
        None | Some("") => Ok(configured.max(1)),
        Some(value) => match value.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_FILL_THREADS).contains(&n) => Ok(n),
            _ => Err(UploadError::Threads {
                value: value.to_string(),
            }),
        },
    }
}

fn cuda(what: &'static str) -> impl FnOnce(tf_cuda::Error) -> UploadError {
    move |source| UploadError::Cuda { what, source }
}

/// A transform of source elements into their device image, applied per chunk by the fill threads.
///
/// The ring hands a transform runs of whole granules: `granule()` consecutive source elements are never split
/// across chunks. A per-output-channel FP8 quantizer implements it with a granule of one row: `apply` sees
/// whole rows (and the index of the first one, `first / granule`), writes the e4m3 bytes into `dst` and keeps
/// each row's scale in its own storage (a `Mutex<Vec<f32>>`, say), which the caller uploads as a second piece
/// once the first has landed.
pub trait ChunkTransform: Sync {
    /// A short name for errors.
    fn name(&self) -> &'static str;
    /// Bytes of one source element.
    fn src_elem_bytes(&self) -> usize;
    /// Bytes of one device element.
    fn dst_elem_bytes(&self) -> usize;
    /// Source elements that must stay in one chunk (1: any split is fine).
    fn granule(&self) -> usize {
        1
    }
    /// Converts `src` (whole elements, starting at element `first` of the piece) into `dst` (the same count of
    /// device elements).
    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError>;
}

/// What a piece becomes on the device.
#[derive(Clone, Copy)]
pub enum Transform<'a> {
    /// The source bytes as they are (bf16 that stays bf16, f32 norm gammas, packed tables).
    Copy,
    /// Elements of `from` (F32, BF16 or F16) as bf16, rounded to nearest even.
    ToBf16 { from: Dtype },
    /// Any other transform (FP8 quantization next).
    Custom(&'a dyn ChunkTransform),
}

impl std::fmt::Debug for Transform<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transform::Copy => f.write_str("Copy"),
            Transform::ToBf16 { from } => write!(f, "ToBf16 {{ from: {from} }}"),
            Transform::Custom(t) => write!(f, "Custom({})", t.name()),
        }
    }
}

impl Transform<'_> {
    fn name(&self) -> &'static str {
        match self {
            Transform::Copy => "copy",
            Transform::ToBf16 { .. } => "bf16",
            Transform::Custom(t) => t.name(),
        }
    }

    /// (source bytes, device bytes) per element.
    fn elem_bytes(&self) -> Result<(usize, usize), UploadError> {
        match self {
            Transform::Copy => Ok((1, 1)),
            Transform::ToBf16 { from } => match from {
                Dtype::F32 => Ok((4, BF16)),
                Dtype::BF16 | Dtype::F16 => Ok((2, BF16)),
                other => Err(UploadError::Dtype {
                    dtype: *other,
                    transform: "bf16",
                    accepts: "F32, BF16 or F16",
                }),
            },
            Transform::Custom(t) => Ok((t.src_elem_bytes().max(1), t.dst_elem_bytes().max(1))),
        }
    }

    fn granule(&self) -> usize {
        match self {
            Transform::Custom(t) => t.granule().max(1),
            _ => 1,
        }
    }

    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        match self {
            Transform::Copy => {
                let n = dst.len().min(src.len());
                dst[..n].copy_from_slice(&src[..n]);
                Ok(())
            }
            Transform::ToBf16 { from } => convert_to_bf16(src, *from, dst),
            Transform::Custom(t) => t.apply(first, src, dst),
        }
    }
}

/// One source tensor (or part of one) and where its device image goes.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// Source bytes: little-endian elements the transform reads.
    pub src: &'a [u8],
    pub transform: Transform<'a>,
    /// Destination byte offset in the device allocation.
    pub dst_offset: usize,
}

impl<'a> Piece<'a> {
    /// `src`, stored as `dtype`, converted to bf16 at `dst_offset`.
    pub fn bf16(src: &'a [u8], dtype: Dtype, dst_offset: usize) -> Piece<'a> {
        Piece {
            src,
            transform: Transform::ToBf16 { from: dtype },
            dst_offset,
        }
    }

    /// `src` copied as it is to `dst_offset`.
    pub fn copy(src: &'a [u8], dst_offset: usize) -> Piece<'a> {
        Piece {
            src,
            transform: Transform::Copy,
            dst_offset,
        }
    }

    /// (source elements, source bytes per element, device bytes per element), checked.
    fn geometry(&self) -> Result<(usize, usize, usize), UploadError> {
        let (src_unit, dst_unit) = self.transform.elem_bytes()?;
        let granule_bytes = src_unit
            .checked_mul(self.transform.granule())
            .ok_or(UploadError::Overflow { what: "a granule" })?;
        if !self.src.len().is_multiple_of(granule_bytes) {
            return Err(UploadError::Ragged {
                bytes: self.src.len(),
                unit: granule_bytes,
                transform: self.transform.name(),
            });
        }
        Ok((self.src.len() / src_unit, src_unit, dst_unit))
    }

    /// Device bytes this piece writes.
    pub fn device_bytes(&self) -> Result<usize, UploadError> {
        let (n, _, dst_unit) = self.geometry()?;
        n.checked_mul(dst_unit).ok_or(UploadError::Overflow {
            what: "a piece's device bytes",
        })
    }
}

/// A contiguous run of elements of one piece placed in a staging slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index of the piece.
    pub piece: usize,
    /// First element of the piece in this segment.
    pub first: usize,
    pub elements: usize,
    /// Byte offset in the staging slot.
    pub staging_offset: usize,
}

/// How [`pack`] sees a piece: its element count, device bytes per element and granule (elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackItem {
    pub elements: usize,
    pub dst_elem_bytes: usize,
    pub granule: usize,
}

/// Packs pieces into jobs of at most `slot_bytes` device bytes each, in order, splitting pieces that cross a
/// job boundary at a granule boundary. Fails when one granule does not fit a slot.
pub fn pack(items: &[PackItem], slot_bytes: usize) -> Result<Vec<Vec<Segment>>, UploadError> {
    let slot_bytes = slot_bytes.max(1);
    let mut jobs: Vec<Vec<Segment>> = Vec::new();
    let mut current: Vec<Segment> = Vec::new();
    let mut used = 0usize;
    for (piece, item) in items.iter().enumerate() {
        let unit = item.dst_elem_bytes.max(1);
        let granule = item.granule.max(1);
        let granule_bytes = unit
            .checked_mul(granule)
            .ok_or(UploadError::Overflow { what: "a granule" })?;
        if item.elements > 0 && granule_bytes > slot_bytes {
            return Err(UploadError::SlotTooSmall {
                granule_bytes,
                slot_bytes,
                transform: "piece",
            });
        }
        let mut first = 0usize;
        while first < item.elements {
            let room = (slot_bytes - used) / granule_bytes * granule;
            if room == 0 {
                jobs.push(std::mem::take(&mut current));
                used = 0;
                continue;
            }
            let take = (item.elements - first).min(room);
            current.push(Segment {
                piece,
                first,
                elements: take,
                staging_offset: used,
            });
            used += take * unit;
            first += take;
        }
    }
    if !current.is_empty() {
        jobs.push(current);
    }
    Ok(jobs)
}

/// Converts `src` (elements of `dtype`) to bf16 bytes in `dst` (2 bytes per element, same count).
pub fn convert_to_bf16(src: &[u8], dtype: Dtype, dst: &mut [u8]) -> Result<(), UploadError> {
    match dtype {
        Dtype::BF16 => {
            let n = dst.len().min(src.len());
            dst[..n].copy_from_slice(&src[..n]);
        }
        Dtype::F32 => {
            for (out, v) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let x = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
                out.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (out, v) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let x = half::f16::from_bits(u16::from_le_bytes([v[0], v[1]])).to_f32();
                out.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        other => {
            return Err(UploadError::Dtype {
                dtype: other,
                transform: "bf16",
                accepts: "F32, BF16 or F16",
            })
        }
    }
    Ok(())
}

/// A `[rows, cols]` matrix stored as `from` (F32, BF16 or F16) with each row times its own scale, as bf16: the
/// element in f32 (exact from any of the three), times `scale[row]` in f32, rounded to nearest even. It folds a
/// per-row scale (a layer scale on an output projection) into a weight on the ring's threads, with no host copy of
/// the matrix; the bits equal the host path's (f32 values, scaled, then [`Transform::ToBf16`]).
#[derive(Debug, Clone)]
pub struct RowScaleToBf16 {
    from: Dtype,
    cols: usize,
    scale: Vec<f32>,
}

impl RowScaleToBf16 {
    /// The transform of a matrix of `scale.len()` rows of `cols` elements stored as `from`.
    pub fn new(from: Dtype, cols: usize, scale: Vec<f32>) -> Result<RowScaleToBf16, UploadError> {
        if !matches!(from, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(UploadError::Dtype {
                dtype: from,
                transform: "row-scaled bf16",
                accepts: "F32, BF16 or F16",
            });
        }
        let bytes = scale
            .len()
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(from.size_bytes()));
        if cols == 0 || scale.is_empty() || bytes.is_none() {
            return Err(UploadError::Transform {
                transform: "row-scaled bf16",
                why: format!("a matrix of {} rows of {cols} columns", scale.len()),
            });
        }
        Ok(RowScaleToBf16 { from, cols, scale })
    }

    /// Writes `rows` rows of `src` (elements of `unit` bytes, read by `read`) times their scales into `dst`.
    fn scale_rows(
        &self,
        scales: &[f32],
        src: &[u8],
        dst: &mut [u8],
        unit: usize,
        read: impl Fn(&[u8]) -> f32,
    ) {
        let cols = self.cols;
        let rows = src
            .chunks_exact(cols * unit)
            .zip(dst.chunks_exact_mut(cols * BF16));
        for ((row_in, row_out), &s) in rows.zip(scales) {
            for (v, o) in row_in
                .chunks_exact(unit)
                .zip(row_out.chunks_exact_mut(BF16))
            {
                o.copy_from_slice(&half::bf16::from_f32(read(v) * s).to_bits().to_le_bytes());
            }
        }
    }
}

impl ChunkTransform for RowScaleToBf16 {
    fn name(&self) -> &'static str {
        "row-scaled bf16"
    }

    fn src_elem_bytes(&self) -> usize {
        self.from.size_bytes()
    }

    fn dst_elem_bytes(&self) -> usize {
        BF16
    }

    fn granule(&self) -> usize {
        self.cols
    }

    fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        let cols = self.cols;
        let elements = dst.len() / BF16;
        let rows = elements / cols;
        let first_row = first / cols;
        let whole = first.is_multiple_of(cols)
            && elements.is_multiple_of(cols)
            && dst.len().is_multiple_of(BF16)
            && src.len() == elements * self.src_elem_bytes();
        let scales = self.scale.get(first_row..first_row.saturating_add(rows));
        let Some(scales) = scales.filter(|_| whole) else {
            return Err(UploadError::Transform {
                transform: self.name(),
                why: format!(
                    "a chunk of {elements} elements at element {first} is not whole rows of {cols} inside the \
                     matrix's {} rows",
                    self.scale.len()
                ),
            });
        };
        match self.from {
            Dtype::F32 => self.scale_rows(scales, src, dst, 4, |v| {
                f32::from_le_bytes([v[0], v[1], v[2], v[3]])
            }),
            Dtype::BF16 => self.scale_rows(scales, src, dst, 2, |v| {
                half::bf16::from_le_bytes([v[0], v[1]]).to_f32()
            }),
            _ => self.scale_rows(scales, src, dst, 2, |v| {
                half::f16::from_le_bytes([v[0], v[1]]).to_f32()
            }),
        }
        Ok(())
    }
}

/// Staging geometry.
#[derive(Debug, Clone, Copy)]
pub struct StagingConfig {
    /// Bytes per pinned slot.
    pub slot_bytes: usize,
    /// Slots in the ring (2 = double buffering).
    pub slots: usize,
    /// Host threads that fill a slot ([`UPLOAD_THREADS_ENV`] overrides it).
    pub threads: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            slot_bytes: 64 << 20,
            slots: 3,
            // Loading scales with fill threads: an FP8 load quantizing 14.2 GB took 19.5 s on 1, 6.7 s on 8 and
            // 3.6 s on 16 (docs/RESULTS.md, twenty-ninth call).
            threads: std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .clamp(1, DEFAULT_MAX_FILL_THREADS),
        }
    }
}

/// What an upload moved and how fast.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UploadStats {
    /// Bytes read from the sources (file bytes).
    pub source_bytes: u64,
    /// Bytes written to the device.
    pub device_bytes: u64,
    pub seconds: f64,
}

impl UploadStats {
    /// Source bytes per second, in GB/s.
    pub fn source_gb_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.source_bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for UploadStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} GB read, {:.3} GB on the device in {:.3} s ({:.2} GB/s)",
            self.source_bytes as f64 / 1e9,
            self.device_bytes as f64 / 1e9,
            self.seconds,
            self.source_gb_per_s()
        )
    }
}

/// The checked plan of an upload: every piece's geometry and the jobs.
struct Plan {
    /// Per piece: (source bytes per element, device bytes per element).
    units: Vec<(usize, usize)>,
    jobs: Vec<Vec<Segment>>,
    source_bytes: u64,
    device_bytes: u64,
}

/// Checks every piece against a destination of `capacity` bytes and packs them into `slot_bytes` jobs.
fn plan(pieces: &[Piece<'_>], capacity: usize, slot_bytes: usize) -> Result<Plan, UploadError> {
    let mut items = Vec::with_capacity(pieces.len());
    let mut units = Vec::with_capacity(pieces.len());
    let mut source_bytes = 0u64;
    let mut device_bytes = 0u64;
    for p in pieces {
        let (n, src_unit, dst_unit) = p.geometry()?;
        let bytes = p.device_bytes()?;
        if p.dst_offset.checked_add(bytes).is_none_or(|e| e > capacity) {
            return Err(UploadError::OutOfRange {
                offset: p.dst_offset,
                bytes,
                capacity,
            });
        }
        let granule_bytes = dst_unit.saturating_mul(p.transform.granule());
        if n > 0 && granule_bytes > slot_bytes {
            return Err(UploadError::SlotTooSmall {
                granule_bytes,
                slot_bytes,
                transform: p.transform.name(),
            });
        }
        source_bytes += p.src.len() as u64;
        device_bytes += bytes as u64;
        units.push((src_unit, dst_unit));
        items.push(PackItem {
            elements: n,
            dst_elem_bytes: dst_unit,
            granule: p.transform.granule(),
        });
    }
    let jobs = pack(&items, slot_bytes)?;
    Ok(Plan {
        units,
        jobs,
        source_bytes,
        device_bytes,
    })
}

/// Applies every piece's transform into `dst` (a host image of the device allocation), through the same jobs
/// and fill path as [`upload_pieces`] with `slot_bytes` slots. Bytes no piece covers are left as they are.
pub fn fill_host(
    dst: &mut [u8],
    pieces: &[Piece<'_>],
    slot_bytes: usize,
    threads: usize,
) -> Result<(), UploadError> {
    let slot_bytes = slot_bytes.max(1);
    let plan = plan(pieces, dst.len(), slot_bytes)?;
    let mut slot = vec![0u8; slot_bytes];
    for job in &plan.jobs {
        fill_slot(&mut slot, job, pieces, &plan.units, threads)?;
        for seg in job {
            let dst_unit = plan.units[seg.piece].1;
            let at = pieces[seg.piece].dst_offset + seg.first * dst_unit;
            let len = seg.elements * dst_unit;
            dst[at..at + len].copy_from_slice(&slot[seg.staging_offset..seg.staging_offset + len]);
        }
    }
    Ok(())
}

/// The pinned slots of one upload. Dropping it waits for the stream first, so no copy still reads a slot when
/// it is freed, whichever way the upload ends.
struct Ring<'s> {
    stream: &'s Stream,
    /// (buffer, event recorded behind its last copies, copies in flight).
    slots: Vec<(HostBuffer, Event, bool)>,
}

impl Drop for Ring<'_> {
    fn drop(&mut self) {
        if self.slots.iter().any(|s| s.2) {
            // An error here means the context is lost: nothing runs any more and its memory goes with it
            // (tf-cuda's buffers leak rather than call into a lost context).
            let _ = self.stream.synchronize();
        }
    }
}

/// Uploads every piece into `dst` through a ring of pinned slots; returns once the data landed.
pub fn upload_pieces(
    ctx: &Context,
    stream: &Stream,
    dst: &mut DeviceBuffer,
    pieces: &[Piece<'_>],
    staging: StagingConfig,
) -> Result<UploadStats, UploadError> {
    let started = Instant::now();
    let threads = fill_threads(staging.threads)?;
    let slot_bytes = (staging.slot_bytes.max(4096) / 16) * 16;
    let plan = plan(pieces, dst.len(), slot_bytes)?;
    let slots = staging.slots.clamp(1, plan.jobs.len().max(1));
    let mut ring = Ring {
        stream,
        slots: Vec::with_capacity(slots),
    };
    for _ in 0..slots {
        let buffer =
            HostBuffer::alloc(ctx, slot_bytes).map_err(cuda("allocating pinned staging"))?;
        let event = Event::new(ctx, false).map_err(cuda("creating a staging event"))?;
        ring.slots.push((buffer, event, false));
    }
    for (j, job) in plan.jobs.iter().enumerate() {
        let (buffer, event, in_flight) = &mut ring.slots[j % slots];
        if *in_flight {
            event
                .synchronize()
                .map_err(cuda("waiting for a staging slot"))?;
            *in_flight = false;
        }
        fill_slot(buffer.as_mut_slice(), job, pieces, &plan.units, threads)?;
        let mut view = dst.view_mut();
        for seg in job {
            let dst_unit = plan.units[seg.piece].1;
            let dst_offset = pieces[seg.piece].dst_offset + seg.first * dst_unit;
            // Marked before the copy is enqueued: from here on the ring's Drop waits for the stream.
            *in_flight = true;
            // SAFETY: `buffer` lives in `ring`, whose Drop synchronizes the stream before the slots are freed
            // (on this function's success and error paths alike); it is rewritten only after `event`, recorded
            // behind these copies, has completed. The range was checked against `dst` by `plan`.
            unsafe {
                view.upload_async_pinned(
                    dst_offset,
                    buffer,
                    seg.staging_offset,
                    seg.elements * dst_unit,
                    stream,
                )
                .map_err(cuda("enqueueing a host-to-device copy"))?;
            }
        }
        event
            .record(stream)
            .map_err(cuda("recording a staging event"))?;
    }
    stream
        .synchronize()
        .map_err(cuda("finishing the weight upload"))?;
    for slot in &mut ring.slots {
        slot.2 = false;
    }
    drop(ring);
    Ok(UploadStats {
        source_bytes: plan.source_bytes,
        device_bytes: plan.device_bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A task of one fill thread: transform `src` (from element `first` of the piece) into `dst`.
struct FillTask<'s, 'd> {
    src: &'s [u8],
    first: usize,
    transform: Transform<'s>,
    dst: &'d mut [u8],
}

/// Fills one staging slot with the job's segments, split across `threads` scoped threads (at granule
/// boundaries).
fn fill_slot(
    slot: &mut [u8],
    job: &[Segment],
    pieces: &[Piece<'_>],
    units: &[(usize, usize)],
    threads: usize,
) -> Result<(), UploadError> {
    let threads = threads.max(1);
    let job_bytes: usize = job.iter().map(|s| s.elements * units[s.piece].1).sum();
    let per_task = job_bytes.div_ceil(threads).max(1 << 16);
    let mut tasks: Vec<FillTask<'_, '_>> = Vec::new();
    let limit = job_bytes.min(slot.len());
    let mut rest: &mut [u8] = &mut slot[..limit];
    for seg in job {
        let piece = &pieces[seg.piece];
        let (src_unit, dst_unit) = units[seg.piece];
        let granule = piece.transform.granule();
        let step = (per_task / dst_unit / granule).max(1) * granule;
        let mut first = seg.first;
        let mut left = seg.elements;
        while left > 0 {
            let take = left.min(step);
            let (head, tail) = std::mem::take(&mut rest)
                .split_at_mut_checked(take * dst_unit)
                .ok_or(UploadError::OutOfRange {
                    offset: seg.staging_offset,
                    bytes: take * dst_unit,
                    capacity: limit,
                })?;
            rest = tail;
            let src = piece
                .src
                .get(first * src_unit..(first + take) * src_unit)
                .ok_or(UploadError::OutOfRange {
                    offset: first * src_unit,
                    bytes: take * src_unit,
                    capacity: piece.src.len(),
                })?;
            tasks.push(FillTask {
                src,
                first,
                transform: piece.transform,
                dst: head,
            });
            first += take;
            left -= take;
        }
    }
    if threads <= 1 || tasks.len() <= 1 {
        for t in tasks {
            t.transform.apply(t.first, t.src, t.dst)?;
        }
        return Ok(());
    }
    let per_thread = tasks.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = tasks
            .chunks_mut(per_thread)
            .map(|group| {
                scope.spawn(move || -> Result<(), UploadError> {
                    for t in group.iter_mut() {
                        t.transform.apply(t.first, t.src, t.dst)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| UploadError::Worker)??;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fill_threads_take_the_variable_or_the_configuration() {
        assert_eq!(parse_fill_threads(None, 8).unwrap(), 8);
        assert_eq!(parse_fill_threads(Some(""), 0).unwrap(), 1);
        assert_eq!(parse_fill_threads(Some("16"), 8).unwrap(), 16);
        assert_eq!(parse_fill_threads(Some(" 3 "), 8).unwrap(), 3);
        for bad in ["0", "65", "-1", "four", "1e3"] {
            let err = parse_fill_threads(Some(bad), 8).unwrap_err().to_string();
            assert!(
                err.contains(UPLOAD_THREADS_ENV) && err.contains(bad),
                "{err}"
            );
        }
    }

    /// `values` stored as `dtype` (rounded to it first, so the f32 view is exact).
    fn stored(values: &[f32], dtype: Dtype) -> (Vec<u8>, Vec<f32>) {
        match dtype {
            Dtype::F32 => (
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                values.to_vec(),
            ),
            Dtype::BF16 => {
                let h: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
                (
                    h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    h.iter().map(|v| v.to_f32()).collect(),
                )
            }
            _ => {
                let h: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
                (
                    h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    h.iter().map(|v| v.to_f32()).collect(),
                )
            }
        }
    }

    proptest! {
        /// Row-scaled bf16 equals the host path (f32 value times the row's scale, then bf16) bit for bit, from
        /// every source dtype and in chunks of whole rows starting anywhere.
        #[test]
        fn row_scaled_bf16_equals_the_host_path(
            rows in 1usize..9,
            cols in 1usize..13,
            seed in any::<u64>(),
            dtype_index in 0usize..3,
            split in 0usize..9,
        ) {
            let dtype = [Dtype::F32, Dtype::BF16, Dtype::F16][dtype_index];
            let mut state = seed | 1;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32
            };
            let values: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
            let scale: Vec<f32> = (0..rows).map(|_| next()).collect();
            let (src, exact) = stored(&values, dtype);
            let t = RowScaleToBf16::new(dtype, cols, scale.clone()).unwrap();
            prop_assert_eq!(t.granule(), cols);
            let unit = dtype.size_bytes();
            let at = split.min(rows) * cols;
            let mut dst = vec![0u8; rows * cols * BF16];
            let (head, tail) = dst.split_at_mut(at * BF16);
            t.apply(0, &src[..at * unit], head).unwrap();
            t.apply(at, &src[at * unit..], tail).unwrap();
            for (e, out) in dst.chunks_exact(BF16).enumerate() {
                let want = half::bf16::from_f32(exact[e] * scale[e / cols]).to_bits();
                prop_assert_eq!(u16::from_le_bytes([out[0], out[1]]), want, "element {}", e);
            }
        }
    }

    #[test]
    fn row_scaled_bf16_refuses_what_is_not_whole_rows_of_its_matrix() {
        let t = RowScaleToBf16::new(Dtype::F32, 4, vec![1.0, 2.0]).unwrap();
        let src = vec![0u8; 4 * 4];
        let mut dst = vec![0u8; 4 * BF16];
        // A chunk that starts inside a row, one that is not whole rows, and one past the last row.
        assert!(t.apply(2, &src, &mut dst).is_err());
        assert!(t.apply(0, &src[..12], &mut dst[..6]).is_err());
        let err = t.apply(8, &src, &mut dst).unwrap_err().to_string();
        assert!(
            err.contains("row-scaled bf16") && err.contains("2 rows"),
            "{err}"
        );
        // A source of the wrong length for the chunk.
        assert!(t.apply(0, &src[..8], &mut dst).is_err());
        assert!(t.apply(0, &src, &mut dst).is_ok());
        assert!(matches!(
            RowScaleToBf16::new(Dtype::I8, 4, vec![1.0]),
            Err(UploadError::Dtype { .. })
        ));
        assert!(RowScaleToBf16::new(Dtype::F32, 0, vec![1.0]).is_err());
        assert!(RowScaleToBf16::new(Dtype::F32, 4, Vec::new()).is_err());
        assert!(RowScaleToBf16::new(Dtype::F32, usize::MAX / 2, vec![1.0; 3]).is_err());
    }

    #[test]
    fn conversion_matches_half() {
        let values = [0.0f32, -1.5, 2.71, 1e-20, 65504.0, -7.0e30];
        let src: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut dst = vec![0u8; values.len() * 2];
        convert_to_bf16(&src, Dtype::F32, &mut dst).unwrap();
        for (v, out) in values.iter().zip(dst.chunks_exact(2)) {
            assert_eq!(
                u16::from_le_bytes([out[0], out[1]]),
                half::bf16::from_f32(*v).to_bits()
            );
        }
        let f16: Vec<u8> = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        convert_to_bf16(&f16, Dtype::F16, &mut dst).unwrap();
        for (v, out) in values.iter().zip(dst.chunks_exact(2)) {
            let expect = half::bf16::from_f32(half::f16::from_f32(*v).to_f32()).to_bits();
            assert_eq!(u16::from_le_bytes([out[0], out[1]]), expect);
        }
        assert!(convert_to_bf16(&src, Dtype::I64, &mut dst).is_err());
    }

    /// A stand-in for the FP8 quantizer: whole rows of f32, each written as its row index (one byte per
    /// element), so a split row would show.
    struct RowTag {
        cols: usize,
    }

    impl ChunkTransform for RowTag {
        fn name(&self) -> &'static str {
            "row-tag"
        }
        fn src_elem_bytes(&self) -> usize {
            4
        }
        fn dst_elem_bytes(&self) -> usize {
            1
        }
        fn granule(&self) -> usize {
            self.cols
        }
        fn apply(&self, first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
            if !first.is_multiple_of(self.cols) || !(src.len() / 4).is_multiple_of(self.cols) {
                return Err(UploadError::Transform {
                    transform: "row-tag",
                    why: format!("split row at element {first}"),
                });
            }
            for (i, out) in dst.iter_mut().enumerate() {
                *out = ((first + i) / self.cols) as u8;
            }
            Ok(())
        }
    }

    #[test]
    fn filled_slots_hold_every_piece_transformed_in_place() {
        // Mixed dtypes and transforms, packed into small slots, filled by 4 threads.
        let a: Vec<u8> = (0..100_000)
            .flat_map(|i| (i as f32 * 0.5 - 3.0).to_le_bytes())
            .collect();
        let b: Vec<u8> = (0..30_000u32)
            .flat_map(|i| half::bf16::from_f32(i as f32).to_bits().to_le_bytes())
            .collect();
        let c: Vec<u8> = (0..50_000u32)
            .flat_map(|i| {
                half::f16::from_f32((i % 1000) as f32)
                    .to_bits()
                    .to_le_bytes()
            })
            .collect();
        let raw: Vec<u8> = (0..9_999u32).map(|i| (i % 251) as u8).collect();
        let rows = vec![0u8; 4 * 7 * 300];
        let tag = RowTag { cols: 7 };
        let pieces = [
            Piece::bf16(&a, Dtype::F32, 0),
            Piece::bf16(&b, Dtype::BF16, 200_000),
            Piece::bf16(&c, Dtype::F16, 260_000),
            Piece::copy(&raw, 360_001),
            Piece {
                src: &rows,
                transform: Transform::Custom(&tag),
                dst_offset: 370_000,
            },
        ];
        let mut device = vec![0u8; 372_100];
        fill_host(&mut device, &pieces, 140_000, 4).unwrap();
        for piece in &pieces[..3] {
            let Transform::ToBf16 { from } = piece.transform else {
                unreachable!()
            };
            let n = piece.device_bytes().unwrap();
            let mut want = vec![0u8; n];
            convert_to_bf16(piece.src, from, &mut want).unwrap();
            assert!(
                device[piece.dst_offset..piece.dst_offset + n] == want[..],
                "{from}"
            );
        }
        assert_eq!(&device[360_001..360_001 + raw.len()], &raw[..]);
        for (i, &v) in device[370_000..370_000 + 2100].iter().enumerate() {
            assert_eq!(v, (i / 7) as u8);
        }
        // A slot smaller than one granule, a ragged piece and a piece past the end are refused.
        let mut small = vec![0u8; 4000];
        let at_start = [Piece {
            src: &rows,
            transform: Transform::Custom(&tag),
            dst_offset: 0,
        }];
        let err = fill_host(&mut small, &at_start, 6, 1).unwrap_err();
        assert!(
            matches!(
                err,
                UploadError::SlotTooSmall {
                    transform: "row-tag",
                    ..
                }
            ),
            "{err}"
        );
        assert!(matches!(
            fill_host(&mut small, &[Piece::bf16(&a[..6], Dtype::F32, 0)], 64, 1),
            Err(UploadError::Ragged { .. })
        ));
        assert!(matches!(
            fill_host(&mut small, &[Piece::copy(&raw, 0)], 64, 1),
            Err(UploadError::OutOfRange { .. })
        ));
        assert!(matches!(
            fill_host(&mut small, &[Piece::bf16(&raw[..8], Dtype::I32, 0)], 64, 1),
            Err(UploadError::Dtype { .. })
        ));
    }

    proptest! {
        /// Every element of every piece lands exactly once, in order, no job exceeds the slot, and no granule
        /// is split.
        #[test]
        fn packing_covers_every_element_once(
            sizes in proptest::collection::vec((0usize..12, 1usize..4, 1usize..3), 0..12),
            slot in 6usize..40,
        ) {
            let items: Vec<PackItem> = sizes
                .iter()
                .map(|&(g, unit, granule)| PackItem { elements: g * granule, dst_elem_bytes: unit, granule })
                .collect();
            let jobs = pack(&items, slot).unwrap();
            let mut next = vec![0usize; items.len()];
            let mut last_piece = 0usize;
            for job in &jobs {
                let mut offset = 0;
                let total: usize = job.iter().map(|s| s.elements * items[s.piece].dst_elem_bytes).sum();
                prop_assert!(total <= slot && total > 0);
                for seg in job {
                    let item = items[seg.piece];
                    prop_assert_eq!(seg.staging_offset, offset);
                    prop_assert_eq!(seg.first, next[seg.piece]);
                    prop_assert!(seg.first % item.granule == 0 && seg.elements % item.granule == 0);
                    prop_assert!(seg.piece >= last_piece);
                    last_piece = seg.piece;
                    next[seg.piece] += seg.elements;
                    offset += seg.elements * item.dst_elem_bytes;
                }
            }
            let want: Vec<usize> = items.iter().map(|i| i.elements).collect();
            prop_assert_eq!(next, want);
        }
    }
}
