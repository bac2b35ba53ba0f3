#!/usr/bin/env python3
"""Full-size Qwen-Image 2.1 DiT reference run on the GPU (diffusers 0.42.1).

Builds the default-config QwenImage21Transformer2DModel with seeded random weights, saves it in the diffusers
layout (bf16, sharded), writes forward-argument bundles for `tf forward`, and the reference outputs:
fp32 compute (the accuracy reference) and bf16 compute (whose distance to fp32 is the floor our bf16 path is
judged against). It also times the reference: eager bf16 full and cached steps, and the cached step under
torch.compile. Everything lands under --out; a JSON summary goes to --out/reference.json and stdout.

Torch FP8 beside ours (--fp8 SPEC, our --precision spelling: `fp8` for Qwen-Image's default groups,
qkv,out,mlp_in,mlp_out,ends=0, or GROUP[,GROUP...][,ends=N]; torch has no scaled INT8 GEMM, so our default's
`gemm=int8` is matched by e4m3 with the same scales): once the bf16 and fp32 runs of every size are done, the
chosen nn.Linear layers of the blocks between the first and last N become e4m3 GEMMs quantized as ours are
(tests/python/torch_fp8.py: per-output-channel weight scales, per-token activation scales computed on the fly,
torch._scaled_mm row-wise, bf16 output; qkv = attn.to_q/to_k/to_v, out = attn.to_out.0, mlp_in = img_mlp.proj and
img_mlp.gate_layer, mlp_out = img_mlp.out). Each case gets `fp8_torch`: the extract (all and target rows) and
cached outputs against fp32 beside the floor, as compare_outputs.py reports ours, and at 1024x1024 on the GPU the
eager full / cached and compiled cached times again (fp8_eager_full_ms, fp8_eager_cached_ms, fp8_compiled_cached_ms,
fp8_eager_peak_bytes). --no-save skips writing the model (a run that only wants the figures).

Usage (GPU machine, diffusers on PYTHONPATH):
    python3 tests/python/qwen_dit_reference.py --out /tmp/qwen21 [--seed 0] [--sizes 1024x1024,1280x768] [--fp8 fp8]
Smoke run of the script itself (CPU, three blocks, a small canvas):
    python3 tests/python/qwen_dit_reference.py --device cpu --layers 3 --sizes 64x64 --text-len 8 --out /tmp/q --fp8 fp8
"""

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

import board_energy
import torch_fp8

from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache


DEVICE = "cuda"
# The board's NVML handle for the energy of the timed steps (board_energy.py); None on the CPU or without NVML.
BOARD = None

# Our FP8 groups on a QwenImage21TransformerBlock's modules (docs/ENGINES.md, "The Qwen-Image DiT in FP8"); no
# `adaln`: the modulation is one shared layer outside the blocks. Qwen-Image's `fp8`:
QWEN_FP8_MODULES = {
    "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "out": ("attn.to_out.0",),
    "mlp_in": ("img_mlp.proj", "img_mlp.gate_layer"),
    "mlp_out": ("img_mlp.out",),
}
QWEN_FP8_DEFAULT = "qkv,out,mlp_in,mlp_out,ends=0"


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


def fp8_views(ext, cached, ref):
    """Ours-style rows (compare_outputs.py): extract all rows, extract target rows, cached; against fp32, beside the
    floor (bf16 against fp32)."""
    n = ref["cached_fp32"].shape[1]
    views = (("extract", "all rows", ext, "extract", None), ("extract", "target rows", ext, "extract", n),
             ("cached", "all rows", cached, "cached", None))
    rows = []
    for step, label, o, key, tail in views:
        r, f = ref[f"{key}_fp32"], ref[f"{key}_bf16"]
        if tail is not None:
            o, r, f = o[:, -tail:], r[:, -tail:], f[:, -tail:]
        err, floor = rel_l2(o, r), rel_l2(f, r)
        rows.append({"step": step, "rows": label, "rel_l2": err, "cosine": cosine(o, r), "floor_rel_l2": floor,
                     "ratio_to_floor": err / floor if floor > 0 else float("inf"),
                     "finite": bool(torch.isfinite(o).all())})
    return rows


