//! Unit tests of the GPU decoder's host side: the weight layout and its device image (the folded layer scales),
//! and the batching of tiles into rows and clips. The GPU runs are `tests/gpu_h3_video_vae.rs`.

use super::*;
use crate::nn::upload::fill_host;
use ops::{ClipFrames, ClipTiles, VideoBuffer};

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
    let mut groups = 0;
    upload_groups(&model, &config, &net, |group| {
        fill_host(&mut image, &group.pieces(&model).unwrap(), 1 << 16, 2).unwrap();
        groups += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(groups, 2);
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
    // Every element of every block's scaled projections equals the host path's: f32 values times the row's
    // scale, then bf16 (the ring folds the scales on its threads, with no host copy of the matrices).
    for (i, b) in net.blocks.iter().enumerate() {
        let p = format!("decoder.transformer_blocks.{i}");
        let (s1, s2) = (get(&format!("{p}.scale1")), get(&format!("{p}.scale2")));
        for (name, at, cols, scale) in [
            ("attn.to_out.0.weight", b.out_w, d, &s1),
            ("ff.net.2.weight", b.ff2_w, inner, &s2),
        ] {
            let w = get(&format!("{p}.{name}"));
            for (e, &v) in w.iter().enumerate() {
                let want = half::bf16::from_f32(v * scale[e / cols]).to_bits();
                let got = u16::from_le_bytes([image[at + e * BF16], image[at + e * BF16 + 1]]);
                assert_eq!(got, want, "{p}.{name} element {e}");
            }
        }
    }
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

/// A line-by-line host twin of kernel h3v_assemble for one clip (see kernels/minimax_h3/vae_video.cu).
fn assemble_twin(
    out: &[f32],
    t: &ClipTiles,
    grid: &[usize],
    f: &ClipFrames,
    v: &VideoBuffer,
    video: &mut [f32],
) {
    let (ny, nx) = (t.ny, t.nx);
    let (ys, y_ov) = (&grid[..ny], &grid[ny..2 * ny - 1]);
    let (xs, x_ov) = (&grid[2 * ny - 1..2 * ny - 1 + nx], &grid[2 * ny - 1 + nx..]);
    let (_, tr, tc) = t.tile_latents;
    let (tile_h, tile_w) = t.tile_px;
    let value = |tile: usize, ch: usize, tt: usize, y: usize, x: usize| {
        let token = ((tt / t.pt) * tr + y / t.ps) * tc + x / t.ps;
        let col = ((ch * t.pt + tt % t.pt) * t.ps + y % t.ps) * t.ps + x % t.ps;
        out[(tile * t.tokens + token) * t.patch + col]
    };
    let blend = |a: f32, b: f32, p: usize, ext: usize| {
        let wb = p as f32 / ext as f32;
        a * (1.0 - wb) + b * wb
    };
    for tt in 0..f.clip_frames {
        let (frame, fade) = if tt >= f.pre && tt < f.chunk_frames {
            (
                f.clip * f.head + tt - f.pre,
                f.clip > 0 && tt - f.pre < f.blend,
            )
        } else if f.tail > 0 && tt >= f.chunk_frames + f.pre && tt < f.chunk_frames + f.pre + f.tail
        {
            ((f.clip + 1) * f.head + tt - f.chunk_frames - f.pre, false)
        } else {
            continue;
        };
        if frame >= v.frames {
            continue;
        }
        for y in 0..v.height {
            for x in 0..v.width {
                let mut ti = 0;
                while ti + 1 < ny && ys[ti + 1] <= y {
                    ti += 1;
                }
                let mut tj = 0;
                while tj + 1 < nx && xs[tj + 1] <= x {
                    tj += 1;
                }
                let (ly, lx) = (y - ys[ti], x - xs[tj]);
                let here = t.tile0 + ti * nx + tj;
                for ch in 0..t.channels {
                    let mut val = value(here, ch, tt, ly, lx);
                    if ti > 0 {
                        let ext = y_ov[ti - 1].min(tile_h);
                        if ly < ext {
                            val = blend(
                                value(here - nx, ch, tt, tile_h - ext + ly, lx),
                                val,
                                ly,
                                ext,
                            );
                        }
                    }
                    if tj > 0 {
                        let ext = x_ov[tj - 1].min(tile_w);
                        if lx < ext {
                            val =
                                blend(value(here - 1, ch, tt, ly, tile_w - ext + lx), val, lx, ext);
                        }
                    }
                    let at = ((frame * v.height + y) * v.width + x) * t.channels + ch;
                    if fade {
                        val = blend(video[at], val, tt - f.pre, f.blend);
                    }
                    video[at] = val;
                }
            }
        }
    }
}

/// The GPU decode's host side and its kernels' arithmetic (tile gather from the post-quant volume by the batch
/// origins, the proj_out rows each tile leaves, the assembly twin, clip by clip in group order) around the host
/// reference's ViT give the host reference's decode exactly: the batching, the origins and the assembly are right.
#[test]
fn the_gpu_data_flow_reproduces_the_host_decode() {
    let model = fixture();
    let mut host = super::super::vae_video::HostVideoVae::load(&model).unwrap();
    let config = host.config().clone();
    let dir = model.dir().join("..");
    let inputs =
        crate::nn::weights::SafetensorsFile::open(&dir.join("inputs.safetensors")).unwrap();
    let tiling = TilingOptions {
        enabled: true,
        tile_height: 8,
        tile_width: 12,
        min_overlap_height: 4,
        min_overlap_width: 4,
    };
    host.set_tiling(tiling).unwrap();
    let post_quant = (
        values(&model, "post_quant_conv.weight").unwrap(),
        values(&model, "post_quant_conv.bias").unwrap(),
    );
    let (c, p) = (config.latent_channels, config.patch_values());
    let (pt, ps) = (config.temporal_ratio(), config.spatial_ratio());
    let geo = config.chunk_geometry();
    // Budgets in token rows: a clip in two batches of 3 tiles (tiled: 6 tiles of 46 tokens per clip), both
    // clips in one batch, one tile per batch, and groups of two clips then one (three one-tile clips).
    for (case, budget) in [
        ("tiled", 3 * 46),
        ("tiled", 100_000),
        ("min_frames", 1),
        ("untiled_3chunks", 2 * 46),
    ] {
        let z = inputs.to_f32(&format!("{case}.latents")).unwrap();
        let lat = denormalize_latents(&config, &z).unwrap();
        let plan = DecodePlan::new(
            &config,
            lat.shape(),
            &tiling,
            GpuVideoVaeBudget { max_rows: budget },
        )
        .unwrap();
        let volume = post_quant_latents(&post_quant, &lat, &plan).unwrap();
        let (_, h, w) = plan.latents;
        let (tf, tr, tc) = plan.tile_latents;
        let (frames, hh, ww) = plan.video;
        let mut video = vec![f32::NAN; frames * hh * ww * 3];
        let mut out = vec![0f32; plan.group_tiles * plan.tokens * p];
        let t = &plan.tiles;
        let grid: Vec<usize> =
            t.y.starts
                .iter()
                .chain(&t.y.overlaps)
                .chain(&t.x.starts)
                .chain(&t.x.overlaps)
                .copied()
                .collect();
        let (mut slot, mut first_clip) = (0, 0);
        for batch in plan.batches() {
            for &(clip, i, j) in &batch.tiles {
                let (y0, x0) = plan.tiles.latent_origin(i, j);
                let f0 = clip * geo.tokens_chunk_size;
                // The token kernel's gather, channel-first for the host ViT.
                let mut tile = vec![0f32; c * tf * tr * tc];
                for ch in 0..c {
                    for (n, v) in tile[ch * tf * tr * tc..(ch + 1) * tf * tr * tc]
                        .iter_mut()
                        .enumerate()
                    {
                        let (ff, y, x) = (n / (tr * tc), n / tc % tr, n % tc);
                        *v = volume[(((f0 + ff) * h + y0 + y) * w + x0 + x) * c + ch];
                    }
                }
                let pixels = host.decode_tile(&tile, (tf, tr, tc)).unwrap();
                // Back to proj_out rows (the inverse of the un-patchify).
                let (ft, th, tw) = (tf * pt, tr * ps, tc * ps);
                for ch in 0..3 {
                    for tt in 0..ft {
                        for y in 0..th {
                            for x in 0..tw {
                                let token = ((tt / pt) * tr + y / ps) * tc + x / ps;
                                let col = ((ch * pt + tt % pt) * ps + y % ps) * ps + x % ps;
                                out[(slot * plan.tokens + token) * p + col] =
                                    pixels[((ch * ft + tt) * th + y) * tw + x];
                            }
                        }
                    }
                }
                slot += 1;
            }
            if batch.ends_group {
                let clips = slot / plan.tiles_per_clip;
                for k in 0..clips {
                    assemble_twin(
                        &out,
                        &ClipTiles {
                            out: DeviceSpan::new(0, 0),
                            tiles_held: plan.group_tiles,
                            tile0: k * plan.tiles_per_clip,
                            tokens: plan.tokens,
                            patch: p,
                            grid: DeviceSpan::new(0, 0),
                            ny: t.y.starts.len(),
                            nx: t.x.starts.len(),
                            tile_px: (t.y.size, t.x.size),
                            tile_latents: plan.tile_latents,
                            pt,
                            ps,
                            channels: 3,
                        },
                        &grid,
                        &ClipFrames {
                            clip: first_clip + k,
                            clip_frames: geo.clip_frames(),
                            pre: geo.frame_pre_padding,
                            chunk_frames: geo.chunk_frames(),
                            head: geo.head_frames(),
                            tail: geo.tail_frames(),
                            blend: geo.blend_frames(),
                        },
                        &VideoBuffer {
                            data: DeviceSpan::new(0, 0),
                            frames,
                            height: hh,
                            width: ww,
                        },
                        &mut video,
                    );
                }
                first_clip += clips;
                slot = 0;
            }
        }
        assert_eq!(first_clip, plan.chunks.chunks);
        let reference = host.decode_sample(&lat).unwrap();
        let n = frames * hh * ww;
        for (i, px) in video.chunks_exact(3).enumerate() {
            for (ch, &v) in px.iter().enumerate() {
                assert_eq!(
                    v,
                    reference.data()[ch * n + i],
                    "{case} (budget {budget}): pixel {i} channel {ch}"
                );
            }
        }
    }
}
