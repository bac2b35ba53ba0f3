//! Streaming weights into one device allocation through pinned staging, converting to bf16 on the way.
//!
//! The source of every device copy is a pinned [`HostBuffer`] (never the file map): worker threads copy (or
//! convert f32/f16 to bf16) a chunk of the map into a staging slot while the GPU copies the previous slot, so
//! reading the map overlaps the host-to-device copies. Slots are reused only after the event recorded behind
//! their copies has completed.
//!
//! The packing of pieces into slots ([`pack`]) is pure and unit-tested; the conversion is unit-tested against
//! the `half` crate.

use std::time::Instant;

use tf_cuda::{Context, DeviceBuffer, Event, HostBuffer, Stream};
use thiserror::Error;

use crate::nn::weights::Dtype;

/// Why an upload failed.
#[derive(Debug, Error)]
pub enum UploadError {
    #[error("weight upload: {what}: {source}")]
    Cuda {
        what: &'static str,
        #[source]
        source: tf_cuda::Error,
    },
    #[error("weight upload: tensor stored as {0}; only F32, BF16 and F16 weights can be uploaded as bf16")]
    Dtype(Dtype),
    #[error("weight upload: piece at device offset {offset} of {bytes} B runs past the {capacity} B allocation")]
    OutOfRange {
        offset: usize,
        bytes: usize,
        capacity: usize,
    },
    #[error("weight upload: a worker thread panicked while filling staging memory")]
    Worker,
}

fn cuda(what: &'static str) -> impl FnOnce(tf_cuda::Error) -> UploadError {
    move |source| UploadError::Cuda { what, source }
}

/// One source tensor (or part of one) and where its bf16 image goes.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// Source bytes: little-endian elements of `dtype`.
    pub src: &'a [u8],
    pub dtype: Dtype,
    /// Destination byte offset (bf16 elements) in the device allocation.
    pub dst_offset: usize,
}

impl Piece<'_> {
    fn elements(&self) -> Result<usize, UploadError> {
        match self.dtype {
            Dtype::F32 => Ok(self.src.len() / 4),
            Dtype::BF16 | Dtype::F16 => Ok(self.src.len() / 2),
            other => Err(UploadError::Dtype(other)),
        }
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

/// Packs pieces (given as element counts) into jobs of at most `slot_elements` bf16 elements each, in order,
/// splitting pieces that cross a job boundary.
pub fn pack(piece_elements: &[usize], slot_elements: usize) -> Vec<Vec<Segment>> {
    let slot_elements = slot_elements.max(1);
    let mut jobs: Vec<Vec<Segment>> = Vec::new();
    let mut current: Vec<Segment> = Vec::new();
    let mut used = 0usize;
    for (piece, &total) in piece_elements.iter().enumerate() {
        let mut first = 0usize;
        while first < total {
            if used == slot_elements {
                jobs.push(std::mem::take(&mut current));
                used = 0;
            }
            let take = (total - first).min(slot_elements - used);
            current.push(Segment {
                piece,
                first,
                elements: take,
                staging_offset: used * 2,
            });
            used += take;
            first += take;
        }
    }
    if !current.is_empty() {
        jobs.push(current);
    }
    jobs
}

/// Converts `src` (elements of `dtype`) to bf16 bytes in `dst` (2 bytes per element, same count).
pub fn convert_to_bf16(src: &[u8], dtype: Dtype, dst: &mut [u8]) -> Result<(), UploadError> {
    match dtype {
        Dtype::BF16 => dst.copy_from_slice(&src[..dst.len()]),
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
        other => return Err(UploadError::Dtype(other)),
    }
    Ok(())
}

/// Staging geometry.
#[derive(Debug, Clone, Copy)]
pub struct StagingConfig {
    /// Bytes per pinned slot.
    pub slot_bytes: usize,
    /// Slots in the ring (2 = double buffering).
    pub slots: usize,
    /// Host threads that fill a slot.
    pub threads: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            slot_bytes: 64 << 20,
            slots: 3,
            threads: std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .clamp(1, 8),
        }
    }
}

/// What an upload moved and how fast.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UploadStats {
    /// Bytes read from the sources (file bytes).
    pub source_bytes: u64,
    /// bf16 bytes written to the device.
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

/// A task of one fill thread: convert `src` into `dst`.
struct FillTask<'s, 'd> {
    src: &'s [u8],
    dtype: Dtype,
    dst: &'d mut [u8],
}

