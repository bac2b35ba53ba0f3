//! The whole Qwen-Image 2.1 pipeline on the host reference against the diffusers pipeline in fp32, on the tiny
//! complete model folder of tests/fixtures/qwen_pipeline (built by tests/python/qwen_pipeline_tiny.py): template
//! ids, initial noise, prompt features, the latents after every step, the decoded image and its uint8 pixels.
//! Then the sequential residency against the resident one (a device budget that forces it, and one below the
//! largest component), request validation, and `tf image` run as a process.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tf_engines::nn::media::png::{read_png, ColorType};
use tf_engines::nn::memory_plan::Residency;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen_image::pipeline::{
    Backend, Limits, LoadOptions, Pipeline, PipelineError, Progress, Request,
};
use tf_engines::qwen_image::vae::HostVaeDecoder;
use tf_tokenizer::templates::QwenImage21;
use tf_tokenizer::Tokenizer;

/// Relative L2 bound for the prompt features and the latents of every step (f32 host reference vs torch fp32 on the
/// CPU; measured up to 1.5e-5).
const TOLERANCE: f64 = 1e-4;
/// Bound for the decoded image of the whole run: the random tiny VAE amplifies the latents' last-step difference
/// about 20x (measured 2.4e-4 with true CFG 4). The VAE alone is held to [`VAE_TOLERANCE`] on the reference's own
/// final latents.
const DECODED_TOLERANCE: f64 = 1e-3;
const VAE_TOLERANCE: f64 = 1e-5;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_pipeline")
}

fn model_dir() -> PathBuf {
    fixture_dir().join("model")
}

fn manifest() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn expected() -> SafetensorsFile {
    SafetensorsFile::open(&fixture_dir().join("expected.safetensors")).unwrap()
}

fn host_pipeline() -> Pipeline {
    Pipeline::load(&model_dir(), &LoadOptions::new(Backend::Host)).unwrap()
}

fn request_of(case: &Value) -> Request {
    let number = |k: &str| case[k].as_u64().unwrap() as usize;
    Request {
        negative_prompt: case["negative_prompt"].as_str().map(str::to_string),
        true_cfg_scale: case["true_cfg_scale"].as_f64().unwrap() as f32,
        width: number("width"),
        height: number("height"),
        steps: Some(number("steps")),
        seed: case["seed"].as_u64().unwrap(),
        ..Request::new(case["prompt"].as_str().unwrap())
    }
}

fn compare(what: &str, ours: &[f32], reference: &[f32]) -> f64 {
    compare_within(what, ours, reference, TOLERANCE)
}

fn compare_within(what: &str, ours: &[f32], reference: &[f32], tolerance: f64) -> f64 {
    assert_eq!(ours.len(), reference.len(), "{what}: element counts differ");
    let rel = relative_l2(ours, reference).unwrap_or(f64::INFINITY);
    let max_abs = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!(
        "{what}: rel L2 {rel:.3e}, max |diff| {max_abs:.3e} over {} values",
        ours.len()
    );
    assert!(
        rel <= tolerance,
        "{what}: rel L2 {rel:.3e} above {tolerance:.0e}"
    );
    rel
}

#[test]
fn template_ids_equal_the_processor() {
    let manifest = manifest();
    let expected = expected();
    let tokenizer = Tokenizer::from_file(model_dir().join("processor/tokenizer.json")).unwrap();
    let drop = manifest["drop_idx"].as_u64().unwrap() as usize;
    for case in manifest["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let texts = [
            ("prompt", case["prompt"].as_str()),
            ("negative", case["negative_prompt"].as_str()),
        ];
        for (tag, text) in texts {
            let Some(text) = text else { continue };
            let reference: Vec<u32> = expected
                .to_i64(&format!("{name}.{tag}_ids"))
                .unwrap()
                .data()
                .iter()
                .map(|&v| u32::try_from(v).unwrap())
                .collect();
            let ours = QwenImage21::encode(&tokenizer, text).unwrap();
            println!("{name}.{tag}: {} ids, drop {}", ours.ids.len(), ours.drop);
            assert_eq!(
                ours.ids, reference,
                "{name}.{tag}: ids differ from the processor's"
            );
            assert_eq!(
                ours.drop, drop,
                "{name}.{tag}: dropped rows differ from the pipeline's drop_idx"
            );
        }
    }
}

