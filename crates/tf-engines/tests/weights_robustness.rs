//! Safetensors robustness: the committed corpus (tests/corpus, each file named for the outcome it must give),
//! property tests on random, mutated and truncated headers, and model folders with damaged shards or weights.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use tf_engines::nn::tensor::Tensor;
use tf_engines::nn::upload::{fill_host, Piece};
use tf_engines::nn::weights::{
    parse_header, write_safetensors, AnyTensor, HeaderError, LayoutPlanner, ModelDir, WeightsError,
};
use tf_engines::qwen_image::config::QwenImageDitConfig;
use tf_engines::qwen_image::dit_host::HostDit;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

/// Expected outcome per corpus file: `None` = accepted, `Some(variant)` = refused with that variant.
fn expected_outcomes() -> BTreeMap<&'static str, Option<&'static str>> {
    BTreeMap::from([
        ("ok_two_tensors.st", None),
        ("ok_empty_header.st", None),
        ("ok_zero_sized_tensor.st", None),
        ("ok_fp8_and_int.st", None),
        ("err_too_short.st", Some("TooShort")),
        ("err_header_truncated.st", Some("HeaderTruncated")),
        ("err_header_too_large.st", Some("HeaderTooLarge")),
        ("err_json_garbage.st", Some("Json")),
        ("err_json_not_utf8.st", Some("Json")),
        ("err_not_an_object.st", Some("NotAnObject")),
        ("err_duplicate_name.st", Some("DuplicateName")),
        ("err_unknown_dtype.st", Some("UnknownDtype")),
        ("err_size_mismatch.st", Some("SizeMismatch")),
        ("err_shape_overflow.st", Some("SizeMismatch")),
        ("err_negative_shape.st", Some("BadEntry")),
        ("err_reversed_offsets.st", Some("ReversedOffsets")),
        ("err_out_of_bounds.st", Some("OutOfBounds")),
        ("err_overlap.st", Some("Overlap")),
        ("err_hole.st", Some("Hole")),
        ("err_trailing_bytes.st", Some("TrailingBytes")),
        ("err_bad_entry_missing_offsets.st", Some("BadEntry")),
        ("err_bad_metadata.st", Some("BadMetadata")),
    ])
}

#[test]
fn corpus_replays_with_the_expected_outcome() {
    let expected = expected_outcomes();
    let mut seen = 0;
    for entry in std::fs::read_dir(corpus()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let outcome = expected
            .get(name.as_str())
            .unwrap_or_else(|| panic!("corpus file {name} has no expected outcome in this test"));
        let bytes = std::fs::read(&path).unwrap();
        let result = parse_header(&bytes);
        println!("{name}: {result:?}");
        match (outcome, &result) {
            (None, Ok(_)) => {
                assert!(
                    safetensors::SafeTensors::deserialize(&bytes).is_ok(),
                    "{name}: the reference reader refuses it"
                );
            }
            (Some(variant), Err(e)) => {
                assert!(
                    format!("{e:?}").starts_with(variant),
                    "{name}: expected {variant}, got {e:?}"
                );
                assert!(!e.to_string().is_empty());
            }
            _ => panic!("{name}: expected {outcome:?}, got {result:?}"),
        }
        seen += 1;
    }
    assert_eq!(seen, expected.len(), "corpus files missing");
}

