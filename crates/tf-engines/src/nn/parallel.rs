//! Sequence parallelism over a packed 1-D token sequence: which rows and heads each GPU holds, and the
//! counts and offsets of the exchanges that move them. Pure host arithmetic; names no model (head count,
//! head width and segment lengths are parameters).
//!
//! The sequence is one packed run of rows made of segments (text, conditioning video, audio channel by
//! channel, video, in the order the layout gives). With `d` ranks:
//!
//! - **Rows** ([`RowPartition`]): rank `r` holds one contiguous block of the packed sequence, in rank order.
//!   Uneven splits give the first `S mod d` ranks one row more than the others, so block sizes differ by at
//!   most one. Contiguous blocks keep the gathered sequence in the original row order (gathering rank by rank
//!   is the identity), so positions, masks and output heads stay indexed by global row.
//! - **Segments per rank** ([`SequencePlan`]): each rank's block cut at the segment borders, with global,
//!   local and within-segment ranges, and the local row indices of any row kind (for the per-kind input and
//!   output projections and the per-kind modulation rows).
//! - **Heads** ([`HeadPartition`]): for Ulysses attention the degree must divide the head count (every rank
//!   holds the same whole number of heads, rank `r` the `r`-th contiguous group); other degrees are refused
//!   with an error naming the rule and the degrees that work.
//! - **Ulysses exchange** ([`UlyssesPlan`]): the element counts and offsets of the grouped send/receive that
//!   moves `[rows of r, all heads, dim]` to `[all rows, heads of r, dim]` ([`UlyssesPlan::to_heads`]) and back
//!   ([`UlyssesPlan::to_rows`], the same exchange with send and receive swapped). Every send to a peer must be
//!   one contiguous range, so before `to_heads` the local block is packed head-group-major
//!   (`[d groups, rows of r, heads/d, dim]`, [`pack_head_groups`]); the received buffer is then already
//!   `[all rows, heads of r, dim]`. After `to_rows` the received buffer is head-group-major again and
//!   [`unpack_head_groups`] restores `[rows of r, all heads, dim]`.
//! - **K/V all-gather alternative** ([`KvGatherPlan`]): every rank keeps all heads, computes K and V for its
//!   rows and gathers everyone's. A fixed-count all-gather needs equal blocks, so each rank's block is padded
//!   to `ceil(S/d)` rows; the plan gives the buffer sizes and where each rank's valid rows land. Works for
//!   every degree, divisible or not.
//!
//! [`simulate_exchange`] is the host model of a grouped send/receive (what each rank's receive buffer holds
//! afterwards); the tests use it to prove the exchanges are partitions and that `to_heads` followed by
//! `to_rows` is the identity.
//!
//! ```
//! use tf_engines::nn::parallel::{HeadPartition, RowKind, SequenceLayout, SequencePlan, UlyssesPlan};
//!
//! // 128 text rows, no conditioning frames, 2 audio channels of 93 rows, 5712 video rows; 4 ranks.
//! let layout = SequenceLayout::video_with_audio(128, 0, 2, 93, 5712).unwrap();
//! let plan = SequencePlan::new(&layout, 4).unwrap();
//! assert_eq!(plan.rows().count(0), 1507); // 6026 rows: 1507 + 1507 + 1506 + 1506
//! assert_eq!(plan.rows().count(3), 1506);
//! assert_eq!(plan.local_rows(0, |k| k == RowKind::Text), (0..128).collect::<Vec<_>>());
//!
//! let ulysses = UlyssesPlan::new(plan.rows(), 56, 128).unwrap();
//! assert_eq!(ulysses.heads().count(), 14);
//! assert!(HeadPartition::new(56, 3).unwrap_err().to_string().contains("1, 2, 4, 7 or 8"));
//! ```

use std::ops::Range;

use thiserror::Error;

/// The most ranks a plan spans (one host of up to 8 GPUs).
pub const MAX_DEGREE: usize = 8;
/// The most rows a packed sequence may have.
pub const MAX_ROWS: usize = 1 << 24;
/// The most attention heads a plan accepts.
pub const MAX_HEADS: usize = 4096;
/// The widest head (elements per head per row) a plan accepts.
pub const MAX_HEAD_DIM: usize = 4096;
/// The most segments a layout may have.
pub const MAX_SEGMENTS: usize = 64;

