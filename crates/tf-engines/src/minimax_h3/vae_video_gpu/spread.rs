//! The video decode spread over the ranks of a multi-GPU job: which rank decodes which part, and what moves to
//! rank 0 (pure arithmetic, tested on the host; the GPU decoder runs it).
//!
//! The unit is one *group* of the one-GPU decode plan ([`DecodeUnit`]): the clips whose tiles the decoder holds at
//! once, run through the ViT as the plan's batches and then blended into the video clip by clip. A group is the
//! smallest unit whose batches keep the one-GPU shapes (the same GEMM row counts, so the same cuBLASLt choices)
//! and whose output is the whole input of its clips' blends. Group `g` is decoded by rank `g mod N` (round-robin,
//! so the ranks decode their first groups at once and later ones while rank 0 blends earlier ones; counts balanced
//! within one), into the same tile slots of its output buffer as one GPU would use; a rank other than 0 then sends
//! those slots, one contiguous range from slot 0, to rank 0, which receives them into the same slots and blends
//! the group's clips in the one-GPU order. So rank 0's video is the one-GPU decode bit for bit wherever the ranks
//! run the same GEMM algorithms (the same plan cache), and with one rank nothing moves.

use std::ops::Range;

use super::TileBatch;

/// One group of the decode plan: its batches (indices into [`super::DecodePlan::batches`]), its clips and its
/// tiles, which fill tile slots `0..tiles` of the decoder's output buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeUnit {
    pub batches: Range<usize>,
    pub clips: Range<usize>,
    pub tiles: usize,
}

/// The groups of `batches` (the plan's batches in order; a group ends at a batch marked `ends_group`), each
/// holding whole clips of `tiles_per_clip` tiles. `None` when the batches do not end in a group of whole clips
/// (not a plan's batches).
pub fn decode_units(batches: &[TileBatch], tiles_per_clip: usize) -> Option<Vec<DecodeUnit>> {
    let mut units = Vec::new();
    let (mut first_batch, mut first_clip, mut tiles) = (0, 0, 0);
    for (i, batch) in batches.iter().enumerate() {
        tiles += batch.tiles.len();
        if batch.ends_group {
            if tiles_per_clip == 0 || !tiles.is_multiple_of(tiles_per_clip) {
                return None;
            }
            let clips = tiles / tiles_per_clip;
            units.push(DecodeUnit {
                batches: first_batch..i + 1,
                clips: first_clip..first_clip + clips,
                tiles,
            });
            (first_batch, first_clip, tiles) = (i + 1, first_clip + clips, 0);
        }
    }
    (first_batch == batches.len()).then_some(units)
}

/// The rank that decodes unit `unit` of a `world`-rank job.
pub fn unit_owner(unit: usize, world: usize) -> usize {
    unit % world.max(1)
}

/// What one rank does for one unit, in this order: decode it, send it to rank 0 or receive it from its owner,
/// blend its clips into the video.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitRole {
    pub decode: bool,
    /// This rank sends the unit's slots to rank 0.
    pub send_to_root: bool,
    /// Rank 0 receives the unit's slots from this rank.
    pub receive_from: Option<usize>,
    /// Rank 0 blends the unit's clips.
    pub blend: bool,
}

/// The role of rank `rank` of `world` for unit `unit`.
pub fn unit_role(unit: usize, world: usize, rank: usize) -> UnitRole {
    let owner = unit_owner(unit, world);
    UnitRole {
        decode: owner == rank,
        send_to_root: owner == rank && rank != 0,
        receive_from: (rank == 0 && owner != 0).then_some(owner),
        blend: rank == 0,
    }
}

/// The values of the decoder's output buffer one unit moves: slots `0..tiles` of `slot_values` values each, from
/// value 0 (the range its batches wrote).
pub fn unit_values(unit: &DecodeUnit, slot_values: usize) -> Option<Range<usize>> {
    unit.tiles.checked_mul(slot_values).map(|n| 0..n)
}

