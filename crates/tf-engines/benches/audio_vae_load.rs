//! Loading MiniMax H3's audio VAE at its released size on the host: a seeded random `audio_vae/` folder in f32,
//! read and weight-normalized (`HostAudioVae::load`) and laid out for the kernels (`AudioVaeLayout::from_host`):
//! everything a GPU load does before the copy, which reads the layout's values in place.
// A failed check in a benchmark is meant to stop it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tf_engines::minimax_h3::vae_audio::{AudioVaeConfig, HostAudioVae};
use tf_engines::minimax_h3::vae_audio_gpu::AudioVaeLayout;
use tf_engines::nn::sampling::seeded::SplitMix64;
use tf_engines::nn::tensor::TensorF32;
use tf_engines::nn::weights::{write_f32_safetensors, ModelDir};

fn write_folder(dir: &Path) -> usize {
    let config = AudioVaeConfig::default();
    let c = config.latent_channels;
    let json = serde_json::json!({
        "_class_name": "AutoencoderKLMiniMaxH3Audio",
        "latents_mean": vec![0.1f64; c],
        "latents_std": vec![0.9f64; c],
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let mut rng = SplitMix64::new(11);
    let tensors: Vec<(String, TensorF32)> = config
        .tensor_specs()
        .into_iter()
        .map(|spec| {
            let n: usize = spec.shape.iter().product();
            let data = rng.uniform_vec(n, -0.14, 0.16);
            (spec.name, TensorF32::new(spec.shape, data).unwrap())
        })
        .collect();
    let elements = tensors.iter().map(|(_, t)| t.data().len()).sum();
    write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
    elements
}

fn audio_vae_load(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("tf-audio-vae-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let elements = write_folder(&dir);
    let mut group = c.benchmark_group("audio_vae_load");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(elements as u64 * 4));
    group.bench_function("host_load", |b| {
        b.iter(|| {
            let model = ModelDir::open(black_box(&dir)).unwrap();
            HostAudioVae::load(&model).unwrap()
        })
    });
    let model = ModelDir::open(&dir).unwrap();
    let host = HostAudioVae::load(&model).unwrap();
    group.bench_function("layout", |b| {
        b.iter(|| AudioVaeLayout::from_host(black_box(&host)).unwrap())
    });
    group.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, audio_vae_load);
criterion_main!(benches);
