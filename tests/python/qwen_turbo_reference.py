#!/usr/bin/env python3
"""Full-size Qwen-Image 2.1 Turbo reference run: diffusers 0.42.1 QwenImage21TurboModularPipeline in bf16.

The Turbo checkpoint has the base architecture; its folder differs by its pipeline config (a non-empty
`sample_sigmas` in model_index.json, which makes diffusers' modular loader pick QwenImage21TurboModularPipeline) and
its scheduler config. This script makes such a folder and runs the reference on it, in the layout
tests/python/compare_pipeline.py judges (the one qwen_pipeline_reference.py writes, docs/gpu-runs/README.md):

  model/                 model_index.json (the base index + sample_sigmas), scheduler/ (SCHEDULER_TURBO), and
                         transformer/, text_encoder/, vae/, processor/ linked from --base-model (the folder
                         qwen_pipeline_reference.py saved: no second copy of ~32 GB) or, without one, from
                         base/model built here with that script's seeded random weights
  prompt.txt             the prompt, as given to both
  reference.json         settings, timings, memory, floors (also printed)
  WxH/noise.safetensors  "noise": [1, 1, C, h, w] bf16 (tf image --noise)
  WxH/stepsN/reference.safetensors, reference.png, fp32.safetensors   as qwen_pipeline_reference.py writes them

It loads the folder with ModularPipeline.from_pretrained (which must resolve to the Turbo class; timed, from page
cache), warms up (two steps, `sigmas` cut from the grid), then runs the checkpoint's own grid (8 steps) once for
each size with injected noise and `use_kv_cache=True`: per-step velocities (the transformer output on the target
tokens, hooked) and latents (the scheduler's step, wrapped), wall times per phase synchronized with the device,
peak device memory and the image. Then the same weights in fp32 run the first --fp32-steps steps from the same
noise: the floor (the bf16 reference's per-step velocity rel L2 against fp32).

Usage:
    python3 tests/python/qwen_turbo_reference.py --out /tmp/qwen21t --base-model /tmp/qwen21p/model   # GPU
    python3 tests/python/qwen_turbo_reference.py --out /tmp/qwen21t-tiny --tiny                      # CPU smoke
"""

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
import types

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import qwen_pipeline_reference as base  # noqa: E402  (builders, device timing, image helpers)

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, ModularPipeline, QwenImage21Transformer2DModel  # noqa: E402
from transformers import Qwen3VLForConditionalGeneration  # noqa: E402

# The grid of tests/fixtures/qwen_turbo_pipeline (8 steps) and a constant shift of 3 whatever the resolution (the
# dynamic exponential shift with base_shift = max_shift = ln 3), the scheduler shape of distilled few-step
# checkpoints.
TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]
SCHEDULER_TURBO = dict(use_dynamic_shifting=True, base_shift=math.log(3.0), max_shift=math.log(3.0),
                       base_image_seq_len=256, max_image_seq_len=8192, shift=1.0, time_shift_type="exponential")
LINKED = ("transformer", "text_encoder", "vae", "processor")
log = base.log


class StopRun(Exception):
    """Raised from the wrapped scheduler step to end a run after the steps it needs."""


def complete_folder(path):
    return path and all(os.path.exists(os.path.join(path, name)) for name in ("model_index.json", *LINKED))


