//! Where the bytes of a sequence-parallel step go: every strided copy between the step's buffers and the exchange
//! buffers, and the byte ranges each collective sends and receives, as pure arithmetic. The GPU code runs them
//! (`copy_2d` and NCCL); the tests run them on host arrays, with `nn::parallel`'s model of a grouped send/receive,
//! for every degree, uneven blocks and two batch items, and check that every value lands where the one-GPU step
//! keeps it. Sizes are in bytes (`elem` bytes an element: bf16 on the GPU).

use std::ops::Range;

use crate::nn::parallel::RowPartition;

/// `height` rows of `width` bytes from `src` (rows `src_pitch` apart) to `dst` (rows `dst_pitch` apart), offsets
/// into the source and destination buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowCopy {
    pub dst: usize,
    pub dst_pitch: usize,
    pub src: usize,
    pub src_pitch: usize,
    pub width: usize,
    pub height: usize,
}

/// One rank's Ulysses attention in bytes: `batch` items of `rows` rows of this rank (`seq` in all), q|k|v rows of
/// `width` bytes each (all heads) and head groups of `group` bytes (this rank's heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UlyssesBytes {
    pub batch: usize,
    pub world: usize,
    pub rows: usize,
    pub seq: usize,
    pub width: usize,
    pub group: usize,
}

impl UlyssesBytes {
    /// Bytes of the send buffer `[q|k|v][item][peer][row][group]` (reused as `[item][peer][row][group]` on the
    /// way back).
    pub fn send_len(&self) -> usize {
        3 * self.batch * self.world * self.rows * self.group
    }

    /// Bytes of the receive buffer `[q|k|v][item][seq][group]`.
    pub fn recv_len(&self) -> usize {
        3 * self.plane_len()
    }

    /// Bytes of one of q, k, v head-sharded, `[item][seq][group]` (also the attention output's size).
    pub fn plane_len(&self) -> usize {
        self.batch * self.seq * self.group
    }

    /// The step's `[item][row][q|k|v][width]` into the send buffer, head group by head group.
    pub fn pack(&self) -> Vec<RowCopy> {
        let (g, w, n) = (self.group, self.width, self.rows);
        let mut out = Vec::with_capacity(3 * self.batch * self.world);
        for c in 0..3 {
            for b in 0..self.batch {
                for p in 0..self.world {
                    out.push(RowCopy {
                        dst: ((c * self.batch + b) * self.world + p) * n * g,
                        dst_pitch: g,
                        src: (b * n * 3 + c) * w + p * g,
                        src_pitch: 3 * w,
                        width: g,
                        height: n,
                    });
                }
            }
        }
        out
    }

    /// The (send, receive) byte ranges of the exchange to head groups, one pair per (q|k|v, item): each send is
    /// `[peer][row][group]`, each receive `[seq][group]`.
    pub fn heads_exchange(&self) -> Vec<(Range<usize>, Range<usize>)> {
        let (send, recv) = (self.world * self.rows * self.group, self.seq * self.group);
        (0..3 * self.batch)
            .map(|i| (i * send..(i + 1) * send, i * recv..(i + 1) * recv))
            .collect()
    }

    /// The (send, receive) byte ranges of the way back, one pair per item: sends from the output
    /// `[item][seq][group]`, receives into the send buffer as `[item][peer][row][group]`.
    pub fn rows_exchange(&self) -> Vec<(Range<usize>, Range<usize>)> {
        let (send, recv) = (self.seq * self.group, self.world * self.rows * self.group);
        (0..self.batch)
            .map(|b| (b * send..(b + 1) * send, b * recv..(b + 1) * recv))
            .collect()
    }

