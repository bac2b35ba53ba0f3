//! The MiniMax H3 video VAE host decode against the diffusers 0.42.1 fp32 fixture (tests/fixtures/minimax_h3_video_vae,
//! made by tests/python/h3_video_vae_fixtures.py): the model's decode (temporal chunks, spatial tiles, the ViT) and
//! the pipeline's 8-bit frames for every case, one tile of the ViT alone, what the fixture covers, the chunk and tile
//! geometry against the reference's, and hostile configs, malformed checkpoints and bad inputs, which must give
//! errors and never panic.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::PathBuf;

#[path = "common/scratch_model.rs"]
mod scratch_model;
use scratch_model::{assert_bad_tensors_named, rewrite, ScratchModel};
use tf_engines::minimax_h3::vae_video::{
    denormalize_latents, split_tiles, HostVideoVae, TilingOptions, VideoVaeBackend, VideoVaeError,
    PIXEL_MEAN, PIXEL_STD,
};
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};

const TOLERANCE: f64 = 1e-5;
const CASES: [&str; 4] = ["tiled", "untiled_3chunks", "min_frames", "no_tiling"];

fn fixtures() -> PathBuf {
    fixture_dir::find("minimax_h3_video_vae")
}

fn manifest() -> serde_json::Value {
    fixture_dir::manifest(&fixtures())
}

fn load() -> HostVideoVae {
    HostVideoVae::load(&ModelDir::open(&fixtures().join("model")).unwrap()).unwrap()
}

fn tensor(file: &str, name: &str) -> TensorF32 {
    SafetensorsFile::open(&fixtures().join(file))
        .unwrap()
        .to_f32(name)
        .unwrap()
}

fn frames(case: &str) -> Vec<u8> {
    let file = SafetensorsFile::open(&fixtures().join("expected.safetensors")).unwrap();
    file.to_u8(&format!("{case}.frames")).unwrap().into_data()
}

/// The tiling a case was decoded with.
fn tiling(case: &str) -> TilingOptions {
    let c = &manifest()["cases"][case];
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    TilingOptions {
        enabled: c["tiling"].as_bool().unwrap(),
        tile_height: n("tile_sample_min_height"),
        tile_width: n("tile_sample_min_width"),
        min_overlap_height: n("tile_sample_min_overlap_height"),
        min_overlap_width: n("tile_sample_min_overlap_width"),
    }
}

fn assert_close(what: &str, actual: &TensorF32, reference: &TensorF32) -> f64 {
    assert_eq!(actual.shape(), reference.shape(), "{what}: shape");
    let err = relative_l2(actual.data(), reference.data()).unwrap();
    println!("{what}: shape {:?}, relative L2 {err:.3e}", actual.shape());
    assert!(
        err <= TOLERANCE,
        "{what}: relative L2 {err:.3e} > {TOLERANCE:e}"
    );
    err
}

/// Values of two 8-bit frame sets that differ, and the largest difference.
fn byte_diff(a: &[u8], b: &[u8]) -> (usize, u8) {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold((0, 0), |(n, m), (&x, &y)| {
        let d = x.abs_diff(y);
        (n + usize::from(d > 0), m.max(d))
    })
}

#[test]
fn every_case_matches_diffusers() {
    let mut vae = load();
    for case in CASES {
        vae.set_tiling(tiling(case)).unwrap();
        let z = tensor("inputs.safetensors", &format!("{case}.latents"));
        let expected = tensor("expected.safetensors", &format!("{case}.sample"));
        let lat = denormalize_latents(vae.config(), &z).unwrap();
        let sample = vae.decode_sample(&lat).unwrap();
        assert_close(&format!("{case} sample"), &sample, &expected);
        // The pipeline's frames: f32 values within a rounding step of the reference, so at most a value or two
        // lands on the other side of a half and differs by one.
        let out = VideoVaeBackend::decode(&mut vae, &z).unwrap();
        let [_, _, f, h, w] = expected.dims::<5>("sample").unwrap();
        assert_eq!((out.frames, out.height, out.width), (f, h, w));
        let (n, max) = byte_diff(&out.rgb, &frames(case));
        println!(
            "{case} frames: {n} of {} values differ (max {max})",
            out.rgb.len()
        );
        assert!(
            max <= 1 && n * 10_000 <= out.rgb.len(),
            "{case}: {n} differ, max {max}"
        );
        assert!(out.pixels.iter().all(|v| (0.0..=1.0).contains(v)));
    }
}