/// Uploads every piece into `dst` as bf16 through a ring of pinned slots; returns once the data landed.
pub fn upload_pieces(
    ctx: &Context,
    stream: &Stream,
    dst: &mut DeviceBuffer,
    pieces: &[Piece<'_>],
    staging: StagingConfig,
) -> Result<UploadStats, UploadError> {
    let started = Instant::now();
    let mut elements = Vec::with_capacity(pieces.len());
    let mut source_bytes = 0u64;
    for p in pieces {
        let n = p.elements()?;
        let end = p.dst_offset.checked_add(n * 2);
        if end.is_none_or(|e| e > dst.len()) {
            return Err(UploadError::OutOfRange {
                offset: p.dst_offset,
                bytes: n * 2,
                capacity: dst.len(),
            });
        }
        source_bytes += p.src.len() as u64;
        elements.push(n);
    }
    let slot_bytes = (staging.slot_bytes.max(4096) / 16) * 16;
    let jobs = pack(&elements, slot_bytes / 2);
    let slots = staging.slots.clamp(1, jobs.len().max(1));
    let mut ring = Vec::with_capacity(slots);
    for _ in 0..slots {
        let buffer =
            HostBuffer::alloc(ctx, slot_bytes).map_err(cuda("allocating pinned staging"))?;
        let event = Event::new(ctx, false).map_err(cuda("creating a staging event"))?;
        ring.push((buffer, event, false));
    }
    let threads = staging.threads.max(1);
    for (j, job) in jobs.iter().enumerate() {
        let (buffer, event, in_flight) = &mut ring[j % slots];
        if *in_flight {
            event
                .synchronize()
                .map_err(cuda("waiting for a staging slot"))?;
        }
        fill_slot(buffer.as_mut_slice(), job, pieces, threads)?;
        let mut view = dst.view_mut();
        for seg in job {
            let piece = &pieces[seg.piece];
            let dst_offset = piece.dst_offset + seg.first * 2;
            // SAFETY: `buffer` lives in `ring` until this function returns, after the stream is synchronized, and
            // it is rewritten only after `event` (recorded behind these copies) has completed.
            unsafe {
                view.upload_async_pinned(
                    dst_offset,
                    buffer,
                    seg.staging_offset,
                    seg.elements * 2,
                    stream,
                )
                .map_err(cuda("enqueueing a host-to-device copy"))?;
            }
        }
        event
            .record(stream)
            .map_err(cuda("recording a staging event"))?;
        *in_flight = true;
    }
    stream
        .synchronize()
        .map_err(cuda("finishing the weight upload"))?;
    let device_bytes = elements.iter().map(|&n| n as u64 * 2).sum();
    Ok(UploadStats {
        source_bytes,
        device_bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Fills one staging slot with the job's segments, split across `threads` scoped threads.
fn fill_slot(
    slot: &mut [u8],
    job: &[Segment],
    pieces: &[Piece<'_>],
    threads: usize,
) -> Result<(), UploadError> {
    let job_bytes: usize = job.iter().map(|s| s.elements * 2).sum();
    let per_task = job_bytes.div_ceil(threads).max(1 << 16);
    let mut tasks: Vec<FillTask<'_, '_>> = Vec::new();
    let limit = job_bytes.min(slot.len());
    let mut rest: &mut [u8] = &mut slot[..limit];
    for seg in job {
        let piece = &pieces[seg.piece];
        let src_size = match piece.dtype {
            Dtype::F32 => 4,
            _ => 2,
        };
        let mut first = seg.first;
        let mut left = seg.elements;
        while left > 0 {
            let take = left.min(per_task / 2).max(1);
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(take * 2);
            rest = tail;
            let src = piece
                .src
                .get(first * src_size..(first + take) * src_size)
                .ok_or(UploadError::OutOfRange {
                    offset: first * src_size,
                    bytes: take * src_size,
                    capacity: piece.src.len(),
                })?;
            tasks.push(FillTask {
                src,
                dtype: piece.dtype,
                dst: head,
            });
            first += take;
            left -= take;
        }
    }
    if threads <= 1 || tasks.len() <= 1 {
        for t in tasks {
            convert_to_bf16(t.src, t.dtype, t.dst)?;
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
                        convert_to_bf16(t.src, t.dtype, t.dst)?;
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

    #[test]
    fn filled_slots_hold_every_segment_converted_in_place() {
        // Three pieces of mixed dtypes, packed into slots of 70 000 elements, filled by 4 threads.
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
        let pieces = [
            Piece {
                src: &a,
                dtype: Dtype::F32,
                dst_offset: 0,
            },
            Piece {
                src: &b,
                dtype: Dtype::BF16,
                dst_offset: 200_000,
            },
            Piece {
                src: &c,
                dtype: Dtype::F16,
                dst_offset: 260_000,
            },
        ];
        let elements: Vec<usize> = pieces.iter().map(|p| p.elements().unwrap()).collect();
        let jobs = pack(&elements, 70_000);
        // The device image assembled from the slots as the copies would place them.
        let mut device = vec![0u8; 360_000];
        let mut slot = vec![0u8; 140_000];
        for job in &jobs {
            fill_slot(&mut slot, job, &pieces, 4).unwrap();
            for seg in job {
                let dst = pieces[seg.piece].dst_offset + seg.first * 2;
                device[dst..dst + seg.elements * 2].copy_from_slice(
                    &slot[seg.staging_offset..seg.staging_offset + seg.elements * 2],
                );
            }
        }
        for piece in &pieces {
            let n = piece.elements().unwrap();
            let mut want = vec![0u8; n * 2];
            convert_to_bf16(piece.src, piece.dtype, &mut want).unwrap();
            assert!(
                device[piece.dst_offset..piece.dst_offset + n * 2] == want[..],
                "{:?}",
                piece.dtype
            );
        }
    }

    proptest! {
        /// Every element of every piece lands exactly once, in order, and no job exceeds the slot.
        #[test]
        fn packing_covers_every_element_once(sizes in proptest::collection::vec(0usize..50, 0..12), slot in 1usize..40) {
            let jobs = pack(&sizes, slot);
            let mut next = vec![0usize; sizes.len()];
            let mut last_piece = 0usize;
            for job in &jobs {
                let mut offset = 0;
                let total: usize = job.iter().map(|s| s.elements).sum();
                prop_assert!(total <= slot && total > 0);
                for seg in job {
                    prop_assert_eq!(seg.staging_offset, offset * 2);
                    prop_assert_eq!(seg.first, next[seg.piece]);
                    prop_assert!(seg.piece >= last_piece);
                    last_piece = seg.piece;
                    next[seg.piece] += seg.elements;
                    offset += seg.elements;
                }
            }
            prop_assert_eq!(next, sizes);
        }
    }
}
