#!/usr/bin/env python3
"""Reference fixtures for the Qwen-Image 2.1 pipeline host pieces (crates/tf-engines).

Writes three fixture folders, each checked by a Rust integration test with no Python:

  tests/fixtures/qwen_sampler/   FlowMatchEulerDiscreteScheduler grids and steps, as the Qwen-Image 2.1 pipeline
                                 drives it (sigmas, timesteps, model timesteps, Euler steps, true-CFG combine),
                                 plus noise test vectors of the documented portable generator (tf_engines::noise).
  tests/fixtures/qwen_te/        a tiny random Qwen3-VL (Qwen3VLForConditionalGeneration, save_pretrained) and the
                                 prompt features the pipeline reads (last decoder layer before the final norm,
                                 system rows dropped), for a left-padded batch of two prompts.
  tests/fixtures/qwen_vae/       a tiny random AutoencoderKLQwenImage21 (save_pretrained) and the decode of packed
                                 latents exactly as the pipeline does it (unpack, z * std + mean, decode, frame 0).

Regenerate (from the repository root):
  python3 tests/python/qwen_pipeline_fixtures.py --out tests/fixtures
"""
import argparse
import json
import math
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

import diffusers
import transformers
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift


def versions():
    import safetensors

    return {
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
    }


# ---------------------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------------------

TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]

SCHEDULER_CONFIGS = {
    # The Qwen-Image 2.1 shape: resolution-dependent exponential shift.
    "dynamic": dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                    max_image_seq_len=4096, shift=1.0),
    "dynamic_terminal": dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                             max_image_seq_len=8192, shift=1.0, shift_terminal=0.02),
    "linear_shift": dict(use_dynamic_shifting=True, time_shift_type="linear", base_shift=0.5, max_shift=1.15,
                         base_image_seq_len=256, max_image_seq_len=4096),
    "fixed_shift": dict(use_dynamic_shifting=False, shift=3.0),
    "identity": dict(),
}

# (config, steps or explicit sigmas, latent height, latent width)
SAMPLER_CASES = [
    ("dynamic", 40, 64, 64),
    ("dynamic", 25, 64, 64),
    ("dynamic", 8, 32, 48),
    ("dynamic", 1, 16, 16),
    ("dynamic", 2, 104, 104),
    ("dynamic", 50, 8, 8),
    ("dynamic", TURBO_SIGMAS, 64, 64),
    ("dynamic_terminal", 30, 64, 96),
    ("dynamic_terminal", 5, 20, 12),
    ("linear_shift", 20, 48, 40),
    ("fixed_shift", 28, 64, 64),
    ("fixed_shift", 3, 16, 32),
    ("identity", TURBO_SIGMAS, 64, 64),
    ("identity", 10, 4, 4),
]


def bf16_round(x):
    return x.to(torch.bfloat16).to(torch.float32)