#[test]
fn one_tile_of_the_vit_matches_diffusers() {
    let vae = load();
    let c = vae.config().latent_channels;
    let m = manifest();
    let y = &m["cases"]["tiled"]["tiles"]["y"];
    let x = &m["cases"]["tiled"]["tiles"]["x"];
    let ratio = vae.config().spatial_ratio();
    let (th, tw) = (
        y[1][0].as_u64().unwrap() as usize / ratio,
        x[1][0].as_u64().unwrap() as usize / ratio,
    );
    let z = tensor("inputs.safetensors", "tiled.latents");
    let lat = denormalize_latents(vae.config(), &z).unwrap();
    let [_, _, f, h, w] = lat.dims::<5>("latents").unwrap();
    let frames = vae.config().chunk_geometry().clip_latents();
    // post_quant_conv by hand (weights from the folder), then the decoder on the tile.
    let model = ModelDir::open(&fixtures().join("model")).unwrap();
    let pw = model.to_f32("post_quant_conv.weight").unwrap();
    let pb = model.to_f32("post_quant_conv.bias").unwrap();
    let mut tile = vec![0f32; c * frames * th * tw];
    for o in 0..c {
        for t in 0..frames {
            for yy in 0..th {
                for xx in 0..tw {
                    let mut acc = f64::from(pb.data()[o]);
                    for i in 0..c {
                        let v = lat.data()[((i * f + t) * h + yy) * w + xx];
                        acc += f64::from(pw.data()[o * c + i]) * f64::from(v);
                    }
                    tile[((o * frames + t) * th + yy) * tw + xx] = acc as f32;
                }
            }
        }
    }
    let out = vae.decode_tile(&tile, (frames, th, tw)).unwrap();
    let expected = tensor("expected.safetensors", "clip0.tile0");
    let shape = expected.shape().to_vec();
    assert_close(
        "clip0.tile0",
        &TensorF32::new(shape, out).unwrap(),
        &expected,
    );
}

#[test]
fn the_fixture_covers_every_path() {
    let m = manifest();
    let vae = load();
    let config = vae.config();
    // Two blocks of two heads of 64, RoPE on 48 of them, registers other than the default count.
    assert!(config.decoder_num_layers >= 2 && config.decoder_num_attention_heads >= 2);
    assert_eq!(config.rope_dim(), 48);
    assert!(config.rope_dim() < config.decoder_attention_head_dim);
    assert_ne!(config.decoder_num_register_tokens, 4);
    // The tiled case crosses two temporal chunks with padding latents and 2 x 3 tiles with spread slack.
    let geo = config.chunk_geometry();
    let g = &m["geometry"];
    assert_eq!(
        (
            geo.frame_pre_padding,
            geo.tokens_chunk_size,
            geo.token_overlap,
            geo.frame_overlap
        ),
        (
            g["frame_pre_padding"].as_u64().unwrap() as usize,
            g["tokens_chunk_size"].as_u64().unwrap() as usize,
            g["token_overlap"].as_u64().unwrap() as usize,
            g["frame_overlap"].as_u64().unwrap() as usize,
        )
    );
    let [_, _, f, h, w] = tensor("inputs.safetensors", "tiled.latents")
        .dims::<5>("latents")
        .unwrap();
    let plan = geo.plan(f).unwrap();
    assert!(plan.chunks >= 2 && plan.pad_tokens > 0, "{plan:?}");
    let t = tiling("tiled");
    let r = config.spatial_ratio();
    let ys = split_tiles(h * r, t.tile_height, t.min_overlap_height, r).unwrap();
    let xs = split_tiles(w * r, t.tile_width, t.min_overlap_width, r).unwrap();
    assert!(ys.starts.len() >= 2 && xs.starts.len() >= 3);
    let tiles = &m["cases"]["tiled"]["tiles"];
    let ints = |v: &serde_json::Value| -> Vec<usize> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    };
    assert_eq!(ys.starts, ints(&tiles["y"][0]));
    assert_eq!(ys.overlaps, ints(&tiles["y"][2]));
    assert_eq!(xs.starts, ints(&tiles["x"][0]));
    assert_eq!(xs.overlaps, ints(&tiles["x"][2]));
    assert!(xs.overlaps.iter().any(|&o| o > t.min_overlap_width));
    assert!(
        m["cases"]["untiled_3chunks"]["latents_shape"][2]
            .as_u64()
            .unwrap()
            >= 17
    );
    // Some pixels reach the clamp, most do not.
    for case in CASES {
        let frac = m["cases"][case]["clamped_fraction"].as_f64().unwrap();
        assert!(frac < 0.2, "{case}: {frac}");
    }
    assert_eq!(m["versions"]["diffusers"], "0.42.1");
}

