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

Torch FP8 beside ours (--fp8 SPEC, our --precision spelling: `fp8` for H3's default GEMM groups,
qkv,out,mlp_value,mlp_out,ends=1 (ours also keeps the adaLN projections weight-only in INT8, a memory choice torch's
layers here do not copy: their adaLN stays bf16), or GROUP[,GROUP...][,ends=N]): the chosen nn.Linear layers of the blocks between the first and last N become e4m3 GEMMs
quantized as ours are (tests/python/torch_fp8.py: per-output-channel weight scales, per-token activation scales
computed on the fly, torch._scaled_mm row-wise, bf16 output; qkv = attn.to_q/to_k/to_v, out = attn.to_out.0, mlp_in
= ff.net.0.proj (mlp_value / mlp_gate: its value / gate output rows), mlp_out = ff.net.2, adaln = adaln_proj.linear, its activation rows quantized too where ours reads
them in bf16). The accuracy set adds an FP8 run of the bf16 model (accuracy.fp8_torch: rel L2, cosine and ratio to
the floor against fp32 per output; the outputs in fp8_torch.safetensors); the speed run converts the 50-block model
after its bf16 timings and times the main case eager and compiled again (fp8_eager_ms, fp8_compiled_ms and their
peaks in the case). On the CPU the GEMMs are an f32 emulation of the same codes and scales.

--out/reference.json is rewritten after every stage, so a stage stopped by a time limit keeps the earlier ones.
Each speed case is named WIDTHxHEIGHT_FRAMESf_TEXTt (e.g. 768x448_56f_128t), as `tf bench h3-dit` looks it up.

Usage (GPU machine, diffusers on PYTHONPATH):
    python3 tests/python/h3_dit_reference.py --out /tmp/h3dit [--skip-speed] [--skip-compile] [--skip-canvas] \
        [--fp8 qkv,out,mlp_value,mlp_out,ends=1]
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

import board_energy
from safetensors.torch import save_file

import torch_fp8

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
# The board's NVML handle for the energy of the timed steps (board_energy.py); None on the CPU or without NVML.
BOARD = None

# Our FP8 groups on a MiniMaxH3TransformerBlock's modules (docs/ENGINES.md, "MiniMax H3 DiT in FP8"); H3's `fp8`.
H3_FP8_MODULES = {
    "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "out": ("attn.to_out.0",),
    "mlp_in": ("ff.net.0.proj",),
    # ff.net.0.proj's output rows are [value; gate]: our mlp_value / mlp_gate halves.
    "mlp_value": ("ff.net.0.proj@0",),
    "mlp_gate": ("ff.net.0.proj@1",),
    "mlp_out": ("ff.net.2",),
    "adaln": ("adaln_proj.linear",),
}
H3_FP8_DEFAULT = "qkv,out,mlp_value,mlp_out,ends=1"


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


def convert_fp8(model, spec):
    """Swaps the blocks' layers that `spec` names for FP8 ones in place; what was converted, for the JSON."""
    groups, ends = torch_fp8.parse_spec(spec, H3_FP8_DEFAULT)
    select = torch_fp8.block_selector("transformer_blocks", len(model.transformer_blocks), H3_FP8_MODULES, groups,
                                      ends)
    done = torch_fp8.convert(model, select)
    return {"precision": torch_fp8.spec_string(groups, ends), "converted_layers": len(done["converted"]),
            "skipped_layers": done["skipped"],
            "gemm": ("torch._scaled_mm, row-wise scales, bf16 out" if DEVICE == "cuda"
                     else "CPU emulation (dequantized codes, f32 matmul, bf16 out)")}


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
    if args.fp8:
        result["fp8_torch"] = accuracy_fp8(args, model_dir, inp, outputs, result["outputs"])
    summary["accuracy"] = result
    write_summary(summary_path, summary)
    print(json.dumps({"accuracy": {k: result[k] for k in ("case", "seq_len", "timesteps", "outputs")}}), flush=True)
    del inp, outputs
    free_cuda()


def accuracy_fp8(args, model_dir, inp, outputs, floors):
    """The bf16 model with its blocks' chosen layers in FP8, against fp32 beside the bf16 floor."""
    try:
        t0 = time.time()
        m = MiniMaxH3Transformer3DModel.from_pretrained(model_dir, torch_dtype=torch.bfloat16, device_map=DEVICE).eval()
        res = convert_fp8(m, args.fp8)
        sample, audio = forward(m, inp)
        sync()
        res["load_and_forward_s"] = time.time() - t0
        got = {"sample": sample.float().cpu(), "audio_sample": audio.float().cpu()}
        del m, sample, audio
        free_cuda()
    except Exception as exc:  # report and carry on: the bf16 / fp32 set still stands
        print(f"torch FP8 accuracy run failed: {exc!r}"[:800], flush=True)
        return {"error": repr(exc)[:800]}
    save_file({f"{k}_fp8_torch": v.contiguous() for k, v in got.items()},
              os.path.join(args.out, "fp8_torch.safetensors"))
    res["outputs"] = {}
    for out, o in got.items():
        fp32, bf16 = outputs[f"{out}_fp32"], outputs[f"{out}_bf16"]
        err, floor = rel_l2(o, fp32), floors[out]["floor_rel_l2"]
        res["outputs"][out] = {"rel_l2": err, "cosine": cosine(o, fp32), "floor_rel_l2": floor,
                               "ratio_to_floor": err / floor if floor > 0 else float("inf"),
                               "rel_l2_vs_bf16": rel_l2(o, bf16), "finite": bool(torch.isfinite(o).all())}
    print(json.dumps({"fp8_torch": res}), flush=True)
    return res


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
        if main_case:
            # The board's joules a step over about two seconds of steps (board_energy.py; absent without NVML).
            case["eager_j"] = board_energy.joules_per_call(BOARD, lambda: forward(model, inp), ms)
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
            case["compiled_j"] = board_energy.joules_per_call(BOARD, lambda: forward(compiled, inp), ms)
            print(f"{case['name']}: torch.compile ({args.compile_scope}, mode {args.compile_mode}) {ms:.2f} ms after "
                  f"{case['compile_s']:.0f}s of compilation", flush=True)
        except Exception as exc:  # report and carry on: the eager figures still stand
            case["compile_error"] = repr(exc)[:800]
            print(f"torch.compile failed: {case['compile_error']}", flush=True)
        write_summary(summary_path, summary)
    if args.fp8:
        speed_fp8(args, model, inputs, summary_path, summary)
    del model, inputs
    free_cuda()


