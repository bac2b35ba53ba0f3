#!/usr/bin/env python3
"""Reference fixture for the MiniMax H3 audio VAE decoder host reference (crates/tf-engines/src/minimax_h3/vae_audio.rs).

Builds a tiny random-weight AutoencoderKLMiniMaxH3Audio with diffusers, decodes a stereo pair of normalized latents
in fp32 on CPU the way the pipeline does (z * latents_std + latents_mean, then decode with the two channels as a
batch of 2) and writes, under tests/fixtures/minimax_h3_audio_vae/:

  model/                 config.json + diffusion_pytorch_model.safetensors (save_pretrained output)
  inputs.safetensors     latents [2, latent_channels, frames] (normalized, as the DiT produces them)
  expected.safetensors   sample [2, 1, samples] (clamped waveform), dec_in [2, latent_dim, frames] (dec_in_proj
                         output, for a finer diagnosis)
  manifest.json          the config, the shapes and the versions of the run

Every parameter is re-drawn at random (the SnakeBeta alpha/beta default to zero), and the Kaiser-sinc filter buffers
of the anti-aliased activations are perturbed so the test proves they are read from the state dict.

Regenerate (from the repository root):
  python3 tests/python/h3_audio_vae_fixtures.py --out tests/fixtures/minimax_h3_audio_vae
"""
import argparse
import json
import os
import platform
import shutil

import numpy as np
import safetensors
import torch
from safetensors.torch import save_file

import diffusers
from diffusers import AutoencoderKLMiniMaxH3Audio

# Three up-samplers (one with an odd kernel - rate difference, so the output is not frames x hop), two AMP blocks
# per stage with two and three dilations, decoder channels 16 -> 8 -> 4 -> 2.
CONFIG = dict(
    encoder_dim=2,
    encoder_rates=(2, 2, 3),
    latent_dim=12,
    latent_channels=4,
    num_attention_heads=2,
    decoder_dim=16,
    decoder_rates=(2, 3, 2),
    decoder_kernel_sizes=(4, 6, 5),
    resblock_kernel_sizes=(3, 5),
    resblock_dilation_sizes=((1, 3), (1, 2, 3)),
    sampling_rate=32000,
)
FRAMES = 9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/minimax_h3_audio_vae")
    args = parser.parse_args()
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(1234)

    c = CONFIG["latent_channels"]
    mean = (torch.randn(c, generator=gen) * 0.5).tolist()
    std = (torch.rand(c, generator=gen) * 1.5 + 0.25).tolist()
    model = AutoencoderKLMiniMaxH3Audio(**CONFIG, latents_mean=mean, latents_std=std).eval()

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight_g"):
                p.copy_(torch.rand(p.shape, generator=gen) * 0.8 + 0.6)
            elif name.endswith(".alpha") or name.endswith(".beta"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("filter"):
                b.add_(torch.randn(b.shape, generator=gen) * 0.02)
        # The output is clamped to [-1, 1]: keep most samples inside so the test sees the convolutions.
        model.decoder.conv_post.weight_g.mul_(0.15)

    z = torch.randn(2, c, FRAMES, generator=gen)
    with torch.no_grad():
        lat = z * torch.tensor(std).view(1, c, 1) + torch.tensor(mean).view(1, c, 1)
        dec_in = model.dec_in_proj(lat)
        sample = model.decode(lat, return_dict=False)[0]
    clamped = (sample.abs() >= 1.0).float().mean().item()
    assert clamped < 0.2, f"{clamped:.2f} of the samples clamp; lower the conv_post gain"

    out = args.out
    if os.path.isdir(os.path.join(out, "model")):
        shutil.rmtree(os.path.join(out, "model"))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    save_file({"latents": z.contiguous()}, os.path.join(out, "inputs.safetensors"))
    save_file({"sample": sample.contiguous(), "dec_in": dec_in.contiguous()}, os.path.join(out, "expected.safetensors"))
    manifest = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in CONFIG.items()},
        "frames": FRAMES,
        "latents_shape": list(z.shape),
        "sample_shape": list(sample.shape),
        "clamped_fraction": clamped,
        "versions": {
            "diffusers": diffusers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
        },
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