def make_turbo_folder(out, base_model):
    model_dir = os.path.join(out, "model")
    shutil.rmtree(model_dir, ignore_errors=True)
    os.makedirs(os.path.join(model_dir, "scheduler"))
    with open(os.path.join(base_model, "model_index.json")) as f:
        index = json.load(f)
    index["sample_sigmas"] = TURBO_SIGMAS
    with open(os.path.join(model_dir, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_TURBO).save_config(os.path.join(model_dir, "scheduler"))
    for name in LINKED:
        os.symlink(os.path.abspath(os.path.join(base_model, name)), os.path.join(model_dir, name))
    return model_dir


def load_turbo(model_dir, dev, processor):
    """ModularPipeline.from_pretrained on the folder (the Turbo class, or an error), components in bf16, moved."""
    t0 = time.perf_counter()
    pipe = ModularPipeline.from_pretrained(model_dir)
    if type(pipe).__name__ != "QwenImage21TurboModularPipeline":
        raise RuntimeError(f"{model_dir} loads as {type(pipe).__name__}, not QwenImage21TurboModularPipeline")
    pipe.load_components(names=["transformer", "text_encoder", "vae"], dtype=torch.bfloat16)
    pipe.load_components(names=["scheduler"])
    if base.HAVE_TORCHVISION:
        pipe.load_components(names=["processor"])
    else:
        # Without torchvision the saved processor cannot be loaded (no video processor class): hand it over built.
        pipe.update_components(processor=processor)
    pipe = pipe.to(dev.name)
    pipe.set_progress_bar_config(disable=True)
    return pipe, dev.now() - t0


def fp32_pipeline(pipe, model_dir, dev):
    """The same weights in fp32, built fresh so non-persistent buffers (RoPE, timestep tables) are fp32 too."""
    with torch.device(dev.name):
        transformer = QwenImage21Transformer2DModel.from_config(pipe.transformer.config)
    transformer.load_state_dict(pipe.transformer.state_dict())
    with torch.device(dev.name):
        text_encoder = Qwen3VLForConditionalGeneration(pipe.text_encoder.config)
    text_encoder.load_state_dict(pipe.text_encoder.state_dict())
    pipe32 = ModularPipeline.from_pretrained(model_dir)
    pipe32.update_components(transformer=transformer.to(torch.float32).eval(),
                             text_encoder=text_encoder.to(torch.float32).eval(), vae=pipe.vae,
                             processor=pipe.processor,
                             scheduler=FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config))
    pipe32.set_progress_bar_config(disable=True)
    return pipe32


class Recorder:
    """Hooks the transformer and the text encoder and wraps the scheduler's step: velocities and latents per step,
    synchronized phase boundaries; raises StopRun after `stop_after` steps."""

    def __init__(self, pipe, dev, target_tokens, stop_after=None):
        self.dev, self.pipe, self.target_tokens, self.stop_after = dev, pipe, target_tokens, stop_after
        self.velocities, self.latents = [], []
        self.step_start, self.step_end, self.te_start, self.te_end = [], [], [], []
        self.handles = [
            pipe.transformer.register_forward_pre_hook(lambda m, a: self.step_start.append(dev.now())),
            pipe.transformer.register_forward_hook(self._velocity),
            pipe.text_encoder.register_forward_pre_hook(lambda m, a: self.te_start.append(dev.now())),
            pipe.text_encoder.register_forward_hook(lambda m, a, o: self.te_end.append(dev.now())),
        ]
        self.scheduler_step = pipe.scheduler.step
        pipe.scheduler.step = self._step

    def _velocity(self, module, args, output):
        out = output[0] if isinstance(output, (tuple, list)) else output.sample
        self.velocities.append(out[:, -self.target_tokens:].detach().clone())

    def _step(self, *args, **kwargs):
        out = self.scheduler_step(*args, **kwargs)
        self.step_end.append(self.dev.now())
        self.latents.append(out[0].detach().clone())
        if self.stop_after is not None and len(self.latents) >= self.stop_after:
            raise StopRun()
        return out

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.pipe.scheduler.step = self.scheduler_step


def run_pipeline(pipe, dev, prompt, noise_packed, width, height, sigmas=None, stop_after=None):
    recorder = Recorder(pipe, dev, noise_packed.shape[1], stop_after)
    extra = {} if sigmas is None else dict(sigmas=sigmas)
    image = None
    # The modular pipeline logs every exception out of its blocks with a traceback; StopRun is no error.
    block_logger = logging.getLogger("diffusers.modular_pipelines.modular_pipeline")
    level = block_logger.level
    if stop_after is not None:
        block_logger.setLevel(logging.CRITICAL)
    try:
        t0 = dev.now()
        try:
            with torch.no_grad():
                state = pipe(prompt=prompt, height=height, width=width, latents=noise_packed, output_type="pt",
                             use_kv_cache=True, **extra)
            image = state.get("images")
        except StopRun:
            pass
        t_end = dev.now()
    finally:
        recorder.remove()
        block_logger.setLevel(level)
    steps = len(pipe.scheduler.sigmas) - 1
    expected = steps if stop_after is None else min(steps, stop_after)
    if not (len(recorder.step_end) == len(recorder.velocities) == len(recorder.step_start) == expected):
        raise RuntimeError(f"expected {expected} steps, recorded {len(recorder.step_end)} step ends, "
                           f"{len(recorder.velocities)} velocities and {len(recorder.step_start)} transformer calls "
                           "(a second, guided call per step?)")
    ms = lambda a, b: (b - a) * 1000.0  # noqa: E731
    timings = dict(
        encode_ms=ms(t0, recorder.step_start[0]),
        text_encoder_forward_ms=sum(ms(a, b) for a, b in zip(recorder.te_start, recorder.te_end)),
        steps_ms=[ms(a, b) for a, b in zip(recorder.step_start, recorder.step_end)],
        decode_ms=ms(recorder.step_end[-1], t_end) if image is not None else None,
        total_ms=ms(t0, t_end),
    )
    timings["steps_sum_ms"] = sum(timings["steps_ms"])
    recorder.sigmas = [float(v) for v in pipe.scheduler.sigmas]
    recorder.euler_rel_l2 = base.euler_check(noise_packed, recorder)
    return recorder, timings, image, steps


