#!/usr/bin/env python3
"""MiniMax H3 DiT reference run on the GPU (diffusers 0.42.1): an accuracy set and the speed reference.

Accuracy set (skipped with --skip-accuracy), everything under --out:
  model/                  MiniMaxH3Transformer3DModel at full width (hidden 5376, 56 x 128 heads, ffn 14336, text
                          dim 5120, other dims at their defaults) with --layers blocks (4) and --refiner-layers (2),
                          seeded random weights re-drawn so every tensor matters (RMSNorm weights 1 + 0.1 N(0, 1),
                          every bias N(0, 0.1^2), every matrix N(0, 1/fan_in), the adaLN projections twice that
                          spread so the modulation is far from zero). The weights are rounded to bf16 and saved in
                          bf16 (save_pretrained): diffusers and our engine load the very same values.
  inputs.safetensors      the forward arguments by name (H3Inputs::from_bundle): the text-to-video layout at
                          --width x --height, --frames frames, --text-rows text rows (768x448, 56 frames, 128 rows:
                          S = 6026) from the pipeline's own builders (build_packed_sequence, build_row_timesteps),
                          with the video and audio timesteps of step --step of the pipeline's 50-point grids (video
                          shift 12, audio shift 3: two distinct timesteps). Video and audio rows are fp32 N(0, 1) as
                          the pipeline's latents; the text rows are N(0, 1) rounded to bf16 (the text encoder's
                          dtype), so both diffusers runs see identical inputs.
  reference.safetensors   sample_fp32, audio_sample_fp32 (diffusers loaded with torch_dtype=float32, TF32 off) and
                          sample_bf16, audio_sample_bf16 (torch_dtype=bfloat16: the release's mixed precision, the
                          patch projections, time embedder and output heads in fp32). floor = rel L2(bf16 vs fp32)
                          per output is in reference.json.

Speed reference (skipped with --skip-speed): the full-depth model (50 blocks, 33.1B parameters) with random weights
made on the GPU (bf16, the release's fp32 modules in fp32; no file), one step at S = 6026 eager and under
torch.compile (--compile-scope blocks: diffusers' compile_repeated_blocks, or model: torch.compile of the whole
model; --compile-mode default or max-autotune-no-cudagraphs), and one eager step at the pipeline's default canvas,
768 high x 1344 wide, 5 s (124 frames, 37 latent frames, S = 37838 with 128 text rows). Times are medians of
per-iteration CUDA event times after warm-up (eager_ms, compiled_ms; the means beside them); peak memory is
torch.cuda.max_memory_allocated / _reserved over the case (weights included). The --tiny smoke run compiles on the
CPU too (inductor's C++ backend).

--out/reference.json is rewritten after every stage, so a stage stopped by a time limit keeps the earlier ones.
Each speed case is named WIDTHxHEIGHT_FRAMESf_TEXTt (e.g. 768x448_56f_128t), as `tf bench h3-dit` looks it up.

Usage (GPU machine, diffusers on PYTHONPATH):
    python3 tests/python/h3_dit_reference.py --out /tmp/h3dit [--skip-speed] [--skip-compile] [--skip-canvas]
Smoke run of the script itself (CPU, tiny config and geometry, a few seconds):
    python3 tests/python/h3_dit_reference.py --tiny --out /tmp/h3dit-tiny
"""

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time

import torch
from safetensors.torch import save_file

import diffusers
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    align_num_frames,
    audio_latent_num_frames,
    video_latent_num_frames,
)

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
AUDIO_CHANNELS = 2
VAE_SPATIAL = 16
# The release keeps these modules in fp32 (MiniMaxH3Transformer3DModel._keep_in_fp32_modules, matched as
# substrings of the module name).
KEEP_FP32 = tuple(MiniMaxH3Transformer3DModel._keep_in_fp32_modules)

