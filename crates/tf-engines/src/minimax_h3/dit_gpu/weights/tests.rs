//! Unit tests of the H3 DiT's device weights: the dimensions, the placement plans of both name layouts, padding,
//! the FP8 groups, and the upload of checkpoint FP8 weights on the test driver.

use super::*;
use crate::minimax_h3::checkpoint::to_diffusers;
use crate::nn::tensor::TensorF32;

/// The fixtures' odd config: hidden 20, ffn 28, 3 heads of 8, text 20, temb 12 (everything padded).
fn odd() -> MiniMaxH3Config {
    MiniMaxH3Config {
        num_attention_heads: 3,
        attention_head_dim: 8,
        hidden_size: 20,
        num_layers: 2,
        num_refiner_layers: 1,
        ffn_dim: 28,
        in_channels: 4,
        audio_in_channels: 6,
        text_dim: 20,
        freq_dim: 16,
        time_embed_hidden_dim: 32,
        time_embed_dim: 12,
        rope_freq_dim: 1,
        ..MiniMaxH3Config::default_full_size()
    }
}

/// Device byte of every placed source element: (tensor name, element) -> byte offset.
fn destinations(plan: &WeightPlan) -> HashMap<(String, usize), usize> {
    let mut out = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for pl in &plan.placements {
        for k in 0..pl.len {
            let dst = pl.dst + k * pl.device.bytes();
            assert!(dst + pl.device.bytes() <= plan.total);
            assert!(seen.insert(dst), "device byte {dst} written twice");
            let key = (plan.names[pl.tensor].clone(), pl.src_first + k);
            assert!(out.insert(key, dst).is_none());
        }
    }
    out
}

#[test]
fn dims_pad_widths_and_refuse_what_the_kernels_cannot_run() {
    let full = Dims::of(&MiniMaxH3Config::default_full_size()).unwrap();
    assert!(!full.padded());
    assert_eq!(
        (full.hp, full.width, full.fp, full.rotated),
        (5376, 7168, 14336, 96)
    );
    let odd = Dims::of(&odd()).unwrap();
    assert!(odd.padded());
    assert_eq!(
        (odd.hp, odd.fp, odd.text_p, odd.temb_p, odd.width),
        (24, 32, 24, 16, 384)
    );
    let mut wide = MiniMaxH3Config::default_full_size();
    wide.attention_head_dim = 256;
    wide.rope_freq_dim = 16;
    assert!(Dims::of(&wide)
        .unwrap_err()
        .to_string()
        .contains("attention_head_dim"));
    wide.attention_head_dim = 128;
    wide.hidden_size = 8200;
    assert!(Dims::of(&wide)
        .unwrap_err()
        .to_string()
        .contains("hidden_size"));
}

#[test]
fn the_full_size_diffusers_plan_is_one_piece_per_tensor() {
    let config = MiniMaxH3Config::default_full_size();
    let dims = Dims::of(&config).unwrap();
    let plan = plan(&config, &dims, Source::Diffusers, &[]).unwrap();
    assert!(!plan.padded);
    let specs = config.tensor_specs();
    // One placement per tensor, but fc1 (`ff.net.0.proj`): its value rows and its gate rows, one each, so a seeded
    // fill gives each half the same values whether the halves are one matrix or two.
    let halved = |name: &str| name.ends_with("ff.net.0.proj.weight");
    let fc1_tensors = specs.iter().filter(|s| halved(&s.name)).count();
    assert_eq!(fc1_tensors, config.num_layers + config.num_refiner_layers);
    assert_eq!(plan.placements.len(), specs.len() + fc1_tensors);
    let mut placements = plan.placements.iter();
    for spec in &specs {
        let total = spec.shape.iter().product::<usize>();
        let pieces = if halved(&spec.name) { 2 } else { 1 };
        for piece in 0..pieces {
            let pl = placements.next().unwrap();
            assert_eq!(plan.names[pl.tensor], spec.name);
            assert_eq!(pl.src_first, piece * total / pieces);
            assert_eq!(pl.len, total / pieces, "{}", spec.name);
        }
    }
    // The f32 modules (about 17.3M values) at 4 bytes, the rest at 2, plus alignment.
    let f32_elems: usize = plan
        .placements
        .iter()
        .filter(|p| p.device == Device::F32)
        .map(|p| p.len)
        .sum();
    let all = config.parameter_count();
    let bytes = 2 * all + 2 * f32_elems;
    assert!(
        plan.total >= bytes && plan.total < bytes + 256 * 2000,
        "{} vs {bytes}",
        plan.total
    );
    // q, k and v are one contiguous [3 * 7168, 5376] group.
    let b = &plan.offsets.blocks[7].attn;
    let k = plan
        .placements
        .iter()
        .find(|p| plan.names[p.tensor] == "transformer_blocks.7.attn.to_k.weight")
        .unwrap();
    assert_eq!(k.dst, b.qkv + 7168 * 5376 * 2);
}