def sampler_fixtures(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    tensors, cases = {}, []
    gen = torch.Generator().manual_seed(20261202)
    for index, (config_name, steps, lat_h, lat_w) in enumerate(SAMPLER_CASES):
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS[config_name])
        with tempfile.TemporaryDirectory() as tmp:
            scheduler.save_config(tmp)
            with open(os.path.join(tmp, "scheduler_config.json")) as f:
                saved_config = json.load(f)
        seq_len = lat_h * lat_w
        # Exactly the pipeline's preparation (pipeline_qwenimage21.py, "4. Prepare timesteps").
        if isinstance(steps, list):
            sigmas_in, explicit = list(steps), list(steps)
            num_steps = len(steps)
        else:
            sigmas_in, explicit = np.linspace(1.0, 1 / steps, steps), None
            num_steps = steps
        mu = calculate_shift(
            seq_len,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(num_steps, sigmas=sigmas_in, mu=mu)
        prefix = f"case{index}"
        tensors[f"{prefix}.sigmas"] = scheduler.sigmas.clone().float()
        tensors[f"{prefix}.timesteps"] = scheduler.timesteps.clone().float()
        # What the transformer receives: t cast to the latent dtype, then / 1000 (in that dtype).
        t_bf16 = scheduler.timesteps.to(torch.bfloat16) / 1000
        tensors[f"{prefix}.model_t_bf16"] = t_bf16.float()
        tensors[f"{prefix}.model_t_f32"] = (scheduler.timesteps.float() / 1000).float()

        # A few Euler steps on random latents, in f32 and in bf16 (the pipeline's dtype), as the loop calls step().
        channels, tokens = 8, 6
        steps_run = min(3, num_steps)
        for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            scheduler.set_timesteps(num_steps, sigmas=sigmas_in, mu=mu)
            scheduler.set_begin_index(0)
            latents = torch.randn(1, tokens, channels, generator=gen).to(dtype)
            tensors[f"{prefix}.{dtype_name}.x0"] = latents.float()
            for i in range(steps_run):
                t = scheduler.timesteps[i]
                velocity = torch.randn(1, tokens, channels, generator=gen).to(dtype)
                tensors[f"{prefix}.{dtype_name}.v{i}"] = velocity.float()
                latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
                assert latents.dtype == dtype
                tensors[f"{prefix}.{dtype_name}.x{i + 1}"] = latents.float()
        cases.append(dict(index=index, config_name=config_name, scheduler_config=saved_config,
                          steps=num_steps, explicit_sigmas=explicit, latent_height=lat_h, latent_width=lat_w,
                          image_seq_len=seq_len, mu=repr(mu), euler_steps=steps_run))

    # True CFG combine: neg + s * (cond - neg), in each dtype.
    for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        cond = torch.randn(2, 5, 8, generator=gen).to(dtype)
        neg = torch.randn(2, 5, 8, generator=gen).to(dtype)
        scale = 4.0
        combined = neg + scale * (cond - neg)
        tensors[f"cfg.{dtype_name}.cond"] = cond.float()
        tensors[f"cfg.{dtype_name}.neg"] = neg.float()
        tensors[f"cfg.{dtype_name}.out"] = combined.float()

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "sampler.safetensors"))
    noise_tensors, noise_cases = noise_vectors()
    save_file(noise_tensors, os.path.join(out_dir, "noise.safetensors"))
    # mu is written as its repr string: JSON readers are not all correctly rounded on 17-digit numbers.
    manifest = dict(versions=versions(), cfg_scale=4.0, cases=cases, noise=noise_cases)
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------------------
# Noise: an independent implementation of the algorithm documented in crates/tf-engines/src/noise.rs.
# ---------------------------------------------------------------------------------------------------------------

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK64
    return z ^ (z >> 31)


def normals(seed, count):
    out, counter = [], 0

    def uniform():
        nonlocal counter
        z = (seed + (counter + 1) * GOLDEN) & MASK64
        counter += 1
        return (splitmix64(z) >> 11) * (2.0 ** -53)

    while len(out) < count:
        a = 2.0 * uniform() - 1.0
        b = 2.0 * uniform() - 1.0
        s = a * a + b * b
        if s == 0.0 or s >= 1.0:
            continue
        f = math.sqrt(-2.0 * math.log(s) / s)
        out.append(a * f)
        out.append(b * f)
    return np.array(out[:count], dtype=np.float64).astype(np.float32)


def noise_vectors():
    tensors, cases = {}, []
    for seed, count in ((0, 1000), (42, 257), (2**64 - 1, 64), (0x123456789ABCDEF0, 4096)):
        name = f"seed_{seed:x}"
        tensors[name] = torch.from_numpy(normals(seed, count))
        cases.append(dict(name=name, seed=str(seed), count=count))
    # A packed latent batch: B = 2, 3 x 5 latent, 4 channels; image b uses seed + b, drawn in (C, h, w) order.
    batch, channels, lat_h, lat_w, seed = 2, 4, 3, 5, 7
    images = []
    for b in range(batch):
        draw = torch.from_numpy(normals(seed + b, channels * lat_h * lat_w)).view(channels, lat_h * lat_w)
        images.append(draw.transpose(0, 1))
    packed = torch.stack(images)
    tensors["packed_f32"] = packed.contiguous()
    tensors["packed_bf16"] = bf16_round(packed).contiguous()
    cases.append(dict(name="packed", seed=str(seed), batch=batch, channels=channels, latent_height=lat_h,
                      latent_width=lat_w))
    return tensors, cases


# ---------------------------------------------------------------------------------------------------------------
# Text encoder
# ---------------------------------------------------------------------------------------------------------------

TE_TEXT = dict(vocab_size=160, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
               rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[4, 2, 2],
                                    mrope_interleaved=True))
TE_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=16,
                 spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                 deepstack_visual_indexes=[0])
SYSTEM_ROWS = 14