/// Why a partition cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PartitionError {
    /// The degree is 0 or above [`MAX_DEGREE`].
    #[error("sequence-parallel degree {degree} is outside 1..={MAX_DEGREE}: use between 1 and {MAX_DEGREE} ranks")]
    DegreeOutOfRange { degree: usize },
    /// Ulysses attention needs the degree to divide the head count.
    #[error(
        "Ulysses degree {degree} does not divide the {heads} attention heads (each rank must hold the same whole \
         number of heads); use one of {}, or the K/V all-gather plan, which takes any degree",
        list(.valid)
    )]
    HeadsNotDivisible {
        degree: usize,
        heads: usize,
        valid: Vec<usize>,
    },
    /// The packed sequence has no rows.
    #[error("the packed sequence has no rows: nothing to partition")]
    EmptySequence,
    /// A size is above its supported limit.
    #[error("{what} = {value} is above the supported limit of {max}")]
    TooLarge {
        what: &'static str,
        value: usize,
        max: usize,
    },
    /// A size is zero where it must be positive.
    #[error("{what} must be positive, found 0")]
    Zero { what: &'static str },
    /// A product of sizes overflows.
    #[error("{what} overflows the address space")]
    Overflow { what: &'static str },
    /// Exchanges that do not fit together (a simulation input error).
    #[error("exchange mismatch: {0}")]
    Mismatch(String),
}

fn list(values: &[usize]) -> String {
    match values {
        [] => "none".to_string(),
        [one] => one.to_string(),
        [head @ .., last] => format!(
            "{} or {last}",
            head.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn check_degree(degree: usize) -> Result<(), PartitionError> {
    if degree == 0 || degree > MAX_DEGREE {
        return Err(PartitionError::DegreeOutOfRange { degree });
    }
    Ok(())
}

fn bounded(what: &'static str, value: usize, max: usize) -> Result<usize, PartitionError> {
    if value == 0 {
        return Err(PartitionError::Zero { what });
    }
    if value > max {
        return Err(PartitionError::TooLarge { what, value, max });
    }
    Ok(value)
}

fn product(what: &'static str, factors: &[usize]) -> Result<usize, PartitionError> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or(PartitionError::Overflow { what })
}

/// What a row of the packed sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowKind {
    /// Text (prompt) rows.
    Text,
    /// Conditioning video rows (frames held fixed, e.g. keyframes).
    ConditioningVideo,
    /// Audio rows of one channel (channel-major layouts put each channel's rows in a segment of its own).
    Audio { channel: usize },
    /// Target video rows.
    Video,
}

/// One run of rows of one kind, at global rows `rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub kind: RowKind,
    pub rows: Range<usize>,
}

/// The packed sequence: segments in order, back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceLayout {
    segments: Vec<Segment>,
    total: usize,
}

impl SequenceLayout {
    /// Segments of the given kinds and lengths, in order. Zero-length parts are kept (empty ranges), so a
    /// segment's index does not depend on which parts happen to be empty.
    pub fn new(parts: &[(RowKind, usize)]) -> Result<SequenceLayout, PartitionError> {
        if parts.len() > MAX_SEGMENTS {
            return Err(PartitionError::TooLarge {
                what: "segments",
                value: parts.len(),
                max: MAX_SEGMENTS,
            });
        }
        let mut segments = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for &(kind, len) in parts {
            let end = total.checked_add(len).filter(|&e| e <= MAX_ROWS).ok_or(
                PartitionError::TooLarge {
                    what: "packed rows",
                    value: total.saturating_add(len),
                    max: MAX_ROWS,
                },
            )?;
            segments.push(Segment {
                kind,
                rows: total..end,
            });
            total = end;
        }
        if total == 0 {
            return Err(PartitionError::EmptySequence);
        }
        Ok(SequenceLayout { segments, total })
    }

    /// The packed video-with-audio layout: `[text | conditioning video | audio channel 0 .. channel c-1 |
    /// video]`, audio channel-major (all rows of channel 0, then channel 1, ...).
    pub fn video_with_audio(
        text: usize,
        conditioning: usize,
        audio_channels: usize,
        audio_rows_per_channel: usize,
        video: usize,
    ) -> Result<SequenceLayout, PartitionError> {
        if audio_channels > MAX_SEGMENTS - 3 {
            return Err(PartitionError::TooLarge {
                what: "audio channels",
                value: audio_channels,
                max: MAX_SEGMENTS - 3,
            });
        }
        let mut parts = vec![
            (RowKind::Text, text),
            (RowKind::ConditioningVideo, conditioning),
        ];
        parts.extend(
            (0..audio_channels).map(|channel| (RowKind::Audio { channel }, audio_rows_per_channel)),
        );
        parts.push((RowKind::Video, video));
        SequenceLayout::new(&parts)
    }

    /// The segments in order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Rows in all.
    pub fn total_rows(&self) -> usize {
        self.total
    }

    /// The kind of global row `row` (`None` past the end).
    pub fn kind_of(&self, row: usize) -> Option<RowKind> {
        self.segments
            .iter()
            .find(|s| s.rows.contains(&row))
            .map(|s| s.kind)
    }
}

/// Contiguous blocks of `total` rows over `degree` ranks; the first `total mod degree` ranks hold one row more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowPartition {
    /// `degree + 1` bounds: rank `r` holds `bounds[r]..bounds[r + 1]`.
    bounds: Vec<usize>,
}

impl RowPartition {
    /// Splits `total` rows over `degree` ranks (1..=[`MAX_DEGREE`]). A rank may hold no rows when
    /// `total < degree`; its exchanges are then empty.
    pub fn new(total: usize, degree: usize) -> Result<RowPartition, PartitionError> {
        check_degree(degree)?;
        if total == 0 {
            return Err(PartitionError::EmptySequence);
        }
        if total > MAX_ROWS {
            return Err(PartitionError::TooLarge {
                what: "packed rows",
                value: total,
                max: MAX_ROWS,
            });
        }
        let (base, extra) = (total / degree, total % degree);
        let mut bounds = Vec::with_capacity(degree + 1);
        bounds.push(0);
        let mut at = 0;
        for r in 0..degree {
            at += base + usize::from(r < extra);
            bounds.push(at);
        }
        Ok(RowPartition { bounds })
    }

