//! The two weight layouts a MiniMax H3 transformer folder may hold, and the mapping of the original release
//! layout onto the diffusers names at load.
//!
//! - [`CheckpointLayout::Diffusers`]: the names of [`MiniMaxH3Config::tensor_specs`].
//! - [`CheckpointLayout::Original`]: the release names: `blocks.{i}.` and `token_refiner.blocks.{j}.`, one fused
//!   `attn.qkv_proj.weight` (per-head interleaved `[head 0: q k v, head 1: q k v, ...]` in the release shards, or
//!   `[q; k; v]` stacked in single-file conversions, see [`QkvLayout`]), `attn.q_norm`/`k_norm`, `attn.out_proj`,
//!   `mlp.fc1` stored as `[gate; value]` (the diffusers SwiGLU reads `[value; gate]`), `mlp.fc2`,
//!   `video_patch_proj`, `audio_patch_proj`, `condition_proj`, `time_embedder.proj_in`/`proj_out`,
//!   `final_layer.{norm, adaln_proj.linear, video_out, audio_out}`, and optionally the recomputed
//!   `rope.inv_freq`, which is ignored. A pruned checkpoint (`adaln_t_table` instead of the time embedder) is
//!   refused.
//!
//! [`detect`] tells the layouts apart by name; [`original_tensor_specs`] lists what an original folder must hold;
//! [`to_diffusers`] turns one original tensor into the diffusers tensors it stands for.
//!
//! Either layout may store weights in FP8 with their scales (a scaled-FP8 checkpoint, read by
//! [`crate::nn::fp8_checkpoint`]): [`check_folder`] finds and validates them before the names and shapes are
//! checked. The host reference dequantizes them to f32; the GPU loader feeds the codes of its FP8 GEMM weights as
//! stored and dequantizes the rest.

use super::config::MiniMaxH3Config;
use super::dit::H3Error;
use crate::nn::fp8_checkpoint::Fp8Checkpoint;
use crate::nn::tensor::TensorF32;
use crate::nn::weights::{ModelDir, TensorSpec, FLOAT_DTYPES};

/// Row order of a fused `qkv_proj` weight `[3 * inner, hidden]`. Keys and shapes are the same for both, so the
/// caller says which one a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkvLayout {
    /// `[head 0: q k v, head 1: q k v, ...]`, each block `head_dim` rows: the release shards.
    #[default]
    Interleaved,
    /// `[q; k; v]`, each `inner` rows: single-file conversions.
    Stacked,
}

/// Which names a folder uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointLayout {
    /// diffusers `save_pretrained` names.
    Diffusers,
    /// The original release names, mapped at load.
    Original(QkvLayout),
}

/// Name of the pruned time-embedding table that replaces `time_embedder` in a pruned release file.
pub const PRUNED_TABLE: &str = "adaln_t_table";
/// The rotary buffer some original files carry; it is recomputed from the config.
pub const ROPE_BUFFER: &str = "rope.inv_freq";

/// Whether `model` holds the original release layout (any `blocks.` or `token_refiner.blocks.` tensor, or a
/// `video_patch_proj`) or the diffusers one. The qkv order of an original folder is `qkv`.
pub fn detect(model: &ModelDir, qkv: QkvLayout) -> CheckpointLayout {
    let original = model.names().any(|n| {
        n.starts_with("blocks.")
            || n.starts_with("token_refiner.blocks.")
            || n.starts_with("video_patch_proj.")
            || n.starts_with("final_layer.")
    });
    if original {
        CheckpointLayout::Original(qkv)
    } else {
        CheckpointLayout::Diffusers
    }
}

/// The tensors a folder of `layout` must hold (diffusers specs, or the original ones with the optional rotary
/// buffer when the folder has it).
pub fn folder_specs(
    model: &ModelDir,
    config: &MiniMaxH3Config,
    layout: CheckpointLayout,
) -> Vec<TensorSpec> {
    match layout {
        CheckpointLayout::Diffusers => config.tensor_specs(),
        CheckpointLayout::Original(_) => {
            original_tensor_specs(config, model.names().any(|n| n == ROPE_BUFFER))
        }
    }
}

/// Checks a transformer folder of `layout` before anything is loaded: finds the weights stored in FP8 with their
/// scales (none in an ordinary checkpoint) and validates them, then checks every tensor's name, shape and dtype,
/// `F8_E4M3` allowed where the file stores it and the scale tensors declared. Returns the FP8 weights found.
pub fn check_folder(
    model: &ModelDir,
    config: &MiniMaxH3Config,
    layout: CheckpointLayout,
) -> Result<Fp8Checkpoint, H3Error> {
    let fp8 = Fp8Checkpoint::scan(model)?;
    model.check(&fp8.model_specs(&folder_specs(model, config, layout)))?;
    Ok(fp8)
}

