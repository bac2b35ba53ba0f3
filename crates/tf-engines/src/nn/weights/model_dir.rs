//! Diffusers- and transformers-format model folders: `config.json` plus one safetensors file or a sharded set
//! with its index, and the check of their tensors against what a model expects.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{Dtype, SafetensorsFile, TensorInfo, WeightsError};
use crate::nn::tensor::TensorF32;

/// What a model expects of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// Accepted stored dtypes.
    pub dtypes: Vec<Dtype>,
}

/// Elements in all of `specs` (a model's parameter count), or which product or sum overflows.
pub fn element_total(specs: &[TensorSpec]) -> Result<usize, String> {
    specs.iter().try_fold(0usize, |total, spec| {
        let n = spec
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("the size of tensor {} overflows", spec.name))?;
        total
            .checked_add(n)
            .ok_or_else(|| "the total parameter count overflows".to_string())
    })
}

/// Floating dtypes a host-converted weight may be stored in.
pub const FLOAT_DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::BF16, Dtype::F16];

/// Throughput of a pass over the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadStats {
    pub bytes: u64,
    pub seconds: f64,
}

impl LoadStats {
    /// Bytes per second (0 when nothing was timed).
    pub fn bytes_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds
        } else {
            0.0
        }
    }
}

impl fmt::Display for LoadStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes in {:.3} s ({:.3} GB/s)",
            self.bytes,
            self.seconds,
            self.bytes_per_second() / 1e9
        )
    }
}

/// A diffusers-format model folder: `config.json` plus one or more safetensors shards.
#[derive(Debug)]
pub struct ModelDir {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<SafetensorsFile>,
    /// Tensor name -> index into `shards`.
    location: BTreeMap<String, usize>,
}

fn read_json(path: &Path) -> Result<serde_json::Value, WeightsError> {
    let text = std::fs::read_to_string(path).map_err(|source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| WeightsError::Config {
        path: path.to_path_buf(),
        why: format!("not valid JSON: {e}"),
    })
}

/// Bytes from which [`ModelDir::load_f32`] reads its tensors on several threads.
const PARALLEL_LOAD_BYTES: u64 = 64 << 20;

