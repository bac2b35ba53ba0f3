#!/usr/bin/env python3
"""A tiny Qwen-Image 2.1 Turbo model folder and what diffusers' QwenImage21TurboModularPipeline computes on it.

The Turbo checkpoint has the base architecture; what makes a folder Turbo is its pipeline config: diffusers'
modular loader maps a `model_index.json` with a non-empty `sample_sigmas` to QwenImage21TurboModularPipeline
(`modular_pipelines/modular_pipeline.py`, `_qwenimage21_map_fn`), which samples that grid (8 steps by default when
there is none), with no guidance and no negative prompt (an unexpected `negative_prompt` or `guidance_scale` is
ignored with a warning).

So the folder written here shares the tiny components of tests/fixtures/qwen_pipeline/model (built by
qwen_pipeline_tiny.py) through relative symbolic links, and has its own:

  model/model_index.json                  the base index with `sample_sigmas` (8 values)
  model/scheduler/scheduler_config.json   a constant shift of 3 (dynamic exponential shift with base_shift =
                                          max_shift = ln 3), the shape distilled few-step checkpoints ship
  model/{transformer,text_encoder,vae,processor} -> ../../qwen_pipeline/model/...

The pipeline is loaded with `ModularPipeline.from_pretrained` (which must resolve to the Turbo class) and run in fp32
on the CPU with `use_kv_cache=True`, from the packed noise of the portable generator (tf_engines::noise). One more
case loads the base folder with the Turbo blocks named explicitly (`QwenImage21TurboAutoBlocks().init_pipeline`):
no `sample_sigmas`, so its default of 8 linspace steps. Recorded in expected.safetensors, per case:

  {case}.prompt_ids      the processor's ids of the filled template (manifest.drop_idx leading rows dropped)
  {case}.noise           the initial packed latents [h * w, 16]
  {case}.sigmas          the scheduler's sigmas after set_timesteps (terminal 0 included)
  {case}.prompt_embeds   the prompt features the transformer read [rows, 48]
  {case}.velocity.{i}    the transformer output on the target tokens at step i [h * w, 16]
  {case}.latents.{i}     the packed latents after step i
  {case}.decoded         the VAE output [4, H, W] in [-1, 1]
  {case}.image_u8        the pipeline's uint8 image [H, W, 4]

Regenerate from the repository root (after qwen_pipeline_tiny.py, whose folder this one links):
  /path/to/python tests/python/qwen_turbo_fixtures.py --out tests/fixtures/qwen_turbo_pipeline
"""
import argparse
import json
import math
import os
import shutil
import sys
import warnings

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The base fixture's builder: the portable noise, the processor without its video part (no torchvision here).
import qwen_pipeline_tiny as tiny  # noqa: E402

import diffusers  # noqa: E402
from diffusers import (FlowMatchEulerDiscreteScheduler, ModularPipeline, QwenImage21TurboAutoBlocks,  # noqa: E402
                       QwenImage21TurboModularPipeline)
from transformers import PreTrainedTokenizerFast  # noqa: E402

TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]
SCHEDULER_TURBO = dict(use_dynamic_shifting=True, base_shift=math.log(3.0), max_shift=math.log(3.0),
                       base_image_seq_len=256, max_image_seq_len=8192, shift=1.0, time_shift_type="exponential")
LINKED = ("transformer", "text_encoder", "vae", "processor")

# (name, folder, prompt, extra pipeline inputs, height, width, seed)
CASES = [
    ("fox", "turbo", "a red fox in the snow", {}, 64, 64, 42),
    # Guidance asked of a Turbo folder: the reference warns and ignores both inputs.
    ("ignored_guidance", "turbo",
     "A capybara wearing a wizard hat, reading an old book by candlelight in a stone tower, oil painting",
     dict(negative_prompt="blurry", guidance_scale=4.0), 64, 96, 7),
    # The Turbo class named explicitly on the base folder: no sample_sigmas, 8 linspace steps.
    ("forced_turbo", "base", "a lighthouse on a cliff at dusk", {}, 96, 64, 2026),
]


def write_folder(out, base_model):
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
        target = os.path.relpath(os.path.join(base_model, name), model_dir)
        os.symlink(target, os.path.join(model_dir, name))
    return model_dir


def load(model_dir, explicit_class):
    """The modular pipeline of `model_dir` in fp32: the class the folder resolves to, or the Turbo blocks named
    explicitly (`QwenImage21TurboAutoBlocks().init_pipeline`)."""
    if explicit_class:
        pipe = QwenImage21TurboAutoBlocks().init_pipeline(model_dir)
    else:
        pipe = ModularPipeline.from_pretrained(model_dir)
    pipe.load_components(names=["transformer", "text_encoder", "vae", "scheduler"], dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(model_dir, "processor"))
    pipe.update_components(processor=tiny.make_processor(tokenizer))
    for name in ("transformer", "text_encoder", "vae"):
        getattr(pipe, name).eval().float()
    return pipe


def drop_idx(pipe):
    sys_message = [{"role": "system", "content": [{"type": "text", "text": "Comprehend and analyze the provided prompt."}]}]
    return len(pipe.processor.apply_chat_template(sys_message, tokenize=True, return_dict=False)[0])