    /// The returned `[item][peer][row][group]` into the step's attention rows `[item][row][width]`.
    pub fn unpack(&self) -> Vec<RowCopy> {
        let (g, w, n) = (self.group, self.width, self.rows);
        let mut out = Vec::with_capacity(self.batch * self.world);
        for b in 0..self.batch {
            for p in 0..self.world {
                out.push(RowCopy {
                    dst: b * n * w + p * g,
                    dst_pitch: w,
                    src: (b * self.world + p) * n * g,
                    src_pitch: g,
                    width: g,
                    height: n,
                });
            }
        }
        out
    }
}

/// One rank's K/V all-gather in bytes: `batch` items of `rows` rows (`seq` in all), every rank's block padded to
/// `padded` rows, K and V rows of `width` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvBytes {
    pub batch: usize,
    pub world: usize,
    pub rows: usize,
    pub seq: usize,
    pub padded: usize,
    pub width: usize,
}

impl KvBytes {
    /// Bytes of one rank's send buffer `[k|v][item][padded][width]`.
    pub fn send_len(&self) -> usize {
        2 * self.batch * self.padded * self.width
    }

    /// Bytes of one of K, V compacted, `[item][seq][width]`.
    pub fn plane_len(&self) -> usize {
        self.batch * self.seq * self.width
    }

    /// The step's K and V rows (`[item][row][q|k|v][width]`) into the send buffer.
    pub fn pack(&self) -> Vec<RowCopy> {
        let (w, n) = (self.width, self.rows);
        let mut out = Vec::with_capacity(2 * self.batch);
        for c in 0..2 {
            for b in 0..self.batch {
                out.push(RowCopy {
                    dst: (c * self.batch + b) * self.padded * w,
                    dst_pitch: w,
                    src: (b * n * 3 + c + 1) * w,
                    src_pitch: 3 * w,
                    width: w,
                    height: n,
                });
            }
        }
        out
    }

    /// The gathered `[rank][k|v][item][padded][width]` into `[k|v][item][seq][width]`, each rank's valid rows at
    /// its block.
    pub fn compact(&self, rows: &RowPartition) -> Vec<RowCopy> {
        let w = self.width;
        let mut out = Vec::with_capacity(self.world * 2 * self.batch);
        for q in 0..self.world {
            let block = rows.rows(q);
            for c in 0..2 {
                for b in 0..self.batch {
                    out.push(RowCopy {
                        dst: ((c * self.batch + b) * self.seq + block.start) * w,
                        dst_pitch: w,
                        src: ((q * 2 + c) * self.batch + b) * self.padded * w,
                        src_pitch: w,
                        width: w,
                        height: block.len(),
                    });
                }
            }
        }
        out
    }
}

/// The output gather's slot of one rank: its video rows, then its audio rows, each item padded to the largest
/// rank's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutputBytes {
    pub batch: usize,
    pub video_rows: usize,
    pub audio_rows: usize,
    pub max_video: usize,
    pub max_audio: usize,
    /// Bytes of one video (audio) output row.
    pub video_row: usize,
    pub audio_row: usize,
}

impl OutputBytes {
    /// The rank's video output `[item][row][video_row]` into its slot.
    pub fn video(&self) -> Vec<RowCopy> {
        let vb = self.video_row;
        (0..self.batch)
            .map(|b| RowCopy {
                dst: b * self.max_video * vb,
                dst_pitch: vb,
                src: b * self.video_rows * vb,
                src_pitch: vb,
                width: vb,
                height: self.video_rows,
            })
            .collect()
    }