#[test]
fn host_pipeline_equals_diffusers_fp32() {
    let manifest = manifest();
    let expected = expected();
    let mut pipeline = host_pipeline();
    pipeline.keep_step_latents(true);
    let report = pipeline.load_report();
    println!(
        "loaded on {} in {:.3} s, {} resident bytes",
        report.backend.name(),
        report.seconds,
        report.resident_bytes
    );
    assert!(report.resident_bytes > 0);
    let vae = HostVaeDecoder::load(&ModelDir::open(&model_dir().join("vae")).unwrap()).unwrap();
    for case in manifest["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let request = request_of(case);

        // Our seeded generator against the script's independent implementation: bit-equal.
        let plan = pipeline.plan(&request).unwrap();
        let noise = expected.to_f32(&format!("{name}.noise")).unwrap();
        let ours_noise = tf_engines::nn::sampling::noise::packed_latents(
            request.seed,
            1,
            pipeline.latent_channels(),
            plan.latent_rows,
            plan.latent_cols,
            tf_engines::nn::sampling::flow_match::LatentDtype::F32,
        )
        .unwrap();
        assert_eq!(
            ours_noise.data(),
            noise.data(),
            "{name}: initial noise differs"
        );

        let mut events = Vec::new();
        let result = pipeline
            .generate(&request, &mut |p| events.push(p))
            .unwrap();
        let steps = case["steps"].as_u64().unwrap() as usize;
        assert_eq!(result.step_latents.len(), steps, "{name}: steps run");
        let step_events = events
            .iter()
            .filter(|p| matches!(p, Progress::Step { .. }))
            .count();
        assert_eq!(step_events, steps, "{name}: one progress event per step");
        assert!(matches!(events.first(), Some(Progress::Encoded { .. })));
        assert!(matches!(events.last(), Some(Progress::Decoded { .. })));

        let embeds = expected.to_f32(&format!("{name}.prompt_embeds")).unwrap();
        assert_eq!(
            result.prompt_embeds.shape(),
            embeds.shape(),
            "{name}: prompt embeds shape"
        );
        compare(
            &format!("{name}.prompt_embeds"),
            result.prompt_embeds.data(),
            embeds.data(),
        );
        for (i, latents) in result.step_latents.iter().enumerate() {
            let reference = expected.to_f32(&format!("{name}.latents.{i}")).unwrap();
            compare(
                &format!("{name}.latents.{i}"),
                latents.data(),
                reference.data(),
            );
        }
        let decoded = expected.to_f32(&format!("{name}.decoded")).unwrap();
        let ours_decoded = result
            .decoded
            .as_ref()
            .expect("the decoded image is kept with the step latents");
        assert_eq!(
            &ours_decoded.shape()[1..],
            decoded.shape(),
            "{name}: decoded shape"
        );
        compare_within(
            &format!("{name}.decoded"),
            ours_decoded.data(),
            decoded.data(),
            DECODED_TOLERANCE,
        );
        // The decoder alone, from the reference's own final latents.
        let last = expected
            .to_f32(&format!("{name}.latents.{}", steps - 1))
            .unwrap();
        let packed = TensorF32::new([&[1], last.shape()].concat(), last.data().to_vec()).unwrap();
        let alone = vae
            .decode_packed(&packed, plan.latent_rows, plan.latent_cols)
            .unwrap();
        compare_within(
            &format!("{name}.decoded (VAE alone)"),
            alone.data(),
            decoded.data(),
            VAE_TOLERANCE,
        );

        let pixels = expected.to_u8(&format!("{name}.image_u8")).unwrap();
        let [h, w, c] = [pixels.shape()[0], pixels.shape()[1], pixels.shape()[2]];
        assert_eq!(
            (
                result.image.height,
                result.image.width,
                result.image.channels
            ),
            (h, w, c)
        );
        let off_by: Vec<u8> = result
            .image
            .pixels
            .iter()
            .zip(pixels.data())
            .map(|(a, b)| a.abs_diff(*b))
            .collect();
        let max = off_by.iter().copied().max().unwrap_or(0);
        let differing = off_by.iter().filter(|&&d| d > 0).count();
        println!(
            "{name}.image_u8: {differing} of {} bytes differ, by at most {max}",
            off_by.len()
        );
        // A decoded difference of 8e-3 is one level (of 127.5 per unit); allow two, and only on a few bytes.
        assert!(max <= 2, "{name}: a pixel differs by {max} levels");
        assert!(
            differing * 100 <= off_by.len(),
            "{name}: {differing} bytes differ"
        );
        let t = &result.timings;
        println!(
            "{name}: encode {:.3} s, steps {:?}, decode {:.3} s, total {:.3} s",
            t.encode, t.steps, t.decode, t.total
        );
    }
}

