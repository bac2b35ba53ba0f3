//! Configuration variants of a cuBLASLt algorithm, for shapes where the heuristic offers too few
//! candidates to time.
//!
//! cuBLASLt's heuristic can return a single algorithm (every row-wise FP8 GEMM on sm_90 does),
//! which leaves timed selection nothing to compare. An algorithm's configuration (tile, stages,
//! CTA swizzling, custom option, cluster shape) can be set by hand, though, and
//! `cublasLtMatmulAlgoCheck` says whether the library runs it for the GEMM's descriptors. This
//! module orders the configurations worth trying around the heuristic's choice
//! ([`variant_configs`], pure); the handle checks them in that order and hands the accepted ones
//! to timing beside the heuristic's results. The order is deterministic for a given library and
//! shape, so a choice stored in the plan cache is found again among the same candidates.

use std::collections::HashSet;

/// `cublasLtClusterShape_t` values tried, in order: 1x1, 2x1, 1x2, 2x2.
pub const CLUSTER_SHAPES: [u16; 4] = [2, 3, 5, 6];

/// The configurable attributes of one algorithm (`CUBLASLT_ALGO_CONFIG_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AlgoConfig {
    pub tile: u32,
    pub stages: u32,
    pub swizzle: u32,
    pub custom: u32,
    pub cluster: u16,
}

/// What an initialized algorithm accepts (`CUBLASLT_ALGO_CAP_*`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AlgoCaps {
    pub tiles: Vec<u32>,
    pub stages: Vec<u32>,
    pub swizzle: bool,
    pub custom_max: u32,
}

/// Upper bound on the custom options walked (the library reports a small range; a larger value
/// would only add configurations it refuses).
const MAX_CUSTOM_OPTIONS: u32 = 16;

/// The configurations to check around `base`, nearest first: CTA swizzling flipped, each cluster
/// shape, each other tile, each other stage count, then each custom option; `base` itself is
/// left out and no configuration appears twice. At most `limit` are returned.
pub fn variant_configs(base: AlgoConfig, caps: &AlgoCaps, limit: usize) -> Vec<AlgoConfig> {
    let mut seen: HashSet<AlgoConfig> = HashSet::from([base]);
    let mut out = Vec::new();
    let mut push = |config: AlgoConfig, out: &mut Vec<AlgoConfig>| {
        if out.len() < limit && seen.insert(config) {
            out.push(config);
        }
    };
    if caps.swizzle {
        push(
            AlgoConfig {
                swizzle: 1 - base.swizzle.min(1),
                ..base
            },
            &mut out,
        );
    }
    for &cluster in &CLUSTER_SHAPES {
        push(AlgoConfig { cluster, ..base }, &mut out);
    }
    for &tile in &caps.tiles {
        push(AlgoConfig { tile, ..base }, &mut out);
    }
    for &stages in &caps.stages {
        push(AlgoConfig { stages, ..base }, &mut out);
    }
    for custom in 0..=caps.custom_max.min(MAX_CUSTOM_OPTIONS) {
        push(AlgoConfig { custom, ..base }, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn base() -> AlgoConfig {
        AlgoConfig {
            tile: 23,
            stages: 35,
            swizzle: 0,
            custom: 0,
            cluster: 0,
        }
    }

    #[test]
    fn nearest_variants_come_first() {
        let caps = AlgoCaps {
            tiles: vec![20, 23, 24],
            stages: vec![35, 36],
            swizzle: true,
            custom_max: 1,
        };
        let got = variant_configs(base(), &caps, 64);
        assert_eq!(
            got[0],
            AlgoConfig {
                swizzle: 1,
                ..base()
            }
        );
        let clusters: Vec<u16> = got[1..5].iter().map(|c| c.cluster).collect();
        assert_eq!(clusters, CLUSTER_SHAPES);
        assert_eq!(got[5], AlgoConfig { tile: 20, ..base() });
        assert_eq!(got[6], AlgoConfig { tile: 24, ..base() });
        assert_eq!(
            got[7],
            AlgoConfig {
                stages: 36,
                ..base()
            }
        );
        assert_eq!(
            got[8],
            AlgoConfig {
                custom: 1,
                ..base()
            }
        );
        assert_eq!(got.len(), 9);
    }

    #[test]
    fn no_swizzle_support_no_swizzle_variant() {
        let got = variant_configs(base(), &AlgoCaps::default(), 64);
        assert!(got.iter().all(|c| c.swizzle == 0));
        assert_eq!(got.len(), CLUSTER_SHAPES.len());
    }

    proptest! {
        #[test]
        fn variants_are_distinct_bounded_and_never_the_base(
            tiles in proptest::collection::vec(0u32..40, 0..40),
            stages in proptest::collection::vec(0u32..40, 0..40),
            swizzle in any::<bool>(),
            custom_max in 0u32..1000,
            base_tile in 0u32..40,
            base_cluster in 0u16..8,
            limit in 0usize..80,
        ) {
            let caps = AlgoCaps { tiles, stages, swizzle, custom_max };
            let base = AlgoConfig { tile: base_tile, cluster: base_cluster, ..base() };
            let got = variant_configs(base, &caps, limit);
            prop_assert!(got.len() <= limit);
            prop_assert!(!got.contains(&base));
            let unique: HashSet<_> = got.iter().collect();
            prop_assert_eq!(unique.len(), got.len());
            // Each variant changes exactly one attribute of the base.
            for c in &got {
                let changed = [c.tile != base.tile, c.stages != base.stages, c.swizzle != base.swizzle,
                    c.custom != base.custom, c.cluster != base.cluster];
                prop_assert_eq!(changed.iter().filter(|&&x| x).count(), 1);
            }
        }
    }
}
