#!/usr/bin/env python3
"""Reference fixture for the MiniMax H3 video VAE decoder host reference (crates/tf-engines/src/minimax_h3/vae_video.rs).

Builds a tiny random-weight AutoencoderKLMiniMaxH3 with diffusers and decodes normalized latents in fp32 on CPU the
way the pipeline's video decode step does: z * latents_std + latents_mean, `vae.decode` (temporal chunks of 5
latents + 2 overlap with the pre-padding frames dropped and a 5-frame cross-fade, spatial tiles blended), then
`sample * imagenet_std + imagenet_mean`, clamp to [0, 1] and the PIL conversion `round(x * 255)` to u8.
Writes, under tests/fixtures/minimax_h3_video_vae/:

  model/                 config.json + diffusion_pytorch_model.safetensors: the save_pretrained folder, with the
                         two-dimensional decoder weights stored in bf16 (their values are bf16-exact, so the fp32
                         run below computes with exactly what is stored; 1-D tensors and the encoder stay f32)
  inputs.safetensors     per case `<case>.latents` [1, C, F, h, w] (normalized, as the DiT produces them)
  expected.safetensors   per case `<case>.sample` [1, 3, frames, H, W] (the vae.decode output, ImageNet-normalized)
                         and `<case>.frames` u8 [frames, H, W, 3] (the pipeline's 8-bit frames); `clip0.tile0`
                         [1, 3, 28, th, tw]: the ViT decoder's output for the first spatial tile of the first
                         temporal chunk of the `tiled` case (no chunking or blending), for a finer diagnosis
  manifest.json          the config, the cases with their tiling, `_split_tiles` at the default tile geometry for
                         several frame sizes, the ImageNet constants as f32 bit patterns, the versions

Cases: `tiled` (9 latent frames: two temporal chunks and three padding latents; a 3 x 6 latent grid cut into
2 x 3 tiles with the slack of the width spread over its overlaps), `untiled_3chunks` (17 latent frames, one tile),
`min_frames` (3 latent frames, the shortest decode the reference accepts; 2 x 2 tiles), and `no_tiling` (the
`tiled` latents with tiling disabled). Tile sizes are small (8 and 12 px) so the tiny grids are cut at all.

Every parameter is re-drawn at random: the layer scales `scale1` / `scale2` (zero at init, which would make every
block an identity), the register tokens, every norm weight and bias, `latents_mean` / `latents_std`.

Regenerate (from the repository root):
  python3 tests/python/h3_video_vae_fixtures.py --out tests/fixtures/minimax_h3_video_vae
"""
import argparse
import json
import os
import platform
import shutil
import struct

import numpy as np
import safetensors
import torch
from safetensors.torch import save_file

import diffusers
from diffusers import AutoencoderKLMiniMaxH3

# Spatial ratio 4 (patch 4 x 4), temporal ratio 4 (clip_length 17: chunks of 5 latents + 2 overlap, 3 pre-padding
# frames), 2 blocks of 2 heads x 64 (RoPE on 48 of 64 channels, 8 frequencies per axis as released), 3 register
# tokens, SwiGLU inner width 128 (ffn_mult 1). The encoder is as small as the class allows; a decode ignores it.
CONFIG = dict(
    latent_channels=4,
    block_out_channels=(4, 4, 4, 4, 4, 4),
    layers_per_block=1,
    norm_num_groups=2,
    spatial_downsample_factors=(2, 2, 1, 1, 1, 1),
    temporal_downsample_factors=(1, 2, 2, 1, 1, 1),
    decoder_num_layers=2,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=64,
    decoder_num_register_tokens=3,
    decoder_ffn_mult=1,
    decoder_rope_theta=100.0,
    decoder_rope_dim_ratio=0.75,
    decoder_norm_eps=1e-5,
)

# (tile height, tile width, min overlap height, min overlap width) in pixels.
TILES = (8, 12, 4, 4)
CASES = {
    "tiled": dict(frames=9, h=3, w=6, tiling=True),
    "untiled_3chunks": dict(frames=17, h=2, w=3, tiling=True),
    "min_frames": dict(frames=3, h=3, w=4, tiling=True),
    "no_tiling": dict(frames=9, h=3, w=6, tiling=False, latents_of="tiled"),
}
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
# Frame sizes (pixels) at which `_split_tiles` is recorded with the released geometry (256 px tiles, 64 px
# overlap, spatial ratio 16).
SPLIT_LENGTHS = [16, 128, 256, 272, 320, 448, 512, 576, 704, 768, 1024, 1280, 1344, 1920, 2048]


def bf16_exact(t):
    return t.to(torch.bfloat16).to(torch.float32)


def f32_bits(values):
    return [struct.unpack("<I", struct.pack("<f", float(np.float32(torch.tensor(v).item()))))[0] for v in values]


