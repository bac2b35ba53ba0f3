#!/usr/bin/env python3
"""Full-size MiniMax H3 video VAE decoder reference run on the GPU (diffusers 0.42.1).

Builds the default-config AutoencoderKLMiniMaxH3 (ViT decoder: 36 blocks of width 2048, 32 heads of 64) with seeded
random weights on the GPU (layer scales, register tokens, norm weights and biases moved off their defaults; random
latents_mean / latents_std), saves it in bf16 (--out/vae, diffusers layout), writes seeded normalized latents of a
768 x 448, 124-frame clip (37 latent frames x 28 x 48, --out/latents.safetensors), and decodes them the way the
pipeline's video decode step does (z * latents_std + latents_mean, vae.decode with its default tiling, ImageNet
de-normalization, clamp, PIL's 8-bit rounding):

  - in fp32 (TF32 off): the accuracy reference, --out/sample_fp32.safetensors (`sample`, [1, 3, 124, 448, 768])
    and --out/frames_fp32.safetensors (`frames`, u8 [124, 448, 768, 3]);
  - in bf16 (`from_pretrained(torch_dtype=torch.bfloat16)`, the fp32-pinned modules kept in fp32): the floor, its
    relative L2 and 8-bit differences to fp32, the time of `vae.decode` (median of --repeats after a warm-up) and
    of the whole decode step (with the frames on the host), and the peak device memory.

Every figure lands in --out/reference.json (and stdout). The saved weights are bf16, and both runs load them, so
fp32 and bf16 compute with the same values.

Usage (GPU machine, diffusers on PYTHONPATH):
    python3 tests/python/h3_video_vae_reference.py --out /tmp/h3vv [--seed 0] [--repeats 3]
A smoke run of the script itself on a CPU (tiny sizes, not a reference):
    python3 tests/python/h3_video_vae_reference.py --out /tmp/h3vv-smoke --device cpu --layers 1 --frames 7 \
        --height 2 --width 3 --repeats 1
"""

import argparse
import json
import os
import re
import statistics
import time

import numpy as np
import torch
from safetensors.torch import save_file

import diffusers
from diffusers import AutoencoderKLMiniMaxH3

DEVICE = "cuda"
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)


def rel_l2(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def allocated():
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def build(seed, layers):
    gen = torch.Generator().manual_seed(seed)
    mean = (torch.randn(24, generator=gen) * 0.5).tolist()
    std = (torch.rand(24, generator=gen) * 1.5 + 0.25).tolist()
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoencoderKLMiniMaxH3(latents_mean=mean, latents_std=std, **layers)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("encoder.", "quant_conv.")):
                continue
            noise = torch.randn(p.shape, generator=g, device=DEVICE)
            if name.endswith((".scale1", ".scale2")):
                p.copy_(0.1 * noise)  # zero at init: every block would be an identity
            elif name.endswith("register_tokens"):
                p.copy_(noise)
            elif "norm" in name and name.endswith(".weight"):
                p.add_(0.1 * noise)
            elif "norm" in name and name.endswith(".bias"):
                p.copy_(0.1 * noise)
    return model.to(torch.bfloat16).eval()


def pipeline_frames(sample):
    """The pipeline's video decode after vae.decode: ImageNet de-normalization, clamp, PIL's 8-bit rounding."""
    mean = torch.tensor(PIXEL_MEAN, device=sample.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=sample.device).view(1, -1, 1, 1, 1)
    video = (sample.float() * std + mean).clamp(0, 1)
    frames = video[0].permute(1, 2, 3, 0).cpu().float().numpy()
    return video, (frames * 255).round().astype("uint8")


