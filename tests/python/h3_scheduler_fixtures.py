#!/usr/bin/env python3
"""Reference fixtures for the MiniMax H3 scheduler and noise layout (crates/tf-engines/src/minimax_h3/scheduler.rs,
noise.rs), checked bit for bit by crates/tf-engines/tests/h3_scheduler.rs.

Runs diffusers' MiniMaxH3Scheduler in fp32 on CPU and writes, under the output folder:

  scheduler.safetensors  per case `<case>`: `<case>.sigmas` and `<case>.timesteps` (the grid for N points), and for
                         the stepped cases `<case>.velocities` [steps, 32] (fixed model outputs) and
                         `<case>.samples` [steps + 1, 32] (the start sample, then the sample after every step, as the
                         pipeline's loop step calls `step`); `noising.clean`, `noising.noise` and
                         `noising.t<k>` (`scale_noise` at the levels in the manifest, 0.999 first)
  noise.safetensors      `video_noise` [1, C, F, H, W] and `audio_noise` [2A, A_C] in the pipeline's draw layout, and
                         `video_rows` (the pipeline's `patchify_video_latents` of the video noise)
  manifest.json          versions, the torch CPU capability, and the cases (shift, N or explicit sigmas, stepped)

torch's CPU `linspace` fuses `1 + step * i` into one rounding in its AVX2 and AVX-512 builds and rounds twice in its
plain build (ATEN_CPU_CAPABILITY=default); the fixtures pin the fused result, so the script refuses the plain build.

Regenerate (from the repository root):
  /tmp/h3venv/bin/python tests/python/h3_scheduler_fixtures.py --out tests/fixtures/minimax_h3_scheduler
"""
import argparse
import json
import os
import platform

import numpy as np
import torch
from safetensors.torch import save_file

import diffusers
import safetensors
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

SHIFTS = {"video": 12.0, "audio": 3.0, "identity": 1.0, "fractional": 7.3}
GRID_POINTS = list(range(2, 41)) + [50, 64, 100, 250, 1000]
STEPPED = [2, 3, 8, 30, 50]
WIDTH = 32
NOISE_LEVELS = [0.999, 0.5, 0.25, 1.0, 0.0]
EXPLICIT = [1.0, 0.9, 0.55, 0.3, 0.07, 0.0]


def fixed_values(gen, shape):
    """Random values with a few exact ones mixed in (zero, large and tiny magnitudes)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * 3.0
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 1.0, -1.0e4, 3.0e-6, 65504.0])
    return x


def run_steps(scheduler, gen):
    sample = fixed_values(gen, (WIDTH,))
    velocities = fixed_values(gen, (len(scheduler.timesteps), WIDTH))
    samples = [sample.clone()]
    for i, t in enumerate(scheduler.timesteps):
        sample = scheduler.step(velocities[i], t, sample, return_dict=False)[0]
        samples.append(sample.clone())
    return velocities, torch.stack(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        raise SystemExit("torch runs its plain CPU build here (no fused multiply-add in linspace); run on an AVX2 "
                         "or AVX-512 machine without ATEN_CPU_CAPABILITY=default")
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(20261203)
    tensors, cases = {}, {}
    for label, shift in SHIFTS.items():
        for n in GRID_POINTS:
            case = f"{label}_n{n}"
            s = MiniMaxH3Scheduler(shift=shift)
            s.set_timesteps(n)
            tensors[f"{case}.sigmas"] = s.sigmas.clone()
            tensors[f"{case}.timesteps"] = s.timesteps.clone()
            stepped = n in STEPPED
            if stepped:
                v, xs = run_steps(s, gen)
                tensors[f"{case}.velocities"], tensors[f"{case}.samples"] = v, xs
            cases[case] = dict(shift=shift, points=n, stepped=stepped)
    s = MiniMaxH3Scheduler(shift=12.0)
    s.set_timesteps(sigmas=EXPLICIT)
    tensors["explicit.sigmas"], tensors["explicit.timesteps"] = s.sigmas.clone(), s.timesteps.clone()
    tensors["explicit.velocities"], tensors["explicit.samples"] = run_steps(s, gen)
    cases["explicit"] = dict(shift=12.0, sigmas=EXPLICIT, stepped=True)

    clean, noise = fixed_values(gen, (2, 64)), fixed_values(gen, (2, 64))
    tensors["noising.clean"], tensors["noising.noise"] = clean, noise
    s = MiniMaxH3Scheduler(shift=12.0)
    for k, t in enumerate(NOISE_LEVELS):
        tensors[f"noising.t{k}"] = s.scale_noise(clean, t, noise)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "scheduler.safetensors"))

    # The draw layouts: video (1, C, F, H, W) first, then audio rows (2A, A_C), and the pipeline's patchify.
    video = torch.randn((1, 4, 3, 4, 6), generator=gen, dtype=torch.float32)
    audio = torch.randn((10, 6), generator=gen, dtype=torch.float32)
    rows = patchify_video_latents(video, (1, 2, 2))
    save_file({"video_noise": video, "audio_noise": audio, "video_rows": rows.contiguous()},
              os.path.join(args.out, "noise.safetensors"))

    manifest = dict(
        versions=dict(diffusers=diffusers.__version__, torch=torch.__version__, numpy=np.__version__,
                      safetensors=safetensors.__version__, python=platform.python_version()),
        cpu_capability=capability,
        width=WIDTH,
        noise_levels=NOISE_LEVELS,
        noise=dict(video=[1, 4, 3, 4, 6], audio=[10, 6], patch=[1, 2, 2]),
        cases=cases,
    )
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