    /// The rank's audio output into its slot, after every item's video part.
    pub fn audio(&self) -> Vec<RowCopy> {
        let (vb, ab) = (self.video_row, self.audio_row);
        (0..self.batch)
            .map(|b| RowCopy {
                dst: self.batch * self.max_video * vb + b * self.max_audio * ab,
                dst_pitch: ab,
                src: b * self.audio_rows * ab,
                src_pitch: ab,
                width: ab,
                height: self.audio_rows,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::parallel::{simulate_exchange, KvGatherPlan, UlyssesPlan};

    /// Runs `c` on host bytes, as `copy_2d` does on the device.
    fn apply(dst: &mut [u16], src: &[u16], c: &RowCopy) {
        // The tests use 2-byte elements: byte offsets halve.
        for r in 0..c.height {
            let (d, s) = ((c.dst + r * c.dst_pitch) / 2, (c.src + r * c.src_pitch) / 2);
            let n = c.width / 2;
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        }
    }

    /// A value naming (item, global row, q|k|v, head, element): unique while the sizes stay small.
    fn id(b: usize, row: usize, c: usize, h: usize, e: usize) -> u16 {
        (((((b * 16 + row) * 3 + c) * 8 + h) * 4 + e) % 65_521) as u16 + 1
    }

    const ELEM: usize = 2;

    /// One rank's q|k|v rows `[item][row][q|k|v][heads][head dim]` as the step leaves them.
    fn qkv(b_: usize, block: Range<usize>, heads: usize, hd: usize) -> Vec<u16> {
        let mut v = Vec::new();
        for b in 0..b_ {
            for row in block.clone() {
                for c in 0..3 {
                    for h in 0..heads {
                        for e in 0..hd {
                            v.push(id(b, row, c, h, e));
                        }
                    }
                }
            }
        }
        v
    }

    #[test]
    fn ulysses_moves_every_value_to_its_head_group_and_back() {
        let (batch, heads, hd, seq) = (2, 8, 4, 11);
        for world in [1, 2, 4, 8] {
            let rows = RowPartition::new(seq, world).unwrap();
            let plan = UlyssesPlan::new(&rows, heads, hd).unwrap();
            let hl = heads / world;
            let bytes = |r: usize| UlyssesBytes {
                batch,
                world,
                rows: rows.count(r),
                seq,
                width: heads * hd * ELEM,
                group: hl * hd * ELEM,
            };
            // Pack every rank's rows.
            let mut sends: Vec<Vec<u16>> = (0..world)
                .map(|r| {
                    let m = bytes(r);
                    let src = qkv(batch, rows.rows(r), heads, hd);
                    let mut send = vec![0u16; m.send_len() / ELEM];
                    for c in m.pack() {
                        apply(&mut send, &src, &c);
                    }
                    send
                })
                .collect();
            // The exchange to head groups, pair by pair, as NCCL would run it.
            let exchanges: Vec<_> = (0..world)
                .map(|r| plan.to_heads(r).unwrap().clone())
                .collect();
            let mut recvs: Vec<Vec<u16>> = (0..world)
                .map(|r| vec![0; bytes(r).recv_len() / ELEM])
                .collect();
            for pair in 0..3 * batch {
                let parts: Vec<Vec<u16>> = (0..world)
                    .map(|r| {
                        let (s, _) = bytes(r).heads_exchange()[pair].clone();
                        sends[r][s.start / ELEM..s.end / ELEM].to_vec()
                    })
                    .collect();
                let got = simulate_exchange(&exchanges, &parts, 0).unwrap();
                for r in 0..world {
                    let (_, d) = bytes(r).heads_exchange()[pair].clone();
                    recvs[r][d.start / ELEM..d.start / ELEM + got[r].len()]
                        .copy_from_slice(&got[r]);
                }
            }
            // Every rank now holds every row of its heads, q, k and v.
            for (r, recv) in recvs.iter().enumerate() {
                let mut want = Vec::new();
                for c in 0..3 {
                    for b in 0..batch {
                        for row in 0..seq {
                            for h in r * hl..(r + 1) * hl {
                                for e in 0..hd {
                                    want.push(id(b, row, c, h, e));
                                }
                            }
                        }
                    }
                }
                assert_eq!(recv, &want, "world {world}, rank {r}: head-sharded q|k|v");
            }
            // Attention as the identity on q: the output is q's plane. Back to the row blocks, then unpacked.
            let outs: Vec<Vec<u16>> = (0..world)
                .map(|r| recvs[r][..bytes(r).plane_len() / ELEM].to_vec())
                .collect();
            let back: Vec<_> = (0..world).map(|r| plan.to_rows(r).unwrap()).collect();
            for b in 0..batch {
                let parts: Vec<Vec<u16>> = (0..world)
                    .map(|r| {
                        let (s, _) = bytes(r).rows_exchange()[b].clone();
                        outs[r][s.start / ELEM..s.end / ELEM].to_vec()
                    })
                    .collect();
                let got = simulate_exchange(&back, &parts, 0).unwrap();
                for r in 0..world {
                    let (_, d) = bytes(r).rows_exchange()[b].clone();
                    sends[r][d.start / ELEM..d.start / ELEM + got[r].len()]
                        .copy_from_slice(&got[r]);
                }
            }
            for (r, send) in sends.iter().enumerate() {
                let m = bytes(r);
                let mut attn = vec![0u16; batch * m.rows * heads * hd];
                for c in m.unpack() {
                    apply(&mut attn, send, &c);
                }
                // The rank's own rows, all heads: q as the step computed it.
                let mut want = Vec::new();
                for b in 0..batch {
                    for row in rows.rows(r) {
                        for h in 0..heads {
                            for e in 0..hd {
                                want.push(id(b, row, 0, h, e));
                            }
                        }
                    }
                }
                assert_eq!(attn, want, "world {world}, rank {r}: attention rows back");
            }
        }
    }

    #[test]
    fn the_kv_gather_compacts_every_ranks_keys_and_values_in_sequence_order() {
        let (batch, heads, hd, seq) = (2, 3, 2, 13);
        for world in 1..=8 {
            let rows = RowPartition::new(seq, world).unwrap();
            let plan = KvGatherPlan::new(&rows, heads, hd).unwrap();
            let bytes = |r: usize| KvBytes {
                batch,
                world,
                rows: rows.count(r),
                seq,
                padded: plan.padded_rows(),
                width: heads * hd * ELEM,
            };
            // All-gather: every rank's padded send buffer, rank by rank.
            let mut gathered = Vec::new();
            for r in 0..world {
                let m = bytes(r);
                assert_eq!(m.send_len() / ELEM, 2 * batch * plan.send_len());
                let src = qkv(batch, rows.rows(r), heads, hd);
                let mut send = vec![0u16; m.send_len() / ELEM];
                for c in m.pack() {
                    apply(&mut send, &src, &c);
                }
                gathered.extend(send);
            }
            for r in 0..world {
                let m = bytes(r);
                let mut full = vec![0u16; 2 * m.plane_len() / ELEM];
                for c in m.compact(&rows) {
                    apply(&mut full, &gathered, &c);
                }
                let mut want = Vec::new();
                for c in 1..3 {
                    for b in 0..batch {
                        for row in 0..seq {
                            for h in 0..heads {
                                for e in 0..hd {
                                    want.push(id(b, row, c, h, e));
                                }
                            }
                        }
                    }
                }
                assert_eq!(full, want, "world {world}, rank {r}");
            }
        }
    }

    #[test]
    fn output_slots_hold_video_then_audio_rows_per_item() {
        let m = OutputBytes {
            batch: 2,
            video_rows: 2,
            audio_rows: 1,
            max_video: 3,
            max_audio: 2,
            video_row: 4,
            audio_row: 2,
        };
        // sample [2 items][2 rows][2 elements], audio [2][1][1].
        let sample: Vec<u16> = (1..=8).collect();
        let audio: Vec<u16> = vec![100, 200];
        let mut slot = vec![0u16; 2 * 3 * 2 + 2 * 2];
        for c in m.video() {
            apply(&mut slot, &sample, &c);
        }
        for c in m.audio() {
            apply(&mut slot, &audio, &c);
        }
        assert_eq!(
            slot,
            vec![1, 2, 3, 4, 0, 0, 5, 6, 7, 8, 0, 0, 100, 0, 200, 0]
        );
    }
}
