//! Qwen-Image 2.1 Turbo on the host reference against diffusers' `QwenImage21TurboModularPipeline` in fp32, on the
//! tiny Turbo folder of tests/fixtures/qwen_turbo_pipeline (built by tests/python/qwen_turbo_fixtures.py: the
//! components of tests/fixtures/qwen_pipeline, its own `model_index.json` with `sample_sigmas` and scheduler
//! config). Per case: the variant the folder is found to be, the sigma grid, template ids, initial noise, prompt
//! features, the velocity and latents of every step, the decoded image and its uint8 pixels. The bounds are those
//! of the base pipeline's parity test (tests/qwen_pipeline.rs): relative L2 1e-4 for features, velocities and
//! latents, 1e-3 for the decoded image of the whole run, 1e-5 for the VAE alone, pixels within 2 levels on at most
//! 1 % of the bytes. Then the guidance inputs Turbo ignores, its step rule, and `tf image` / `tf worker` naming the
//! variant.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/worker_session.rs"]
mod worker_session;

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};
use tf_engines::nn::media::png::{decode_png, read_png, ColorType};
use tf_engines::nn::sampling::flow_match::LatentDtype;
use tf_engines::nn::sampling::noise::packed_latents;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen_image::pipeline::{
    Backend, FolderLayout, LoadOptions, Pipeline, Progress, Request,
};
use tf_engines::qwen_image::vae::HostVaeDecoder;
use tf_engines::qwen_image::variant::{Ignored, Variant, TURBO_DEFAULT_STEPS};
use tf_tokenizer::templates::QwenImage21;
use tf_tokenizer::Tokenizer;
use worker_session::session;

/// Relative L2 bound for prompt features, velocities and latents (tests/qwen_pipeline.rs's `TOLERANCE`).
const TOLERANCE: f64 = 1e-4;
/// Bound for the decoded image of the whole run (tests/qwen_pipeline.rs's `DECODED_TOLERANCE`).
const DECODED_TOLERANCE: f64 = 1e-3;
/// Bound for the VAE alone on the reference's final latents (tests/qwen_pipeline.rs's `VAE_TOLERANCE`).
const VAE_TOLERANCE: f64 = 1e-5;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_turbo_pipeline")
}

fn turbo_dir() -> PathBuf {
    fixture_dir().join("model")
}

fn base_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_pipeline/model")
}

fn manifest() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn expected() -> SafetensorsFile {
    SafetensorsFile::open(&fixture_dir().join("expected.safetensors")).unwrap()
}

/// The folder a case ran on, and the variant it was loaded as: the Turbo folder as it says, or the base folder
/// with the Turbo blocks named explicitly.
fn load_case_pipeline(case: &Value) -> Pipeline {
    let options = match case["folder"].as_str().unwrap() {
        "turbo" => (turbo_dir(), LoadOptions::new(Backend::Host)),
        "base" => (
            base_dir(),
            LoadOptions {
                variant: Some(Variant::Turbo),
                ..LoadOptions::new(Backend::Host)
            },
        ),
        other => panic!("unknown folder {other}"),
    };
    let pipeline = Pipeline::load(&options.0, &options.1).unwrap();
    assert_eq!(
        case["pipeline_class"], "QwenImage21TurboModularPipeline",
        "the reference ran another pipeline"
    );
    assert_eq!(pipeline.variant(), Variant::Turbo);
    assert_eq!(pipeline.load_report().variant, Variant::Turbo);
    pipeline
}