# A tiny config for the --tiny smoke run (heads * head_dim != hidden, partial rotation, as the release).
TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, ffn_dim=40, in_channels=4,
            audio_in_channels=6, text_dim=20, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=12,
            rope_freq_dim=2)

DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_cuda():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def rel_l2(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def case_name(width, height, frames, text_rows):
    return f"{width}x{height}_{frames}f_{text_rows}t"


def schedule_timesteps(step, points):
    """The video (shift 12) and audio (shift 3) timesteps of grid step `step` of the pipeline's `points`-point grids."""
    out = []
    for shift in (12.0, 3.0):
        sched = MiniMaxH3Scheduler(shift=shift)
        sched.set_timesteps(points)
        if not 0 <= step < len(sched.timesteps):
            raise SystemExit(f"--step {step} is outside the {len(sched.timesteps)} steps of a {points}-point grid")
        out.append(float(sched.timesteps[step]))
    return tuple(out)


def build_layout(cfg, width, height, frames, text_rows, t_video, t_audio):
    """The text-to-video packed layout from the pipeline's own builders (no keyframes, every text row tagged text)."""
    if width % 32 or height % 32:
        raise SystemExit(f"{width}x{height}: the canvas must be a multiple of 32 pixels")
    aligned = align_num_frames(frames, 17, 5)
    if aligned != frames:
        raise SystemExit(f"{frames} frames is not of the form 17n+5 (the pipeline would use {aligned})")
    latent_frames = video_latent_num_frames(frames, 17, 5)
    audio_latents = audio_latent_num_frames(frames)
    tags = torch.full((text_rows,), TEXT_TAG, dtype=torch.long)
    pos, token_tags, vid, aud, txt, n_cond_v, n_cond_a = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, latent_frames, height // VAE_SPATIAL, width // VAE_SPATIAL, audio_latents, tuple(cfg["patch_size"]),
        AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, keyframe_anchors=())
    uniq, tidx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        vid, aud, n_cond_v, n_cond_a, txt.numel(), t_video, t_audio, max(t_video, 0.999), 1.0)
    return dict(position_ids=pos, token_tags=token_tags, video_indices=vid, audio_indices=aud, text_indices=txt,
                timestep=uniq.to(torch.float32), timestep_indices=tidx, latent_frames=latent_frames,
                audio_latents=audio_latents)


def make_inputs(cfg, layout, text_rows, seed, device):
    """Forward arguments on `device`: fp32 video/audio rows, text rows rounded to bf16 (held in fp32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    patch = cfg["patch_size"]
    vp = cfg["in_channels"] * patch[0] * patch[1] * patch[2]
    nv, na = layout["video_indices"].numel(), layout["audio_indices"].numel()
    inp = dict(
        hidden_states=torch.randn(1, nv, vp, generator=g, device=device),
        audio_hidden_states=torch.randn(1, na, cfg["audio_in_channels"], generator=g, device=device),
        encoder_hidden_states=torch.randn(1, text_rows, cfg["text_dim"], generator=g, device=device)
        .to(torch.bfloat16).float(),
    )
    for k in ("timestep", "timestep_indices", "token_tags", "position_ids", "video_indices", "audio_indices",
              "text_indices"):
        inp[k] = layout[k].to(device)
    return inp


def full_config(overrides, tiny):
    """The diffusers defaults (the release), or the tiny config, with `overrides`."""
    params = inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.values()
    cfg = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    if tiny:
        cfg.update(TINY)
    cfg.update(overrides)
    cfg["patch_size"] = tuple(cfg["patch_size"])
    return cfg


def randomize(model, seed, device):
    """Re-draws every parameter (see the module doc) from one seeded generator on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                # RMSNorm weights: near 1, never exactly 1.
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            elif p.ndim == 1:
                v = 0.1 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            else:
                gain = 2.0 if "adaln_proj" in name else 1.0
                v = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
                v.mul_(gain / p.shape[1] ** 0.5)
            p.copy_(v)
            del v