def pipeline_frames(sample):
    """The pipeline's video decode after vae.decode: ImageNet de-normalization, clamp, PIL's 8-bit rounding."""
    mean = torch.tensor(PIXEL_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD).view(1, -1, 1, 1, 1)
    video = (sample.float() * std + mean).clamp(0, 1)
    frames = video[0].permute(1, 2, 3, 0).cpu().float().numpy()  # [F, H, W, 3]
    return video, (frames * 255).round().astype("uint8")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/minimax_h3_video_vae")
    args = parser.parse_args()
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(1234)

    c = CONFIG["latent_channels"]
    mean = (torch.randn(c, generator=gen) * 0.5).tolist()
    std = (torch.rand(c, generator=gen) * 1.5 + 0.25).tolist()
    model = AutoencoderKLMiniMaxH3(**CONFIG, latents_mean=mean, latents_std=std).eval()

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("encoder.") or name.startswith("quant_conv."):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith(".scale1") or name.endswith(".scale2"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("register_tokens"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:
                fan_in = p.shape[1] if p.ndim >= 2 else 1
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        # Keep most pixels inside the clamp so the test sees the decoder, not the clamp.
        model.decoder.proj_out.weight.mul_(0.6)
        model.decoder.proj_out.bias.mul_(0.5)
        # Two-dimensional decoder weights are stored in bf16: make their values bf16-exact first.
        for name, p in model.named_parameters():
            if not name.startswith(("encoder.", "quant_conv.")) and p.ndim >= 2:
                p.copy_(bf16_exact(p))

    out = args.out
    if os.path.isdir(os.path.join(out, "model")):
        shutil.rmtree(os.path.join(out, "model"))
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(out, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    state = model.state_dict()
    stored = {}
    for name, t in state.items():
        t = t.contiguous()
        if not name.startswith(("encoder.", "quant_conv.")) and t.ndim >= 2:
            t = t.to(torch.bfloat16)
        stored[name] = t
    save_file(stored, os.path.join(model_dir, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    # The folder loads back in diffusers and decodes identically.
    reloaded = AutoencoderKLMiniMaxH3.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for name, t in reloaded.state_dict().items():
        assert torch.equal(t.float(), state[name].float()), name

    lat_mean = torch.tensor(mean).view(1, -1, 1, 1, 1)
    lat_std = torch.tensor(std).view(1, -1, 1, 1, 1)
    inputs, expected, cases = {}, {}, {}
    latents_of = {}
    clamped = []
    for case, spec in CASES.items():
        if "latents_of" in spec:
            z = latents_of[spec["latents_of"]]
        else:
            z = torch.randn(1, c, spec["frames"], spec["h"], spec["w"], generator=gen)
        latents_of[case] = z
        for m in (model, reloaded):
            if spec["tiling"]:
                m.enable_tiling(*TILES)
            else:
                m.disable_tiling()
        with torch.no_grad():
            lat = z * lat_std + lat_mean
            sample = model.decode(lat, return_dict=False)[0]
            again = reloaded.decode(lat, return_dict=False)[0]
        assert torch.equal(sample, again), case
        video, frames = pipeline_frames(sample)
        frac = float(((video == 0) | (video == 1)).float().mean())
        clamped.append(frac)
        inputs[f"{case}.latents"] = z.clone().contiguous()
        expected[f"{case}.sample"] = sample.contiguous()
        expected[f"{case}.frames"] = torch.from_numpy(frames).contiguous()
        cases[case] = dict(
            latents_shape=list(z.shape),
            sample_shape=list(sample.shape),
            tiling=spec["tiling"],
            tile_sample_min_height=TILES[0],
            tile_sample_min_width=TILES[1],
            tile_sample_min_overlap_height=TILES[2],
            tile_sample_min_overlap_width=TILES[3],
            clamped_fraction=frac,
        )
        if case == "tiled":
            y_idx, y_len, y_ov = model._split_tiles(spec["h"] * 4, TILES[0], TILES[2])
            x_idx, x_len, x_ov = model._split_tiles(spec["w"] * 4, TILES[1], TILES[3])
            cases[case]["tiles"] = dict(y=[y_idx, y_len, y_ov], x=[x_idx, x_len, x_ov])
            ratio = model.spatial_compression_ratio
            tile = lat[..., : y_len[0] // ratio, : x_len[0] // ratio][:, :, :7]
            with torch.no_grad():
                expected["clip0.tile0"] = model.decoder(model.post_quant_conv(tile)).contiguous()
    assert max(clamped) < 0.2, f"{clamped}: lower the proj_out gain"

    # _split_tiles at the released tile geometry.
    released = AutoencoderKLMiniMaxH3(**CONFIG, latents_mean=mean, latents_std=std)
    released.spatial_compression_ratio = 16
    split = {str(n): list(released._split_tiles(n, 256, 64)) for n in SPLIT_LENGTHS}

    save_file(inputs, os.path.join(out, "inputs.safetensors"))
    save_file(expected, os.path.join(out, "expected.safetensors"))
    manifest = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in CONFIG.items()},
        "latents_mean": mean,
        "latents_std": std,
        "cases": cases,
        "split_tiles_256_64_ratio16": split,
        "geometry": dict(
            frame_pre_padding=model.frame_pre_padding,
            tokens_chunk_size=model.tokens_chunk_size,
            token_overlap=model.token_overlap,
            frame_overlap=model.frame_overlap,
        ),
        "pixel_mean_f32_bits": f32_bits(PIXEL_MEAN),
        "pixel_std_f32_bits": f32_bits(PIXEL_STD),
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
    print(json.dumps({k: v for k, v in manifest.items() if k != "split_tiles_256_64_ratio16"}))


if __name__ == "__main__":
    main()
