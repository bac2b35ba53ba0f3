//! Unit tests of the video VAE config, the chunk and tile geometry and the small host pieces (the fixture parity
//! is `tests/h3_video_vae_parity.rs`).

use super::*;
use crate::nn::config::test_support::{
    assert_each_key_under_hostile_values, assert_refused_naming_key,
};

fn parse(value: serde_json::Value) -> Result<VideoVaeConfig, VideoVaeConfigError> {
    VideoVaeConfig::from_json(&value)
}

#[test]
fn defaults_are_the_release() {
    let c = parse(serde_json::json!({})).unwrap();
    assert_eq!(c.dim(), 2048);
    assert_eq!(c.rope_dim(), 48);
    assert_eq!(c.ffn_inner(), 8192);
    assert_eq!((c.spatial_ratio(), c.temporal_ratio()), (16, 4));
    assert_eq!(c.patch_values(), 3 * 4 * 16 * 16);
    // The diffusers state dict of the default model: 585 decoder and post_quant_conv tensors, 2,423,531,096 values.
    assert_eq!(c.tensor_specs().len(), 585);
    assert_eq!(c.parameter_count(), 2_423_531_096);
    assert_eq!(
        VideoVaeConfig {
            class_name: None,
            ..VideoVaeConfig::default()
        },
        c
    );
}

#[test]
fn released_chunking_matches_the_reference() {
    let g = VideoVaeConfig::default().chunk_geometry();
    assert_eq!(
        (
            g.tokens_chunk_size,
            g.frame_pre_padding,
            g.token_overlap,
            g.frame_overlap
        ),
        (5, 3, 2, 5)
    );
    assert_eq!(
        (g.clip_latents(), g.clip_frames(), g.chunk_frames()),
        (7, 28, 20)
    );
    assert_eq!(
        (g.head_frames(), g.tail_frames(), g.blend_frames()),
        (17, 5, 5)
    );
    assert_eq!(g.min_latent_frames(), 3);
    // 17 n + 5 frames <-> 5 n + 2 latents, no padding.
    for n in 0..12 {
        let p = g
            .plan(5 * n + 2)
            .map(|p| (p.chunks, p.pad_tokens, p.out_frames));
        if n == 0 {
            assert!(p.is_err());
        } else {
            assert_eq!(p.unwrap(), (n, 0, 17 * n + 5));
        }
    }
    // The fixture's lengths: padding latents and the frames they made cut again.
    let p = g.plan(9).unwrap();
    assert_eq!(
        (p.chunks, p.pad_tokens, p.pad_frames, p.out_frames),
        (2, 3, 9, 30)
    );
    let p = g.plan(3).unwrap();
    assert_eq!(
        (p.chunks, p.pad_tokens, p.pad_frames, p.out_frames),
        (1, 4, 13, 9)
    );
    // Frames per latent count from 3 to 40, from diffusers' `_decode` with a stand-in clip decoder.
    let reference = [
        9, 13, 17, 18, 22, 26, 30, 34, 35, 39, 43, 47, 51, 52, 56, 60, 64, 68, 69, 73, 77, 81, 85,
        86, 90, 94, 98, 102, 103, 107, 111, 115, 119, 120, 124, 128, 132, 136,
    ];
    for (f, &frames) in (3..).zip(&reference) {
        assert_eq!(g.plan(f).unwrap().out_frames, frames, "{f}");
    }
    assert!(g.plan(2).is_err() && g.plan(0).is_err());
    // No token drop: plain chunks of 5 latents, no overlap.
    let g = ChunkGeometry::new(20, 4, 0);
    assert_eq!(
        (g.frame_pre_padding, g.token_overlap, g.tail_frames()),
        (0, 0, 0)
    );
    assert_eq!(g.plan(10).unwrap().out_frames, 40);
}