def forward(model, inp):
    with torch.no_grad():
        return model(**inp, return_dict=False)


def write_summary(path, summary):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------- accuracy


def accuracy(args, summary, summary_path):
    cfg = full_config(dict(num_layers=args.layers, num_refiner_layers=args.refiner_layers), args.tiny)
    t_video, t_audio = schedule_timesteps(args.step, args.grid_points)
    model_dir = os.path.join(args.out, "model")

    t0 = time.time()
    with torch.device(DEVICE):
        model = MiniMaxH3Transformer3DModel(**cfg)
    randomize(model, args.seed, DEVICE)
    # Round once to bf16 and save in bf16: every run below (and ours) reads these exact values.
    model = model.to(torch.bfloat16)
    model.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    free_cuda()
    build_save_s = time.time() - t0
    print(f"accuracy model: {params / 1e9:.3f}B parameters, built and saved (bf16) to {model_dir} in "
          f"{build_save_s:.1f}s", flush=True)

    layout = build_layout(cfg, args.width, args.height, args.frames, args.text_rows, t_video, t_audio)
    inp = make_inputs(cfg, layout, args.text_rows, args.seed + 1, DEVICE)
    save_file({k: v.contiguous().cpu() for k, v in inp.items()}, os.path.join(args.out, "inputs.safetensors"))
    seq = int(layout["position_ids"].shape[0])

    outputs = {}
    run_s = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t0 = time.time()
        m = MiniMaxH3Transformer3DModel.from_pretrained(model_dir, torch_dtype=dtype, device_map=DEVICE).eval()
        sample, audio = forward(m, inp)
        sync()
        outputs[f"sample_{dtype_name}"] = sample.float().cpu()
        outputs[f"audio_sample_{dtype_name}"] = audio.float().cpu()
        run_s[dtype_name] = time.time() - t0
        del m, sample, audio
        free_cuda()
    save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(args.out, "reference.safetensors"))

    result = {
        "model_dir": model_dir,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "parameters": params,
        "weights": "seeded random, re-drawn (norm weights 1 + 0.1 N, biases 0.1 N, matrices N(0, 1/fan_in), adaLN "
                   "2x), rounded to bf16 and saved in bf16",
        "case": case_name(args.width, args.height, args.frames, args.text_rows),
        "seq_len": seq,
        "video_rows": int(layout["video_indices"].numel()),
        "audio_rows": int(layout["audio_indices"].numel()),
        "text_rows": args.text_rows,
        "latent_frames": layout["latent_frames"],
        "timesteps": [float(v) for v in layout["timestep"]],
        "grid_step": args.step,
        "t_video": t_video,
        "t_audio": t_audio,
        "build_save_s": build_save_s,
        "load_and_forward_s": run_s,
        "outputs": {},
    }
    for out in ("sample", "audio_sample"):
        fp32, bf16 = outputs[f"{out}_fp32"], outputs[f"{out}_bf16"]
        result["outputs"][out] = {
            "shape": list(fp32.shape),
            "floor_rel_l2": rel_l2(bf16, fp32),
            "floor_cosine": cosine(bf16, fp32),
            "fp32_rms": float(fp32.double().pow(2).mean().sqrt()),
            "finite": bool(torch.isfinite(fp32).all() and torch.isfinite(bf16).all()),
        }
    summary["accuracy"] = result
    write_summary(summary_path, summary)
    print(json.dumps({"accuracy": {k: result[k] for k in ("case", "seq_len", "timesteps", "outputs")}}), flush=True)
    del inp, outputs
    free_cuda()


# ------------------------------------------------------------------------------------------------------- speed


def device_model(cfg, seed):
    """The model with random weights made on the device: bf16, the release's fp32 modules in fp32."""
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**cfg)
    model = model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if name and any(k in name for k in KEEP_FP32):
            module.to(torch.float32)
    model = model.to_empty(device=DEVICE)
    randomize(model, seed, DEVICE)
    # Buffers made at construction (the rotary inv_freq) did not survive the meta device: recompute them.
    fresh = type(model.rope)(rope_freq_dim=cfg["rope_freq_dim"], rope_theta=cfg["rope_theta"])
    model.rope.inv_freq = fresh.inv_freq.to(DEVICE)
    return model.eval()