    /// Ranks.
    pub fn degree(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Rows in all.
    pub fn total(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }

    /// The global rows of `rank` (empty past the last rank).
    pub fn rows(&self, rank: usize) -> Range<usize> {
        match (self.bounds.get(rank), self.bounds.get(rank + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => 0..0,
        }
    }

    /// How many rows `rank` holds.
    pub fn count(&self, rank: usize) -> usize {
        self.rows(rank).len()
    }

    /// The largest block: `ceil(total / degree)`.
    pub fn max_count(&self) -> usize {
        self.total().div_ceil(self.degree())
    }

    /// The rank holding global row `row` (`None` past the end).
    pub fn rank_of(&self, row: usize) -> Option<usize> {
        if row >= self.total() {
            return None;
        }
        // bounds is sorted; the rank is the last bound <= row whose block is not empty.
        Some(self.bounds.partition_point(|&b| b <= row) - 1)
    }
}

/// One rank's share of one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPiece {
    /// The segment's index in the layout.
    pub segment: usize,
    pub kind: RowKind,
    /// Global rows.
    pub global: Range<usize>,
    /// The same rows as indices into the rank's local block.
    pub local: Range<usize>,
    /// The same rows counted from the segment's first row.
    pub in_segment: Range<usize>,
}

/// Which rows of which segments one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankRows {
    pub rank: usize,
    /// The rank's global block.
    pub rows: Range<usize>,
    /// The block cut at segment borders, in order; segments the block misses are absent.
    pub pieces: Vec<RankPiece>,
}

/// A layout split over ranks: the row blocks and each rank's pieces of each segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequencePlan {
    layout: SequenceLayout,
    rows: RowPartition,
    ranks: Vec<RankRows>,
}

impl SequencePlan {
    /// Splits `layout` over `degree` ranks (1..=[`MAX_DEGREE`], divisible or not).
    pub fn new(layout: &SequenceLayout, degree: usize) -> Result<SequencePlan, PartitionError> {
        let rows = RowPartition::new(layout.total_rows(), degree)?;
        let ranks = (0..degree)
            .map(|rank| {
                let block = rows.rows(rank);
                let pieces = layout
                    .segments()
                    .iter()
                    .enumerate()
                    .filter_map(|(segment, s)| {
                        let start = s.rows.start.max(block.start);
                        let end = s.rows.end.min(block.end);
                        (start < end).then(|| RankPiece {
                            segment,
                            kind: s.kind,
                            global: start..end,
                            local: start - block.start..end - block.start,
                            in_segment: start - s.rows.start..end - s.rows.start,
                        })
                    })
                    .collect();
                RankRows {
                    rank,
                    rows: block,
                    pieces,
                }
            })
            .collect();
        Ok(SequencePlan {
            layout: layout.clone(),
            rows,
            ranks,
        })
    }

    /// The layout this plan splits.
    pub fn layout(&self) -> &SequenceLayout {
        &self.layout
    }

    /// The row blocks.
    pub fn rows(&self) -> &RowPartition {
        &self.rows
    }

    /// One rank's rows (`None` past the last rank).
    pub fn rank(&self, rank: usize) -> Option<&RankRows> {
        self.ranks.get(rank)
    }

    /// Every rank's rows, in rank order.
    pub fn ranks(&self) -> &[RankRows] {
        &self.ranks
    }