def run_case(pipe, case, tensors):
    name, folder, prompt, extra, height, width, seed = case
    lat_h, lat_w = 2 * (height // 32), 2 * (width // 32)
    target = lat_h * lat_w
    noise = tiny.packed_noise(seed, tiny.LATENT_CHANNELS, lat_h, lat_w)
    tensors[f"{name}.noise"] = noise[0].clone()
    templated = ("<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
                 f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    ids = pipe.processor(text=[templated], padding=True, padding_side="left", return_tensors="pt").input_ids
    tensors[f"{name}.prompt_ids"] = ids[0].to(torch.int64).clone()

    velocities, latents, decoded = [], [], []
    hook = pipe.transformer.register_forward_hook(
        lambda m, a, out: velocities.append(out[0][:, -target:].detach().clone()))
    scheduler_step = pipe.scheduler.step
    vae_decode = pipe.vae.decode

    def recording_step(*args, **kwargs):
        out = scheduler_step(*args, **kwargs)
        latents.append(out[0].detach().clone())
        return out

    def recording_decode(*args, **kwargs):
        out = vae_decode(*args, **kwargs)
        decoded.append(out[0].detach().clone())
        return out

    pipe.scheduler.step = recording_step
    pipe.vae.decode = recording_decode
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            state = pipe(prompt=prompt, height=height, width=width, latents=noise.clone(), output_type="np",
                         use_kv_cache=True, **extra)
    finally:
        hook.remove()
        pipe.scheduler.step = scheduler_step
        pipe.vae.decode = vae_decode
    ignored = [str(w.message) for w in caught if "Unexpected input" in str(w.message)]
    if extra and not ignored:
        raise RuntimeError(f"{name}: the reference did not report {sorted(extra)} as ignored")
    steps = state.get("num_inference_steps")
    sigmas = pipe.scheduler.sigmas.clone().float()
    if len(latents) != steps or len(velocities) != steps or len(decoded) != 1:
        raise RuntimeError(f"{name}: {steps} steps but {len(latents)} latents, {len(velocities)} transformer calls "
                           f"and {len(decoded)} decodes recorded")
    tensors[f"{name}.sigmas"] = sigmas
    tensors[f"{name}.prompt_embeds"] = state.get("prompt_embeds")[0].detach().clone()
    for i, (v, x) in enumerate(zip(velocities, latents)):
        tensors[f"{name}.velocity.{i}"] = v[0].contiguous()
        tensors[f"{name}.latents.{i}"] = x[0].contiguous()
    tensors[f"{name}.decoded"] = decoded[0][0, :, 0].contiguous()
    images = state.get("images")
    u8 = (images[0] * 255).round().astype("uint8")  # what numpy_to_pil does
    tensors[f"{name}.image_u8"] = torch.from_numpy(np.ascontiguousarray(u8))
    return dict(name=name, folder=folder, pipeline_class=type(pipe).__name__, prompt=prompt,
                negative_prompt=extra.get("negative_prompt"), guidance_scale=extra.get("guidance_scale"),
                reference_warnings=ignored, height=height, width=width, steps=steps, seed=seed,
                latent_height=lat_h, latent_width=lat_w, image_shape=list(u8.shape))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures/qwen_turbo_pipeline")
    parser.add_argument("--base", default=None, help="the base fixture's model folder "
                        "(default: qwen_pipeline/model beside --out)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base_model = args.base or os.path.join(os.path.dirname(os.path.abspath(args.out)), "qwen_pipeline", "model")
    if not os.path.isfile(os.path.join(base_model, "model_index.json")):
        raise SystemExit(f"{base_model} is not the base fixture folder; run qwen_pipeline_tiny.py first")
    os.makedirs(args.out, exist_ok=True)
    model_dir = write_folder(args.out, base_model)

    pipes = {"turbo": load(model_dir, explicit_class=False), "base": load(base_model, explicit_class=True)}
    for folder, pipe in pipes.items():
        pipe.set_progress_bar_config(disable=True)
        if type(pipe) is not QwenImage21TurboModularPipeline:
            raise RuntimeError(f"{folder}: loaded as {type(pipe).__name__}, not the Turbo pipeline")
    if ModularPipeline.from_pretrained(base_model).__class__.__name__ != "QwenImage21ModularPipeline":
        raise RuntimeError("the base folder should resolve to QwenImage21ModularPipeline")

    tensors, cases = {}, []
    for case in CASES:
        cases.append(run_case(pipes[case[1]], case, tensors))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "expected.safetensors"))
    with open(os.path.join(model_dir, "scheduler", "scheduler_config.json")) as f:
        scheduler_config = json.load(f)
    manifest = dict(generator="tests/python/qwen_turbo_fixtures.py", versions=tiny.versions(),
                    detection="model_index.json sample_sigmas non-empty -> QwenImage21TurboModularPipeline",
                    sample_sigmas=TURBO_SIGMAS, scheduler=scheduler_config, linked=list(LINKED),
                    drop_idx=drop_idx(pipes["turbo"]), use_kv_cache=True, dtype="float32", cases=cases)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
