//! A disposable copy of a fixture model folder that a test may break (edit its config, rewrite its weights),
//! removed when dropped; shared by the parity tests' refusal cases.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use tf_engines::nn::tensor::TensorF32;
use tf_engines::nn::weights::{ModelDir, SafetensorsFile, WeightsError};

/// A copy of a model folder under the temp dir.
pub struct ScratchModel(pub PathBuf);

impl ScratchModel {
    /// Copies the files of `model` into a fresh folder named after `name` and this process.
    pub fn copy_of(model: &Path, name: &str) -> ScratchModel {
        let dir = std::env::temp_dir().join(format!("{name}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(model).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
        ScratchModel(dir)
    }

    /// The folder's `config.json`.
    pub fn config(&self) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(self.0.join("config.json")).unwrap()).unwrap()
    }

    /// Replaces `config.json`.
    pub fn set_config(&self, value: &serde_json::Value) {
        std::fs::write(self.0.join("config.json"), value.to_string()).unwrap();
    }

    /// The first safetensors file of the folder.
    pub fn weights(&self) -> PathBuf {
        std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .unwrap()
    }

    /// The folder opened as a model.
    pub fn open(&self) -> Result<ModelDir, WeightsError> {
        ModelDir::open(&self.0)
    }
}

impl Drop for ScratchModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Rewrites a safetensors file with `edit` applied to its tensors as f32 (name -> (shape, data)).
pub fn rewrite(path: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let file = SafetensorsFile::open(path).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = file
        .names()
        .map(|n| {
            let t = file.to_f32(n).unwrap();
            (n.to_string(), t.shape().to_vec(), t.into_data())
        })
        .collect();
    drop(file);
    edit(&mut tensors);
    let owned: Vec<(String, TensorF32)> = tensors
        .into_iter()
        .map(|(n, s, d)| (n, TensorF32::new(s, d).unwrap()))
        .collect();
    tf_engines::nn::weights::write_f32_safetensors(path, &owned).unwrap();
}

/// The checkpoint refusals a decoder loader shares, each error naming the tensor: `missing` left out, `misshapen`
/// one element shorter along dimension `dim`, and a stray `decoder.stray.weight` added. `scratch` makes a fresh
/// copy of the fixture model for a tag; `load` loads such a copy.
pub fn assert_bad_tensors_named<T, E: std::fmt::Display>(
    scratch: impl Fn(&str) -> ScratchModel,
    load: impl Fn(&ScratchModel) -> Result<T, E>,
    missing: &str,
    (misshapen, dim): (&str, usize),
) {
    let refusal = |s: &ScratchModel, what: &str| match load(s) {
        Ok(_) => panic!("{what}: the checkpoint loaded"),
        Err(e) => e.to_string(),
    };
    let s = scratch("missing");
    rewrite(&s.weights(), |t| t.retain(|(n, _, _)| n != missing));
    let err = refusal(&s, missing);
    assert!(err.contains(missing), "{err}");

    let s = scratch("shape");
    rewrite(&s.weights(), |t| {
        for (n, shape, data) in t.iter_mut() {
            if n == misshapen {
                shape[dim] -= 1;
                data.truncate(shape.iter().product());
            }
        }
    });
    let err = refusal(&s, misshapen);
    assert!(err.contains(misshapen) && err.contains("shape"), "{err}");

    let s = scratch("extra");
    rewrite(&s.weights(), |t| {
        t.push(("decoder.stray.weight".into(), vec![2], vec![0.0; 2]))
    });
    let err = refusal(&s, "decoder.stray.weight");
    assert!(err.contains("decoder.stray.weight"), "{err}");
}