/// The bits of `values`, so that equality is exact (and NaN-safe).
fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn assert_same_tensors(what: &str, ours: &[TensorF32], reference: &[TensorF32]) {
    assert_eq!(ours.len(), reference.len(), "{what}: counts differ");
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        assert_eq!(a.shape(), b.shape(), "{what}[{i}]: shapes differ");
        assert!(
            bits(a.data()) == bits(b.data()),
            "{what}[{i}]: values differ"
        );
    }
}

/// The host pipeline loaded with `budget` as its device budget.
fn budget_pipeline(budget: u64) -> Result<Pipeline, PipelineError> {
    let options = LoadOptions {
        device_budget: Some(budget),
        ..LoadOptions::new(Backend::Host)
    };
    Pipeline::load(&model_dir(), &options)
}

#[test]
fn sequential_residency_gives_the_resident_bytes() {
    let manifest = manifest();
    let mut resident = host_pipeline();
    resident.keep_step_latents(true);
    assert_eq!(resident.load_report().residency, Residency::AllResident);
    let figures = resident.memory_plan().clone();
    let largest = figures.largest();
    println!("resident: {figures}");
    assert!(largest < figures.total(), "{figures}");

    // A cap at the total still keeps everything resident.
    let at_total = budget_pipeline(figures.total()).unwrap();
    assert_eq!(at_total.load_report().residency, Residency::AllResident);
    drop(at_total);

    // The largest component alone: loaded, run and freed in turn.
    let mut sequential = budget_pipeline(largest).unwrap();
    sequential.keep_step_latents(true);
    let report = sequential.load_report();
    let plan = sequential.memory_plan();
    println!("sequential: {plan}; loaded in {:.3} s", report.seconds);
    assert_eq!(report.residency, Residency::Sequential);
    assert_eq!(plan.residency(), Residency::Sequential);
    assert_eq!((plan.budget(), plan.peak()), (largest, largest));
    assert!(plan.to_string().contains("in turn"), "{plan}");
    assert_eq!(
        report.resident_bytes, 0,
        "nothing stays loaded between requests"
    );
    assert_eq!(sequential.latent_channels(), resident.latent_channels());

    // Nothing stays loaded to warm: the warm-up does nothing and says so.
    let warm = sequential.warm_up(64, 64, Duration::ZERO).unwrap();
    println!("warm-up: {:?}", warm.skipped);
    assert!(warm.skipped.is_some());
    assert!(warm.timings.steps.is_empty() && warm.gemms.is_none());

    for case in manifest["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let request = request_of(case);
        let mut resident_events = Vec::new();
        let ours = resident
            .generate(&request, &mut |p| resident_events.push(p))
            .unwrap();
        // Twice: every request loads the components again.
        for round in 0..2 {
            let what = format!("{name} (sequential, request {round})");
            let mut events = Vec::new();
            let theirs = sequential
                .generate(&request, &mut |p| events.push(p))
                .unwrap();
            assert_eq!(theirs.image, ours.image, "{what}: image bytes differ");
            assert_same_tensors(
                &format!("{what}: step latents"),
                &theirs.step_latents,
                &ours.step_latents,
            );
            assert_same_tensors(
                &format!("{what}: step velocities"),
                &theirs.step_velocities,
                &ours.step_velocities,
            );
            assert_same_tensors(
                &format!("{what}: prompt embeds and decoded image"),
                &[
                    theirs.prompt_embeds.clone(),
                    theirs.decoded.clone().expect("kept"),
                ],
                &[
                    ours.prompt_embeds.clone(),
                    ours.decoded.clone().expect("kept"),
                ],
            );
            assert_eq!(theirs.step_latents.len(), ours.plan_steps);
            assert_eq!(
                events.len(),
                resident_events.len(),
                "{what}: progress events"
            );
            let (t, loads) = (&theirs.timings, theirs.timings.loads);
            println!(
                "{what}: loads te {:.4} s, DiT {:.4} s, VAE {:.4} s; encode {:.4} s, steps {:?}, decode {:.4} s, \
                 total {:.4} s",
                loads.text_encoder, loads.dit, loads.vae, t.encode, t.steps, t.decode, t.total
            );
            assert!(loads.text_encoder > 0.0 && loads.dit > 0.0 && loads.vae > 0.0);
            let work = t.encode + t.steps.iter().sum::<f64>() + t.decode;
            assert!(
                t.total >= loads.total() + work,
                "{what}: total leaves out a load"
            );
        }
        assert_eq!(
            ours.timings.loads.total(),
            0.0,
            "resident requests load nothing"
        );
    }
}

