#!/usr/bin/env python3
"""Scaled-FP8 checkpoints of the tiny Qwen-Image DiT fixture, in the two layouts the engine reads.

Reads tests/fixtures/qwen_dit/t2i/model (f32 weights) and writes, under --out:

- per_tensor/: the legacy scaled-FP8 layout: a `scaled_fp8` marker tensor (F8_E4M3, no elements), each quantized
  layer's weight as F8_E4M3 with `<layer>.scale_weight` (F32, shape []) and, on the q/k/v projections, an
  uncalibrated `<layer>.scale_input` of 1.0.
- per_channel/: the per-layer metadata layout: no marker; `<layer>.weight_scale` per output channel (shape [out] on
  the attention projections, [out, 1] elsewhere), a `<layer>.comfy_quant` declaration on the MLP layers, the
  `_quantization_metadata` header entry listing every quantized layer, and one calibrated `input_scale`.

Quantized in both: every block GEMM weight (to_q, to_k, to_v, to_out.0, img_mlp.gate_layer, img_mlp.proj,
img_mlp.out) and two outer layers (img_in, txt_in.out_layer); the rest stays f32. Scales are amax / 448 (1 for an
all-zero row); codes are e4m3 (fn) rounded to nearest even, as a cast to torch.float8_e4m3fn gives.

Standard library only (no torch, numpy or safetensors package): the safetensors container is a length-prefixed
JSON header followed by the raw little-endian tensor bytes. Run from the repository root:

    python3 tests/python/qwen_fp8_checkpoint_fixtures.py --out tests/fixtures/qwen_fp8
"""

import argparse
import json
import math
import os
import shutil
import struct

SOURCE = "tests/fixtures/qwen_dit/t2i/model"
E4M3_MAX = 448.0


def f32(x):
    """x rounded to the nearest f32."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3_value(code):
    exponent = (code >> 3) & 0x0F
    mantissa = code & 0x07
    if exponent == 0:
        return mantissa * 2.0**-9
    return (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


POSITIVE = [e4m3_value(c) for c in range(0x7F)]  # codes 0x00..0x7e; 0x7f is NaN


def e4m3_encode(x):
    """Nearest e4m3 code, ties to the even code, saturating at 448."""
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), E4M3_MAX)
    lo, hi = 0, len(POSITIVE) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if POSITIVE[mid] <= a:
            lo = mid
        else:
            hi = mid
    dl, dh = a - POSITIVE[lo], POSITIVE[hi] - a
    if dl < dh or (dl == dh and lo % 2 == 0):
        code = lo
    else:
        code = hi
    return sign | code


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {info['dtype']}, expected the F32 fixture")
        begin, end = info["data_offsets"]
        values = list(struct.unpack(f"<{(end - begin) // 4}f", body[begin:end]))
        tensors[name] = (info["shape"], values)
    return tensors


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> (dtype, shape, bytes); written in name order."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    chunks = []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)


def f32_bytes(values):
    return struct.pack(f"<{len(values)}f", *values)


def scale_of(values):
    amax = max((abs(v) for v in values), default=0.0)
    return f32(amax / E4M3_MAX) if amax > 0 else 1.0


def quantize(values, scale):
    return bytes(e4m3_encode(f32(v / scale)) for v in values)


def quantized_layers(names):
    block = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")
    outer = ("img_in", "txt_in.out_layer")
    layers = []
    for name in names:
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if layer is None:
            continue
        if layer in outer or (layer.startswith("transformer_blocks.") and layer.split(".", 2)[2] in block):
            layers.append(layer)
    return layers


def per_tensor(source):
    out = {}
    layers = set(quantized_layers(source))
    for name, (shape, values) in source.items():
        layer = name[: -len(".weight")]
        if layer in layers:
            scale = scale_of(values)
            out[name] = ("F8_E4M3", shape, quantize(values, scale))
            out[f"{layer}.scale_weight"] = ("F32", [], f32_bytes([scale]))
            if layer.endswith(("to_q", "to_k", "to_v")):
                out[f"{layer}.scale_input"] = ("F32", [], f32_bytes([1.0]))
        else:
            out[name] = ("F32", shape, f32_bytes(values))
    out["scaled_fp8"] = ("F8_E4M3", [0], b"")
    return out, None


def per_channel(source):
    out = {}
    layers = quantized_layers(source)
    for name, (shape, values) in source.items():
        layer = name[: -len(".weight")]
        if layer not in layers:
            out[name] = ("F32", shape, f32_bytes(values))
            continue
        rows, cols = shape
        codes = bytearray()
        scales = []
        for r in range(rows):
            row = values[r * cols : (r + 1) * cols]
            s = scale_of(row)
            scales.append(s)
            codes += quantize(row, s)
        out[name] = ("F8_E4M3", shape, bytes(codes))
        scale_shape = [rows] if ".attn." in layer else [rows, 1]
        out[f"{layer}.weight_scale"] = ("F32", scale_shape, f32_bytes(scales))
        if ".img_mlp." in layer:
            declaration = json.dumps({"format": "float8_e4m3fn"}).encode()
            out[f"{layer}.comfy_quant"] = ("U8", [len(declaration)], declaration)
        if layer == "transformer_blocks.0.img_mlp.out":
            out[f"{layer}.input_scale"] = ("F32", [], f32_bytes([0.0625]))
    metadata = {
        "_quantization_metadata": json.dumps(
            {"format_version": "1.0", "layers": {layer: {"format": "float8_e4m3fn"} for layer in layers}}
        )
    }
    return out, metadata


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/qwen_fp8")
    args = parser.parse_args()
    source = read_safetensors(os.path.join(SOURCE, "diffusion_pytorch_model.safetensors"))
    for variant, build in (("per_tensor", per_tensor), ("per_channel", per_channel)):
        folder = os.path.join(args.out, variant)
        os.makedirs(folder, exist_ok=True)
        shutil.copyfile(os.path.join(SOURCE, "config.json"), os.path.join(folder, "config.json"))
        tensors, metadata = build(source)
        write_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"), tensors, metadata)
        fp8 = sum(1 for t in tensors.values() if t[0] == "F8_E4M3" and t[1] != [0])
        print(f"{folder}: {len(tensors)} tensors, {fp8} FP8 weights")


if __name__ == "__main__":
    main()