fn spec(name: String, shape: Vec<usize>) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        dtypes: FLOAT_DTYPES.to_vec(),
    }
}

fn original_block_specs(config: &MiniMaxH3Config, p: &str, specs: &mut Vec<TensorSpec>) {
    let (h, inner, hd, f) = (
        config.hidden_size,
        config.inner_dim(),
        config.attention_head_dim,
        config.ffn_dim,
    );
    specs.push(spec(format!("{p}norm1.weight"), vec![h]));
    specs.push(spec(format!("{p}attn.qkv_proj.weight"), vec![3 * inner, h]));
    specs.push(spec(format!("{p}attn.q_norm.weight"), vec![hd]));
    specs.push(spec(format!("{p}attn.k_norm.weight"), vec![hd]));
    specs.push(spec(format!("{p}attn.out_proj.weight"), vec![h, inner]));
    specs.push(spec(format!("{p}norm2.weight"), vec![h]));
    specs.push(spec(format!("{p}mlp.fc1.weight"), vec![2 * f, h]));
    specs.push(spec(format!("{p}mlp.fc2.weight"), vec![h, f]));
}

/// Every tensor an original-layout folder of `config` holds, with its shape. `with_rope_buffer` adds the
/// optional `rope.inv_freq` (present in some files, ignored at load).
pub fn original_tensor_specs(config: &MiniMaxH3Config, with_rope_buffer: bool) -> Vec<TensorSpec> {
    let h = config.hidden_size;
    let (te, th) = (config.time_embed_dim, config.time_embed_hidden_dim);
    let (vp, ca) = (config.video_patch_dim(), config.audio_in_channels);
    let mut specs = vec![
        spec("video_patch_proj.weight".into(), vec![h, vp]),
        spec("video_patch_proj.bias".into(), vec![h]),
        spec("audio_patch_proj.weight".into(), vec![h, ca]),
        spec("audio_patch_proj.bias".into(), vec![h]),
        spec("condition_proj.weight".into(), vec![h, config.text_dim]),
        spec("condition_proj.bias".into(), vec![h]),
        spec(
            "time_embedder.proj_in.weight".into(),
            vec![th, config.freq_dim],
        ),
        spec("time_embedder.proj_in.bias".into(), vec![th]),
        spec("time_embedder.proj_out.weight".into(), vec![te, th]),
        spec("time_embedder.proj_out.bias".into(), vec![te]),
        spec("token_refiner.final_norm.weight".into(), vec![h]),
        spec("final_layer.norm.weight".into(), vec![h]),
        spec(
            "final_layer.adaln_proj.linear.weight".into(),
            vec![2 * h, te],
        ),
        spec("final_layer.adaln_proj.linear.bias".into(), vec![2 * h]),
        spec("final_layer.video_out.weight".into(), vec![vp, h]),
        spec("final_layer.video_out.bias".into(), vec![vp]),
        spec("final_layer.audio_out.weight".into(), vec![ca, h]),
        spec("final_layer.audio_out.bias".into(), vec![ca]),
    ];
    if with_rope_buffer {
        specs.push(spec(ROPE_BUFFER.into(), vec![config.rope_freq_dim]));
    }
    for j in 0..config.num_refiner_layers {
        original_block_specs(config, &format!("token_refiner.blocks.{j}."), &mut specs);
    }
    for i in 0..config.num_layers {
        let p = format!("blocks.{i}.");
        original_block_specs(config, &p, &mut specs);
        specs.push(spec(
            format!("{p}adaln_proj.linear.weight"),
            vec![config.adaln_width(), te],
        ));
        specs.push(spec(
            format!("{p}adaln_proj.linear.bias"),
            vec![config.adaln_width()],
        ));
    }
    specs
}

