#!/usr/bin/env python3
"""The MiniMax H3 audio VAE decoder in diffusers on the GPU: the reference figures `tf bench h3-audio-vae` prints
beside its own (same run, same machine, same folder and latents).

Builds `AutoencoderKLMiniMaxH3Audio` at its default (released) config with seeded random weights: the default
initialisation, the SnakeBeta `alpha` / `beta` (zero by default) re-drawn around 0, random `latents_mean` /
`latents_std`, and `conv_post`'s gain set so the waveform's RMS before the clamp is about 0.3 (most samples inside
[-1, 1]). The Kaiser-sinc filter buffers are the real ones. Saved with `save_pretrained` to OUT/audio_vae/ (fp32).
Latents: 5 s of stereo (A = 200 frames per channel, `[2, 32, 200]`, normalized, N(0, 1)) in OUT/latents.safetensors.

Each run decodes as the pipeline does (`z * latents_std + latents_mean`, then `decode`, the stereo channels as a
batch of 2), timed with CUDA events (the mean of `--iters` after two warm-ups) with its peak memory
(torch.cuda.max_memory_allocated, the weights included):
  fp32  TF32 off for matmuls and cuDNN: the truth every other output is compared with;
  tf32  fp32 with PyTorch's default settings (cuDNN may run the convolutions in TF32): what the pipeline runs;
  bf16  the model cast to bf16 (a floor only: the reference keeps this VAE in fp32, `_keep_in_fp32_modules`).
Writes OUT/reference.json and OUT/reference.safetensors (`fp32`, `tf32`, `bf16` waveforms, `[2, 1, 160000]`).

Usage (GPU machine, diffusers on PYTHONPATH): python3 tests/python/h3_audio_vae_reference.py --out /tmp/h3audio
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

import diffusers
from diffusers import AutoencoderKLMiniMaxH3Audio


def decode(model, z, mean, std):
    lat = z * std.view(1, -1, 1) + mean.view(1, -1, 1)
    return model.decode(lat.to(next(model.decoder.parameters()).dtype), return_dict=False)[0].float()


def timed(model, z, mean, std, iters):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(2):
            out = decode(model, z, mean, std)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            out = decode(model, z, mean, std)
        end.record()
        end.synchronize()
    return out, start.elapsed_time(end) / iters, torch.cuda.max_memory_allocated()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/h3audio")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=2032)
    parser.add_argument("--json", default=None, help="also copy reference.json here")
    args = parser.parse_args()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    c = 32
    mean = (torch.randn(c, generator=gen) * 0.5).tolist()
    std = (torch.rand(c, generator=gen) + 0.5).tolist()
    model = AutoencoderKLMiniMaxH3Audio(latents_mean=mean, latents_std=std).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("decoder.") and (name.endswith(".alpha") or name.endswith(".beta")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = model.cuda()
    z = torch.randn(2, c, args.frames, generator=gen).cuda()
    mean_t, std_t = torch.tensor(mean).cuda(), torch.tensor(std).cuda()

    # conv_post's gain: RMS 0.3 before the clamp.
    captured = {}
    hook = model.decoder.conv_post.register_forward_hook(lambda m, i, o: captured.setdefault("pre", o.detach()))
    with torch.no_grad():
        decode(model, z[:, :, :40], mean_t, std_t)
    hook.remove()
    rms = float(captured["pre"].pow(2).mean().sqrt())
    with torch.no_grad():
        model.decoder.conv_post.weight_g.mul_(0.3 / max(rms, 1e-12))
    model.save_pretrained(os.path.join(args.out, "audio_vae"))
    save_file({"latents": z.cpu().contiguous()}, os.path.join(args.out, "latents.safetensors"))
    params = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("decoder.", "dec_in_proj.")))

    runs, outputs = {}, {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    outputs["fp32"], ms, peak = timed(model, z, mean_t, std_t, args.iters)
    runs["fp32"] = dict(ms=ms, peak_allocated_bytes=peak, tf32=False)
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
    outputs["tf32"], ms, peak = timed(model, z, mean_t, std_t, args.iters)
    runs["tf32"] = dict(ms=ms, peak_allocated_bytes=peak, tf32=True)
    model = model.to(torch.bfloat16)
    outputs["bf16"], ms, peak = timed(model, z, mean_t, std_t, args.iters)
    runs["bf16"] = dict(ms=ms, peak_allocated_bytes=peak, tf32=True)

    truth = outputs["fp32"]
    for key, out in outputs.items():
        rel = float((out - truth).norm() / truth.norm())
        runs[key]["rel_l2_vs_fp32"] = rel
        runs[key]["clamped_fraction"] = float((out.abs() >= 1.0).float().mean())
        print(f"diffusers {key}: {runs[key]['ms']:.3f} ms per decode, peak {runs[key]['peak_allocated_bytes'] / 1e6:.1f}"
              f" MB, relative L2 vs fp32 {rel:.3e}, {runs[key]['clamped_fraction']:.3f} of the samples clamped")
    outputs_file = os.path.join(args.out, "reference.safetensors")
    save_file({k: v.cpu().contiguous() for k, v in outputs.items()}, outputs_file)
    summary = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, diffusers=diffusers.__version__,
                   decoder_parameters=params, latents_shape=list(z.shape), sample_shape=list(truth.shape),
                   pre_clamp_rms_before_gain=rms, runs=runs, outputs_file=outputs_file,
                   model=os.path.join(args.out, "audio_vae"), latents=os.path.join(args.out, "latents.safetensors"))
    path = os.path.join(args.out, "reference.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    if args.json:
        shutil.copy(path, args.json)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