#[test]
fn released_tiles_match_the_reference() {
    // diffusers' _split_tiles(length, 256, 64) with the spatial ratio 16.
    let t = split_tiles(448, 256, 64, 16).unwrap();
    assert_eq!((t.starts, t.overlaps), (vec![0, 192], vec![64]));
    let t = split_tiles(768, 256, 64, 16).unwrap();
    assert_eq!(
        (t.starts, t.overlaps),
        (vec![0, 160, 336, 512], vec![96, 80, 80])
    );
    let t = split_tiles(1344, 256, 64, 16).unwrap();
    assert_eq!(t.starts, vec![0, 176, 352, 528, 704, 896, 1088]);
    assert_eq!(t.overlaps, vec![80, 80, 80, 80, 64, 64]);
    let t = split_tiles(256, 256, 64, 16).unwrap();
    assert_eq!((t.starts, t.size, t.overlaps), (vec![0], 256, vec![]));
    let plan = TilePlan::new(28, 48, 16, &TilingOptions::default()).unwrap();
    assert_eq!((plan.count(), plan.latent_size()), (8, (16, 16)));
    assert_eq!(plan.latent_origin(1, 3), (12, 32));
    let off = TilePlan::new(28, 48, 16, &TilingOptions::disabled()).unwrap();
    assert_eq!((off.count(), off.latent_size()), (1, (28, 48)));
}

#[test]
fn bad_tiling_is_refused() {
    for t in [
        TilingOptions {
            tile_height: 250,
            ..TilingOptions::default()
        },
        TilingOptions {
            min_overlap_width: 256,
            ..TilingOptions::default()
        },
        TilingOptions {
            min_overlap_height: 0,
            ..TilingOptions::default()
        },
        TilingOptions {
            tile_width: 0,
            ..TilingOptions::default()
        },
    ] {
        assert!(t.check(16).is_err(), "{t:?}");
        assert!(TilePlan::new(40, 40, 16, &t).is_err());
    }
    assert!(TilingOptions::disabled().check(16).is_ok());
}

#[test]
fn rope_tables_hold_the_normalized_grid() {
    // 2 frames x 1 row x 2 columns, 1 register: rope 48 -> 8 frequencies per axis.
    let (cos, sin) = rope_tables((2, 1, 2), 1, 48, 100.0);
    let half = 24;
    assert_eq!(cos.len(), (4 + 2) * half);
    // Token 0: t = -0.5, y = 0, x = -0.5. The row axis (position 0) has angle 0 everywhere.
    for j in 0..8 {
        assert_eq!((cos[8 + j], sin[8 + j]), (1.0, 0.0));
    }
    let angle = (2.0 * std::f64::consts::PI) as f32 * -0.5f32;
    assert_eq!(cos[0], angle.cos());
    assert_eq!(sin[16], angle.sin());
    let inv1 = 1.0f32 / 100f32.powf(0.125);
    assert_eq!(sin[1], (angle * inv1).sin());
    // Register and zero tokens sit at position 0.
    assert!(cos[4 * half..].iter().all(|&c| c == 1.0));
    assert!(sin[4 * half..].iter().all(|&s| s == 0.0));
}

#[test]
fn stitching_blends_with_the_original_neighbours() {
    // Two tiles side by side of width 4 with an overlap of 2 over one plane of one row: [0, 4) and [2, 6).
    let plan = TilePlan {
        y: AxisTiles {
            starts: vec![0],
            size: 1,
            overlaps: vec![],
        },
        x: AxisTiles {
            starts: vec![0, 2],
            size: 4,
            overlaps: vec![2],
        },
        ratio: 1,
    };
    let out = stitch_tiles(&[vec![1.0; 4], vec![3.0; 4]], &plan, 1);
    // Left tile kept for x < 2; the right tile's first 2 columns fade from the left tile (weights 1, 0.5).
    assert_eq!(out, vec![1.0, 1.0, 1.0, 2.0, 3.0, 3.0]);
    assert_eq!(blend_weights(1, 5), (1.0 - 0.2f32, 0.2f32));
}

#[test]
fn finalize_rounds_half_to_even() {
    // 0.5 * 255 = 127.5 rounds to 128 (even); the clamp holds values outside [0, 1].
    let x = (0.5 - PIXEL_MEAN[0]) / PIXEL_STD[0];
    let (v, b) = finalize_value(x, 0);
    assert!((v - 0.5).abs() < 1e-6);
    assert!(b == 127 || b == 128);
    assert_eq!(finalize_value(100.0, 1), (1.0, 255));
    assert_eq!(finalize_value(-100.0, 2), (0.0, 0));
}

