//! VAE decoder parity with tests/fixtures/qwen_vae (a tiny random AutoencoderKLQwenImage21 decoded by diffusers
//! exactly as the Qwen-Image 2.1 pipeline does: unpack, z * std + mean, decode, first frame).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use serde_json::Value;
use tf_engines::nn::tensor::relative_l2;
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen_image::vae::{to_u8_hwc, HostVaeDecoder};

const TOLERANCE: f64 = 1e-5;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_vae")
}

#[test]
fn decode_matches_the_pipeline() {
    let dir = fixture_dir();
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let (h, w) = (
        manifest["latent_height"].as_u64().unwrap() as usize,
        manifest["latent_width"].as_u64().unwrap() as usize,
    );
    let vae = HostVaeDecoder::load(&ModelDir::open(&dir.join("model")).unwrap()).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let packed = expected.to_f32("packed_latents").unwrap();
    let reference = expected.to_f32("image").unwrap();
    let start = std::time::Instant::now();
    let image = vae.decode_packed(&packed, h, w).unwrap();
    assert_eq!(image.shape(), reference.shape());
    let rel = relative_l2(image.data(), reference.data()).unwrap();
    let clamped = reference.data().iter().filter(|v| v.abs() >= 1.0).count();
    println!(
        "VAE decode {:?} -> {:?} in {:.2?}: relative L2 {rel:.3e} ({clamped} of {} reference values clamped)",
        packed.shape(),
        image.shape(),
        start.elapsed(),
        reference.data().len()
    );
    assert!(rel <= TOLERANCE, "relative L2 {rel:e} > {TOLERANCE:e}");
    assert!(
        clamped * 10 < reference.data().len(),
        "fixture saturates too much to test anything"
    );
    let rgba = to_u8_hwc(&image, 1).unwrap();
    assert_eq!(rgba.len(), 4 * 16 * h * 16 * w);
}

#[test]
fn wrong_latent_shapes_are_errors() {
    let dir = fixture_dir();
    let vae = HostVaeDecoder::load(&ModelDir::open(&dir.join("model")).unwrap()).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let packed = expected.to_f32("packed_latents").unwrap();
    assert!(vae.decode_packed(&packed, 5, 5).is_err());
    assert!(vae.decode_packed(&packed, 4, 5).is_err());
}