def build_base(args, dev, summary):
    """The base folder, built here with qwen_pipeline_reference.py's seeded weights when none is given."""
    build_args = types.SimpleNamespace(out=os.path.join(args.out, "base"), tiny=args.tiny, layers=args.layers,
                                       seed=args.seed, reuse_transformer=None)
    os.makedirs(build_args.out, exist_ok=True)
    base_summary = {}
    model_dir, processor = base.build_and_save(build_args, dev, base_summary)
    summary["base_build"] = base_summary
    return model_dir, processor


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base-model", default=None,
                    help="a pipeline folder saved by qwen_pipeline_reference.py whose components are linked")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke run of this script)")
    ap.add_argument("--sizes", default=None, help="WxH[,WxH...] (default 1024x1024; tiny 64x64)")
    ap.add_argument("--fp32-steps", type=int, default=len(TURBO_SIGMAS),
                    help="steps of the fp32 floor run per size (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=base.DEFAULT_PROMPT)
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--layers", type=int, default=None, help="smoke runs: this many layers (full width otherwise)")
    args = ap.parse_args()
    sizes = base.parse_sizes(args.sizes or ("64x64" if args.tiny else "1024x1024"))
    dev = base.Device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    summary = dict(
        versions=dict(diffusers=diffusers.__version__, transformers=transformers.__version__,
                      torch=torch.__version__),
        device=torch.cuda.get_device_name(0) if dev.cuda else "cpu",
        variant="turbo", tiny=args.tiny, layers=args.layers, seed=args.seed, prompt=args.prompt,
        sample_sigmas=TURBO_SIGMAS, scheduler=SCHEDULER_TURBO, use_kv_cache=True, dtype="bfloat16",
        noise_tensor="noise", cases=[],
    )
    with open(os.path.join(args.out, "prompt.txt"), "w", encoding="utf-8") as f:
        f.write(args.prompt)

    processor = None
    if complete_folder(args.base_model):
        base_model = args.base_model
        summary["components_from"] = os.path.abspath(base_model)
        if not base.HAVE_TORCHVISION:
            processor = base.build_processor(os.path.join(args.out, "tokenizer-src"), 16)
    else:
        if args.base_model:
            log(f"--base-model {args.base_model} is not a complete pipeline folder; building the components")
        base_model, processor = build_base(args, dev, summary)
        summary["components_from"] = "built (qwen_pipeline_reference.py, same seed)"
    model_dir = make_turbo_folder(args.out, base_model)
    log(f"Turbo folder {model_dir}: sample_sigmas {TURBO_SIGMAS}, components linked from {base_model}")

    pipe, load_s = load_turbo(model_dir, dev, processor)
    summary["pipeline_class"] = type(pipe).__name__
    summary["reference_load_s"] = load_s
    summary["resident"] = dev.memory()
    log(f"{type(pipe).__name__} loaded in {load_s:.1f}s; resident {dev.memory()}")
    channels = pipe.transformer.config.in_channels

    # Warm-up: the first call pays for kernel loading and library handles; two steps of the grid, not timed.
    w0, h0 = sizes[0]
    g = torch.Generator().manual_seed(args.seed + 100)
    warm = torch.randn(1, (h0 // 16) * (w0 // 16), channels, generator=g).to(dev.name, torch.bfloat16)
    dev.reset_peak(release_cache=True)
    _, warm_timings, _, _ = run_pipeline(pipe, dev, args.prompt, warm, w0, h0, sigmas=TURBO_SIGMAS[:2])
    summary["warmup"] = dict(warm_timings, memory=dev.peak())
    log(f"warm-up run (2 steps): {warm_timings['total_ms']:.0f} ms")

    runs = {}
    for width, height in sizes:
        size_dir = os.path.join(args.out, f"{width}x{height}")
        os.makedirs(size_dir, exist_ok=True)
        lat_h, lat_w = height // 16, width // 16
        g = torch.Generator().manual_seed(args.seed + 1000 + width * 7 + height)
        noise = torch.randn(1, 1, channels, lat_h, lat_w, generator=g).to(torch.bfloat16)
        save_file({"noise": noise.contiguous()}, os.path.join(size_dir, "noise.safetensors"))
        packed = noise.view(1, channels, lat_h * lat_w).transpose(1, 2).contiguous()
        dev.reset_peak()
        before = dev.memory()
        recorder, timings, image, steps = run_pipeline(pipe, dev, args.prompt, packed.to(dev.name), width, height)
        case_dir = os.path.join(size_dir, f"steps{steps}")
        os.makedirs(case_dir, exist_ok=True)
        case = dict(name=f"{width}x{height}/steps{steps}", width=width, height=height, steps=steps,
                    target_tokens=lat_h * lat_w, channels=channels, timings=timings,
                    memory=dict(before=before, **dev.peak()), sigmas=recorder.sigmas,
                    euler_check_rel_l2=recorder.euler_rel_l2)
        tensors = {}
        for i, (v, x) in enumerate(zip(recorder.velocities, recorder.latents)):
            tensors[f"velocity.{i}"] = v.float().cpu().contiguous()
            tensors[f"latents.{i}"] = x.float().cpu().contiguous()
        tensors["image"] = image.float().cpu().contiguous()
        save_file(tensors, os.path.join(case_dir, "reference.safetensors"))
        base.to_png(image, os.path.join(case_dir, "reference.png"))
        case["image"] = base.image_stats(image)
        case["velocity_norms"] = [float(v.float().norm()) for v in recorder.velocities]
        if not all(math.isfinite(n) for n in case["velocity_norms"]):
            raise RuntimeError(f"{case['name']}: non-finite velocity norms {case['velocity_norms']}")
        runs[case["name"]] = (recorder.velocities, recorder.latents)
        summary["cases"].append(case)
        log(f"{case['name']}: encode {timings['encode_ms']:.1f} ms, steps {timings['steps_sum_ms']:.1f} ms "
            f"(mean {timings['steps_sum_ms'] / steps:.1f}), decode {timings['decode_ms']:.1f} ms, "
            f"end to end {timings['total_ms']:.1f} ms; peak {case['memory']}")

    if args.fp32_steps > 0:
        t0 = time.perf_counter()
        pipe32 = fp32_pipeline(pipe, model_dir, dev)
        summary["fp32_build_s"] = time.perf_counter() - t0
        log(f"fp32 copy built in {summary['fp32_build_s']:.1f}s; resident {dev.memory()}")
        for case in summary["cases"]:
            width, height, steps = case["width"], case["height"], case["steps"]
            lat_h, lat_w = height // 16, width // 16
            size_dir = os.path.join(args.out, f"{width}x{height}")
            noise = load_file(os.path.join(size_dir, "noise.safetensors"))["noise"]
            packed = noise.view(1, channels, lat_h * lat_w).transpose(1, 2).float().contiguous().to(dev.name)
            stop = min(args.fp32_steps, steps)
            t1 = time.perf_counter()
            recorder, timings32, _, _ = run_pipeline(pipe32, dev, args.prompt, packed, width, height, stop_after=stop)
            velocities16, latents16 = runs[case["name"]]
            tensors, floors = {}, []
            for i, (v32, x32) in enumerate(zip(recorder.velocities, recorder.latents)):
                tensors[f"velocity.{i}"] = v32.float().cpu().contiguous()
                tensors[f"latents.{i}"] = x32.float().cpu().contiguous()
                floors.append(dict(step=i, velocity_rel_l2=base.rel_l2(velocities16[i].float(), v32.float()),
                                   velocity_cosine=base.cosine(velocities16[i].float(), v32.float()),
                                   latents_rel_l2=base.rel_l2(latents16[i].float(), x32.float())))
            save_file(tensors, os.path.join(size_dir, f"steps{steps}", "fp32.safetensors"))
            case["fp32"] = dict(steps=stop, seconds=time.perf_counter() - t1, timings=timings32,
                                euler_check_rel_l2=recorder.euler_rel_l2)
            case["floor"] = floors
            log(f"{case['name']}: floor (bf16 vs fp32 velocity rel L2 per step) "
                + ", ".join(f"{f['velocity_rel_l2']:.4g}" for f in floors))
        del pipe32
    summary["total_s"] = time.perf_counter() - started
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    log(f"done in {summary['total_s']:.1f}s; summary in {os.path.join(args.out, 'reference.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