/// The diffusers name of an original name, for every tensor that maps one to one (not the fused `qkv_proj`,
/// which splits into three, and not `rope.inv_freq`). `None` for a name the original layout does not have.
pub fn diffusers_name(original: &str) -> Option<String> {
    const GLOBAL: [(&str, &str); 9] = [
        ("video_patch_proj.", "proj_in."),
        ("audio_patch_proj.", "audio_proj_in."),
        ("condition_proj.", "context_embedder."),
        ("time_embedder.proj_in.", "time_embedder.linear_1."),
        ("time_embedder.proj_out.", "time_embedder.linear_2."),
        ("final_layer.norm.", "norm_out.norm."),
        ("final_layer.adaln_proj.linear.", "norm_out.linear."),
        ("final_layer.video_out.", "proj_out."),
        ("final_layer.audio_out.", "audio_proj_out."),
    ];
    const IN_BLOCK: [(&str, &str); 9] = [
        ("norm1.weight", "norm1.weight"),
        ("norm2.weight", "norm2.weight"),
        ("attn.q_norm.weight", "attn.norm_q.weight"),
        ("attn.k_norm.weight", "attn.norm_k.weight"),
        ("attn.out_proj.weight", "attn.to_out.0.weight"),
        ("mlp.fc1.weight", "ff.net.0.proj.weight"),
        ("mlp.fc2.weight", "ff.net.2.weight"),
        ("adaln_proj.linear.weight", "adaln_proj.linear.weight"),
        ("adaln_proj.linear.bias", "adaln_proj.linear.bias"),
    ];
    if original == "token_refiner.final_norm.weight" {
        return Some(original.to_string());
    }
    for (from, to) in GLOBAL {
        if let Some(rest) = original.strip_prefix(from) {
            if rest == "weight" || rest == "bias" {
                return Some(format!("{to}{rest}"));
            }
        }
    }
    let (block_prefix, rest) = split_block(original)?;
    IN_BLOCK
        .iter()
        .find(|(from, _)| *from == rest)
        .filter(|(from, _)| {
            !(block_prefix.starts_with("token_refiner") && from.starts_with("adaln"))
        })
        .map(|(_, to)| format!("{block_prefix}{to}"))
}

/// Splits `blocks.{i}.rest` / `token_refiner.blocks.{j}.rest` into the diffusers block prefix and `rest`.
fn split_block(original: &str) -> Option<(String, &str)> {
    let (kind, tail) = if let Some(t) = original.strip_prefix("token_refiner.blocks.") {
        ("token_refiner.refiner_blocks.", t)
    } else if let Some(t) = original.strip_prefix("blocks.") {
        ("transformer_blocks.", t)
    } else {
        return None;
    };
    let (index, rest) = tail.split_once('.')?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((format!("{kind}{index}."), rest))
}

/// What went wrong mapping one original tensor (the loader adds the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapError {
    pub tensor: String,
    pub why: String,
}

/// The diffusers tensors that the original tensor `name` (already checked against
/// [`original_tensor_specs`]) stands for: renamed as it is, the fused `qkv_proj` split into `to_q`, `to_k`,
/// `to_v` in `qkv` order, `mlp.fc1` with its `[gate; value]` halves swapped to `[value; gate]`. `rope.inv_freq`
/// maps to nothing.
pub fn to_diffusers(
    config: &MiniMaxH3Config,
    qkv: QkvLayout,
    name: &str,
    tensor: TensorF32,
) -> Result<Vec<(String, TensorF32)>, MapError> {
    let err = |why: String| MapError {
        tensor: name.to_string(),
        why,
    };
    if name == ROPE_BUFFER {
        return Ok(Vec::new());
    }
    if name.ends_with("attn.qkv_proj.weight") {
        let (block, _) = split_block(name)
            .filter(|(_, rest)| *rest == "attn.qkv_proj.weight")
            .ok_or_else(|| err("a fused qkv_proj outside a block".into()))?;
        let [q, k, v] = split_qkv(config, qkv, &tensor).map_err(err)?;
        return Ok(vec![
            (format!("{block}attn.to_q.weight"), q),
            (format!("{block}attn.to_k.weight"), k),
            (format!("{block}attn.to_v.weight"), v),
        ]);
    }
    let target = diffusers_name(name)
        .ok_or_else(|| err("not a tensor of the original MiniMax H3 layout".into()))?;
    if name.ends_with("mlp.fc1.weight") {
        return Ok(vec![(target, swap_halves(&tensor).map_err(err)?)]);
    }
    Ok(vec![(target, tensor)])
}

/// Splits a fused `[3 * inner, hidden]` weight into q, k, v `[inner, hidden]`.
fn split_qkv(
    config: &MiniMaxH3Config,
    layout: QkvLayout,
    fused: &TensorF32,
) -> Result<[TensorF32; 3], String> {
    let (inner, hidden) = (config.inner_dim(), config.hidden_size);
    let (heads, hd) = (config.num_attention_heads, config.attention_head_dim);
    if fused.shape() != [3 * inner, hidden] {
        return Err(format!(
            "fused qkv_proj has shape {:?}, expected [{}, {hidden}]",
            fused.shape(),
            3 * inner
        ));
    }
    let data = fused.data();
    let mut parts: [Vec<f32>; 3] = [
        Vec::with_capacity(inner * hidden),
        Vec::with_capacity(inner * hidden),
        Vec::with_capacity(inner * hidden),
    ];
    match layout {
        QkvLayout::Stacked => {
            for (p, part) in parts.iter_mut().enumerate() {
                part.extend_from_slice(&data[p * inner * hidden..(p + 1) * inner * hidden]);
            }
        }
        QkvLayout::Interleaved => {
            let block = hd * hidden;
            for head in 0..heads {
                for (p, part) in parts.iter_mut().enumerate() {
                    let start = (head * 3 + p) * block;
                    part.extend_from_slice(&data[start..start + block]);
                }
            }
        }
    }
    let [q, k, v] = parts;
    let make = |d: Vec<f32>| TensorF32::new(vec![inner, hidden], d).map_err(|e| e.to_string());
    Ok([make(q)?, make(k)?, make(v)?])
}