/// The case's request as the reference got it: no step count (the Turbo default), the guidance inputs if any.
fn request_of(case: &Value) -> Request {
    let number = |k: &str| case[k].as_u64().unwrap() as usize;
    Request {
        negative_prompt: case["negative_prompt"].as_str().map(str::to_string),
        true_cfg_scale: case["guidance_scale"].as_f64().map_or(1.0, |g| g as f32),
        width: number("width"),
        height: number("height"),
        steps: None,
        seed: case["seed"].as_u64().unwrap(),
        ..Request::new(case["prompt"].as_str().unwrap())
    }
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

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn the_folder_is_turbo_as_diffusers_decides() {
    let manifest = manifest();
    let turbo = FolderLayout::read(&turbo_dir()).unwrap();
    assert_eq!(turbo.variant, Variant::Turbo);
    let sigmas: Vec<f64> = manifest["sample_sigmas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(turbo.sample_sigmas.as_deref(), Some(sigmas.as_slice()));
    // The base fixture (`sample_sigmas: null`) is the base checkpoint.
    let base = FolderLayout::read(&base_dir()).unwrap();
    assert_eq!((base.variant, base.sample_sigmas), (Variant::Base, None));
    // Naming the base variant runs the Turbo folder as the base pipeline would (its grid, guidance allowed).
    let options = LoadOptions {
        variant: Some(Variant::Base),
        ..LoadOptions::new(Backend::Host)
    };
    let as_base = Pipeline::load(&turbo_dir(), &options).unwrap();
    assert_eq!(as_base.variant(), Variant::Base);
    let guided = Request {
        width: 64,
        height: 64,
        negative_prompt: Some("blurry".into()),
        true_cfg_scale: 4.0,
        ..Request::new("a red fox")
    };
    let plan = as_base.plan(&guided).unwrap();
    assert!(plan.negative.is_some() && plan.ignored.is_empty());
    assert_eq!(plan.schedule.steps(), sigmas.len());
}

#[test]
fn host_turbo_pipeline_equals_diffusers_fp32() {
    let manifest = manifest();
    let expected = expected();
    let tokenizer = Tokenizer::from_file(turbo_dir().join("processor/tokenizer.json")).unwrap();
    let drop = manifest["drop_idx"].as_u64().unwrap() as usize;
    let vae = HostVaeDecoder::load(&ModelDir::open(&turbo_dir().join("vae")).unwrap()).unwrap();
    for case in manifest["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut pipeline = load_case_pipeline(case);
        pipeline.keep_step_latents(true);
        let request = request_of(case);
        let steps = case["steps"].as_u64().unwrap() as usize;
        assert_eq!(steps, TURBO_DEFAULT_STEPS, "{name}: the reference's steps");

        // What is ignored: exactly the inputs the reference warned about.
        let plan = pipeline.plan(&request).unwrap();
        let warned = !case["reference_warnings"].as_array().unwrap().is_empty();
        let want: Vec<Ignored> = if warned {
            vec![Ignored::NegativePrompt, Ignored::GuidanceScale]
        } else {
            Vec::new()
        };
        assert_eq!(plan.ignored, want, "{name}: ignored fields");
        assert!(plan.negative.is_none(), "{name}: a negative branch");
        assert_eq!(plan.true_cfg_scale, 1.0);

        // The sigma grid after the folder's scheduler config (terminal 0 included), bit for bit.
        let sigmas = expected.to_f32(&format!("{name}.sigmas")).unwrap();
        println!("{name}: sigmas {:?}", plan.schedule.sigmas());
        assert_eq!(plan.schedule.steps(), steps);
        assert_eq!(
            bits(plan.schedule.sigmas()),
            bits(sigmas.data()),
            "{name}: sigmas differ from the reference scheduler's"
        );

        // Template ids and dropped rows.
        let ids: Vec<u32> = expected
            .to_i64(&format!("{name}.prompt_ids"))
            .unwrap()
            .data()
            .iter()
            .map(|&v| u32::try_from(v).unwrap())
            .collect();
        let ours = QwenImage21::encode(&tokenizer, case["prompt"].as_str().unwrap()).unwrap();
        assert_eq!(ours.ids, ids, "{name}: template ids");
        assert_eq!(ours.drop, drop, "{name}: dropped rows");

        // The seeded noise against the script's independent generator: bit-equal.
        let noise = expected.to_f32(&format!("{name}.noise")).unwrap();
        let ours_noise = packed_latents(
            request.seed,
            1,
            pipeline.latent_channels(),
            plan.latent_rows,
            plan.latent_cols,
            LatentDtype::F32,
        )
        .unwrap();
        assert_eq!(ours_noise.data(), noise.data(), "{name}: initial noise");

        let mut events = Vec::new();
        let result = pipeline
            .generate(&request, &mut |p| events.push(p))
            .unwrap();
        assert_eq!(result.plan_steps, steps);
        assert_eq!(result.ignored, want);
        let step_events = events
            .iter()
            .filter(|p| matches!(p, Progress::Step { .. }))
            .count();
        assert_eq!(step_events, steps, "{name}: one progress event per step");

        let embeds = expected.to_f32(&format!("{name}.prompt_embeds")).unwrap();
        assert_eq!(result.prompt_embeds.shape(), embeds.shape());
        compare_within(
            &format!("{name}.prompt_embeds"),
            result.prompt_embeds.data(),
            embeds.data(),
            TOLERANCE,
        );
        assert_eq!(result.step_velocities.len(), steps);
        assert_eq!(result.step_latents.len(), steps);
        for i in 0..steps {
            let velocity = expected.to_f32(&format!("{name}.velocity.{i}")).unwrap();
            compare_within(
                &format!("{name}.velocity.{i}"),
                result.step_velocities[i].data(),
                velocity.data(),
                TOLERANCE,
            );
            let latents = expected.to_f32(&format!("{name}.latents.{i}")).unwrap();
            compare_within(
                &format!("{name}.latents.{i}"),
                result.step_latents[i].data(),
                latents.data(),
                TOLERANCE,
            );
        }
        let decoded = expected.to_f32(&format!("{name}.decoded")).unwrap();
        let ours_decoded = result
            .decoded
            .as_ref()
            .expect("the decoded image is kept with the step latents");
        assert_eq!(&ours_decoded.shape()[1..], decoded.shape());
        compare_within(
            &format!("{name}.decoded"),
            ours_decoded.data(),
            decoded.data(),
            DECODED_TOLERANCE,
        );
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
        assert_eq!(
            [
                result.image.height,
                result.image.width,
                result.image.channels
            ],
            [pixels.shape()[0], pixels.shape()[1], pixels.shape()[2]]
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
        assert!(max <= 2, "{name}: a pixel differs by {max} levels");
        assert!(
            differing * 100 <= off_by.len(),
            "{name}: {differing} bytes differ"
        );

        // Ignored means unused: the same request without the guidance inputs gives the same bits.
        if warned {
            let plain = Request {
                negative_prompt: None,
                true_cfg_scale: 1.0,
                ..request.clone()
            };
            let again = pipeline.generate(&plain, &mut |_| {}).unwrap();
            assert!(again.ignored.is_empty());
            assert_eq!(
                again.image, result.image,
                "{name}: the ignored inputs changed the image"
            );
            assert_eq!(
                bits(again.decoded.as_ref().expect("kept").data()),
                bits(result.decoded.as_ref().expect("kept").data())
            );
        }
    }
}

#[test]
fn turbo_steps_follow_its_grid() {
    let mut pipeline = Pipeline::load(&turbo_dir(), &LoadOptions::new(Backend::Host)).unwrap();
    let grid = pipeline.sample_sigmas().unwrap().len();
    let ok = Request {
        width: 64,
        height: 32,
        ..Request::new("a red fox")
    };
    // Its own count may be asked for; another is refused before any work, naming the field.
    let plan = pipeline
        .plan(&Request {
            steps: Some(grid),
            ..ok.clone()
        })
        .unwrap();
    assert_eq!(plan.schedule.steps(), grid);
    let err = pipeline
        .generate(
            &Request {
                steps: Some(4),
                ..ok.clone()
            },
            &mut |_| panic!("no progress before validation"),
        )
        .unwrap_err();
    println!("refused: {err}");
    assert!(err.is_invalid_request());
    assert!(err.to_string().contains("sample_sigmas"), "{err}");
    assert!(pipeline
        .plan(&Request {
            steps: Some(0),
            ..ok.clone()
        })
        .is_err());

    // The Turbo blocks on a folder without sample_sigmas: 8 steps by default, any count on request.
    let options = LoadOptions {
        variant: Some(Variant::Turbo),
        ..LoadOptions::new(Backend::Host)
    };
    let forced = Pipeline::load(&base_dir(), &options).unwrap();
    assert_eq!(
        forced.plan(&ok).unwrap().schedule.steps(),
        TURBO_DEFAULT_STEPS
    );
    let three = Request {
        steps: Some(3),
        ..ok.clone()
    };
    assert_eq!(forced.plan(&three).unwrap().schedule.steps(), 3);

    // The preflight (no weights read) sees the same variant, steps and ignored fields.
    let guided = Request {
        negative_prompt: Some("blurry".into()),
        true_cfg_scale: 3.0,
        ..ok.clone()
    };
    let preflight =
        Pipeline::preflight(&turbo_dir(), &LoadOptions::new(Backend::Host), &guided).unwrap();
    assert_eq!(preflight.variant, Variant::Turbo);
    assert_eq!(preflight.steps, grid);
    assert_eq!(
        preflight.ignored,
        vec![Ignored::NegativePrompt, Ignored::GuidanceScale]
    );
}

#[test]
fn tf_image_names_the_variant_and_what_it_ignores() {
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tf_image_turbo_test");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join("turbo.png");
    let _ = std::fs::remove_file(&out);
    let output = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(["image", "--model"])
        .arg(turbo_dir())
        .args(["--prompt", "a red fox", "--size", "64x32", "--seed", "5"])
        .args(["--negative", "blurry", "--cfg", "4"])
        .args(["--backend", "host", "--json", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("stderr:\n{stderr}");
    assert!(output.status.success(), "tf image failed: {stderr}");
    for needle in [
        "(Qwen-Image 2.1 Turbo)",
        "Qwen-Image 2.1 Turbo: 8 steps on 8 sigmas from model_index.json's sample_sigmas, no guidance",
        "--negative is ignored: the Turbo checkpoint samples without guidance",
        "--cfg is ignored",
        "step 8/8",
    ] {
        assert!(stderr.contains(needle), "{needle:?} missing");
    }
    let summary: Value = serde_json::from_slice(&output.stdout).unwrap();
    println!("summary: {summary}");
    assert_eq!(summary["variant"], "turbo");
    assert_eq!(summary["steps"], 8);
    assert_eq!(
        summary["ignored"],
        json!(["negative_prompt", "true_cfg_scale"])
    );
    let png = read_png(&out).unwrap();
    assert_eq!(
        (png.width, png.height, png.color),
        (64, 32, ColorType::Rgba)
    );

    // --variant base on the same folder: the base pipeline, its guidance used, nothing ignored.
    let base_out = out_dir.join("as_base.png");
    let output = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(["image", "--model"])
        .arg(turbo_dir())
        .args([
            "--prompt",
            "a red fox",
            "--size",
            "64x32",
            "--variant",
            "base",
        ])
        .args(["--negative", "blurry", "--cfg", "4"])
        .args(["--backend", "host", "--json", "-o"])
        .arg(&base_out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "tf image failed: {stderr}");
    assert!(!stderr.contains("ignored"), "{stderr}");
    assert!(stderr.contains("true CFG on request"), "{stderr}");
    let summary: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(summary["variant"], "base");
    assert_eq!(summary["ignored"], json!([]));

    // A step count off the grid fails before the load, naming the field.
    let output = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(["image", "--model"])
        .arg(turbo_dir())
        .args(["--prompt", "x", "--size", "64x32", "--steps", "3"])
        .args(["--backend", "host", "-o"])
        .arg(out_dir.join("bad.png"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("invalid request") && stderr.contains("sample_sigmas"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("loading"),
        "refused after a load: {stderr}"
    );
}

#[test]
fn tf_worker_names_the_variant_and_what_it_ignores() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tf_worker_turbo_test");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let image = json!({"prompt": "a red fox", "width": 64, "height": 32, "seed": 9,
                       "negative_prompt": "blurry", "guidance": 4.0});
    let lines = [
        json!({"op": "load"}),
        json!({"op": "generate", "dir": dir, "request": {"image": image}}),
        json!({"op": "exit"}),
    ];
    let mut worker = Command::new(env!("CARGO_BIN_EXE_tf"));
    worker
        .args([
            "worker",
            "--engine",
            "qwen_image",
            "--backend",
            "host",
            "--model",
        ])
        .arg(turbo_dir());
    let output = session(worker, &lines);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("stderr:\n{stderr}\nstdout:\n{stdout}");
    assert_eq!(output.status.code(), Some(0));
    assert!(stderr.contains("loaded Qwen-Image 2.1 Turbo"), "{stderr}");
    assert!(
        stderr.contains(
            "`negative_prompt` is ignored: the Turbo checkpoint samples without guidance"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("`guidance` is ignored"), "{stderr}");
    let values: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let replies: Vec<&Value> = values.iter().filter(|v| v.get("ok").is_some()).collect();
    assert_eq!(replies.len(), 3, "{stdout}");
    assert!(replies.iter().all(|r| r["ok"] == true), "{stdout}");
    let denoise = values
        .iter()
        .filter(|v| v["progress"]["phase"] == "denoise")
        .count();
    assert_eq!(denoise, 8, "{stdout}");

    // The worker's PNG is the in-process pipeline's image for the request without the ignored inputs.
    let png = decode_png(&std::fs::read(dir.join("image_0.png")).unwrap()).unwrap();
    let mut pipeline = Pipeline::load(&turbo_dir(), &LoadOptions::new(Backend::Host)).unwrap();
    let request = Request {
        width: 64,
        height: 32,
        seed: 9,
        ..Request::new("a red fox")
    };
    let ours = pipeline.generate(&request, &mut |_| {}).unwrap().image;
    assert_eq!((png.width, png.height), (ours.width, ours.height));
    assert_eq!(png.pixels, ours.pixels);
}