    /// The local row indices of `rank` whose kind passes `keep`, ascending (empty past the last rank).
    pub fn local_rows(&self, rank: usize, keep: impl Fn(RowKind) -> bool) -> Vec<usize> {
        self.rank(rank)
            .map(|r| {
                r.pieces
                    .iter()
                    .filter(|p| keep(p.kind))
                    .flat_map(|p| p.local.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The head groups of Ulysses attention: rank `r` holds heads `r*h .. (r+1)*h`, `h = heads / degree`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPartition {
    heads: usize,
    degree: usize,
}

impl HeadPartition {
    /// Refuses a degree outside 1..=[`MAX_DEGREE`] or one that does not divide `heads`.
    pub fn new(heads: usize, degree: usize) -> Result<HeadPartition, PartitionError> {
        check_degree(degree)?;
        bounded("attention heads", heads, MAX_HEADS)?;
        if !heads.is_multiple_of(degree) {
            return Err(PartitionError::HeadsNotDivisible {
                degree,
                heads,
                valid: HeadPartition::valid_degrees(heads),
            });
        }
        Ok(HeadPartition { heads, degree })
    }

    /// The degrees 1..=[`MAX_DEGREE`] that divide `heads` (56 heads: 1, 2, 4, 7, 8).
    pub fn valid_degrees(heads: usize) -> Vec<usize> {
        (1..=MAX_DEGREE)
            .filter(|&d| heads > 0 && heads.is_multiple_of(d))
            .collect()
    }

    /// All heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Ranks.
    pub fn degree(&self) -> usize {
        self.degree
    }

    /// Heads per rank.
    pub fn count(&self) -> usize {
        self.heads / self.degree
    }

    /// The heads of `rank` (empty past the last rank).
    pub fn group(&self, rank: usize) -> Range<usize> {
        if rank >= self.degree {
            return 0..0;
        }
        rank * self.count()..(rank + 1) * self.count()
    }
}

/// One rank's grouped send/receive: for each peer (own rank included), how many elements go to it from
/// which offset of the send buffer, and how many come from it to which offset of the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    pub send_counts: Vec<usize>,
    pub send_offsets: Vec<usize>,
    pub recv_counts: Vec<usize>,
    pub recv_offsets: Vec<usize>,
}

impl Exchange {
    /// Elements the send buffer must hold (the end of the furthest send range).
    pub fn send_len(&self) -> usize {
        extent(&self.send_counts, &self.send_offsets)
    }

    /// Elements the receive buffer must hold.
    pub fn recv_len(&self) -> usize {
        extent(&self.recv_counts, &self.recv_offsets)
    }

    /// The reverse exchange: what was received is sent back to where it came from.
    pub fn inverse(&self) -> Exchange {
        Exchange {
            send_counts: self.recv_counts.clone(),
            send_offsets: self.recv_offsets.clone(),
            recv_counts: self.send_counts.clone(),
            recv_offsets: self.send_offsets.clone(),
        }
    }

    /// Elements that cross to another rank (own-rank parts excluded), sent and received by `rank`.
    pub fn off_rank(&self, rank: usize) -> (usize, usize) {
        let sum = |counts: &[usize]| {
            counts
                .iter()
                .enumerate()
                .filter(|&(p, _)| p != rank)
                .map(|(_, &c)| c)
                .sum()
        };
        (sum(&self.send_counts), sum(&self.recv_counts))
    }
}

fn extent(counts: &[usize], offsets: &[usize]) -> usize {
    counts
        .iter()
        .zip(offsets)
        .map(|(&c, &o)| o + c)
        .max()
        .unwrap_or(0)
}

/// The Ulysses exchanges of every rank, in elements (multiply by the element size for bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UlyssesPlan {
    rows: RowPartition,
    heads: HeadPartition,
    head_dim: usize,
    to_heads: Vec<Exchange>,
}

impl UlyssesPlan {
    /// Plans the exchanges of `rows` for `heads` heads of `head_dim` elements each. The degree is the row
    /// partition's and must divide `heads`.
    pub fn new(
        rows: &RowPartition,
        heads: usize,
        head_dim: usize,
    ) -> Result<UlyssesPlan, PartitionError> {
        let d = rows.degree();
        let heads = HeadPartition::new(heads, d)?;
        bounded("head dim", head_dim, MAX_HEAD_DIM)?;
        // The largest buffer: all rows by all heads by the head dim.
        product(
            "rows x heads x head dim",
            &[rows.total(), heads.heads(), head_dim],
        )?;
        let group = heads.count() * head_dim;
        let to_heads = (0..d)
            .map(|r| {
                let n = rows.count(r);
                Exchange {
                    send_counts: vec![n * group; d],
                    send_offsets: (0..d).map(|p| p * n * group).collect(),
                    recv_counts: (0..d).map(|q| rows.count(q) * group).collect(),
                    recv_offsets: (0..d).map(|q| rows.rows(q).start * group).collect(),
                }
            })
            .collect();
        Ok(UlyssesPlan {
            rows: rows.clone(),
            heads,
            head_dim,
            to_heads,
        })
    }

    /// The row blocks.
    pub fn rows(&self) -> &RowPartition {
        &self.rows
    }

    /// The head groups.
    pub fn heads(&self) -> &HeadPartition {
        &self.heads
    }

    /// Elements per head per row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `rank`'s exchange from `[its rows, all heads]` (packed head-group-major by [`pack_head_groups`]) to
    /// `[all rows, its heads]` (`None` past the last rank).
    pub fn to_heads(&self, rank: usize) -> Option<&Exchange> {
        self.to_heads.get(rank)
    }

    /// `rank`'s exchange back from `[all rows, its heads]` to `[its rows, all heads]` head-group-major (undo
    /// with [`unpack_head_groups`]).
    pub fn to_rows(&self, rank: usize) -> Option<Exchange> {
        self.to_heads.get(rank).map(Exchange::inverse)
    }

    /// Elements of `rank`'s row-sharded buffer: its rows by all heads.
    pub fn row_shard_len(&self, rank: usize) -> usize {
        self.rows.count(rank) * self.heads.heads() * self.head_dim
    }

    /// Elements of every rank's head-sharded buffer: all rows by its heads.
    pub fn head_shard_len(&self) -> usize {
        self.rows.total() * self.heads.count() * self.head_dim
    }

    /// Elements `rank` receives from other ranks for one attention: Q, K and V to heads, the output back.
    pub fn received_per_attention(&self, rank: usize) -> usize {
        let Some(x) = self.to_heads(rank) else {
            return 0;
        };
        let (sent, received) = x.off_rank(rank);
        3 * received + sent
    }
}

/// The K/V all-gather alternative: every rank keeps all heads and gathers K and V of all rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGatherPlan {
    rows: RowPartition,
    /// Elements per row of one of K or V: heads x head dim.
    row_width: usize,
}

impl KvGatherPlan {
    /// Plans the gather of `rows` for `heads` heads of `head_dim` elements (any degree).
    pub fn new(
        rows: &RowPartition,
        heads: usize,
        head_dim: usize,
    ) -> Result<KvGatherPlan, PartitionError> {
        bounded("attention heads", heads, MAX_HEADS)?;
        bounded("head dim", head_dim, MAX_HEAD_DIM)?;
        let row_width = product("heads x head dim", &[heads, head_dim])?;
        product(
            "ranks x padded rows x row width x 2",
            &[rows.degree(), rows.max_count(), row_width, 2],
        )?;
        Ok(KvGatherPlan {
            rows: rows.clone(),
            row_width,
        })
    }

    /// The row blocks.
    pub fn rows(&self) -> &RowPartition {
        &self.rows
    }

    /// Rows each rank contributes, its own block padded to the largest: `ceil(S / d)`.
    pub fn padded_rows(&self) -> usize {
        self.rows.max_count()
    }

    /// Elements of one rank's send buffer for K (or for V): padded rows by heads by head dim.
    pub fn send_len(&self) -> usize {
        self.padded_rows() * self.row_width
    }

    /// Elements of the gathered buffer for K (or for V): ranks by padded rows by heads by head dim.
    pub fn gathered_len(&self) -> usize {
        self.rows.degree() * self.send_len()
    }

    /// The rows of the gathered buffer that hold `rank`'s valid rows (the rest of its slot is padding);
    /// empty past the last rank.
    pub fn valid_rows(&self, rank: usize) -> Range<usize> {
        if rank >= self.rows.degree() {
            return 0..0;
        }
        let start = rank * self.padded_rows();
        start..start + self.rows.count(rank)
    }

    /// Elements each rank receives from other ranks for one attention (K and V, padding included).
    pub fn received_per_attention(&self) -> usize {
        2 * (self.rows.degree() - 1) * self.send_len()
    }
}

/// `[rows, heads, head_dim]` to `[degree, rows, heads/degree, head_dim]` (head-group-major), so each
/// group goes to its rank as one contiguous range. Fails when the lengths do not fit together.
pub fn pack_head_groups<T: Copy>(
    local: &[T],
    rows: usize,
    heads: &HeadPartition,
    head_dim: usize,
) -> Result<Vec<T>, PartitionError> {
    regroup(local, rows, heads, head_dim, true)
}

/// The inverse of [`pack_head_groups`]: `[degree, rows, heads/degree, head_dim]` to `[rows, heads, head_dim]`.
pub fn unpack_head_groups<T: Copy>(
    grouped: &[T],
    rows: usize,
    heads: &HeadPartition,
    head_dim: usize,
) -> Result<Vec<T>, PartitionError> {
    regroup(grouped, rows, heads, head_dim, false)
}

fn regroup<T: Copy>(
    src: &[T],
    rows: usize,
    heads: &HeadPartition,
    head_dim: usize,
    pack: bool,
) -> Result<Vec<T>, PartitionError> {
    let len = product("rows x heads x head dim", &[rows, heads.heads(), head_dim])?;
    if src.len() != len {
        return Err(PartitionError::Mismatch(format!(
            "the buffer holds {} elements, {rows} rows x {} heads x {head_dim} need {len}",
            src.len(),
            heads.heads()
        )));
    }
    let (d, h) = (heads.degree(), heads.count());
    let mut out = Vec::with_capacity(len);
    if pack {
        for g in 0..d {
            for r in 0..rows {
                let at = (r * heads.heads() + g * h) * head_dim;
                out.extend_from_slice(&src[at..at + h * head_dim]);
            }
        }
    } else {
        for r in 0..rows {
            for g in 0..d {
                let at = (g * rows + r) * h * head_dim;
                out.extend_from_slice(&src[at..at + h * head_dim]);
            }
        }
    }
    Ok(out)
}

/// The host model of one grouped send/receive over all ranks: `sends[r]` is rank `r`'s send buffer and
/// `exchanges[r]` its counts and offsets. Returns each rank's receive buffer (`recv_len` elements, `fill`
/// where nothing lands). Fails when a send count differs from the matching receive count or a range falls
/// outside its buffer.
pub fn simulate_exchange<T: Copy>(
    exchanges: &[Exchange],
    sends: &[Vec<T>],
    fill: T,
) -> Result<Vec<Vec<T>>, PartitionError> {
    let d = exchanges.len();
    if sends.len() != d {
        return Err(PartitionError::Mismatch(format!(
            "{} send buffers for {d} ranks",
            sends.len()
        )));
    }
    for (r, x) in exchanges.iter().enumerate() {
        for v in [
            &x.send_counts,
            &x.send_offsets,
            &x.recv_counts,
            &x.recv_offsets,
        ] {
            if v.len() != d {
                return Err(PartitionError::Mismatch(format!(
                    "rank {r} lists {} peers, the exchange has {d} ranks",
                    v.len()
                )));
            }
        }
    }
    let mut out: Vec<Vec<T>> = exchanges.iter().map(|x| vec![fill; x.recv_len()]).collect();
    for (r, x) in exchanges.iter().enumerate() {
        for p in 0..d {
            let n = x.send_counts[p];
            if n != exchanges[p].recv_counts[r] {
                return Err(PartitionError::Mismatch(format!(
                    "rank {r} sends {n} elements to rank {p}, which expects {}",
                    exchanges[p].recv_counts[r]
                )));
            }
            let src = x.send_offsets[p];
            let dst = exchanges[p].recv_offsets[r];
            let piece = sends[r].get(src..src + n).ok_or_else(|| {
                PartitionError::Mismatch(format!(
                    "rank {r}'s send range {src}..{} is outside its {}-element buffer",
                    src + n,
                    sends[r].len()
                ))
            })?;
            out[p][dst..dst + n].copy_from_slice(piece);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_degree_splits_rows_with_at_most_one_row_of_difference() {
        for d in 1..=MAX_DEGREE {
            let p = RowPartition::new(6026, d).unwrap();
            let counts: Vec<usize> = (0..d).map(|r| p.count(r)).collect();
            assert_eq!(counts.iter().sum::<usize>(), 6026);
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(hi - lo <= 1, "degree {d}: {counts:?}");
            assert_eq!(*hi, p.max_count());
            // The longer blocks come first.
            assert!(counts.windows(2).all(|w| w[0] >= w[1]), "{counts:?}");
        }
        let p = RowPartition::new(10, 4).unwrap();
        assert_eq!(
            (0..4).map(|r| p.rows(r)).collect::<Vec<_>>(),
            vec![0..3, 3..6, 6..8, 8..10]
        );
        assert_eq!(p.rank_of(5), Some(1));
        assert_eq!(p.rank_of(6), Some(2));
        assert_eq!(p.rank_of(10), None);
        // Fewer rows than ranks: the last ranks hold none, and rank_of skips them.
        let p = RowPartition::new(3, 5).unwrap();
        assert_eq!(
            (0..5).map(|r| p.count(r)).collect::<Vec<_>>(),
            vec![1, 1, 1, 0, 0]
        );
        assert_eq!(p.rank_of(2), Some(2));
    }

    #[test]
    fn degrees_outside_one_to_eight_and_empty_sequences_are_refused() {
        for d in [0, 9, 16] {
            let err = RowPartition::new(100, d).unwrap_err();
            assert_eq!(err, PartitionError::DegreeOutOfRange { degree: d });
            assert!(err.to_string().contains("1..=8"), "{err}");
        }
        assert_eq!(
            RowPartition::new(0, 2).unwrap_err(),
            PartitionError::EmptySequence
        );
        assert!(matches!(
            RowPartition::new(MAX_ROWS + 1, 2),
            Err(PartitionError::TooLarge { .. })
        ));
        assert_eq!(
            SequenceLayout::new(&[(RowKind::Text, 0)]).unwrap_err(),
            PartitionError::EmptySequence
        );
    }

    #[test]
    fn ulysses_degrees_must_divide_the_heads() {
        assert_eq!(HeadPartition::valid_degrees(56), vec![1, 2, 4, 7, 8]);
        for d in [1, 2, 4, 7, 8] {
            let h = HeadPartition::new(56, d).unwrap();
            assert_eq!(h.count() * d, 56);
            assert_eq!(h.group(d - 1).end, 56);
        }
        for d in [3, 5, 6] {
            let err = HeadPartition::new(56, d).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("degree {d} does not divide the 56")),
                "{msg}"
            );
            assert!(msg.contains("1, 2, 4, 7 or 8"), "{msg}");
            assert!(msg.contains("all-gather"), "{msg}");
        }
        // The K/V gather takes those degrees.
        for d in [3, 5, 6] {
            let rows = RowPartition::new(6026, d).unwrap();
            assert!(KvGatherPlan::new(&rows, 56, 128).is_ok());
            assert!(UlyssesPlan::new(&rows, 56, 128).is_err());
        }
        assert_eq!(
            HeadPartition::new(0, 1).unwrap_err(),
            PartitionError::Zero {
                what: "attention heads"
            }
        );
    }

    #[test]
    fn the_video_with_audio_layout_spreads_its_segments() {
        // 4 text, 2 conditioning, 2 channels x 3 audio, 7 video = 19 rows over 3 ranks: 7, 6, 6.
        let layout = SequenceLayout::video_with_audio(4, 2, 2, 3, 7).unwrap();
        assert_eq!(layout.total_rows(), 19);
        assert_eq!(layout.kind_of(6), Some(RowKind::Audio { channel: 0 }));
        assert_eq!(layout.kind_of(9), Some(RowKind::Audio { channel: 1 }));
        assert_eq!(layout.kind_of(12), Some(RowKind::Video));
        let plan = SequencePlan::new(&layout, 3).unwrap();
        let r0 = plan.rank(0).unwrap();
        assert_eq!(r0.rows, 0..7);
        let kinds: Vec<_> = r0
            .pieces
            .iter()
            .map(|p| (p.kind, p.global.clone()))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (RowKind::Text, 0..4),
                (RowKind::ConditioningVideo, 4..6),
                (RowKind::Audio { channel: 0 }, 6..7)
            ]
        );
        let r1 = plan.rank(1).unwrap();
        assert_eq!(r1.rows, 7..13);
        assert_eq!(r1.pieces[0].in_segment, 1..3); // audio channel 0 rows 1 and 2
        assert_eq!(r1.pieces[1].kind, RowKind::Audio { channel: 1 });
        assert_eq!(r1.pieces[1].local, 2..5);
        assert_eq!(r1.pieces[2].global, 12..13);
        assert_eq!(
            plan.local_rows(1, |k| matches!(k, RowKind::Audio { .. })),
            vec![0, 1, 2, 3, 4]
        );
        assert_eq!(
            plan.local_rows(2, |k| k == RowKind::Video),
            (0..6).collect::<Vec<_>>()
        );
        assert!(plan.local_rows(2, |k| k == RowKind::Text).is_empty());
        assert!(plan.rank(3).is_none());
    }