/// The tile slot each batch of `unit` starts at (its batches fill the slots in order from 0).
pub fn batch_slots(unit: &DecodeUnit, batches: &[TileBatch]) -> Vec<usize> {
    let mut slot = 0;
    batches[unit.batches.clone()]
        .iter()
        .map(|b| {
            let at = slot;
            slot += b.tiles.len();
            at
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches as a plan lays them: `clips` clips of `per_clip` tiles, `clips_per_group` clips per group, at most
    /// `per_batch` tiles per batch.
    fn batches(
        clips: usize,
        per_clip: usize,
        clips_per_group: usize,
        per_batch: usize,
    ) -> Vec<TileBatch> {
        let mut out = Vec::new();
        let mut c0 = 0;
        while c0 < clips {
            let c1 = (c0 + clips_per_group).min(clips);
            let jobs: Vec<(usize, usize, usize)> = (c0..c1)
                .flat_map(|c| (0..per_clip).map(move |t| (c, 0, t)))
                .collect();
            let n = jobs.chunks(per_batch).count();
            for (k, b) in jobs.chunks(per_batch).enumerate() {
                out.push(TileBatch {
                    tiles: b.to_vec(),
                    ends_group: k + 1 == n,
                });
            }
            c0 = c1;
        }
        out
    }

    #[test]
    fn units_cover_every_batch_and_clip_in_order() {
        for (clips, per_clip, cpg, per_batch) in [
            (7, 28, 1, 9),
            (5, 4, 2, 8),
            (3, 1, 3, 3),
            (1, 6, 1, 4),
            (9, 2, 4, 3),
        ] {
            let b = batches(clips, per_clip, cpg, per_batch);
            let units = decode_units(&b, per_clip).unwrap();
            let mut next_batch = 0;
            let mut next_clip = 0;
            for u in &units {
                assert_eq!(u.batches.start, next_batch);
                assert_eq!(u.clips.start, next_clip);
                // The unit's batches hold exactly its clips' tiles, in the one-GPU order.
                let tiles: Vec<_> = b[u.batches.clone()]
                    .iter()
                    .flat_map(|x| x.tiles.iter().copied())
                    .collect();
                assert_eq!(tiles.len(), u.tiles);
                assert_eq!(u.tiles, u.clips.len() * per_clip);
                assert!(tiles.iter().all(|t| u.clips.contains(&t.0)));
                next_batch = u.batches.end;
                next_clip = u.clips.end;
            }
            assert_eq!((next_batch, next_clip), (b.len(), clips));
        }
        // Not a plan's batches: a group of a partial clip, or batches after the last group.
        let mut b = batches(2, 4, 1, 3);
        assert!(decode_units(&b, 3).is_none());
        b.last_mut().unwrap().ends_group = false;
        assert!(decode_units(&b, 4).is_none());
    }

    #[test]
    fn every_unit_is_decoded_once_and_ranks_balance_within_one() {
        for world in 1..=8 {
            for units in 0..=25 {
                let mut per_rank = vec![0usize; world];
                for u in 0..units {
                    let roles: Vec<UnitRole> = (0..world).map(|r| unit_role(u, world, r)).collect();
                    let deciders: Vec<usize> = (0..world).filter(|&r| roles[r].decode).collect();
                    assert_eq!(deciders.len(), 1, "unit {u} of world {world}");
                    per_rank[deciders[0]] += 1;
                    // Only rank 0 blends, every unit.
                    assert!(roles[0].blend && roles[1..].iter().all(|r| !r.blend));
                }
                let (lo, hi) = (per_rank.iter().min(), per_rank.iter().max());
                if let (Some(lo), Some(hi)) = (lo, hi) {
                    assert!(hi - lo <= 1, "world {world}, {units} units: {per_rank:?}");
                }
                assert_eq!(per_rank.iter().sum::<usize>(), units);
            }
        }
    }

    #[test]
    fn the_gather_pairs_every_send_with_rank_0s_receive_in_order() {
        for world in 1..=8 {
            let units = 3 * world + 2;
            // NCCL matches a pair's point-to-point calls in issue order: rank r's sends, in unit order, must be
            // the receives rank 0 posts from r, in the same order.
            for r in 1..world {
                let sends: Vec<usize> = (0..units)
                    .filter(|&u| unit_role(u, world, r).send_to_root)
                    .collect();
                let receives: Vec<usize> = (0..units)
                    .filter(|&u| unit_role(u, world, 0).receive_from == Some(r))
                    .collect();
                assert_eq!(sends, receives, "world {world}, rank {r}");
                // A rank never receives, and rank 0 never sends.
                assert!((0..units).all(|u| unit_role(u, world, r).receive_from.is_none()));
            }
            assert!((0..units).all(|u| !unit_role(u, world, 0).send_to_root));
            // What rank 0 decodes itself it does not receive; everything else it receives exactly once.
            for u in 0..units {
                let own = unit_role(u, world, 0);
                assert_ne!(own.decode, own.receive_from.is_some());
            }
        }
    }

    #[test]
    fn a_units_transfer_is_the_slots_its_batches_wrote() {
        let b = batches(7, 28, 1, 9);
        let units = decode_units(&b, 28).unwrap();
        let slot_values = 1797 * 3072;
        for u in &units {
            let slots = batch_slots(u, &b);
            assert_eq!(slots, vec![0, 9, 18, 27]);
            let last = u.batches.end - 1;
            let written = slots[slots.len() - 1] + b[last].tiles.len();
            assert_eq!(written, u.tiles);
            assert_eq!(unit_values(u, slot_values), Some(0..u.tiles * slot_values));
        }
        let b = batches(5, 4, 2, 8);
        let units = decode_units(&b, 4).unwrap();
        assert_eq!(
            units.iter().map(|u| u.tiles).collect::<Vec<_>>(),
            vec![8, 8, 4]
        );
        assert_eq!(batch_slots(&units[2], &b), vec![0]);
        assert_eq!(unit_values(&units[0], usize::MAX), None);
    }
}
