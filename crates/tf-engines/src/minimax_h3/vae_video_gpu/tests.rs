//! Unit tests of the GPU decoder's host side: the weight layout and its device image (the folded layer scales),
//! and the batching of tiles into rows and clips. The GPU runs are `tests/gpu_h3_video_vae.rs`.

use super::*;
use crate::nn::upload::fill_host;

fn fixture() -> ModelDir {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/minimax_h3_video_vae/model");
    ModelDir::open(&dir).unwrap()
}

fn bf16_at(image: &[u8], offset: usize) -> f32 {
    half::bf16::from_le_bytes([image[offset], image[offset + 1]]).to_f32()
}

fn f32_at(image: &[u8], offset: usize) -> f32 {
    f32::from_le_bytes([
        image[offset],
        image[offset + 1],
        image[offset + 2],
        image[offset + 3],
    ])
}

#[test]
fn the_device_image_folds_the_layer_scales() {
    let model = fixture();
    let config = check_model(&model).unwrap();
    check_supported(&config).unwrap();
    let net = Net::plan(&config).unwrap();
    let mut image = vec![0u8; net.total];
    for group in upload_groups(&model, &config, &net).unwrap() {
        fill_host(&mut image, &group.pieces(&model).unwrap(), 1 << 16, 2).unwrap();
    }
    let (c, d, inner) = (config.latent_channels, config.dim(), config.ffn_inner());
    let get = |n: &str| model.to_f32(n).unwrap().into_data();
    let p = "decoder.transformer_blocks.1";
    let b = net.blocks[1];
    // q|k|v rows stacked; k's row 5, column 7 as stored (bf16-exact in the fixture).
    let k = get(&format!("{p}.attn.to_k.weight"));
    assert_eq!(
        bf16_at(&image, b.qkv_w + ((d + 5) * d + 7) * BF16),
        k[5 * d + 7]
    );
    let vb = get(&format!("{p}.attn.to_v.bias"));
    assert_eq!(
        bf16_at(&image, b.qkv_b + (2 * d + 3) * BF16),
        half::bf16::from_f32(vb[3]).to_f32()
    );
    // to_out rows times scale1, rounded to bf16; its bias times scale1 in f32.
    let (s1, s2) = (get(&format!("{p}.scale1")), get(&format!("{p}.scale2")));
    let wo = get(&format!("{p}.attn.to_out.0.weight"));
    let want = half::bf16::from_f32(wo[9 * d + 4] * s1[9]).to_f32();
    assert_eq!(bf16_at(&image, b.out_w + (9 * d + 4) * BF16), want);
    let bo = get(&format!("{p}.attn.to_out.0.bias"));
    assert_eq!(f32_at(&image, b.out_b + 9 * F32), bo[9] * s1[9]);
    let w2 = get(&format!("{p}.ff.net.2.weight"));
    let want = half::bf16::from_f32(w2[(d - 1) * inner + 3] * s2[d - 1]).to_f32();
    assert_eq!(
        bf16_at(&image, b.ff2_w + ((d - 1) * inner + 3) * BF16),
        want
    );
    // proj_in transposed, f32.
    let pin = get("decoder.proj_in.weight");
    assert_eq!(
        f32_at(&image, net.proj_in_wt + (2 * d + 11) * F32),
        pin[11 * c + 2]
    );
    let regs = get("decoder.register_tokens");
    assert_eq!(f32_at(&image, net.registers + (d + 1) * F32), regs[d + 1]);
    // The layout holds every block and nothing overlaps the end.
    assert_eq!(net.blocks.len(), config.decoder_num_layers);
    assert!(net.proj_out_b + config.patch_values() * F32 <= net.total);
}

#[test]
fn other_head_dims_are_refused() {
    let mut config = VideoVaeConfig::default();
    assert!(check_supported(&config).is_ok());
    config.decoder_attention_head_dim = 128;
    let err = check_supported(&config).unwrap_err().to_string();
    assert!(err.contains("head dim 64"), "{err}");
}

#[test]
fn tiles_are_batched_into_rows_and_whole_clips() {
    let config = VideoVaeConfig::default();
    let shape = [1, 24, 37, 28, 48];
    let tiling = TilingOptions::default();
    // Released: 8 tiles of 7 x 16 x 16 voxels + 5 tokens per clip; one clip per batch.
    let plan = DecodePlan::new(&config, &shape, &tiling, GpuVideoVaeBudget::default()).unwrap();
    assert_eq!((plan.tokens, plan.tiles_per_clip), (1797, 8));
    assert_eq!(
        (plan.tiles_per_batch, plan.clips_per_group, plan.group_tiles),
        (8, 1, 8)
    );
    assert_eq!(plan.video, (124, 448, 768));
    let batches = plan.batches();
    assert_eq!(batches.len(), 7);
    assert!(batches.iter().all(|b| b.tiles.len() == 8 && b.ends_group));
    assert_eq!(batches[3].tiles[5], (3, 1, 1));
    // A small budget: three tiles per batch, a clip in three batches (3 + 3 + 2), its last one marked.
    let small = GpuVideoVaeBudget {
        max_rows: 3 * 1797 + 100,
    };
    let plan = DecodePlan::new(&config, &shape, &tiling, small).unwrap();
    assert_eq!(
        (plan.tiles_per_batch, plan.clips_per_group, plan.group_tiles),
        (3, 1, 8)
    );
    let batches = plan.batches();
    assert_eq!(batches.len(), 21);
    let sizes: Vec<(usize, bool)> = batches[..3]
        .iter()
        .map(|b| (b.tiles.len(), b.ends_group))
        .collect();
    assert_eq!(sizes, vec![(3, false), (3, false), (2, true)]);
    // A large budget holds several clips: 3 clips of 8 tiles per group, the last group shorter.
    let large = GpuVideoVaeBudget {
        max_rows: 25 * 1797,
    };
    let plan = DecodePlan::new(&config, &shape, &tiling, large).unwrap();
    assert_eq!(
        (plan.tiles_per_batch, plan.clips_per_group, plan.group_tiles),
        (24, 3, 24)
    );
    let batches = plan.batches();
    let sizes: Vec<usize> = batches.iter().map(|b| b.tiles.len()).collect();
    assert_eq!(sizes, vec![24, 24, 8]);
    assert!(batches.iter().all(|b| b.ends_group));
    // Every (clip, tile) appears once, in clip order.
    let all: Vec<(usize, usize, usize)> = batches.into_iter().flat_map(|b| b.tiles).collect();
    assert_eq!(all.len(), 7 * 8);
    assert!(all.windows(2).all(|w| w[0] < w[1]));
}