    #[test]
    fn exchange_counts_for_an_uneven_split() {
        // 5 rows over 2 ranks (3 + 2), 4 heads of width 2: 2 heads per rank, 4 elements per row and group.
        let rows = RowPartition::new(5, 2).unwrap();
        let plan = UlyssesPlan::new(&rows, 4, 2).unwrap();
        let x0 = plan.to_heads(0).unwrap();
        assert_eq!(x0.send_counts, vec![12, 12]);
        assert_eq!(x0.send_offsets, vec![0, 12]);
        assert_eq!(x0.recv_counts, vec![12, 8]);
        assert_eq!(x0.recv_offsets, vec![0, 12]);
        let x1 = plan.to_heads(1).unwrap();
        assert_eq!(x1.send_counts, vec![8, 8]);
        assert_eq!(x1.send_offsets, vec![0, 8]);
        assert_eq!(x1.recv_len(), plan.head_shard_len());
        assert_eq!(x1.send_len(), plan.row_shard_len(1));
        let back = plan.to_rows(1).unwrap();
        assert_eq!(back.send_counts, x1.recv_counts);
        assert_eq!(back.recv_offsets, x1.send_offsets);
        // Rank 0 receives 8 elements of each of Q, K, V and sends back 12 of the output.
        assert_eq!(plan.received_per_attention(0), 3 * 8 + 12);
    }