impl ModelDir {
    /// Opens `dir`: reads `config.json`, finds the weights (an index file wins over single files), maps and
    /// validates every shard, and checks that index and shards agree.
    pub fn open(dir: &Path) -> Result<ModelDir, WeightsError> {
        let config = read_json(&dir.join("config.json"))?;
        let listing = std::fs::read_dir(dir).map_err(|source| WeightsError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut indexes = Vec::new();
        let mut singles = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|source| WeightsError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".safetensors.index.json") {
                indexes.push(entry.path());
            } else if name.ends_with(".safetensors") {
                singles.push(entry.path());
            }
        }
        indexes.sort();
        singles.sort();
        match (indexes.as_slice(), singles.as_slice()) {
            ([index], _) => Self::open_sharded(dir, config, index),
            ([], [single]) => {
                let file = SafetensorsFile::open(single)?;
                let location = file.names().map(|n| (n.to_string(), 0)).collect();
                Ok(ModelDir {
                    dir: dir.to_path_buf(),
                    config,
                    shards: vec![file],
                    location,
                })
            }
            ([], []) => Err(WeightsError::NoWeights { dir: dir.to_path_buf() }),
            ([], _) => Err(WeightsError::Index {
                path: dir.to_path_buf(),
                why: format!("{} safetensors files but no *.safetensors.index.json saying which tensor is where", singles.len()),
            }),
            _ => Err(WeightsError::Index {
                path: dir.to_path_buf(),
                why: format!("more than one index file: {indexes:?}"),
            }),
        }
    }

    fn open_sharded(
        dir: &Path,
        config: serde_json::Value,
        index_path: &Path,
    ) -> Result<ModelDir, WeightsError> {
        let index_err = |why: String| WeightsError::Index {
            path: index_path.to_path_buf(),
            why,
        };
        let index = read_json(index_path)?;
        let weight_map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| index_err("missing object \"weight_map\"".into()))?;
        let mut shard_names: Vec<String> = Vec::new();
        let mut wanted: BTreeMap<String, String> = BTreeMap::new();
        for (tensor, file) in weight_map {
            let file = file
                .as_str()
                .ok_or_else(|| index_err(format!("weight_map[{tensor:?}] is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(index_err(format!(
                    "shard name {file:?} must be a plain file name in the folder"
                )));
            }
            if !shard_names.iter().any(|s| s == file) {
                shard_names.push(file.to_string());
            }
            wanted.insert(tensor.clone(), file.to_string());
        }
        shard_names.sort();
        let mut shards = Vec::with_capacity(shard_names.len());
        for name in &shard_names {
            shards.push(SafetensorsFile::open(&dir.join(name))?);
        }
        let mut location = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for name in shard.names() {
                if let Some(&first) = location.get(name) {
                    let first: &SafetensorsFile = &shards[first];
                    return Err(WeightsError::DuplicateTensor {
                        name: name.to_string(),
                        first: first.path().to_path_buf(),
                        second: shard.path().to_path_buf(),
                    });
                }
                match wanted.get(name) {
                    Some(file) if *file == shard_names[i] => {}
                    Some(file) => {
                        return Err(index_err(format!(
                            "tensor {name:?} is listed in {file} but stored in {}",
                            shard.path().display()
                        )))
                    }
                    None => {
                        return Err(index_err(format!(
                            "tensor {name:?} of {} is not in the weight_map",
                            shard.path().display()
                        )))
                    }
                }
                location.insert(name.to_string(), i);
            }
        }
        for (tensor, file) in &wanted {
            if !location.contains_key(tensor) {
                return Err(WeightsError::MissingTensor {
                    name: tensor.clone(),
                    place: format!("{} (the index lists it there)", dir.join(file).display()),
                });
            }
        }
        Ok(ModelDir {
            dir: dir.to_path_buf(),
            config,
            shards,
            location,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json`.
    pub fn config_json(&self) -> &serde_json::Value {
        &self.config
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// The shards, in file-name order.
    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    /// The shard holding `name`.
    pub fn file_of(&self, name: &str) -> Result<&SafetensorsFile, WeightsError> {
        self.location
            .get(name)
            .and_then(|&i| self.shards.get(i))
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
                place: self.dir.display().to_string(),
            })
    }

    /// The header entry of `name`.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, WeightsError> {
        self.file_of(name)?.info(name)
    }

    /// Raw bytes of `name` in its map.
    pub fn bytes(&self, name: &str) -> Result<&[u8], WeightsError> {
        self.file_of(name)?.bytes(name)
    }

    /// `name` converted to f32.
    pub fn to_f32(&self, name: &str) -> Result<TensorF32, WeightsError> {
        self.file_of(name)?.to_f32(name)
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.header().tensors.values())
            .map(|t| t.len_bytes() as u64)
            .sum()
    }

    /// Checks the folder against a model's expectations: every spec present with its shape and an accepted
    /// dtype, and no tensor the model does not know.
    pub fn check(&self, specs: &[TensorSpec]) -> Result<(), WeightsError> {
        let mut known: HashMap<&str, ()> = HashMap::with_capacity(specs.len());
        for spec in specs {
            known.insert(spec.name.as_str(), ());
            let file = self.file_of(&spec.name)?;
            let info = file.info(&spec.name)?;
            if info.shape != spec.shape {
                return Err(WeightsError::ShapeMismatch {
                    path: file.path().to_path_buf(),
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    actual: info.shape.clone(),
                });
            }
            if !spec.dtypes.contains(&info.dtype) {
                return Err(WeightsError::DtypeNotAccepted {
                    path: file.path().to_path_buf(),
                    name: spec.name.clone(),
                    dtype: info.dtype,
                    allowed: spec
                        .dtypes
                        .iter()
                        .map(|d| d.header_name())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        let unexpected: Vec<String> = self
            .names()
            .filter(|n| !known.contains_key(n))
            .map(str::to_string)
            .collect();
        if !unexpected.is_empty() {
            return Err(WeightsError::UnexpectedTensors {
                path: self.dir.clone(),
                names: unexpected,
            });
        }
        Ok(())
    }

    /// Converts every tensor named in `names` to f32, timing the pass (host-reference load); past 64 MiB in all the
    /// tensors are read on the host's threads.
    pub fn load_f32(
        &self,
        names: &[&str],
    ) -> Result<(BTreeMap<String, TensorF32>, LoadStats), WeightsError> {
        self.load_f32_threaded_from(names, PARALLEL_LOAD_BYTES)
    }

    /// [`ModelDir::load_f32`], on several threads from `parallel_bytes` in all.
    fn load_f32_threaded_from(
        &self,
        names: &[&str],
        parallel_bytes: u64,
    ) -> Result<(BTreeMap<String, TensorF32>, LoadStats), WeightsError> {
        let start = Instant::now();
        let mut sizes = Vec::with_capacity(names.len());
        for &name in names {
            sizes.push(self.info(name)?.len_bytes() as u64);
        }
        let bytes: u64 = sizes.iter().sum();
        let threads = if bytes < parallel_bytes {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(names.len())
        };
        let mut out = BTreeMap::new();
        if threads <= 1 {
            for &name in names {
                out.insert(name.to_string(), self.to_f32(name)?);
            }
        } else {
            // Largest first, each to the thread with the fewest bytes so far.
            let mut order: Vec<usize> = (0..names.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
            let mut shares: Vec<(u64, Vec<usize>)> = vec![(0, Vec::new()); threads];
            for i in order {
                if let Some(least) = shares.iter_mut().min_by_key(|(load, _)| *load) {
                    least.0 += sizes[i];
                    least.1.push(i);
                }
            }
            let read: Vec<Vec<(usize, Result<TensorF32, WeightsError>)>> =
                std::thread::scope(|scope| {
                    let handles: Vec<_> = shares
                        .iter()
                        .map(|(_, share)| {
                            scope.spawn(move || {
                                share
                                    .iter()
                                    .map(|&i| (i, self.to_f32(names[i])))
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join().unwrap_or_else(|_| {
                                vec![(
                                    usize::MAX,
                                    Err(WeightsError::Config {
                                        path: self.dir.clone(),
                                        why: "a tensor-reading thread stopped before it finished"
                                            .into(),
                                    }),
                                )]
                            })
                        })
                        .collect()
                });
            let mut slots: Vec<Option<TensorF32>> = (0..names.len()).map(|_| None).collect();
            for (i, tensor) in read.into_iter().flatten() {
                let tensor = tensor?;
                if let Some(slot) = slots.get_mut(i) {
                    *slot = Some(tensor);
                }
            }
            for (&name, tensor) in names.iter().zip(slots) {
                if let Some(tensor) = tensor {
                    out.insert(name.to_string(), tensor);
                }
            }
        }
        Ok((
            out,
            LoadStats {
                bytes,
                seconds: start.elapsed().as_secs_f64(),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtypes: FLOAT_DTYPES.to_vec(),
        }
    }

    /// Read on threads (every size, so the split is uneven), the tensors are the one-thread read's, and a missing
    /// name is still the error it is on one thread.
    #[test]
    fn load_f32_on_threads_reads_what_one_thread_reads() {
        use crate::nn::tensor::TensorF32;
        use crate::nn::weights::write_f32_safetensors;
        let dir = std::env::temp_dir().join(format!("tf-load-f32-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let tensors: Vec<(String, TensorF32)> = (0..9usize)
            .map(|i| {
                let n = 1 + i * 37;
                let data = (0..n).map(|j| (i * 1000 + j) as f32 * 0.25).collect();
                (format!("t{i}"), TensorF32::new(vec![n], data).unwrap())
            })
            .collect();
        write_f32_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
        let model = ModelDir::open(&dir).unwrap();
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        let (one, _) = model.load_f32_threaded_from(&names, u64::MAX).unwrap();
        let (many, stats) = model.load_f32_threaded_from(&names, 0).unwrap();
        assert_eq!(one.len(), names.len());
        assert_eq!(
            stats.bytes,
            tensors
                .iter()
                .map(|(_, t)| 4 * t.data().len() as u64)
                .sum::<u64>()
        );
        for (name, t) in &one {
            assert_eq!(many[name].shape(), t.shape(), "{name}");
            assert_eq!(many[name].data(), t.data(), "{name}");
        }
        let missing = model.load_f32_threaded_from(&["t1", "absent", "t2"], 0);
        assert!(
            matches!(missing, Err(WeightsError::MissingTensor { .. })),
            "{missing:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn element_total_sums_and_names_an_overflowing_tensor() {
        assert_eq!(element_total(&[]), Ok(0));
        assert_eq!(
            element_total(&[spec("a", &[2, 3]), spec("b", &[4])]),
            Ok(10)
        );
        let err = element_total(&[spec("huge", &[usize::MAX, 2])]).unwrap_err();
        assert!(err.contains("huge"), "{err}");
        assert!(element_total(&[spec("a", &[usize::MAX]), spec("b", &[1])]).is_err());
    }
}