def run_fp8(args, model, summary, kept):
    """Converts `model` in place and runs every case again in FP8 (accuracy; speed at 1024x1024 on the GPU)."""
    try:
        t0 = time.time()
        groups, ends = torch_fp8.parse_spec(args.fp8, QWEN_FP8_DEFAULT)
        select = torch_fp8.block_selector("transformer_blocks", len(model.transformer_blocks), QWEN_FP8_MODULES,
                                          groups, ends)
        done = torch_fp8.convert(model, select)
        sync()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        summary["fp8_torch"] = {
            "precision": torch_fp8.spec_string(groups, ends), "converted_layers": len(done["converted"]),
            "skipped_layers": done["skipped"], "convert_s": time.time() - t0,
            "weight_bytes": torch_fp8.module_bytes(model),
            "gemm": ("torch._scaled_mm, row-wise scales, bf16 out" if DEVICE == "cuda"
                     else "CPU emulation (dequantized codes, f32 matmul, bf16 out)"),
        }
    except Exception as exc:  # report and carry on: the bf16 figures still stand
        summary["fp8_torch"] = {"error": repr(exc)[:800]}
        print(f"torch FP8 conversion failed: {summary['fp8_torch']['error']}", flush=True)
        return
    print(json.dumps(summary["fp8_torch"]), flush=True)
    for case in summary["cases"]:
        args_a, args_b, ref = kept[case["name"]]
        try:
            cache = QwenImage21KVCache(model.config.num_layers)
            ext = forward(model, *args_a, cache=cache, mode="extract").float().cpu()
            cached = forward(model, *args_b, cache=cache, mode="cached").float().cpu()
            del cache
            case["fp8_torch"] = fp8_views(ext, cached, ref)
        except Exception as exc:  # report and carry on
            case["fp8_torch_error"] = repr(exc)[:800]
        print(json.dumps({"name": case["name"], "fp8_torch": case.get("fp8_torch", case.get("fp8_torch_error"))}),
              flush=True)
        if case["name"] != "1024x1024" or DEVICE != "cuda":
            continue
        try:
            torch.cuda.reset_peak_memory_stats()
            case["fp8_eager_full_ms"] = time_ms(lambda: forward(model, *args_a), 2, args.iters)
            cache = QwenImage21KVCache(model.config.num_layers)
            forward(model, *args_a, cache=cache, mode="extract")
            case["fp8_eager_cached_ms"] = time_ms(lambda: forward(model, *args_b, cache=cache, mode="cached"), 2,
                                                  args.iters)
            case["fp8_eager_peak_bytes"] = torch.cuda.max_memory_allocated()
            if not args.no_compile:
                torch._dynamo.reset()
                t0 = time.time()
                compiled = torch.compile(model)
                forward(compiled, *args_b, cache=cache, mode="cached")
                case["fp8_compile_s"] = time.time() - t0
                case["fp8_compiled_cached_ms"] = time_ms(
                    lambda: forward(compiled, *args_b, cache=cache, mode="cached"), 3, args.iters
                )
        except Exception as exc:  # report and carry on: the accuracy figures still stand
            case["fp8_speed_error"] = repr(exc)[:800]
        print(json.dumps({k: v for k, v in case.items() if k.startswith("fp8_") and k != "fp8_torch"}), flush=True)


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
    ap.add_argument("--fp8", default=None, metavar="SPEC",
                    help="also run torch FP8: fp8 (Qwen-Image's default, " + QWEN_FP8_DEFAULT + ") or "
                         "GROUP[,GROUP...][,ends=N] with GROUP one of qkv, out, mlp_in, mlp_out, all")
    ap.add_argument("--no-save", action="store_true", help="do not write the model (transformer/) under --out")
    args = ap.parse_args()
    if args.fp8:
        try:
            torch_fp8.parse_spec(args.fp8, QWEN_FP8_DEFAULT)
        except ValueError as exc:
            raise SystemExit(f"--fp8: {exc}")
    global DEVICE, BOARD
    DEVICE = args.device
    BOARD = board_energy.open_board(0) if DEVICE == "cuda" else None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    summary = {"seed": args.seed, "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "cases": []}

    t0 = time.time()
    model = build_model(args.seed, args.layers)
    summary["build_s"] = time.time() - t0
    t0 = time.time()
    if not args.no_save:
        model.save_pretrained(os.path.join(args.out, "transformer"))
    summary["save_s"] = time.time() - t0
    print(f"built and saved the model in {summary['build_s']:.1f}s + {summary['save_s']:.1f}s", flush=True)
    model32 = None
    # Per case, what the FP8 run after the loop needs: the bf16 forward arguments and the reference outputs.
    kept = {}

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
            # The board's joules a cached step over about two seconds of steps (board_energy.py; absent without NVML).
            case["eager_cached_j"] = board_energy.joules_per_call(
                BOARD, lambda: forward(model, *args_b, cache=cache, mode="cached"), case["eager_cached_ms"])
            if not args.no_compile:
                try:
                    t0 = time.time()
                    compiled = torch.compile(model)
                    forward(compiled, *args_b, cache=cache, mode="cached")
                    case["compile_s"] = time.time() - t0
                    case["compiled_cached_ms"] = time_ms(
                        lambda: forward(compiled, *args_b, cache=cache, mode="cached"), 3, args.iters
                    )
                    case["compiled_cached_j"] = board_energy.joules_per_call(
                        BOARD, lambda: forward(compiled, *args_b, cache=cache, mode="cached"),
                        case["compiled_cached_ms"])
                except Exception as exc:  # report and carry on: the eager numbers still stand
                    case["compile_error"] = repr(exc)[:500]
            print(json.dumps(case), flush=True)
        summary["cases"].append(case)
        if args.fp8:
            kept[name] = ((hidden, enc, t_a, img_mask, enc_mask, shapes),
                          (hidden_b, enc, t_b, img_mask, enc_mask, shapes),
                          {k: v.cpu() for k, v in outputs.items()})
        if model32 is not None:
            del model32
            model32 = None
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.fp8:
        # The bf16 figures are on disk already; the FP8 run converts the model in place and rewrites the file.
        run_fp8(args, model, summary, kept)
        with open(os.path.join(args.out, "reference.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
