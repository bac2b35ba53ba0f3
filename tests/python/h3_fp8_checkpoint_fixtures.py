#!/usr/bin/env python3
"""Scaled-FP8 checkpoints of the tiny MiniMax H3 DiT fixture, in the two layouts the engine reads.

Reads the f32 weights of tests/fixtures/minimax_h3_dit/fl2va_first/model (diffusers names) and of its original
release twin tests/fixtures/minimax_h3_dit/original_fl2va_first/model, and writes, under --out:

- per_tensor/: diffusers names, the legacy scaled-FP8 layout: a `scaled_fp8` marker tensor (F8_E4M3, no
  elements), each quantized layer's weight as F8_E4M3 with `<layer>.scale_weight` (F32, shape []) and, on the q/k/v
  projections, an uncalibrated `<layer>.scale_input` of 1.0.
- per_channel/: diffusers names, the per-layer metadata layout: no marker; `<layer>.weight_scale` per output
  channel (shape [out] on the attention projections, [out, 1] elsewhere), a `<layer>.comfy_quant` declaration on
  the feed-forward layers and the `_quantization_metadata` header entry listing every quantized layer.
- original_per_channel/: the original release names (fused per-head interleaved `qkv_proj`, `fc1` as
  [gate; value]) with per-channel scales ([out, 1]) and the metadata header, so that row blocks of one stored
  weight land in several device places.

Quantized: every block and refiner GEMM weight (q, k, v, out, the two feed-forward layers), the blocks' adaLN
projections and the text projection (context_embedder / condition_proj); the rest stays f32. Scales are
amax / 448 (1 for an all-zero row); codes are e4m3 (fn) rounded to nearest even, as a cast to torch.float8_e4m3fn
gives. The e4m3 and safetensors helpers are those of qwen_fp8_checkpoint_fixtures.py (standard library only).
Run from the repository root:

    python3 tests/python/h3_fp8_checkpoint_fixtures.py --out tests/fixtures/minimax_h3_fp8
"""

import argparse
import importlib.util
import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("qwen_fp8", os.path.join(HERE, "qwen_fp8_checkpoint_fixtures.py"))
fp8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp8)

DIFFUSERS = "tests/fixtures/minimax_h3_dit/fl2va_first/model"
ORIGINAL = "tests/fixtures/minimax_h3_dit/original_fl2va_first/model"

DIFFUSERS_BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2", "adaln_proj.linear")
ORIGINAL_BLOCK = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")


def quantized_layers(names, block, block_prefixes, outer):
    layers = []
    for name in sorted(names):
        if not name.endswith(".weight"):
            continue
        layer = name[: -len(".weight")]
        in_block = any(
            layer.startswith(p) and layer[len(p) :].split(".", 1)[1] in block
            for p in block_prefixes
            if layer.startswith(p) and "." in layer[len(p) :]
        )
        if in_block or layer in outer:
            layers.append(layer)
    return layers


def diffusers_layers(names):
    return quantized_layers(
        names, DIFFUSERS_BLOCK, ("transformer_blocks.", "token_refiner.refiner_blocks."), ("context_embedder",)
    )


def original_layers(names):
    return quantized_layers(names, ORIGINAL_BLOCK, ("blocks.", "token_refiner.blocks."), ("condition_proj",))


def per_tensor(source, layers):
    out = {}
    for name, (shape, values) in source.items():
        layer = name[: -len(".weight")]
        if name.endswith(".weight") and layer in layers:
            scale = fp8.scale_of(values)
            out[name] = ("F8_E4M3", shape, fp8.quantize(values, scale))
            out[f"{layer}.scale_weight"] = ("F32", [], fp8.f32_bytes([scale]))
            if layer.endswith(("to_q", "to_k", "to_v")):
                out[f"{layer}.scale_input"] = ("F32", [], fp8.f32_bytes([1.0]))
        else:
            out[name] = ("F32", shape, fp8.f32_bytes(values))
    out["scaled_fp8"] = ("F8_E4M3", [0], b"")
    return out, None


def per_channel(source, layers, vector_scales):
    out = {}
    for name, (shape, values) in source.items():
        layer = name[: -len(".weight")]
        if not (name.endswith(".weight") and layer in layers):
            out[name] = ("F32", shape, fp8.f32_bytes(values))
            continue
        rows, cols = shape
        codes = bytearray()
        scales = []
        for r in range(rows):
            row = values[r * cols : (r + 1) * cols]
            s = fp8.scale_of(row)
            scales.append(s)
            codes += fp8.quantize(row, s)
        out[name] = ("F8_E4M3", shape, bytes(codes))
        scale_shape = [rows] if vector_scales and ".attn." in layer else [rows, 1]
        out[f"{layer}.weight_scale"] = ("F32", scale_shape, fp8.f32_bytes(scales))
        if vector_scales and ".ff." in layer:
            declaration = json.dumps({"format": "float8_e4m3fn"}).encode()
            out[f"{layer}.comfy_quant"] = ("U8", [len(declaration)], declaration)
    metadata = {
        "_quantization_metadata": json.dumps(
            {"format_version": "1.0", "layers": {layer: {"format": "float8_e4m3fn"} for layer in layers}}
        )
    }
    return out, metadata


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/minimax_h3_fp8")
    args = parser.parse_args()
    diffusers = fp8.read_safetensors(os.path.join(DIFFUSERS, "diffusion_pytorch_model.safetensors"))
    original = fp8.read_safetensors(os.path.join(ORIGINAL, "model.safetensors"))
    d_layers, o_layers = diffusers_layers(diffusers), original_layers(original)
    variants = (
        ("per_tensor", DIFFUSERS, "diffusion_pytorch_model.safetensors", per_tensor(diffusers, d_layers)),
        ("per_channel", DIFFUSERS, "diffusion_pytorch_model.safetensors", per_channel(diffusers, d_layers, True)),
        ("original_per_channel", ORIGINAL, "model.safetensors", per_channel(original, o_layers, False)),
    )
    for variant, source_dir, file_name, (tensors, metadata) in variants:
        folder = os.path.join(args.out, variant)
        os.makedirs(folder, exist_ok=True)
        shutil.copyfile(os.path.join(source_dir, "config.json"), os.path.join(folder, "config.json"))
        fp8.write_safetensors(os.path.join(folder, file_name), tensors, metadata)
        count = sum(1 for t in tensors.values() if t[0] == "F8_E4M3" and t[1] != [0])
        print(f"{folder}: {len(tensors)} tensors, {count} FP8 weights")


if __name__ == "__main__":
    main()