#[test]
fn a_budget_below_the_largest_component_is_refused_with_the_numbers() {
    let figures = host_pipeline().memory_plan().clone();
    let largest = figures
        .components()
        .iter()
        .max_by_key(|c| c.bytes)
        .unwrap()
        .clone();
    let budget = largest.bytes - 1;
    let err = budget_pipeline(budget).unwrap_err();
    println!("refused: {err}");
    match &err {
        PipelineError::CappedBudget { source, cap } => {
            assert_eq!(*cap, budget);
            assert_eq!(
                (source.name.as_str(), source.bytes, source.budget),
                (largest.name.as_str(), largest.bytes, budget)
            );
        }
        other => panic!("not a capped-budget refusal: {other:?}"),
    }
    let message = err.to_string();
    for needle in [
        largest.name.clone(),
        format!("{} B", largest.bytes),
        format!("{budget} B"),
        "device budget".to_string(),
    ] {
        assert!(
            message.contains(&needle),
            "{needle:?} missing from: {message}"
        );
    }
    assert!(!err.is_invalid_request());
}

fn assert_invalid(pipeline: &mut Pipeline, request: &Request, expect_in_message: &str) {
    let err = pipeline
        .generate(request, &mut |_| panic!("no progress before validation"))
        .unwrap_err();
    println!("refused: {err}");
    assert!(err.is_invalid_request(), "not an invalid request: {err}");
    assert!(err.to_string().contains(expect_in_message), "{err}");
}

#[test]
fn bad_requests_are_refused_before_any_work() {
    let limits = Limits {
        max_side: 512,
        max_pixels: 256 * 512,
        max_steps: 10,
        max_prompt_tokens: 64,
    };
    let options = LoadOptions {
        limits,
        ..LoadOptions::new(Backend::Host)
    };
    let mut pipeline = Pipeline::load(&model_dir(), &options).unwrap();
    let ok = Request {
        width: 64,
        height: 64,
        steps: Some(1),
        ..Request::new("a red fox")
    };
    assert_invalid(
        &mut pipeline,
        &Request {
            width: 16,
            ..ok.clone()
        },
        "32",
    );
    assert_invalid(
        &mut pipeline,
        &Request {
            height: 31,
            ..ok.clone()
        },
        "32",
    );
    assert_invalid(
        &mut pipeline,
        &Request {
            width: 1024,
            ..ok.clone()
        },
        "largest side",
    );
    assert_invalid(
        &mut pipeline,
        &Request {
            width: 512,
            height: 512,
            ..ok.clone()
        },
        "pixels",
    );
    assert_invalid(
        &mut pipeline,
        &Request {
            steps: Some(0),
            ..ok.clone()
        },
        "at least 1",
    );
    assert_invalid(
        &mut pipeline,
        &Request {
            steps: Some(11),
            ..ok.clone()
        },
        "limit",
    );
    assert_invalid(
        &mut pipeline,
        &Request {
            true_cfg_scale: f32::NAN,
            ..ok.clone()
        },
        "finite",
    );
    let long = "many words in a row ".repeat(20);
    assert_invalid(
        &mut pipeline,
        &Request {
            prompt: long.clone(),
            ..ok.clone()
        },
        "tokens",
    );
    let negative_too_long = Request {
        negative_prompt: Some(long.clone()),
        true_cfg_scale: 3.0,
        ..ok.clone()
    };
    assert_invalid(&mut pipeline, &negative_too_long, "negative prompt");
    let wrong_latents = Request {
        initial_latents: Some(TensorF32::new(vec![1, 4, 16], vec![0.0; 64]).unwrap()),
        ..ok.clone()
    };
    assert_invalid(&mut pipeline, &wrong_latents, "injected latents");
    let nan_latents = Request {
        initial_latents: Some(TensorF32::new(vec![1, 16, 16], vec![f32::NAN; 256]).unwrap()),
        ..ok.clone()
    };
    assert_invalid(&mut pipeline, &nan_latents, "non-finite");

    // Floored, not refused: 70x100 runs as 64x96; an empty prompt runs as " "; a negative prompt without a scale
    // above 1 is ignored, as in the reference.
    let floored = Request {
        width: 70,
        height: 100,
        prompt: String::new(),
        negative_prompt: Some("ignored".into()),
        ..ok.clone()
    };
    let plan = pipeline.plan(&floored).unwrap();
    assert_eq!((plan.width, plan.height), (64, 96));
    assert!(plan.negative.is_none());
    let result = pipeline.generate(&floored, &mut |_| {}).unwrap();
    assert_eq!((result.image.width, result.image.height), (64, 96));
    assert_eq!(result.image.pixels.len(), 64 * 96 * 4);
}