#[test]
fn hostile_configs_name_the_key() {
    assert_refused_naming_key(
        parse,
        &[
            (serde_json::json!({"latent_channels": 0}), "latent_channels"),
            (
                serde_json::json!({"latent_channels": "24"}),
                "latent_channels",
            ),
            (
                serde_json::json!({"decoder_num_layers": u64::MAX}),
                "decoder_num_layers",
            ),
            (
                serde_json::json!({"decoder_attention_head_dim": 60}),
                "decoder_attention_head_dim",
            ),
            (
                serde_json::json!({"decoder_rope_dim_ratio": 0.0}),
                "decoder_rope_dim_ratio",
            ),
            (
                serde_json::json!({"decoder_rope_theta": -1.0}),
                "decoder_rope_theta",
            ),
            (
                serde_json::json!({"decoder_norm_eps": 1e308}),
                "decoder_norm_eps",
            ),
            (serde_json::json!({"token_drop": 5}), "token_drop"),
            (serde_json::json!({"clip_length": 0}), "clip_length"),
            (serde_json::json!({"out_channels": 4}), "out_channels"),
            (
                serde_json::json!({"spatial_downsample_factors": [2, 2, 2, 2, 2, 2, 2]}),
                "spatial_downsample_factors",
            ),
            (
                serde_json::json!({"temporal_downsample_factors": [0]}),
                "temporal_downsample_factors[0]",
            ),
            (
                serde_json::json!({"latents_mean": [0.0, 1.0]}),
                "latents_mean",
            ),
            (
                serde_json::json!({"latents_std": vec![0.0; 24]}),
                "latents_std",
            ),
            (
                serde_json::json!({"_class_name": "AutoencoderKLMiniMaxH3Audio"}),
                "_class_name",
            ),
            (
                serde_json::json!({"decoder_num_attention_heads": 1024, "decoder_attention_head_dim": 1024}),
                "decoder_num_attention_heads",
            ),
            (
                serde_json::json!({"decoder_num_layers": 1024, "decoder_ffn_mult": 64}),
                "parameters",
            ),
        ],
    );
    assert!(names_this_class(
        &serde_json::json!({"_class_name": CLASS_NAME})
    ));
}

#[test]
fn every_key_under_hostile_values_parses_or_fails_cleanly() {
    let keys = [
        "in_channels",
        "out_channels",
        "latent_channels",
        "block_out_channels",
        "layers_per_block",
        "spatial_downsample_factors",
        "temporal_downsample_factors",
        "norm_num_groups",
        "norm_eps",
        "spatial_padding_mode",
        "decoder_num_layers",
        "decoder_num_attention_heads",
        "decoder_attention_head_dim",
        "decoder_num_register_tokens",
        "decoder_ffn_mult",
        "decoder_rope_theta",
        "decoder_rope_dim_ratio",
        "decoder_norm_eps",
        "clip_length",
        "token_drop",
        "latents_mean",
        "latents_std",
        "_class_name",
    ];
    assert_each_key_under_hostile_values(&keys, parse, |config| {
        assert!(config.parameter_count() <= MAX_PARAMETERS);
        assert!(config.rope_dim() > 0 && config.dim() > 0);
    });
}

#[test]
fn latents_are_checked_before_anything_is_allocated() {
    let c = VideoVaeConfig::default();
    for shape in [
        vec![1, 24, 9, 4],
        vec![2, 24, 9, 4, 4],
        vec![1, 23, 9, 4, 4],
        vec![1, 24, 2, 4, 4],
        vec![1, 24, 9, 0, 4],
        vec![1, 24, MAX_LATENT_FRAMES + 1, 4, 4],
        vec![1, 24, 9, 4, MAX_LATENT_SIDE + 1],
        vec![1, 24, MAX_LATENT_FRAMES, MAX_LATENT_SIDE, MAX_LATENT_SIDE],
    ] {
        let err = check_latents(&c, &shape).unwrap_err().to_string();
        assert!(err.contains("input"), "{shape:?}: {err}");
    }
    let ((f, h, w), plan) = check_latents(&c, &[1, 24, 37, 28, 48]).unwrap();
    assert_eq!((f, h, w, plan.out_frames), (37, 28, 48, 124));
}