def denormalize(vae, z):
    mean = torch.tensor(vae.config.latents_mean, device=DEVICE).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=DEVICE).view(1, -1, 1, 1, 1)
    return z.to(DEVICE) * std + mean


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frames", type=int, default=37)
    parser.add_argument("--height", type=int, default=28)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="decoder_num_layers (default: the released 36)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    layers = {} if args.layers is None else {"decoder_num_layers": args.layers}
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report = {
        "versions": {"diffusers": diffusers.__version__, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "decoder_num_layers": args.layers or 36,
    }

    t = time.perf_counter()
    model = build(args.seed, layers)
    report["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model.save_pretrained(os.path.join(args.out, "vae"), safe_serialization=True)
    report["save_s"] = time.perf_counter() - t
    report["decoder_parameters"] = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(("decoder.", "post_quant_conv."))
    )
    del model
    torch.cuda.empty_cache()

    gen = torch.Generator().manual_seed(args.seed + 2)
    z = torch.randn(1, 24, args.frames, args.height, args.width, generator=gen)
    save_file({"latents": z.contiguous()}, os.path.join(args.out, "latents.safetensors"))
    report["latents_shape"] = list(z.shape)

    # fp32: the accuracy reference.
    vae = AutoencoderKLMiniMaxH3.from_pretrained(os.path.join(args.out, "vae"), torch_dtype=torch.float32)
    vae = vae.to(DEVICE).eval()
    with torch.no_grad():
        lat = denormalize(vae, z)
        sync()
        t = time.perf_counter()
        sample32 = vae.decode(lat, return_dict=False)[0]
        sync()
        report["fp32_decode_s"] = time.perf_counter() - t
    video32, frames32 = pipeline_frames(sample32)
    report["video_shape"] = list(sample32.shape)
    report["clamped_fraction"] = float(((video32 == 0) | (video32 == 1)).float().mean())
    sample32 = sample32.float().cpu().contiguous()
    del video32
    save_file({"sample": sample32}, os.path.join(args.out, "sample_fp32.safetensors"))
    save_file({"frames": torch.from_numpy(frames32).contiguous()}, os.path.join(args.out, "frames_fp32.safetensors"))
    del vae, lat
    torch.cuda.empty_cache()

    # bf16: the floor, the time, the memory.
    vae = AutoencoderKLMiniMaxH3.from_pretrained(os.path.join(args.out, "vae"), torch_dtype=torch.bfloat16)
    vae = vae.to(DEVICE).eval()
    report["bf16_fp32_params"] = sorted(
        {re.sub(r"\.\d+\.", ".N.", n) for n, p in vae.named_parameters() if p.dtype == torch.float32}
    )
    report["bf16_fp32_params"] = [n for n in report["bf16_fp32_params"] if not n.startswith("encoder.")]
    sync()
    report["bf16_weight_bytes"] = allocated()
    with torch.no_grad():
        lat = denormalize(vae, z)
        sample16 = vae.decode(lat, return_dict=False)[0]  # warm-up
        sync()
        del sample16
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            sync()
            t = time.perf_counter()
            sample16 = vae.decode(lat, return_dict=False)[0]
            sync()
            times.append(time.perf_counter() - t)
        report["bf16_peak_bytes"] = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
        report["bf16_decode_s"] = times
        report["bf16_decode_s_median"] = statistics.median(times)
        # The whole decode step: latents in, 8-bit frames on the host out.
        sync()
        t = time.perf_counter()
        out = vae.decode(denormalize(vae, z), return_dict=False)[0]
        _, frames16 = pipeline_frames(out)
        report["bf16_pipeline_decode_s"] = time.perf_counter() - t
        del out
    report["floor_rel_l2"] = rel_l2(sample16.float().cpu(), sample32)
    report["floor_cosine"] = cosine(sample16.float().cpu(), sample32)
    diff = np.abs(frames16.astype(np.int16) - frames32.astype(np.int16))
    report["floor_frames_mean_abs_diff"] = float(diff.mean())
    report["floor_frames_max_diff"] = int(diff.max())
    report["floor_frames_fraction_differing"] = float((diff > 0).mean())

    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