def time_forward(model, inp, warmup, iters):
    """Median and all per-iteration times in ms after `warmup` calls."""
    for _ in range(warmup):
        forward(model, inp)
    sync()
    times = []
    for _ in range(iters):
        if DEVICE == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            forward(model, inp)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            forward(model, inp)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def reset_peaks():
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peaks():
    if DEVICE != "cuda":
        return {}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def step_flops(cfg, seq, text_rows):
    """Matmul and attention FLOPs of one step (blocks over S rows, the refiner over the text rows)."""
    h, inner, ffn = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]
    per_row = 2 * (4 * h * inner + 3 * h * ffn)
    blocks = cfg["num_layers"] * (seq * per_row + 4 * seq * seq * inner)
    refiner = cfg["num_refiner_layers"] * (text_rows * per_row + 4 * text_rows * text_rows * inner)
    return float(blocks + refiner)


def speed(args, summary, summary_path):
    cfg = full_config(dict(num_layers=args.speed_layers), args.tiny)
    t_video, t_audio = schedule_timesteps(args.step, args.grid_points)
    t0 = time.time()
    model = device_model(cfg, args.seed + 100)
    sync()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    spd = {
        "weights": "random, made on the device (no checkpoint): bf16, with the release's fp32 modules "
                   f"({', '.join(KEEP_FP32)}) in fp32",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "parameters": params,
        "weight_bytes": weight_bytes,
        "build_s": time.time() - t0,
        "grid_step": args.step,
        "t_video": t_video,
        "t_audio": t_audio,
        "warmup": args.warmup,
        "iters": args.iters,
        "timing": "median of per-iteration CUDA event times" if DEVICE == "cuda" else "median of wall times (CPU)",
    }
    summary["speed"] = spd
    summary["cases"] = []
    print(f"speed model: {params / 1e9:.2f}B parameters ({weight_bytes / 2**30:.1f} GiB) made on {DEVICE} in "
          f"{spd['build_s']:.1f}s", flush=True)

    geometries = [(args.width, args.height, args.frames, True)]
    if not args.skip_canvas:
        geometries.append((args.canvas_width, args.canvas_height, args.canvas_frames, False))
    inputs = {}
    for width, height, frames, main_case in geometries:
        layout = build_layout(cfg, width, height, frames, args.text_rows, t_video, t_audio)
        inp = make_inputs(cfg, layout, args.text_rows, args.seed + 1, DEVICE)
        seq = int(layout["position_ids"].shape[0])
        name = case_name(width, height, frames, args.text_rows)
        flops = step_flops(cfg, seq, args.text_rows)
        case = {"name": name, "width": width, "height": height, "frames": frames, "text_rows": args.text_rows,
                "latent_frames": layout["latent_frames"], "seq_len": seq, "flops": flops}
        iters = args.iters if main_case else args.canvas_iters
        warmup = args.warmup if main_case else args.canvas_warmup
        reset_peaks()
        ms, times = time_forward(model, inp, warmup, iters)
        case.update(eager_ms=ms, eager_mean_ms=statistics.mean(times), eager_times_ms=times, eager_tflops=flops / (ms * 1e-3) / 1e12,
                    eager_warmup=warmup, eager_iters=iters, **{f"eager_{k}": v for k, v in peaks().items()})
        print(f"{name} (S = {seq}): eager {ms:.2f} ms ({case['eager_tflops']:.1f} TFLOP/s), peak "
              f"{case.get('eager_peak_allocated_bytes', 0) / 2**30:.2f} GiB allocated", flush=True)
        summary["cases"].append(case)
        write_summary(summary_path, summary)
        if main_case:
            inputs[name] = (inp, case)
        else:
            del inp
        free_cuda()

    if not args.skip_compile:
        (inp, case), = inputs.values()
        mode = None if args.compile_mode == "default" else args.compile_mode
        case["compile_mode"] = args.compile_mode
        case["compile_scope"] = ("repeated blocks (diffusers compile_repeated_blocks)" if args.compile_scope == "blocks"
                                 else "whole model (torch.compile(model))")
        try:
            t0 = time.time()
            if args.compile_scope == "blocks":
                model.compile_repeated_blocks(mode=mode)
                compiled = model
            else:
                compiled = torch.compile(model, mode=mode)
            forward(compiled, inp)
            sync()
            case["compile_s"] = time.time() - t0
            reset_peaks()
            ms, times = time_forward(compiled, inp, args.warmup, args.iters)
            case.update(compiled_ms=ms, compiled_mean_ms=statistics.mean(times), compiled_times_ms=times, compiled_tflops=case["flops"] / (ms * 1e-3) / 1e12,
                        **{f"compiled_{k}": v for k, v in peaks().items()})
            print(f"{case['name']}: torch.compile ({args.compile_scope}, mode {args.compile_mode}) {ms:.2f} ms after "
                  f"{case['compile_s']:.0f}s of compilation", flush=True)
        except Exception as exc:  # report and carry on: the eager figures still stand
            case["compile_error"] = repr(exc)[:800]
            print(f"torch.compile failed: {case['compile_error']}", flush=True)
        write_summary(summary_path, summary)
    del model, inputs
    free_cuda()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true",
                    help="smoke run on CPU: tiny config, 64x64 / 96x64 canvases, 22 frames, 8 text rows")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-canvas", action="store_true", help="skip the default-canvas eager step")
    ap.add_argument("--layers", type=int, default=4, help="blocks of the accuracy model")
    ap.add_argument("--refiner-layers", type=int, default=2, help="refiner blocks of the accuracy model")
    ap.add_argument("--speed-layers", type=int, default=50, help="blocks of the speed model (50: the release)")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--height", type=int, default=448)
    ap.add_argument("--frames", type=int, default=56)
    ap.add_argument("--text-rows", type=int, default=128)
    ap.add_argument("--canvas-width", type=int, default=1344)
    ap.add_argument("--canvas-height", type=int, default=768)
    ap.add_argument("--canvas-frames", type=int, default=124)
    ap.add_argument("--step", type=int, default=30, help="grid step whose video / audio timesteps the inputs take")
    ap.add_argument("--grid-points", type=int, default=50, help="points of the pipeline's grid (its default 50)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--canvas-warmup", type=int, default=1)
    ap.add_argument("--canvas-iters", type=int, default=3)
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--compile-scope", default="blocks", choices=["blocks", "model"])
    args = ap.parse_args()

    global DEVICE
    DEVICE = args.device or ("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.width, args.height, args.frames, args.text_rows = 64, 64, 22, 8
        args.canvas_width, args.canvas_height, args.canvas_frames = 96, 64, 39
        args.speed_layers = min(args.speed_layers, 3)
        args.iters, args.canvas_iters = min(args.iters, 2), min(args.canvas_iters, 2)
        torch.set_num_threads(1)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device (use --tiny or --device cpu for a smoke run)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    summary_path = os.path.join(args.out, "reference.json")
    summary = {
        "generator": "tests/python/h3_dit_reference.py",
        "seed": args.seed,
        "tiny": args.tiny,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
        "attention_backend": os.environ.get("DIFFUSERS_ATTN_BACKEND", "native"),
    }
    started = time.time()
    if not args.skip_accuracy:
        accuracy(args, summary, summary_path)
    if not args.skip_speed:
        speed(args, summary, summary_path)
    summary["total_s"] = time.time() - started
    write_summary(summary_path, summary)
    print(f"wrote {summary_path} ({summary['total_s']:.0f}s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