#[test]
fn released_tile_geometry_matches_the_reference() {
    let m = manifest();
    let table = m["split_tiles_256_64_ratio16"].as_object().unwrap();
    assert!(table.len() >= 10);
    for (length, split) in table {
        let n: usize = length.parse().unwrap();
        let ints = |v: &serde_json::Value| -> Vec<usize> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect()
        };
        let t = split_tiles(n, 256, 64, 16).unwrap();
        assert_eq!(t.starts, ints(&split[0]), "{n}");
        assert!(ints(&split[1]).iter().all(|&s| s == t.size), "{n}");
        assert_eq!(t.overlaps, ints(&split[2]), "{n}");
    }
}

#[test]
fn pixel_constants_are_the_references_f32_values() {
    let m = manifest();
    for (ours, key) in [
        (PIXEL_MEAN, "pixel_mean_f32_bits"),
        (PIXEL_STD, "pixel_std_f32_bits"),
    ] {
        let bits: Vec<u32> = m[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ours.map(f32::to_bits).to_vec(), bits, "{key}");
    }
}

#[test]
fn registers_and_layer_scales_are_read() {
    // The fixture is not degenerate: changing the register tokens or one layer scale changes the decode.
    let z = tensor("inputs.safetensors", "min_frames.latents");
    let expected = tensor("expected.safetensors", "min_frames.sample");
    for target in [
        "decoder.register_tokens",
        "decoder.transformer_blocks.1.scale2",
    ] {
        let s = scratch(&format!("read_{}", target.len()));
        rewrite(&s.weights(), |t| {
            for (n, _, data) in t.iter_mut() {
                if n == target {
                    data.iter_mut().for_each(|v| *v *= 0.5);
                }
            }
        });
        let mut vae = load_scratch(&s).unwrap();
        vae.set_tiling(tiling("min_frames")).unwrap();
        let lat = denormalize_latents(vae.config(), &z).unwrap();
        let err = relative_l2(vae.decode_sample(&lat).unwrap().data(), expected.data()).unwrap();
        assert!(err > 100.0 * TOLERANCE, "{target}: {err}");
    }
}

// ---- hostile configs, checkpoints and inputs ---------------------------------------------------------------

/// A scratch copy of the fixture's model folder.
fn scratch(tag: &str) -> ScratchModel {
    ScratchModel::copy_of(&fixtures().join("model"), &format!("h3_video_vae_{tag}"))
}

fn load_scratch(s: &ScratchModel) -> Result<HostVideoVae, VideoVaeError> {
    HostVideoVae::load(&s.open().map_err(VideoVaeError::Weights)?)
}

