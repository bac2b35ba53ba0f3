#!/usr/bin/env python3
"""Full-size Qwen-Image 2.1 DiT reference run on the GPU (diffusers 0.42.1).

Builds the default-config QwenImage21Transformer2DModel with seeded random weights, saves it in the diffusers
layout (bf16, sharded), writes forward-argument bundles for `tf forward`, and the reference outputs:
fp32 compute (the accuracy reference) and bf16 compute (whose distance to fp32 is the floor our bf16 path is
judged against). It also times the reference: eager bf16 full and cached steps, and the cached step under
torch.compile. Everything lands under --out; a JSON summary goes to --out/reference.json and stdout.

Usage (GPU machine, diffusers on PYTHONPATH):
    python3 tests/python/qwen_dit_reference.py --out /tmp/qwen21 [--seed 0] [--sizes 1024x1024,1280x768]
"""

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache


DEVICE = "cuda"


def rel_l2(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def build_model(seed, layers):
    torch.manual_seed(seed)
    cfg = {}
    if layers is not None:
        cfg["num_layers"] = layers
    with torch.device(DEVICE):
        model = QwenImage21Transformer2DModel(**cfg)
    with torch.no_grad():
        g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                # Norm weights: move them off their defaults so every tensor matters.
                p.add_(0.1 * torch.randn(p.shape, generator=g, device=DEVICE))
    model = model.to(torch.bfloat16).eval()
    return model


def make_inputs(seed, width, height, text_len, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(seed + 2)
    h, w = height // 16, width // 16
    n = h * w
    hidden = torch.randn(1, n, 64, generator=g, device=DEVICE).to(dtype)
    enc = torch.randn(1, text_len, 4096, generator=g, device=DEVICE).to(dtype)
    img_mask = torch.cat([torch.zeros(text_len, dtype=torch.bool), torch.ones(n // 4, dtype=torch.bool)])[None]
    enc_mask = torch.ones(1, text_len, dtype=torch.bool)
    shapes = [[(1, h, w)]]
    return hidden, enc, img_mask.to(DEVICE), enc_mask.to(DEVICE), shapes


def bundle(hidden, enc, timestep, img_mask, enc_mask, shapes):
    return {
        "hidden_states": hidden.float().contiguous().cpu(),
        "encoder_hidden_states": enc.float().contiguous().cpu(),
        "timestep": timestep.float().contiguous().cpu(),
        "img_mask": img_mask.to(torch.uint8).contiguous().cpu(),
        "encoder_hidden_states_mask": enc_mask.to(torch.uint8).contiguous().cpu(),
        "img_shapes": torch.tensor(shapes, dtype=torch.int64).contiguous().cpu(),
    }


def forward(model, hidden, enc, t, img_mask, enc_mask, shapes, cache=None, mode=None):
    with torch.no_grad():
        return model(
            hidden_states=hidden,
            encoder_hidden_states=enc,
            timestep=t,
            img_shapes=shapes,
            img_mask=img_mask,
            encoder_hidden_states_mask=enc_mask,
            kv_cache=cache,
            kv_cache_mode=mode,
            return_dict=False,
        )[0]


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    sync()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def quantized_timestep(sigma, dtype):
    # The pipeline casts t = sigma*1000 to the latent dtype, then divides by 1000 (see the facts on the sampler).
    t = (torch.tensor([sigma * 1000.0], device=DEVICE).to(dtype)) / 1000.0
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="1024x1024,1280x768")
    ap.add_argument("--text-len", type=int, default=80)
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (smoke runs)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu for a smoke run of the script itself")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    summary = {"seed": args.seed, "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "cases": []}

    t0 = time.time()
    model = build_model(args.seed, args.layers)
    summary["build_s"] = time.time() - t0
    t0 = time.time()
    model.save_pretrained(os.path.join(args.out, "transformer"))
    summary["save_s"] = time.time() - t0
    print(f"built and saved the model in {summary['build_s']:.1f}s + {summary['save_s']:.1f}s", flush=True)
    model32 = None

    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        name = f"{width}x{height}"
        case_dir = os.path.join(args.out, name)
        os.makedirs(case_dir, exist_ok=True)
        hidden, enc, img_mask, enc_mask, shapes = make_inputs(args.seed, width, height, args.text_len, torch.bfloat16)
        n_tgt = hidden.shape[1]
        t_a = quantized_timestep(0.9, torch.bfloat16)
        t_b = quantized_timestep(0.6, torch.bfloat16)
        g = torch.Generator(device=DEVICE).manual_seed(args.seed + 3)
        hidden_b = torch.randn(hidden.shape, generator=g, device=DEVICE).to(torch.bfloat16)
        save_file(bundle(hidden, enc, t_a, img_mask, enc_mask, shapes), os.path.join(case_dir, "step0.safetensors"))
        save_file(bundle(hidden_b, enc, t_b, img_mask, enc_mask, shapes), os.path.join(case_dir, "step1.safetensors"))

        outputs = {}
        for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            if dtype == torch.float32:
                if model32 is None:
                    with torch.device(DEVICE):
                        model32 = QwenImage21Transformer2DModel.from_config(model.config)
                    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
                    model32.eval()
                m = model32
            else:
                m = model
            args_a = (hidden.to(dtype), enc.to(dtype), t_a, img_mask, enc_mask, shapes)
            args_b = (hidden_b.to(dtype), enc.to(dtype), t_b, img_mask, enc_mask, shapes)
            cache = QwenImage21KVCache(m.config.num_layers)
            outputs[f"extract_{dtype_name}"] = forward(m, *args_a, cache=cache, mode="extract").float()
            outputs[f"cached_{dtype_name}"] = forward(m, *args_b, cache=cache, mode="cached").float()
            del cache
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        save_file({k: v.contiguous().cpu() for k, v in outputs.items()}, os.path.join(case_dir, "reference.safetensors"))
        case = {
            "name": name,
            "target_tokens": n_tgt,
            "text_rows": args.text_len,
            "floor_extract_target_rel_l2": rel_l2(outputs["extract_bf16"][:, -n_tgt:], outputs["extract_fp32"][:, -n_tgt:]),
            "floor_extract_rel_l2": rel_l2(outputs["extract_bf16"], outputs["extract_fp32"]),
            "floor_cached_rel_l2": rel_l2(outputs["cached_bf16"], outputs["cached_fp32"]),
            "floor_cached_cosine": cosine(outputs["cached_bf16"], outputs["cached_fp32"]),
        }
        print(json.dumps(case), flush=True)

        if name == "1024x1024" and DEVICE == "cuda":
            args_a = (hidden, enc, t_a, img_mask, enc_mask, shapes)
            args_b = (hidden_b, enc, t_b, img_mask, enc_mask, shapes)
            torch.cuda.reset_peak_memory_stats()
            case["eager_full_ms"] = time_ms(lambda: forward(model, *args_a), 2, args.iters)
            cache = QwenImage21KVCache(model.config.num_layers)
            forward(model, *args_a, cache=cache, mode="extract")
            case["eager_cached_ms"] = time_ms(lambda: forward(model, *args_b, cache=cache, mode="cached"), 2, args.iters)
            case["eager_peak_bytes"] = torch.cuda.max_memory_allocated()
            if not args.no_compile:
                try:
                    t0 = time.time()
                    compiled = torch.compile(model)
                    forward(compiled, *args_b, cache=cache, mode="cached")
                    case["compile_s"] = time.time() - t0
                    case["compiled_cached_ms"] = time_ms(
                        lambda: forward(compiled, *args_b, cache=cache, mode="cached"), 3, args.iters
                    )
                except Exception as exc:  # report and carry on: the eager numbers still stand
                    case["compile_error"] = repr(exc)[:500]
            print(json.dumps(case), flush=True)
        summary["cases"].append(case)
        if model32 is not None:
            del model32
            model32 = None
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