    #[test]
    fn kv_gather_pads_every_block_to_the_largest() {
        let rows = RowPartition::new(6026, 7).unwrap();
        let plan = KvGatherPlan::new(&rows, 56, 128).unwrap();
        assert_eq!(plan.padded_rows(), 861); // ceil(6026 / 7)
        assert_eq!(plan.send_len(), 861 * 56 * 128);
        assert_eq!(plan.gathered_len(), 7 * 861 * 56 * 128);
        assert_eq!(plan.valid_rows(0), 0..861);
        assert_eq!(plan.valid_rows(6), 6 * 861..6 * 861 + rows.count(6));
        assert_eq!(rows.count(6), 860);
        assert_eq!(plan.received_per_attention(), 2 * 6 * 861 * 56 * 128);
        // At degree 2 the two exchanges move the same amount; above it the gather moves more.
        for d in [2, 4, 8] {
            let rows = RowPartition::new(8000, d).unwrap();
            let u = UlyssesPlan::new(&rows, 56, 128)
                .unwrap()
                .received_per_attention(0);
            let g = KvGatherPlan::new(&rows, 56, 128)
                .unwrap()
                .received_per_attention();
            assert_eq!(g * 2, u * d, "degree {d}: gather {g}, ulysses {u}");
        }
    }