/// A valid file from (dtype, shape) entries, tensors laid out in order.
fn build_file(entries: &[(&str, Vec<usize>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (i, (dtype, shape)) in entries.iter().enumerate() {
        let size = match *dtype {
            "F32" => 4,
            "BF16" | "F16" => 2,
            _ => 1,
        };
        let len = shape.iter().product::<usize>() * size;
        header.insert(
            format!("t{i}"),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let text = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend((0..offset).map(|i| (i * 7) as u8));
    out
}

fn entries() -> impl Strategy<Value = Vec<(&'static str, Vec<usize>)>> {
    prop::collection::vec(
        (
            prop::sample::select(vec!["F32", "BF16", "F16", "U8"]),
            prop::collection::vec(0usize..5, 0..4),
        ),
        0..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_header(&bytes);
    }

    #[test]
    fn random_header_text_never_panics(text in "\\PC{0,200}", extra in 0usize..64) {
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, extra));
        let _ = parse_header(&bytes);
    }

    #[test]
    fn valid_files_parse_like_the_reference_reader(entries in entries()) {
        let bytes = build_file(&entries);
        let header = parse_header(&bytes).expect("a well-formed file parses");
        let reference = safetensors::SafeTensors::deserialize(&bytes).expect("the reference reader parses it");
        prop_assert_eq!(header.tensors.len(), reference.len());
        for (name, info) in &header.tensors {
            let view = reference.tensor(name).unwrap();
            prop_assert_eq!(&info.shape, &view.shape().to_vec());
            prop_assert_eq!(info.len_bytes(), view.data().len());
        }
    }

    #[test]
    fn every_truncation_is_refused(entries in entries(), cut in any::<prop::sample::Index>()) {
        let bytes = build_file(&entries);
        let at = cut.index(bytes.len());
        prop_assert!(parse_header(&bytes[..at]).is_err(), "truncated at {} of {}", at, bytes.len());
    }

    #[test]
    fn mutated_files_never_panic_and_never_lie(entries in entries(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4)) {
        let mut bytes = build_file(&entries);
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, value) in flips {
            let i = at.index(header_end);
            bytes[i] = value;
        }
        if let Ok(header) = parse_header(&bytes) {
            // Whatever we accept, the ranges are in bounds and the reference reader accepts it too.
            for info in header.tensors.values() {
                prop_assert!(header.data_start + info.end <= bytes.len());
            }
            prop_assert!(safetensors::SafeTensors::deserialize(&bytes).is_ok());
        }
    }
}

fn fixture_model(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen_dit")
        .join(case)
        .join("model")
}

fn copy_dir(from: &Path, name: &str) -> PathBuf {
    let to = std::env::temp_dir().join(format!("tf-engines-weights-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&to);
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
    to
}

#[test]
fn sharded_folder_opens_and_checks() {
    let model = ModelDir::open(&fixture_model("cond_b2")).unwrap();
    assert!(model.shards().len() > 1, "the cond_b2 fixture is sharded");
    let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
    model.check(&config.tensor_specs()).unwrap();
    let params: u64 = config
        .tensor_specs()
        .iter()
        .map(|s| s.shape.iter().product::<usize>() as u64)
        .sum();
    assert_eq!(model.total_bytes(), params * 4);
}

#[test]
fn damaged_sharded_folders_name_the_file_and_tensor() {
    let src = fixture_model("cond_b2");
    let index_name = "diffusion_pytorch_model.safetensors.index.json";

    // A missing shard.
    let dir = copy_dir(&src, "missing_shard");
    let shard = dir.join("diffusion_pytorch_model-00002-of-00004.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let err = ModelDir::open(&dir).unwrap_err();
    assert!(err.to_string().contains("00002-of-00004"), "{err}");

    // A truncated shard.
    let dir = copy_dir(&src, "truncated_shard");
    let shard = dir.join("diffusion_pytorch_model-00003-of-00004.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 10]).unwrap();
    let err = ModelDir::open(&dir).unwrap_err();
    assert!(
        matches!(
            err,
            WeightsError::Header {
                source: HeaderError::OutOfBounds { .. },
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("00003-of-00004"), "{err}");
    println!("{err}");

    // An index that puts a tensor in the wrong shard, and one that lists a tensor no shard has.
    let dir = copy_dir(&src, "lying_index");
    let index_path = dir.join(index_name);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let moved = map
        .iter()
        .find(|(_, f)| f.as_str() != Some("diffusion_pytorch_model-00001-of-00004.safetensors"))
        .unwrap()
        .0
        .clone();
    map.insert(
        moved.clone(),
        serde_json::json!("diffusion_pytorch_model-00001-of-00004.safetensors"),
    );
    std::fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    let err = ModelDir::open(&dir).unwrap_err();
    assert!(err.to_string().contains(&moved), "{err}");

    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join(index_name)).unwrap()).unwrap();
    index["weight_map"]["ghost.weight"] =
        serde_json::json!("diffusion_pytorch_model-00001-of-00004.safetensors");
    std::fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    let err = ModelDir::open(&dir).unwrap_err();
    assert!(
        matches!(&err, WeightsError::MissingTensor { name, .. } if name == "ghost.weight"),
        "{err}"
    );

    // A shard name that escapes the folder.
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join(index_name)).unwrap()).unwrap();
    index["weight_map"]["img_in.weight"] = serde_json::json!("../elsewhere.safetensors");
    std::fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    assert!(matches!(
        ModelDir::open(&dir).unwrap_err(),
        WeightsError::Index { .. }
    ));
}

/// Writes a single-file model folder with the t2i fixture's tensors after `edit`.
fn rewritten_model(name: &str, edit: impl FnOnce(&mut BTreeMap<String, Tensor<f32>>)) -> PathBuf {
    let src = ModelDir::open(&fixture_model("t2i")).unwrap();
    let mut tensors: BTreeMap<String, Tensor<f32>> = src
        .names()
        .map(|n| (n.to_string(), src.to_f32(n).unwrap()))
        .collect();
    edit(&mut tensors);
    let dir =
        std::env::temp_dir().join(format!("tf-engines-weights-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture_model("t2i").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let list: Vec<(&str, AnyTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.as_str(), AnyTensor::F32(t)))
        .collect();
    write_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &list).unwrap();
    dir
}

#[test]
fn wrong_missing_or_extra_weights_are_refused_before_use() {
    let dir = rewritten_model("same", |_| {});
    assert!(HostDit::load(&ModelDir::open(&dir).unwrap()).is_ok());

    let dir = rewritten_model("missing", |t| {
        t.remove("transformer_blocks.1.attn.norm_k.weight");
    });
    let err = HostDit::load(&ModelDir::open(&dir).unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("transformer_blocks.1.attn.norm_k.weight"),
        "{err}"
    );

    let dir = rewritten_model("shape", |t| {
        t.insert(
            "proj_out.weight".into(),
            Tensor::new(vec![16, 31], vec![0.0; 16 * 31]).unwrap(),
        );
    });
    let err = HostDit::load(&ModelDir::open(&dir).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("proj_out.weight") && err.to_string().contains("[16, 31]"),
        "{err}"
    );

    let dir = rewritten_model("extra", |t| {
        t.insert(
            "stray.bias".into(),
            Tensor::new(vec![1], vec![0.0]).unwrap(),
        );
    });
    let err = HostDit::load(&ModelDir::open(&dir).unwrap()).unwrap_err();
    assert!(err.to_string().contains("stray.bias"), "{err}");
}

#[test]
fn planned_pieces_cover_every_tensor_in_order() {
    // The host image the upload ring writes: every tensor at an aligned offset, byte for byte, through slots
    // smaller than most tensors.
    let model = ModelDir::open(&fixture_model("cond_b2")).unwrap();
    let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
    let specs = config.tensor_specs();
    let mut planner = LayoutPlanner::new(256);
    let mut placed = Vec::with_capacity(specs.len());
    for spec in &specs {
        let bytes = model.bytes(&spec.name).unwrap();
        placed.push((spec.name.as_str(), planner.one(bytes.len()).unwrap(), bytes));
    }
    let total = planner.total().unwrap();
    let pieces: Vec<Piece<'_>> = placed.iter().map(|&(_, o, b)| Piece::copy(b, o)).collect();
    let mut device = vec![0u8; total];
    fill_host(&mut device, &pieces, 1000, 3).unwrap();
    for &(name, offset, bytes) in &placed {
        assert_eq!(offset % 256, 0);
        assert_eq!(&device[offset..offset + bytes.len()], bytes, "{name}");
    }
    println!("{} tensors, {total} device bytes", placed.len());
    assert!(model.bytes("nope").is_err());
    // A layout past usize is an error naming it, never a wrap.
    let mut planner = LayoutPlanner::new(256);
    planner.one(usize::MAX - 10).unwrap();
    assert!(matches!(
        planner.one(1),
        Err(WeightsError::LayoutOverflow { .. })
    ));
}