/// `[a; b]` -> `[b; a]` along the first axis (an even number of rows).
fn swap_halves(t: &TensorF32) -> Result<TensorF32, String> {
    let [rows, cols] = t.dims::<2>("mlp.fc1").map_err(|e| e.to_string())?;
    if !rows.is_multiple_of(2) {
        return Err(format!("mlp.fc1 has {rows} rows, not [gate; value] halves"));
    }
    let half = rows / 2 * cols;
    let mut out = Vec::with_capacity(rows * cols);
    out.extend_from_slice(&t.data()[half..]);
    out.extend_from_slice(&t.data()[..half]);
    TensorF32::new(vec![rows, cols], out).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> MiniMaxH3Config {
        MiniMaxH3Config {
            num_attention_heads: 2,
            attention_head_dim: 4,
            hidden_size: 3,
            num_layers: 2,
            num_refiner_layers: 1,
            ffn_dim: 5,
            in_channels: 2,
            audio_in_channels: 3,
            text_dim: 4,
            freq_dim: 4,
            time_embed_hidden_dim: 6,
            time_embed_dim: 2,
            rope_freq_dim: 0,
            ..MiniMaxH3Config::default_full_size()
        }
    }

    #[test]
    fn every_original_name_maps_onto_a_diffusers_spec() {
        let c = tiny();
        let diffusers: std::collections::BTreeSet<String> =
            c.tensor_specs().into_iter().map(|s| s.name).collect();
        let mut mapped = std::collections::BTreeSet::new();
        for s in original_tensor_specs(&c, true) {
            let n: usize = s.shape.iter().product();
            let t = TensorF32::new(s.shape.clone(), vec![0.0; n]).unwrap();
            for (name, out) in to_diffusers(&c, QkvLayout::Interleaved, &s.name, t).unwrap() {
                let want = c
                    .tensor_specs()
                    .into_iter()
                    .find(|d| d.name == name)
                    .unwrap();
                assert_eq!(out.shape(), want.shape.as_slice(), "{name}");
                assert!(mapped.insert(name));
            }
        }
        assert_eq!(mapped, diffusers);
    }

    #[test]
    fn fused_qkv_splits_per_head_or_stacked() {
        let c = tiny(); // 2 heads x 4, hidden 3: fused [24, 3]
        let fused = TensorF32::new(vec![24, 3], (0..72).map(|v| v as f32).collect()).unwrap();
        let name = "blocks.1.attn.qkv_proj.weight";
        let out = to_diffusers(&c, QkvLayout::Interleaved, name, fused.clone()).unwrap();
        assert_eq!(out[1].0, "transformer_blocks.1.attn.to_k.weight");
        // Interleaved: head 0 rows 0..4 q, 4..8 k, 8..12 v; head 1 rows 12..16 q ...
        let k_rows: Vec<f32> = out[1].1.data().chunks(3).map(|r| r[0] / 3.0).collect();
        assert_eq!(k_rows, vec![4.0, 5.0, 6.0, 7.0, 16.0, 17.0, 18.0, 19.0]);
        let out = to_diffusers(&c, QkvLayout::Stacked, name, fused).unwrap();
        let v_rows: Vec<f32> = out[2].1.data().chunks(3).map(|r| r[0] / 3.0).collect();
        assert_eq!(v_rows, (16..24).map(|v| v as f32).collect::<Vec<_>>());
    }

    #[test]
    fn fc1_halves_are_swapped() {
        let c = tiny();
        let t = TensorF32::new(vec![4, 1], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let out = to_diffusers(
            &c,
            QkvLayout::Interleaved,
            "token_refiner.blocks.0.mlp.fc1.weight",
            t,
        )
        .unwrap();
        assert_eq!(
            out[0].0,
            "token_refiner.refiner_blocks.0.ff.net.0.proj.weight"
        );
        assert_eq!(out[0].1.data(), &[3.0, 4.0, 1.0, 2.0]);
    }

    #[test]
    fn unknown_names_are_refused() {
        let c = tiny();
        for name in [
            "blocks.x.norm1.weight",
            "blocks..norm1.weight",
            "token_refiner.blocks.0.adaln_proj.linear.weight",
            "proj_in.weight",
            "final_layer.video_out.scale",
        ] {
            let t = TensorF32::new(vec![1], vec![0.0]).unwrap();
            assert!(
                to_diffusers(&c, QkvLayout::Interleaved, name, t).is_err(),
                "{name}"
            );
        }
        assert_eq!(diffusers_name("rope.inv_freq"), None);
    }
}