#[test]
fn the_original_layout_lands_where_the_diffusers_layout_does() {
    for config in [
        odd(),
        MiniMaxH3Config {
            num_attention_heads: 2,
            attention_head_dim: 16,
            hidden_size: 24,
            ffn_dim: 40,
            rope_freq_dim: 2,
            ..odd()
        },
    ] {
        let dims = Dims::of(&config).unwrap();
        let diffusers = destinations(&plan(&config, &dims, Source::Diffusers, &[]).unwrap());
        let total: usize = config
            .tensor_specs()
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert_eq!(
            diffusers.len(),
            total,
            "every diffusers element placed once"
        );
        for qkv in [QkvLayout::Interleaved, QkvLayout::Stacked] {
            let original = destinations(&plan(&config, &dims, Source::Original(qkv), &[]).unwrap());
            assert_eq!(original.len(), total);
            // Each original tensor with its element indices as values, mapped by the checkpoint converter: an
            // original element must land where the diffusers element it becomes lands.
            for spec in checkpoint::original_tensor_specs(&config, false) {
                let n: usize = spec.shape.iter().product();
                let t =
                    TensorF32::new(spec.shape.clone(), (0..n).map(|v| v as f32).collect()).unwrap();
                for (name, mapped) in to_diffusers(&config, qkv, &spec.name, t).unwrap() {
                    for (j, &v) in mapped.data().iter().enumerate() {
                        assert_eq!(
                            original[&(spec.name.clone(), v as usize)],
                            diffusers[&(name.clone(), j)],
                            "{} element {v} -> {name} element {j}",
                            spec.name
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn padded_heads_and_chunks_keep_their_places() {
    let config = odd();
    let dims = Dims::of(&config).unwrap();
    let plan = plan(&config, &dims, Source::Diffusers, &[]).unwrap();
    let dst = destinations(&plan);
    let o = &plan.offsets;
    // Head 2, channel 5 of to_k (row 2 * 8 + 5, column 3) sits at k-part row 2 * 128 + 5, column 3.
    let at = dst[&("transformer_blocks.1.attn.to_k.weight".into(), 21 * 20 + 3)];
    assert_eq!(
        at,
        o.blocks[1].attn.qkv + ((dims.width + 2 * 128 + 5) * 24 + 3) * 2
    );
    // to_out row 4, head 1 channel 2 (column 10) -> device column 128 + 2.
    let at = dst[&(
        "transformer_blocks.0.attn.to_out.0.weight".into(),
        4 * 24 + 10,
    )];
    assert_eq!(at, o.blocks[0].attn.to_out + (4 * dims.width + 130) * 2);
    // adaLN row of modality 2, chunk 4 (gate... scale_mlp), column 7: source row (2 * 6 + 4) * 20 + 7.
    let at = dst[&(
        "transformer_blocks.0.adaln_proj.linear.weight".into(),
        ((2 * 6 + 4) * 20 + 7) * 12 + 5,
    )];
    assert_eq!(
        at,
        o.blocks[0].ada_w + (((2 * 6 + 4) * 24 + 7) * 16 + 5) * 2
    );
    // fc1 gate row 3 (source row 28 + 3) -> device row 32 + 3.
    let at = dst[&(
        "token_refiner.refiner_blocks.0.ff.net.0.proj.weight".into(),
        31 * 20,
    )];
    assert_eq!(at, o.refiner[0].fc1 + 35 * 24 * 2);
    // The f32 time embedder keeps f32: linear_2 row 11 column 31.
    let at = dst[&("time_embedder.linear_2.weight".into(), 11 * 32 + 31)];
    assert_eq!(at, o.time2_w + (11 * 32 + 31) * 4);
}

#[test]
fn fp8_groups_are_codes_with_row_scales_in_whole_rows() {
    use crate::nn::precision::{DitPrecision, Fp8Layers};
    let config = MiniMaxH3Config::default_full_size();
    let layers = config.num_layers;
    let groups: Vec<Fp8Groups> = (0..layers)
        .map(|l| DitPrecision::Fp8(Fp8Layers::DEFAULT).groups_of(l, layers))
        .collect();
    // Nothing is padded at full size: the FP8 dimensions are the bf16 ones.
    let dims = Dims::of_for(&config, true).unwrap();
    assert_eq!(
        dims,
        Dims {
            fp8: true,
            ..Dims::of(&config).unwrap()
        }
    );
    let bf16 = plan(&config, &dims, Source::Diffusers, &[]).unwrap();
    let fp8 = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
    assert!(bf16.fp8.is_empty());
    assert_eq!(fp8.fp8.len(), 4 * (layers - 2));
    assert_eq!(fp8.placements.len(), bf16.placements.len());
    // The first and last block and the refiner stay bf16; block 1 holds all four groups in FP8.
    let o = &fp8.offsets;
    assert_eq!(o.blocks[0].attn.fp8, GroupScales::default());
    assert_eq!(o.blocks[layers - 1].attn.fp8, GroupScales::default());
    assert_eq!(o.refiner[0].fp8, GroupScales::default());
    let b1 = o.blocks[1].attn;
    for scales in [b1.fp8.qkv, b1.fp8.to_out, b1.fp8.fc1, b1.fp8.fc2] {
        assert!(scales.is_some());
    }
    // One byte a weight plus a 4-byte scale per row: the saving is one byte per FP8 weight, less the scales.
    let (codes, rows): (usize, usize) = fp8
        .fp8
        .iter()
        .fold((0, 0), |(c, r), m| (c + m.rows * m.cols, r + m.rows));
    let saved = bf16.total - fp8.total;
    assert!(
        saved + 4 * rows <= codes + 2 * 256 * fp8.fp8.len()
            && saved + 4 * rows + 2 * 256 * fp8.fp8.len() >= codes,
        "saved {saved}, FP8 weights {codes}, scale rows {rows}"
    );
    println!(
        "full size: {:.2} GB bf16, {:.2} GB in the default FP8 mode ({:.3})",
        bf16.total as f64 / 1e9,
        fp8.total as f64 / 1e9,
        fp8.total as f64 / bf16.total as f64
    );
    // Every FP8 placement is whole rows of its matrix (the ring quantizes them), each row covered once, the
    // scales before the codes; the same values land as in bf16 (placement for placement).
    let mut covered = vec![0usize; fp8.fp8.len()];
    for (pl, twin) in fp8.placements.iter().zip(&bf16.placements) {
        assert_eq!(
            (pl.tensor, pl.src_first, pl.len, pl.init),
            (twin.tensor, twin.src_first, twin.len, twin.init)
        );
        if let Device::Coded { matrix } = pl.device {
            let m = &fp8.fp8[matrix];
            let (first_row, rows) = whole_rows(m, pl).unwrap();
            assert_eq!(pl.dst, m.codes + first_row * m.cols);
            covered[matrix] += rows;
            assert!(m.scales + 4 * m.rows <= m.codes);
            assert_eq!(m.scales % 16, 0);
            assert_eq!(m.codes % 16, 0);
            assert_eq!(m.cols % FP8_WIDTH_MULTIPLE, 0);
        }
    }
    for (c, m) in covered.iter().zip(&fp8.fp8) {
        assert_eq!(*c, m.rows);
    }
    // The original release's interleaved qkv_proj: one placement per head and part, still whole rows.
    let original = plan(
        &config,
        &dims,
        Source::Original(QkvLayout::Interleaved),
        &groups,
    )
    .unwrap();
    let qkv = original
        .placements
        .iter()
        .filter(|p| p.device == (Device::Coded { matrix: 0 }))
        .collect::<Vec<_>>();
    assert_eq!(qkv.len(), 3 * config.num_attention_heads);
    assert!(qkv
        .iter()
        .all(|p| whole_rows(&original.fp8[0], p)
            == Some(((p.dst - original.fp8[0].codes) / 5376, 128))));
}

#[test]
fn the_adaln_group_stores_the_modulation_projections_in_fp8_at_about_half_the_bytes() {
    use crate::nn::precision::DitPrecision;
    let config = MiniMaxH3Config::default_full_size();
    let layers = config.num_layers;
    let precision: DitPrecision = "fp8:all,adaln,ends=1".parse().unwrap();
    let groups: Vec<Fp8Groups> = (0..layers)
        .map(|l| precision.groups_of(l, layers))
        .collect();
    let dims = Dims::of_for(&config, true).unwrap();
    let bf16 = plan(&config, &dims, Source::Diffusers, &[]).unwrap();
    let fp8 = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
    assert_eq!(fp8.fp8.len(), 5 * (layers - 2));
    let o = &fp8.offsets;
    assert!(o.blocks[0].ada_scales.is_none() && o.blocks[layers - 1].ada_scales.is_none());
    let b1 = o.blocks[1];
    let ada = fp8.fp8.iter().find(|m| m.codes == b1.ada_w).unwrap();
    assert_eq!((ada.rows, ada.cols), (18 * 5376, 2688));
    assert_eq!(b1.ada_scales, Some(ada.scales));
    // Its placement is whole rows (the ring quantizes it), and about half the model stays resident.
    for pl in &fp8.placements {
        if let Device::Coded { matrix } = pl.device {
            assert!(whole_rows(&fp8.fp8[matrix], pl).is_some());
        }
    }
    let ratio = fp8.total as f64 / bf16.total as f64;
    println!(
        "full size with adaln: {:.2} GB of {:.2} ({ratio:.3})",
        fp8.total as f64 / 1e9,
        bf16.total as f64 / 1e9
    );
    assert!(ratio > 0.5 && ratio < 0.55, "{ratio}");
}

#[test]
fn adaln_in_int8_takes_the_bytes_of_fp8_and_only_its_own_matrices_change_format() {
    use crate::nn::precision::DitPrecision;
    let config = MiniMaxH3Config::default_full_size();
    let layers = config.num_layers;
    let dims = Dims::of_for(&config, true).unwrap();
    let groups_of = |spec: &str| -> Vec<Fp8Groups> {
        let precision: DitPrecision = spec.parse().unwrap();
        (0..layers)
            .map(|l| precision.groups_of(l, layers))
            .collect()
    };
    let e4m3 = plan(
        &config,
        &dims,
        Source::Diffusers,
        &groups_of("fp8:qkv,out,mlp_value,mlp_out,adaln,ends=1"),
    )
    .unwrap();
    let int8 = plan(
        &config,
        &dims,
        Source::Diffusers,
        &groups_of("fp8:qkv,out,mlp_value,mlp_out,adaln=int8,ends=1"),
    )
    .unwrap();
    let default = plan(
        &config,
        &dims,
        Source::Diffusers,
        &groups_of("fp8:qkv,out,mlp_value,mlp_out,ends=1"),
    )
    .unwrap();
    assert_eq!(int8.total, e4m3.total);
    assert_eq!(int8.placements, e4m3.placements);
    assert_eq!(int8.fp8.len(), e4m3.fp8.len());
    for (a, b) in int8.fp8.iter().zip(&e4m3.fp8) {
        assert_eq!(
            (a.codes, a.scales, a.rows, a.cols),
            (b.codes, b.scales, b.rows, b.cols)
        );
    }
    let int8_matrices = int8
        .fp8
        .iter()
        .filter(|m| m.format == RowCodes::Int8)
        .count();
    assert_eq!(
        int8_matrices,
        layers - 2,
        "one adaLN matrix a block inside the ends"
    );
    assert_eq!(int8.offsets.blocks[1].ada_codes, RowCodes::Int8);
    assert!(int8.offsets.blocks[0].ada_scales.is_none());
    // 18 x 5376 x 2688 weights a block: half their bf16 bytes (and a scale a row) come off the default's.
    let saved = default.total - int8.total;
    let per_block = 18 * 5376 * 2688 - 18 * 5376 * F32;
    assert_eq!(saved, (layers - 2) * per_block);
    println!(
        "full size, default + adaln=int8: {:.2} GB (default {:.2} GB)",
        int8.total as f64 / 1e9,
        default.total as f64 / 1e9
    );
}

#[test]
fn fp8_pads_the_tiny_widths_to_sixteen_and_those_go_through_the_device() {
    let config = odd();
    let dims = Dims::of_for(&config, true).unwrap();
    assert_eq!(
        (dims.hp, dims.fp, dims.width, dims.text_p),
        (32, 32, 384, 24)
    );
    let groups = vec![Fp8Groups::ALL; config.num_layers];
    let p = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
    assert!(p.padded);
    assert_eq!(p.fp8.len(), 4 * config.num_layers);
    // Padded rows are not whole rows of their matrix: the ring cannot quantize them, the device does.
    let fp8_placements: Vec<&Placement> = p
        .placements
        .iter()
        .filter(|pl| matches!(pl.device, Device::Coded { .. }))
        .collect();
    assert!(!fp8_placements.is_empty());
    assert!(fp8_placements.iter().any(|pl| match pl.device {
        Device::Coded { matrix } => whole_rows(&p.fp8[matrix], pl).is_none(),
        _ => false,
    }));
    // Every FP8 element lands inside its matrix.
    for pl in fp8_placements {
        if let Device::Coded { matrix } = pl.device {
            let m = &p.fp8[matrix];
            assert!(pl.dst >= m.codes && pl.dst + pl.len <= m.codes + m.rows * m.cols);
        }
    }
}

/// A scaled-FP8 fixture of `tests/fixtures/minimax_h3_fp8`: the folder, its config, its layout as a plan source and
/// its checked FP8 weights.
fn fp8_fixture(variant: &str) -> (ModelDir, MiniMaxH3Config, Source, Fp8Checkpoint) {
    use crate::minimax_h3::checkpoint::{check_folder, detect};
    let model = ModelDir::open(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/minimax_h3_fp8")
            .join(variant),
    )
    .unwrap();
    let config = MiniMaxH3Config::from_json(model.config_json()).unwrap();
    let layout = detect(&model, QkvLayout::Interleaved);
    let source = match layout {
        checkpoint::CheckpointLayout::Diffusers => Source::Diffusers,
        checkpoint::CheckpointLayout::Original(q) => Source::Original(q),
    };
    let ck = check_folder(&model, &config, layout).unwrap();
    (model, config, source, ck)
}

#[test]
fn int8_matrices_keep_out_the_e4m3_codes_a_checkpoint_stores() {
    use crate::minimax_h3::checkpoint::check_folder;
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let int8 = Fp8Groups {
        adaln: Some(RowCodes::Int8),
        ..Fp8Groups::ALL
    };
    for variant in ["per_channel", "original_per_channel"] {
        let (_, config, source, ck) = fp8_fixture(variant);
        let dims = Dims::of_for(&config, true).unwrap();
        let mut groups = vec![int8; config.num_layers];
        let p = plan(&config, &dims, source, &groups).unwrap();
        let kept = keep_stored_codes(&mut groups, &p, &ck);
        assert_eq!(kept.adaln_e4m3, config.num_layers, "{variant}");
        assert_eq!(kept.gate_bf16, 0, "{variant}");
        assert!(
            groups.iter().all(|g| g.adaln == Some(RowCodes::E4m3)),
            "{variant}: every block's adaLN is stored in e4m3: {groups:?}"
        );
        let again = plan(&config, &dims, source, &groups).unwrap();
        assert!(again.fp8.iter().all(|m| m.format == RowCodes::E4m3));
        assert!(
            !keep_stored_codes(&mut groups, &again, &ck).any(),
            "nothing left to keep"
        );
        // A plan whose adaLN stays bf16 changes nothing.
        let mut bf16_adaln = vec![Fp8Groups::ALL; config.num_layers];
        let p = plan(&config, &dims, source, &bf16_adaln).unwrap();
        assert!(!keep_stored_codes(&mut bf16_adaln, &p, &ck).any());
        assert!(bf16_adaln.iter().all(|g| g.adaln.is_none()));
    }
    // GEMM groups in INT8 (gemm=int8, the default) whose weights the file stores in e4m3 run those blocks in e4m3
    // (the file's codes as they are), and a second look changes nothing.
    for variant in ["per_channel", "original_per_channel"] {
        let (_, config, source, ck) = fp8_fixture(variant);
        let dims = Dims::of_for(&config, true).unwrap();
        let all_int8 = Fp8Groups {
            adaln: Some(RowCodes::Int8),
            gemm_codes: RowCodes::Int8,
            ..Fp8Groups::ALL
        };
        let mut groups = vec![all_int8; config.num_layers];
        let p = plan(&config, &dims, source, &groups).unwrap();
        assert!(
            p.fp8.iter().all(|m| m.format == RowCodes::Int8),
            "{variant}"
        );
        let kept = keep_stored_codes(&mut groups, &p, &ck);
        assert_eq!(kept.gemm_e4m3, config.num_layers, "{variant}");
        assert!(
            groups.iter().all(|g| g.gemm_codes == RowCodes::E4m3),
            "{variant}"
        );
        let again = plan(&config, &dims, source, &groups).unwrap();
        assert!(
            again.fp8.iter().all(|m| m.format == RowCodes::E4m3),
            "{variant}"
        );
        assert!(
            !keep_stored_codes(&mut groups, &again, &ck).any(),
            "{variant}"
        );
        assert!(CheckpointFp8Use {
            stored: 3,
            as_stored: 3,
            kept,
        }
        .describe()
        .contains("the GEMM groups run in e4m3 (cuBLASLt) instead of gemm=int8"));
    }
    // An INT8 fc1 gate half the file stores in e4m3 goes back to bf16 (and a second look changes nothing).
    let (_, config, source, ck) = fp8_fixture("per_channel");
    let dims = Dims::of_for(&config, true).unwrap();
    let gate8 = Fp8Groups {
        mlp_gate: false,
        mlp_gate_int8: true,
        ..Fp8Groups::ALL
    };
    let mut groups = vec![gate8; config.num_layers];
    let p = plan(&config, &dims, source, &groups).unwrap();
    assert!(p.fp8.iter().any(|m| m.format == RowCodes::Int8));
    let kept = keep_stored_codes(&mut groups, &p, &ck);
    assert_eq!((kept.adaln_e4m3, kept.gate_bf16), (0, config.num_layers));
    let text = CheckpointFp8Use {
        stored: 3,
        as_stored: 1,
        kept,
    }
    .describe();
    assert!(
        text.contains("fc1's gate half runs in bf16 in 2 block(s)"),
        "{text}"
    );
    assert!(groups
        .iter()
        .all(|g| !g.mlp_gate_int8 && !g.mlp_gate && g.mlp_value && g.mlp_in_split()));
    let again = plan(&config, &dims, source, &groups).unwrap();
    assert!(again.fp8.iter().all(|m| m.format == RowCodes::E4m3));
    assert!(!keep_stored_codes(&mut groups, &again, &ck).any());
    // A checkpoint that stores nothing in FP8 leaves INT8 as asked.
    let plain = ModelDir::open(&fixtures.join("minimax_h3_dit/fl2va_first/model")).unwrap();
    let config = MiniMaxH3Config::from_json(plain.config_json()).unwrap();
    let ck = check_folder(&plain, &config, checkpoint::CheckpointLayout::Diffusers).unwrap();
    let dims = Dims::of_for(&config, true).unwrap();
    let mut groups = vec![int8; config.num_layers];
    let p = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
    assert!(!keep_stored_codes(&mut groups, &p, &ck).any());
    assert!(groups.iter().all(|g| g.adaln == Some(RowCodes::Int8)));
    let mut groups = vec![gate8; config.num_layers];
    let p = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
    assert!(!keep_stored_codes(&mut groups, &p, &ck).any());
    assert!(groups.iter().all(|g| g.mlp_gate_int8));
}

#[test]
fn the_upload_refuses_stored_e4m3_codes_planned_into_int8() {
    use crate::nn::gpu::test_support::context;
    let _serial = tf_testdriver::test_lock();
    let ctx = context();
    let stream = Stream::new(&ctx, false).unwrap();
    let (model, config, source, ck) = fp8_fixture("per_channel");
    let dims = Dims::of_for(&config, true).unwrap();
    let upload_of = |groups: &[Fp8Groups]| {
        let p = plan(&config, &dims, source, groups).unwrap();
        upload(
            &ctx,
            &stream,
            None,
            &model,
            &ck,
            &p,
            StagingConfig::default(),
        )
    };
    // An INT8 adaLN plan, and an INT8 fc1 gate half, the engine did not pass through keep_stored_codes.
    let int8_adaln = Fp8Groups {
        adaln: Some(RowCodes::Int8),
        ..Fp8Groups::ALL
    };
    let int8_gate = Fp8Groups {
        mlp_gate: false,
        mlp_gate_int8: true,
        ..Fp8Groups::ALL
    };
    for groups in [int8_adaln, int8_gate] {
        let err = upload_of(&vec![groups; config.num_layers])
            .err()
            .expect("INT8 codes from the file's e4m3 weights");
        assert!(err.to_string().contains("INT8 matrix"), "{err}");
    }
    // Through keep_stored_codes the gate half goes to bf16 and the upload takes the file's codes for the value half.
    let mut groups = vec![int8_gate; config.num_layers];
    let p = plan(&config, &dims, source, &groups).unwrap();
    assert!(keep_stored_codes(&mut groups, &p, &ck).any());
    let up =
        upload_of(&groups).expect("the gate half in bf16 beside the value half's stored codes");
    assert_eq!(up.checkpoint_fp8.stored, ck.weights().len());
    assert!(up.checkpoint_fp8.as_stored > 0, "{:?}", up.checkpoint_fp8);
}

#[test]
fn checkpoint_fp8_codes_upload_as_stored_and_dequantize_elsewhere() {
    use crate::nn::gpu::test_support::context;
    let _serial = tf_testdriver::test_lock();
    let ctx = context();
    let stream = Stream::new(&ctx, false).unwrap();
    let staging = StagingConfig {
        slot_bytes: 4096,
        slots: 2,
        threads: 3,
    };
    let f32s = |bytes: &[u8]| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    // q|k|v, the feed-forward pair and the adaLN projection from the file's codes; the output projection
    // (split per head on the device) and everything outside the main blocks dequantized.
    let groups = Fp8Groups {
        out: false,
        adaln: Some(RowCodes::E4m3),
        ..Fp8Groups::ALL
    };
    for (variant, as_stored) in [("per_channel", 12), ("original_per_channel", 8)] {
        let (model, config, source, ck) = fp8_fixture(variant);
        for fp8 in [true, false] {
            let dims = Dims::of_for(&config, fp8).unwrap();
            let layer_groups = vec![if fp8 { groups } else { Fp8Groups::NONE }; config.num_layers];
            let p = plan(&config, &dims, source, &layer_groups).unwrap();
            assert!(p.padded, "the fixture's heads are padded to 128");
            let up = upload(&ctx, &stream, None, &model, &ck, &p, staging).unwrap();
            let want = CheckpointFp8Use {
                stored: ck.weights().len(),
                as_stored: if fp8 { as_stored } else { 0 },
                kept: KeptCodes::default(),
            };
            assert_eq!(up.checkpoint_fp8, want, "{variant} fp8={fp8}");
            let image: Vec<u8> = up.buffer.to_vec().unwrap();
            let mut covered: HashMap<usize, Vec<bool>> = HashMap::new();
            for pl in &p.placements {
                let name = &p.names[pl.tensor];
                let Some(w) = ck.get(name) else {
                    continue;
                };
                let values = ck.to_f32(&model, name).unwrap().into_data();
                let values = &values[pl.src_first..pl.src_first + pl.len];
                match pl.device {
                    Device::Coded { matrix } => {
                        // The file's codes, byte for byte, and each row's scale from the file.
                        let m = &p.fp8[matrix];
                        let codes = &model.bytes(name).unwrap()[pl.src_first..][..pl.len];
                        assert_eq!(&image[pl.dst..][..pl.len], codes, "{variant} {name}");
                        let scales = f32s(&image[m.scales..][..m.rows * F32]);
                        let rows = covered.entry(matrix).or_insert_with(|| vec![false; m.rows]);
                        for (row, scale) in code_row_scales(w, m, pl).unwrap() {
                            assert_eq!(scales[row], scale, "{variant} {name} row {row}");
                            rows[row] = true;
                        }
                    }
                    Device::Bf16 => {
                        let got = &image[pl.dst..][..pl.len * BF16];
                        let want: Vec<u8> = values
                            .iter()
                            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                            .collect();
                        assert_eq!(got, &want[..], "{variant} {name}: dequantized to bf16");
                    }
                    Device::F32 => {
                        assert_eq!(
                            f32s(&image[pl.dst..][..pl.len * F32]),
                            values,
                            "{variant} {name}: dequantized to f32"
                        );
                    }
                }
            }
            // Padding rows of the stored matrices: code 0 with scale 1.
            for (matrix, rows) in &covered {
                let m = &p.fp8[*matrix];
                let scales = f32s(&image[m.scales..][..m.rows * F32]);
                for (row, _) in rows.iter().enumerate().filter(|(_, c)| !**c) {
                    assert_eq!(scales[row], 1.0, "{variant}: padding row {row}");
                    assert!(image[m.codes + row * m.cols..][..m.cols]
                        .iter()
                        .all(|&c| c == 0));
                }
            }
            // q|k|v, fc1, fc2 and adaLN of every main block; nothing in bf16.
            let matrices = if fp8 { 4 * config.num_layers } else { 0 };
            assert_eq!(covered.len(), matrices, "{variant} fp8={fp8}");
        }
    }
}

#[test]
fn seeds_and_host_fills_are_deterministic_and_bounded() {
    assert_eq!(placement_seed(7, 3), placement_seed(7, 3));
    assert_ne!(placement_seed(7, 3), placement_seed(7, 4));
    assert_ne!(placement_seed(7, 3), placement_seed(8, 3));
    let v = host_uniform(1000, 5, 1.0, 0.05);
    assert!(v.iter().all(|x| (0.95..1.05).contains(x)));
    assert_eq!(v, host_uniform(1000, 5, 1.0, 0.05));
    let spread = v.iter().fold(0f32, |m, x| m.max((x - 1.0).abs()));
    assert!(spread > 0.04);
    let mut out = vec![0u8; 8];
    let bf = [
        half::bf16::from_f32(1.5).to_bits(),
        half::bf16::from_f32(-2.0).to_bits(),
    ];
    let src: Vec<u8> = bf.iter().flat_map(|b| b.to_le_bytes()).collect();
    BF16_TO_F32.apply(0, &src, &mut out).unwrap();
    assert_eq!(&out[..4], &1.5f32.to_le_bytes());
    assert_eq!(&out[4..], &(-2.0f32).to_le_bytes());
}

#[test]
fn one_half_of_mlp_in_in_fp8_splits_fc1_into_two_matrices() {
    use crate::nn::precision::DitPrecision;
    let config = MiniMaxH3Config::default_full_size();
    let layers = config.num_layers;
    let (f, h) = (config.ffn_dim, config.hidden_size);
    let dims = Dims::of_for(&config, true).unwrap();
    let bf16 = plan(&config, &dims, Source::Diffusers, &[]).unwrap();
    for (spec, value_fp8) in [
        ("fp8:qkv,out,mlp_value,mlp_out,ends=1", true),
        ("fp8:qkv,out,mlp_gate,mlp_out,ends=1", false),
    ] {
        let precision: DitPrecision = spec.parse().unwrap();
        let groups: Vec<Fp8Groups> = (0..layers)
            .map(|l| precision.groups_of(l, layers))
            .collect();
        let split = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
        // Block 1: the value rows and the gate rows are matrices of their own, one of them e4m3 with row scales.
        let b1 = split.offsets.blocks[1].attn;
        let gate = b1.fc1_gate.expect("the gate rows apart");
        assert_eq!(b1.fp8.fc1.is_some(), value_fp8, "{spec}");
        assert_eq!(b1.fp8.fc1_gate.is_some(), !value_fp8, "{spec}");
        // The bf16 ends keep one fc1 matrix.
        assert_eq!(split.offsets.blocks[0].attn.fc1_gate, None);
        assert_eq!(split.offsets.refiner[0].fc1_gate, None);
        let half = split
            .fp8
            .iter()
            .find(|m| m.codes == if value_fp8 { b1.fc1 } else { gate })
            .unwrap();
        assert_eq!((half.rows, half.cols), (f, h));
        // Placement for placement the same source values as in bf16 (a seeded model is its bf16 twin quantized).
        assert_eq!(split.placements.len(), bf16.placements.len());
        for (pl, twin) in split.placements.iter().zip(&bf16.placements) {
            assert_eq!(
                (pl.tensor, pl.src_first, pl.len, pl.init),
                (twin.tensor, twin.src_first, twin.len, twin.init)
            );
        }
        // Value row 5 and gate row 7 of block 1 land in their own matrices.
        let dst = |plan: &WeightPlan, name: &str, element: usize| destination(plan, name, element);
        let name = "transformer_blocks.1.ff.net.0.proj.weight";
        let (value_bytes, gate_bytes) = if value_fp8 { (1, 2) } else { (2, 1) };
        assert_eq!(
            dst(&split, name, 5 * h + 3),
            b1.fc1 + (5 * h + 3) * value_bytes
        );
        assert_eq!(
            dst(&split, name, (f + 7) * h + 3),
            gate + (7 * h + 3) * gate_bytes
        );
        // The release's [gate; value] rows reach the same device rows.
        let original = plan(
            &config,
            &dims,
            Source::Original(QkvLayout::Interleaved),
            &groups,
        )
        .unwrap();
        let o1 = original.offsets.blocks[1].attn;
        let name = original
            .names
            .iter()
            .find(|n| n.starts_with("blocks.1.") && n.contains("fc1"))
            .unwrap()
            .clone();
        assert_eq!(
            dst(&original, &name, 7 * h + 3),
            o1.fc1_gate.unwrap() + (7 * h + 3) * gate_bytes
        );
        assert_eq!(
            dst(&original, &name, (f + 5) * h + 3),
            o1.fc1 + (5 * h + 3) * value_bytes
        );
    }
    // `mlp_gate=int8`: the gate rows apart as INT8 codes with row scales, beside the e4m3 value rows.
    let precision: DitPrecision = "fp8:qkv,out,mlp_value,mlp_gate=int8,mlp_out,ends=1"
        .parse()
        .unwrap();
    let groups: Vec<Fp8Groups> = (0..layers)
        .map(|l| precision.groups_of(l, layers))
        .collect();
    let int8 = plan(&config, &dims, Source::Diffusers, &groups).unwrap();
    let b1 = int8.offsets.blocks[1].attn;
    let gate = b1.fc1_gate.expect("the gate rows apart");
    assert!(b1.fp8.fc1.is_some() && b1.fp8.fc1_gate.is_some() && b1.fp8.fc1_gate_int8);
    let coded = |codes: usize| int8.fp8.iter().find(|m| m.codes == codes).unwrap();
    assert_eq!(coded(gate).format, RowCodes::Int8);
    assert_eq!(coded(b1.fc1).format, RowCodes::E4m3);
    assert_eq!((coded(gate).rows, coded(gate).cols), (f, h));
    assert!(
        !int8.offsets.blocks[0].attn.fp8.fc1_gate_int8,
        "the bf16 ends"
    );
    // Padded rows (the odd fixture: ffn 28 on 32 device rows) stay inside each half's matrix.
    let odd = odd();
    let dims = Dims::of_for(&odd, true).unwrap();
    let groups = vec![
        Fp8Groups {
            mlp_value: true,
            ..Fp8Groups::NONE
        };
        odd.num_layers
    ];
    let split = plan(&odd, &dims, Source::Diffusers, &groups).unwrap();
    let b0 = split.offsets.blocks[0].attn;
    let dst = destinations(&split);
    let name = "transformer_blocks.0.ff.net.0.proj.weight".to_string();
    // Gate row 27 (source row 28 + 27) -> row 27 of the bf16 gate matrix ([32, 32] with hidden 20 padded to 32).
    assert_eq!(dims.hp, 32);
    assert_eq!(
        dst[&(name, 55 * 20 + 19)],
        b0.fc1_gate.unwrap() + (27 * 32 + 19) * 2
    );
}

/// The device byte of element `element` of tensor `name` (one scan of the placements: the full-size plans are too
/// large for [`destinations`]).
fn destination(plan: &WeightPlan, name: &str, element: usize) -> usize {
    let pl = plan
        .placements
        .iter()
        .find(|pl| {
            plan.names[pl.tensor] == name
                && (pl.src_first..pl.src_first + pl.len).contains(&element)
        })
        .unwrap_or_else(|| panic!("{name}[{element}] is not placed"));
    pl.dst + (element - pl.src_first) * pl.device.bytes()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Any choice of FP8 groups per block, `mlp_in`'s halves apart or together, on small padded models in both
    /// name layouts: placement for placement the bf16 twin's source values, no device byte written twice, and one
    /// FP8 matrix per FP8 group of each block (one for `fc1` whether it is whole or one half).
    #[test]
    fn any_fp8_group_choice_places_the_bf16_twins_values(
        hidden in 1usize..6,
        ffn in 1usize..7,
        layers in 1usize..4,
        picks in proptest::collection::vec(0u8..64, 3),
        source_pick in 0u8..3,
    ) {
        let config = MiniMaxH3Config {
            hidden_size: 4 * hidden,
            ffn_dim: 4 * ffn,
            num_layers: layers,
            ..odd()
        };
        let groups: Vec<Fp8Groups> = (0..layers)
            .map(|l| {
                let bits = picks[l % picks.len()];
                Fp8Groups {
                    qkv: bits & 1 != 0,
                    out: bits & 2 != 0,
                    mlp_value: bits & 4 != 0,
                    mlp_gate: bits & 8 != 0,
                    mlp_out: bits & 16 != 0,
                    mlp_gate_int8: false,
                    adaln: (bits & 32 != 0).then_some(if l % 2 == 0 {
                        RowCodes::E4m3
                    } else {
                        RowCodes::Int8
                    }),
                    gemm_codes: if bits & 64 != 0 {
                        RowCodes::Int8
                    } else {
                        RowCodes::E4m3
                    },
                }
            })
            .collect();
        let source = match source_pick {
            0 => Source::Diffusers,
            1 => Source::Original(QkvLayout::Interleaved),
            _ => Source::Original(QkvLayout::Stacked),
        };
        let dims = Dims::of_for(&config, true).unwrap();
        let twin = plan(&config, &dims, source, &[]).unwrap();
        let fp8 = plan(&config, &dims, source, &groups).unwrap();
        proptest::prop_assert_eq!(fp8.placements.len(), twin.placements.len());
        for (pl, t) in fp8.placements.iter().zip(&twin.placements) {
            proptest::prop_assert_eq!(
                (pl.tensor, pl.src_first, pl.len, pl.init),
                (t.tensor, t.src_first, t.len, t.init)
            );
        }
        destinations(&fp8);
        let want: usize = groups
            .iter()
            .map(|g| {
                [g.qkv, g.out, g.mlp_value || g.mlp_gate, g.mlp_out, g.adaln.is_some()]
                    .iter()
                    .filter(|&&on| on)
                    .count()
            })
            .sum();
        proptest::prop_assert_eq!(fp8.fp8.len(), want);
        for (g, b) in groups.iter().zip(&fp8.offsets.blocks) {
            proptest::prop_assert_eq!(b.attn.fc1_gate.is_some(), g.mlp_in_split());
            proptest::prop_assert_eq!(b.ada_scales.is_some(), g.adaln.is_some());
            if let Some(codes) = g.adaln {
                proptest::prop_assert_eq!(b.ada_codes, codes);
                let m = fp8.fp8.iter().find(|m| m.codes == b.ada_w);
                proptest::prop_assert_eq!(m.map(|m| m.format), Some(codes));
            }
        }
        // Every matrix of a GEMM group holds e4m3 codes.
        let ada_codes: Vec<usize> = fp8.offsets.blocks.iter().map(|b| b.ada_w).collect();
        for m in &fp8.fp8 {
            if !ada_codes.contains(&m.codes) {
                proptest::prop_assert_eq!(m.format, RowCodes::E4m3);
            }
        }
    }
}