def speed_fp8(args, model, inputs, summary_path, summary):
    """The speed model with its blocks' chosen layers in FP8: the main case eager, then compiled as the bf16 run."""
    (inp, case), = inputs.values()
    try:
        # Drop the bf16 compiled code first: nothing it caches may keep the bf16 weights alive.
        torch._dynamo.reset()
        t0 = time.time()
        info = convert_fp8(model, args.fp8)
        sync()
        free_cuda()
        case.update(fp8_precision=info["precision"], fp8_gemm=info["gemm"], fp8_converted_layers=info["converted_layers"],
                    fp8_skipped_layers=info["skipped_layers"], fp8_convert_s=time.time() - t0,
                    fp8_weight_bytes=torch_fp8.module_bytes(model))
        # Eager again: undo compile_repeated_blocks' per-block compiled call (nn.Module.compile).
        for m in model.modules():
            if getattr(m, "_compiled_call_impl", None) is not None:
                m._compiled_call_impl = None
        reset_peaks()
        ms, times = time_forward(model, inp, args.warmup, args.iters)
        case.update(fp8_eager_ms=ms, fp8_eager_mean_ms=statistics.mean(times), fp8_eager_times_ms=times,
                    fp8_eager_tflops=case["flops"] / (ms * 1e-3) / 1e12,
                    **{f"fp8_eager_{k}": v for k, v in peaks().items()})
        print(f"{case['name']}: torch FP8 ({info['precision']}, {info['converted_layers']} layers) eager {ms:.2f} ms, "
              f"peak {case.get('fp8_eager_peak_allocated_bytes', 0) / 2**30:.2f} GiB allocated", flush=True)
    except Exception as exc:  # report and carry on: the bf16 figures still stand
        case["fp8_error"] = repr(exc)[:800]
        print(f"torch FP8 speed run failed: {case['fp8_error']}", flush=True)
        write_summary(summary_path, summary)
        return
    write_summary(summary_path, summary)
    if args.skip_compile:
        return
    mode = None if args.compile_mode == "default" else args.compile_mode
    try:
        torch._dynamo.reset()
        t0 = time.time()
        if args.compile_scope == "blocks":
            model.compile_repeated_blocks(mode=mode)
            compiled = model
        else:
            compiled = torch.compile(model, mode=mode)
        forward(compiled, inp)
        sync()
        case["fp8_compile_s"] = time.time() - t0
        reset_peaks()
        ms, times = time_forward(compiled, inp, args.warmup, args.iters)
        case.update(fp8_compiled_ms=ms, fp8_compiled_mean_ms=statistics.mean(times), fp8_compiled_times_ms=times,
                    fp8_compiled_tflops=case["flops"] / (ms * 1e-3) / 1e12,
                    **{f"fp8_compiled_{k}": v for k, v in peaks().items()})
        print(f"{case['name']}: torch FP8 torch.compile ({args.compile_scope}, mode {args.compile_mode}) {ms:.2f} ms "
              f"after {case['fp8_compile_s']:.0f}s of compilation", flush=True)
    except Exception as exc:  # report and carry on: the eager figures still stand
        case["fp8_compile_error"] = repr(exc)[:800]
        print(f"torch FP8 torch.compile failed: {case['fp8_compile_error']}", flush=True)
    write_summary(summary_path, summary)


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
    ap.add_argument("--fp8", default=None, metavar="SPEC",
                    help="also run torch FP8: fp8 (H3's default, " + H3_FP8_DEFAULT + ") or GROUP[,GROUP...][,ends=N] "
                         "with GROUP one of qkv, out, mlp_in, mlp_out, adaln, all")
    args = ap.parse_args()
    if args.fp8:
        try:
            torch_fp8.parse_spec(args.fp8, H3_FP8_DEFAULT)
        except ValueError as exc:
            raise SystemExit(f"--fp8: {exc}")

    global DEVICE, BOARD
    DEVICE = args.device or ("cpu" if args.tiny else "cuda")
    BOARD = board_energy.open_board(0) if DEVICE == "cuda" else None
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