def te_fixtures(out_dir):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=TE_TEXT, vision_config=TE_VISION, image_token_id=150, video_token_id=151,
                           vision_start_token_id=152, vision_end_token_id=153, tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(config).eval().float()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # RMSNorm weights default to 1: draw them around 1 so a wrong norm shows.
            base = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 2 else 0.1) + base)
    model.save_pretrained(os.path.join(out_dir, "model"), safe_serialization=True)

    # Two prompts shaped like the t2i template: 14 system rows, then user rows; different lengths so the batch is
    # left-padded the way the pipeline's processor pads it.
    pad_id = 0
    system = torch.randint(1, 150, (SYSTEM_ROWS,), generator=gen)
    prompts = [torch.cat([system, torch.randint(1, 150, (n,), generator=gen)]) for n in (11, 6)]
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, longest - len(p):] = p
        attention_mask[i, longest - len(p):] = 1

    # The pipeline's read-out (pipeline_qwenimage21.py, _get_qwen_prompt_embeds): a hook makes the final norm an
    # identity, and hidden_states[-1] is then the last decoder layer's output.
    text_model = getattr(model.model, "language_model", model.model)
    handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        with torch.no_grad():
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    finally:
        handle.remove()
    hidden = outputs.hidden_states[-1]
    with torch.no_grad():
        normed = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    tensors = {}
    for i, p in enumerate(prompts):
        keep = attention_mask[i].bool()
        tensors[f"prompt{i}.ids"] = p.clone()
        tensors[f"prompt{i}.hidden"] = hidden[i][keep][SYSTEM_ROWS:].contiguous()
        tensors[f"prompt{i}.normed"] = normed.hidden_states[-1][i][keep][SYSTEM_ROWS:].contiguous()
    # The same prompt alone (no padding, positions from 0): what a one-prompt run gives.
    with torch.no_grad():
        handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            alone = model(input_ids=prompts[1][None], output_hidden_states=True).hidden_states[-1][0]
        finally:
            handle.remove()
    tensors["prompt1.alone"] = alone[SYSTEM_ROWS:].contiguous()
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    manifest = dict(versions=versions(), drop_rows=SYSTEM_ROWS, pad_id=pad_id,
                    left_padding=[longest - len(p) for p in prompts])
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------------------
# VAE decoder
# ---------------------------------------------------------------------------------------------------------------

def vae_fixtures(out_dir):
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    gen = torch.Generator().manual_seed(11)
    z_dim = 4
    mean = (torch.randn(z_dim, generator=gen) * 0.3).tolist()
    std = (torch.rand(z_dim, generator=gen) * 1.5 + 0.5).tolist()
    # The real layer structure (dim_mult, 3 resnets per up block, temporal flags) at a tiny width, so the folder
    # stays small: decoder channels 16, 16, 16, 8, 4, 2.
    vae = AutoencoderKLQwenImage21(base_dim=2, decoder_base_dim=2, z_dim=z_dim, latents_mean=mean,
                                   latents_std=std).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            base = 1.0 if name.endswith("gamma") else 0.0
            fan_in = p[0].numel() if p.ndim > 1 else 1
            scale = 1.0 / math.sqrt(fan_in) if p.ndim > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + base)
    vae.save_pretrained(os.path.join(out_dir, "model"), safe_serialization=True)

    tensors = {}
    lat_h, lat_w, batch = 4, 6, 2
    packed = torch.randn(batch, lat_h * lat_w, z_dim, generator=gen)
    tensors["packed_latents"] = packed
    # The pipeline's decode (pipeline_qwenimage21.py, after the loop).
    vae_scale_factor = 16
    height, width = lat_h * vae_scale_factor, lat_w * vae_scale_factor
    height_l = 2 * (int(height) // (vae_scale_factor * 2))
    width_l = 2 * (int(width) // (vae_scale_factor * 2))
    latents = packed.transpose(1, 2).reshape(batch, z_dim, 1, height_l, width_l)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
    latents_std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
    latents = latents * latents_std + latents_mean
    with torch.no_grad():
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
    tensors["image"] = image.contiguous()
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    manifest = dict(versions=versions(), latent_height=lat_h, latent_width=lat_w, batch=batch)
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures")
    parser.add_argument("--only", choices=["sampler", "te", "vae"], action="append")
    args = parser.parse_args()
    torch.set_num_threads(1)
    only = set(args.only or ["sampler", "te", "vae"])
    if "sampler" in only:
        sampler_fixtures(os.path.join(args.out, "qwen_sampler"))
    if "te" in only:
        te_fixtures(os.path.join(args.out, "qwen_te"))
    if "vae" in only:
        vae_fixtures(os.path.join(args.out, "qwen_vae"))


if __name__ == "__main__":
    main()
