//! The MiniMax H3 audio VAE host decode against the diffusers 0.42.1 fp32 fixture (tests/fixtures/minimax_h3_audio_vae,
//! made by tests/python/h3_audio_vae_fixtures.py): the stereo decode from normalized latents, what the fixture
//! covers, and hostile configs, malformed checkpoints and bad inputs, which must give errors and never panic.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::PathBuf;

#[path = "common/scratch_model.rs"]
mod scratch_model;
use scratch_model::{assert_bad_tensors_named, rewrite, ScratchModel};
use tf_engines::minimax_h3::vae_audio::{AudioVaeError, HostAudioVae, MAX_FRAMES};
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};

const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    fixture_dir::find("minimax_h3_audio_vae")
}

fn manifest() -> serde_json::Value {
    fixture_dir::manifest(&fixtures())
}

fn load() -> HostAudioVae {
    HostAudioVae::load(&ModelDir::open(&fixtures().join("model")).unwrap()).unwrap()
}

fn tensor(file: &str, name: &str) -> TensorF32 {
    SafetensorsFile::open(&fixtures().join(file))
        .unwrap()
        .to_f32(name)
        .unwrap()
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

/// The pipeline's de-normalization, done here by hand from the config.
fn denormalize(vae: &HostAudioVae, z: &TensorF32) -> TensorF32 {
    let c = vae.config();
    let (mean, std) = (
        c.latents_mean.clone().unwrap(),
        c.latents_std.clone().unwrap(),
    );
    let frames = z.shape()[2];
    let mut data = z.data().to_vec();
    for (i, row) in data.chunks_exact_mut(frames).enumerate() {
        let ch = i % c.latent_channels;
        row.iter_mut()
            .for_each(|v| *v = *v * std[ch] as f32 + mean[ch] as f32);
    }
    TensorF32::new(z.shape().to_vec(), data).unwrap()
}

#[test]
fn stereo_decode_matches_diffusers() {
    let vae = load();
    let z = tensor("inputs.safetensors", "latents");
    assert_eq!(z.shape()[0], 2, "the fixture is a stereo pair");
    let sample = vae.decode(&z).unwrap();
    let expected = tensor("expected.safetensors", "sample");
    assert_close("sample", &sample, &expected);
    assert_eq!(vae.output_len(z.shape()[2]).unwrap(), expected.shape()[2]);
    // The first step alone, and the model's decode on de-normalized latents.
    let lat = denormalize(&vae, &z);
    assert_close(
        "dec_in",
        &vae.dec_in_proj(&lat).unwrap(),
        &tensor("expected.safetensors", "dec_in"),
    );
    assert_eq!(vae.decode_denormalized(&lat).unwrap(), sample);
    // The two channels are independent items of the batch.
    let frames = z.shape()[2];
    let per = z.data().len() / 2;
    let right = TensorF32::new(vec![1, z.shape()[1], frames], z.data()[per..].to_vec()).unwrap();
    let one = vae.decode(&right).unwrap();
    let n = expected.shape()[2];
    assert_eq!(one.data(), &sample.data()[n..]);
}

#[test]
fn the_fixture_covers_every_path() {
    let m = manifest();
    let c = &m["config"];
    assert!(c["decoder_rates"].as_array().unwrap().len() >= 3);
    let dilations = c["resblock_dilation_sizes"].as_array().unwrap();
    assert!(dilations.len() >= 2);
    assert!(dilations.iter().all(|d| d.as_array().unwrap().len() >= 2));
    // Some kernel - rate is odd: the output is not frames x hop, and the host follows the reference's lengths.
    let odd = c["decoder_rates"]
        .as_array()
        .unwrap()
        .iter()
        .zip(c["decoder_kernel_sizes"].as_array().unwrap())
        .any(|(r, k)| (k.as_u64().unwrap() - r.as_u64().unwrap()) % 2 == 1);
    assert!(odd);
    // The clamp is exercised, but most samples are not clamped.
    let clamped = m["clamped_fraction"].as_f64().unwrap();
    assert!(clamped > 0.0 && clamped < 0.2, "{clamped}");
    assert_eq!(m["versions"]["diffusers"], "0.42.1");
}

#[test]
fn the_filters_are_read_from_the_state_dict() {
    // Halving one activation's up-sampling filter changes the decode.
    let s = scratch("filters");
    rewrite(&s.weights(), |t| {
        for (n, _, data) in t.iter_mut() {
            if n == "decoder.activation_post.upsample.filter" {
                data.iter_mut().for_each(|v| *v *= 0.5);
            }
        }
    });
    let vae = load_scratch(&s).unwrap();
    let z = tensor("inputs.safetensors", "latents");
    let err = relative_l2(
        vae.decode(&z).unwrap().data(),
        tensor("expected.safetensors", "sample").data(),
    )
    .unwrap();
    assert!(err > 100.0 * TOLERANCE, "{err}");
}

// ---- hostile configs, checkpoints and inputs ---------------------------------------------------------------

/// A scratch copy of the fixture's model folder.
fn scratch(tag: &str) -> ScratchModel {
    ScratchModel::copy_of(&fixtures().join("model"), &format!("h3_audio_vae_{tag}"))
}

fn load_scratch(s: &ScratchModel) -> Result<HostAudioVae, AudioVaeError> {
    HostAudioVae::load(&s.open().map_err(AudioVaeError::Weights)?)
}

#[test]
fn hostile_configs_are_refused_with_the_file_and_key() {
    let s = scratch("config");
    let base = s.config();
    for (key, value) in [
        ("decoder_dim", serde_json::json!(1_000_000)),
        ("latent_dim", serde_json::json!(0)),
        ("latent_channels", serde_json::json!(-4)),
        ("decoder_rates", serde_json::json!([2, 3, 4])),
        ("decoder_kernel_sizes", serde_json::json!([4, 6])),
        ("resblock_kernel_sizes", serde_json::json!([3, 4])),
        ("resblock_dilation_sizes", serde_json::json!([[1, 3], [0]])),
        ("latents_mean", serde_json::json!([0.0])),
        ("latents_std", serde_json::json!("one")),
        ("_class_name", serde_json::json!("AutoencoderKLMiniMaxH3")),
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
    // The pipeline de-normalizes with the latent statistics: a folder without them is refused.
    let mut c = base.clone();
    c.as_object_mut().unwrap().remove("latents_std");
    s.set_config(&c);
    let err = load_scratch(&s).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("latents_std"),
        "{err}"
    );
    // A config that disagrees with the weights: the tensor is named.
    let mut c = base.clone();
    c["decoder_dim"] = serde_json::json!(32);
    s.set_config(&c);
    let err = load_scratch(&s).unwrap_err().to_string();
    assert!(
        err.contains("decoder.conv_pre.weight_g") && err.contains("shape"),
        "{err}"
    );
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
        "decoder.resblocks.3.activations.4.downsample.lowpass.filter",
        ("decoder.ups.1.0.weight_v", 2),
    );

    // The encoder side is not read, whatever it holds.
    let s = scratch("encoder");
    rewrite(&s.weights(), |t| {
        t.retain(|(n, _, _)| !n.starts_with("pre_block."));
        t.push(("encoder.anything".into(), vec![3], vec![1.0; 3]))
    });
    assert!(load_scratch(&s).is_ok());

    // A zero weight-norm direction would divide by zero: refused, naming the tensor.
    let s = scratch("zero_v");
    rewrite(&s.weights(), |t| {
        for (n, _, data) in t.iter_mut() {
            if n == "decoder.conv_post.weight_v" {
                data.iter_mut().for_each(|v| *v = 0.0);
            }
        }
    });
    let err = load_scratch(&s).unwrap_err().to_string();
    assert!(err.contains("decoder.conv_post.weight_g"), "{err}");
}

#[test]
fn bad_inputs_never_panic() {
    let vae = load();
    let c = vae.config().latent_channels;
    for shape in [
        vec![2, c],
        vec![2, c + 1, 4],
        vec![0, c, 4],
        vec![2, c, 0],
        vec![17, c, 4],
        vec![2, c, MAX_FRAMES + 1],
        vec![1, 2, c, 4],
    ] {
        let n: usize = shape.iter().product();
        let z = TensorF32::new(shape.clone(), vec![0.0; n]).unwrap();
        let err = vae.decode(&z).unwrap_err().to_string();
        assert!(err.contains("input"), "{shape:?}: {err}");
    }
    // One frame is the shortest decode.
    let z = TensorF32::new(vec![2, c, 1], vec![0.1; 2 * c]).unwrap();
    let y = vae.decode(&z).unwrap();
    assert_eq!(y.shape(), &[2, 1, vae.output_len(1).unwrap()]);
    assert!(y.data().iter().all(|v| v.is_finite() && v.abs() <= 1.0));
}