    #[test]
    fn simulation_refuses_mismatched_counts() {
        let rows = RowPartition::new(5, 2).unwrap();
        let plan = UlyssesPlan::new(&rows, 2, 1).unwrap();
        let mut xs = vec![
            plan.to_heads(0).unwrap().clone(),
            plan.to_heads(1).unwrap().clone(),
        ];
        xs[0].send_counts[1] += 1;
        let sends = vec![vec![0u32; 6], vec![0u32; 4]];
        let err = simulate_exchange(&xs, &sends, 0).unwrap_err();
        assert!(err.to_string().contains("rank 0 sends"), "{err}");
    }

    /// A global `[rows, heads, dim]` tensor whose every element is distinct.
    fn global(rows: usize, heads: usize, dim: usize) -> Vec<u32> {
        (0..(rows * heads * dim) as u32).collect()
    }

    fn layouts() -> impl Strategy<Value = (Vec<usize>, usize)> {
        (prop::collection::vec(0usize..40, 4..7), 1usize..=MAX_DEGREE)
            .prop_filter("at least one row", |(lens, _)| {
                lens.iter().sum::<usize>() > 0
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn row_plans_are_partitions((lens, degree) in layouts()) {
            let mut parts = vec![(RowKind::Text, lens[0]), (RowKind::ConditioningVideo, lens[1])];
            for (c, &n) in lens[2..lens.len() - 1].iter().enumerate() {
                parts.push((RowKind::Audio { channel: c }, n));
            }
            parts.push((RowKind::Video, lens[lens.len() - 1]));
            let layout = SequenceLayout::new(&parts).unwrap();
            let plan = SequencePlan::new(&layout, degree).unwrap();
            let total = layout.total_rows();
            // Every global row is held by exactly one rank, at exactly one local index, in exactly one piece
            // whose kind is the row's kind.
            let mut seen = vec![0u32; total];
            for r in plan.ranks() {
                let mut local_seen = vec![false; r.rows.len()];
                for p in &r.pieces {
                    let seg = &layout.segments()[p.segment];
                    prop_assert_eq!(p.kind, seg.kind);
                    prop_assert_eq!(p.global.len(), p.local.len());
                    prop_assert_eq!(p.global.len(), p.in_segment.len());
                    for (i, g) in p.global.clone().enumerate() {
                        seen[g] += 1;
                        prop_assert_eq!(layout.kind_of(g), Some(p.kind));
                        prop_assert_eq!(plan.rows().rank_of(g), Some(r.rank));
                        prop_assert_eq!(seg.rows.start + p.in_segment.start + i, g);
                        let l = p.local.start + i;
                        prop_assert!(!local_seen[l]);
                        local_seen[l] = true;
                    }
                }
                prop_assert!(local_seen.iter().all(|&s| s));
                // The per-kind local index sets split the block.
                let mut by_kind: Vec<usize> = [RowKind::Text, RowKind::ConditioningVideo, RowKind::Video]
                    .into_iter()
                    .flat_map(|k| plan.local_rows(r.rank, move |x| x == k))
                    .chain(plan.local_rows(r.rank, |x| matches!(x, RowKind::Audio { .. })))
                    .collect();
                by_kind.sort_unstable();
                prop_assert_eq!(by_kind, (0..r.rows.len()).collect::<Vec<_>>());
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
        }

        #[test]
        fn head_plans_are_partitions(heads in 1usize..64, degree in 1usize..=MAX_DEGREE) {
            match HeadPartition::new(heads, degree) {
                Ok(h) => {
                    let mut seen = vec![0u32; heads];
                    for r in 0..degree {
                        for x in h.group(r) {
                            seen[x] += 1;
                        }
                    }
                    prop_assert!(seen.iter().all(|&n| n == 1));
                }
                Err(PartitionError::HeadsNotDivisible { valid, .. }) => {
                    prop_assert!(heads % degree != 0);
                    prop_assert!(valid.iter().all(|&d| heads % d == 0));
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        #[test]
        fn to_heads_gathers_every_row_of_a_head_group_and_to_rows_undoes_it(
            rows in 1usize..50,
            heads_per_rank in 1usize..4,
            head_dim in 1usize..4,
            degree in 1usize..=MAX_DEGREE,
        ) {
            let heads = heads_per_rank * degree;
            let part = RowPartition::new(rows, degree).unwrap();
            let plan = UlyssesPlan::new(&part, heads, head_dim).unwrap();
            let all = global(rows, heads, head_dim);
            let width = heads * head_dim;
            let locals: Vec<Vec<u32>> = (0..degree)
                .map(|r| all[part.rows(r).start * width..part.rows(r).end * width].to_vec())
                .collect();
            let packed: Vec<Vec<u32>> = (0..degree)
                .map(|r| pack_head_groups(&locals[r], part.count(r), plan.heads(), head_dim).unwrap())
                .collect();
            let xs: Vec<Exchange> = (0..degree).map(|r| plan.to_heads(r).unwrap().clone()).collect();
            for (r, x) in xs.iter().enumerate() {
                prop_assert_eq!(x.send_len(), packed[r].len());
            }
            let by_heads = simulate_exchange(&xs, &packed, u32::MAX).unwrap();
            // Rank r now holds [all rows, its heads, dim]: exactly the global tensor's head group r.
            let mut seen = vec![0u32; all.len()];
            for (r, buf) in by_heads.iter().enumerate() {
                prop_assert_eq!(buf.len(), plan.head_shard_len());
                let group = plan.heads().group(r);
                let mut want = Vec::new();
                for row in 0..rows {
                    want.extend_from_slice(
                        &all[(row * heads + group.start) * head_dim..(row * heads + group.end) * head_dim],
                    );
                }
                prop_assert_eq!(buf, &want);
                for &v in buf {
                    seen[v as usize] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1), "every element lands exactly once");
            // And back: to_rows then unpack gives every rank its original block.
            let back: Vec<Exchange> = (0..degree).map(|r| plan.to_rows(r).unwrap()).collect();
            let grouped = simulate_exchange(&back, &by_heads, u32::MAX).unwrap();
            for r in 0..degree {
                let restored = unpack_head_groups(&grouped[r], part.count(r), plan.heads(), head_dim).unwrap();
                prop_assert_eq!(&restored, &locals[r]);
            }
        }

        #[test]
        fn kv_gather_slots_hold_every_row_once(rows in 1usize..200, degree in 1usize..=MAX_DEGREE) {
            let part = RowPartition::new(rows, degree).unwrap();
            let plan = KvGatherPlan::new(&part, 2, 3).unwrap();
            let mut seen = vec![0u32; rows];
            for r in 0..degree {
                let slot = plan.valid_rows(r);
                prop_assert_eq!(slot.len(), part.count(r));
                prop_assert!(slot.end <= (r + 1) * plan.padded_rows());
                for (i, _) in slot.enumerate() {
                    seen[part.rows(r).start + i] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
            prop_assert_eq!(plan.gathered_len(), degree * plan.padded_rows() * 6);
            prop_assert!(plan.padded_rows() * degree >= rows);
            prop_assert!(plan.padded_rows() * degree < rows + degree);
        }
    }
}