#[test]
fn hostile_configs_are_refused_with_the_file_and_key() {
    let s = scratch("config");
    let base = s.config();
    for (key, value) in [
        ("decoder_num_layers", serde_json::json!(1_000_000)),
        ("decoder_attention_head_dim", serde_json::json!(0)),
        ("latent_channels", serde_json::json!(-4)),
        ("decoder_rope_dim_ratio", serde_json::json!(0.3)),
        ("token_drop", serde_json::json!(9)),
        ("spatial_downsample_factors", serde_json::json!([2, 0])),
        ("latents_mean", serde_json::json!([0.0])),
        ("latents_std", serde_json::json!("one")),
        ("out_channels", serde_json::json!(1)),
        (
            "_class_name",
            serde_json::json!("AutoencoderKLMiniMaxH3Audio"),
        ),
    ] {
        let mut c = base.clone();
        c[key] = value;
        s.set_config(&c);
        let err = load_scratch(&s).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains(key),
            "{key}: {err}"
        );
    }
    // A config that disagrees with the weights: the tensor is named.
    let mut c = base.clone();
    c["decoder_ffn_mult"] = serde_json::json!(2);
    s.set_config(&c);
    let err = load_scratch(&s).unwrap_err().to_string();
    assert!(
        err.contains("decoder.transformer_blocks.0.ff.net.0.proj.weight") && err.contains("shape"),
        "{err}"
    );
    let mut c = base.clone();
    c["decoder_num_layers"] = serde_json::json!(3);
    s.set_config(&c);
    let err = load_scratch(&s).unwrap_err().to_string();
    assert!(err.contains("decoder.transformer_blocks.2."), "{err}");
    std::fs::write(s.0.join("config.json"), "{not json").unwrap();
    assert!(load_scratch(&s)
        .unwrap_err()
        .to_string()
        .contains("config.json"));
}

#[test]
fn malformed_checkpoints_name_the_tensor() {
    assert_bad_tensors_named(
        scratch,
        load_scratch,
        "decoder.transformer_blocks.1.attn.to_k.bias",
        ("decoder.proj_out.weight", 0),
    );

    // The encoder side is not read, whatever it holds.
    let s = scratch("encoder");
    rewrite(&s.weights(), |t| {
        t.retain(|(n, _, _)| !n.starts_with("encoder.conv_in"));
        t.push(("encoder.anything".into(), vec![3], vec![1.0; 3]))
    });
    assert!(load_scratch(&s).is_ok());

    // A non-finite weight is refused, naming the tensor.
    let s = scratch("nan");
    rewrite(&s.weights(), |t| {
        for (n, _, data) in t.iter_mut() {
            if n == "decoder.transformer_blocks.0.scale1" {
                data[3] = f32::NAN;
            }
        }
    });
    let err = load_scratch(&s).unwrap_err().to_string();
    assert!(err.contains("decoder.transformer_blocks.0.scale1"), "{err}");
}

#[test]
fn bad_inputs_never_panic() {
    let mut vae = load();
    let c = vae.config().latent_channels;
    for shape in [
        vec![1, c, 9, 3],
        vec![2, c, 9, 3, 6],
        vec![1, c + 1, 9, 3, 6],
        vec![1, c, 2, 3, 6],
        vec![1, c, 0, 3, 6],
        vec![1, c, 9, 0, 6],
        vec![1, c, 9, 3, 100_000],
    ] {
        let n: usize = shape.iter().product();
        let z = TensorF32::new(shape.clone(), vec![0.0; n]).unwrap();
        let err = vae.decode_sample(&z).unwrap_err().to_string();
        assert!(err.contains("input"), "{shape:?}: {err}");
        assert!(VideoVaeBackend::decode(&mut vae, &z).is_err());
    }
    // Tilings the spatial ratio cannot cut are refused; the decoder keeps its tiling.
    let before = vae.tiling();
    let err = vae
        .set_tiling(TilingOptions {
            tile_height: 10,
            ..TilingOptions::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiples of the spatial ratio"), "{err}");
    assert_eq!(vae.tiling(), before);
    // The shortest decode: three latent frames, one latent pixel, no tiling needed.
    let z = TensorF32::new(vec![1, c, 3, 1, 1], vec![0.1; 3 * c]).unwrap();
    let out = VideoVaeBackend::decode(&mut vae, &z).unwrap();
    let r = vae.config().spatial_ratio();
    assert_eq!((out.frames, out.height, out.width), (9, r, r));
    assert!(out.pixels.iter().all(|v| v.is_finite()));
}