#[test]
fn incomplete_folders_are_not_request_errors() {
    let err = Pipeline::load(
        Path::new("/nonexistent/model"),
        &LoadOptions::new(Backend::Host),
    )
    .unwrap_err();
    assert!(matches!(err, PipelineError::Folder { .. }), "{err}");
    assert!(!err.is_invalid_request());
    // The transformer folder alone is not a pipeline folder.
    let err = Pipeline::load(
        &model_dir().join("transformer"),
        &LoadOptions::new(Backend::Host),
    )
    .unwrap_err();
    assert!(err.to_string().contains("model_index.json"), "{err}");
}

#[test]
fn tf_image_writes_a_png_of_the_right_size() {
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tf_image_test");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join("fox.png");
    let _ = std::fs::remove_file(&out);
    let output = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(["image", "--model"])
        .arg(model_dir())
        .args([
            "--prompt",
            "a red fox",
            "--size",
            "100x70",
            "--steps",
            "2",
            "--seed",
            "5",
        ])
        .args(["--backend", "host", "--json", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("stderr:\n{stderr}");
    assert!(output.status.success(), "tf image failed: {stderr}");
    assert!(stderr.contains("step 2/2"), "no progress lines: {stderr}");
    // The host reference computes every component in f32, the DiT included, and plans against no device budget.
    assert!(
        stderr.contains(
            "precision: DiT f32 (host reference), text encoder f32 (host reference), VAE f32 (host reference)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("no device budget: unbounded") && !stderr.contains("17592186044416"),
        "{stderr}"
    );
    let summary: Value = serde_json::from_slice(&output.stdout).unwrap();
    println!("summary: {summary}");
    assert_eq!(summary["load"]["dit_precision"], "f32");
    assert_eq!(
        summary["load"]["precision"],
        serde_json::json!({"DiT": "f32", "text encoder": "f32", "VAE": "f32"})
    );
    assert_eq!(summary["width"], 96);
    assert_eq!(summary["height"], 64);
    assert_eq!(summary["timings"]["steps_s"].as_array().unwrap().len(), 2);
    let png = read_png(&out).unwrap();
    assert_eq!(
        (png.width, png.height, png.color),
        (96, 64, ColorType::Rgba)
    );

    // A bad request fails with a message and a non-zero status, and writes nothing.
    let bad = out_dir.join("bad.png");
    let output = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(["image", "--model"])
        .arg(model_dir())
        .args([
            "--prompt",
            "x",
            "--size",
            "16x16",
            "--backend",
            "host",
            "-o",
        ])
        .arg(&bad)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("invalid request"), "{stderr}");
    assert!(!bad.exists());
}
