#!/usr/bin/env python3
"""A tiny complete MiniMax H3 folder and the diffusers pipeline's fp32 results on it
(crates/tf-engines/src/minimax_h3/pipeline.rs, checked by crates/tf-engines/tests/h3_pipeline.rs).

Builds, with seeded random weights, the folder a user would download, at toy size, with diffusers' own classes and
save layout (`MiniMaxH3ModularPipeline.save_pretrained`):

  tests/fixtures/minimax_h3_pipeline/model/
      modular_model_index.json   the pipeline's index
      transformer/               MiniMaxH3Transformer3DModel: 2 layers, 1 refiner layer, 2 heads of 16, hidden 24,
                                 4 latent channels, 4 audio channels, text width 8
      text_encoder/              Qwen3VLForConditionalGeneration: 51 text layers (the pipeline reads
                                 hidden_states[50], which needs more than 50), hidden 8, 2 heads of 128 / 1 KV head
      tokenizer/, processor/     the small Qwen2 tokenizer with H3's seven extra tokens at 151669-151675 (the one
                                 tests/python/h3_text_fixtures.py builds), and the Qwen3-VL processor
      vae/                       AutoencoderKLMiniMaxH3: spatial ratio 4, temporal ratio 4, 17-frame clips of 5
                                 latents, a 2-block ViT decoder of 2 heads x 64
      audio_vae/                 AutoencoderKLMiniMaxH3Audio: hop 200 at 8 kHz (40 latents a second, as released),
                                 4 latent channels, 5 up-samplers
      scheduler/, audio_scheduler/   MiniMaxH3Scheduler with shift 12 and 3

then loads the folder back with `ModularPipeline.from_pretrained` and runs the t2va workflow in fp32 on the CPU
with injected noise (the portable generator of crates/tf-engines/src/nn/sampling/noise.rs, re-implemented below:
video noise first, then audio, from the case's seed), recording:

  expected.safetensors   per case: `{case}.prompt_ids`, `{case}.prompt_embeds` [tokens, 8] (what the DiT read),
                         `{case}.video_noise` [1, 4, F, h, w] and `{case}.audio_noise` [2 A, 4] (the injected rows),
                         `{case}.latents.{i}` [video rows, 16] and `{case}.audio_latents.{i}` [2 A, 4] (the rows
                         after step i), `{case}.frames` [frames, H, W, 3] (the pipeline's "np" output, in [0, 1]),
                         `{case}.audio` [2, samples] (the decoded soundtrack)
  noise_{case}.safetensors   `video_noise`, `audio_noise` for `tf video --noise`
  manifest.json          the cases (prompt, size, frames, steps, seed), sizes, versions

Cases: `five_seconds` runs the pipeline exactly as shipped (120 frames snap to 124, 5.17 s, inside its 5 to 15 s
window) on a 24x16 canvas (width x height; 3 x 2 patched rows a frame); `short` runs 22 frames (0.92 s) on 16x24
with the pipeline's 5 s floor lifted (its `min_duration` property patched to 0; nothing else changes), a length the
Rust pipeline accepts below 5 s.

Regenerate (from the repository root; torch, diffusers 0.42.1, transformers 5.x):
  python3 tests/python/h3_pipeline_fixtures.py --out tests/fixtures/minimax_h3_pipeline
"""
import argparse
import json
import math
import os
import platform
import shutil
import sys

import numpy as np
import safetensors
import tokenizers
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h3_text_fixtures as text_fx  # noqa: E402  (the tokenizer and text-encoder recipe of the text fixture)

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler,  # noqa: E402
                       MiniMaxH3Transformer3DModel)
from diffusers.modular_pipelines import ModularPipeline  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import denoise as h3_denoise  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline  # noqa: E402
from transformers import (Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig,  # noqa: E402
                          Qwen3VLForConditionalGeneration, Qwen3VLProcessor)

TEXT_LAYERS = 51  # hidden_states[50] needs more than 50 layers
HIDDEN = text_fx.HIDDEN
LATENT_CHANNELS = 4
AUDIO_CHANNELS = 4

DIT = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=1,
           ffn_dim=40, in_channels=LATENT_CHANNELS, audio_in_channels=AUDIO_CHANNELS, patch_size=(1, 2, 2),
           text_dim=HIDDEN, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=12, rope_freq_dim=2,
           rope_theta=10000.0)
VAE = dict(latent_channels=LATENT_CHANNELS, block_out_channels=(4, 4, 4, 4, 4, 4), layers_per_block=1,
           norm_num_groups=2, spatial_downsample_factors=(2, 2, 1, 1, 1, 1), temporal_downsample_factors=(1, 2, 2, 1, 1, 1),
           decoder_num_layers=2, decoder_num_attention_heads=2, decoder_attention_head_dim=64,
           decoder_num_register_tokens=3, decoder_ffn_mult=1, decoder_rope_theta=100.0, decoder_rope_dim_ratio=0.75,
           decoder_norm_eps=1e-5)
AUDIO_VAE = dict(encoder_dim=2, encoder_rates=(2, 4, 5, 5), latent_dim=8, latent_channels=AUDIO_CHANNELS,
                 num_attention_heads=2, decoder_dim=32, decoder_rates=(5, 5, 2, 2, 2),
                 decoder_kernel_sizes=(9, 9, 4, 4, 4), resblock_kernel_sizes=(3, 5),
                 resblock_dilation_sizes=((1, 3), (1, 2)), sampling_rate=8000)

# (name, prompt, height, width, num_frames, num_inference_steps, seed, lift the 5 s floor)
CASES = [
    ("five_seconds", "a red fox runs through fresh snow at dawn", 16, 24, 120, 4, 42, False),
    ("short", "waves break on the rocks below the lighthouse", 24, 16, 22, 5, 7, True),
]

# Qwen3-VL's processor wants a video processor, which needs torchvision; H3's text path never uses it. The
# processor is built without one, and saved as its parts (the tokenizer, the image processor).
_save_processor = Qwen3VLProcessor.save_pretrained


def save_text_processor(self, save_directory, **kwargs):
    os.makedirs(save_directory, exist_ok=True)
    self.tokenizer.save_pretrained(save_directory)
    self.image_processor.save_pretrained(save_directory)


Qwen3VLProcessor.save_pretrained = save_text_processor


def versions():
    return {
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------------------------
# The portable generator of crates/tf-engines/src/nn/sampling/noise.rs, written again from its documentation:
# sample pairs by Marsaglia's polar method over splitmix64 uniforms of (seed + k * golden), k from 1.
# ---------------------------------------------------------------------------------------------------------------

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK64
    return z ^ (z >> 31)


def normals(seed, count):
    out, k = [], 0
    while len(out) < count:
        u = []
        for _ in range(2):
            k += 1
            u.append((splitmix64((seed + k * GOLDEN) & MASK64) >> 11) * (2.0 ** -53))
        a, b = 2.0 * u[0] - 1.0, 2.0 * u[1] - 1.0
        s = a * a + b * b
        if s == 0.0 or s >= 1.0:
            continue
        f = math.sqrt(-2.0 * math.log(s) / s)
        out += [a * f, b * f]
    return np.array(out[:count], dtype=np.float64).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------------------

def build_transformer(gen):
    model = MiniMaxH3Transformer3DModel(**DIT).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.ndim == 2 else 0.1))
    return model


def build_vae(gen):
    c = LATENT_CHANNELS
    mean = (torch.randn(c, generator=gen) * 0.5).tolist()
    std = (torch.rand(c, generator=gen) * 1.5 + 0.25).tolist()
    model = AutoencoderKLMiniMaxH3(**VAE, latents_mean=mean, latents_std=std).eval()
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
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
        # Keep most pixels inside the clamp, so the comparison sees the decoder rather than the clamp.
        model.decoder.proj_out.weight.mul_(0.6)
        model.decoder.proj_out.bias.mul_(0.5)
    return model


def build_audio_vae(gen):
    c = AUDIO_CHANNELS
    mean = (torch.randn(c, generator=gen) * 0.5).tolist()
    std = (torch.rand(c, generator=gen) * 1.5 + 0.25).tolist()
    model = AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE, latents_mean=mean, latents_std=std).eval()
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
        model.decoder.conv_post.weight_g.mul_(0.15)
    return model


def build_text(gen, scratch):
    """The text fixture's tokenizer and encoder recipe, with 51 layers."""
    os.makedirs(scratch, exist_ok=True)
    gz = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenizer", "fixtures",
                      "qwen-tokenizer.json.gz")
    with open(os.path.join(scratch, "tokenizer.json"), "w") as f:
        json.dump(text_fx.tiny_tokenizer_json(gz), f, ensure_ascii=False)
    with open(os.path.join(scratch, "tokenizer_config.json"), "w") as f:
        json.dump(text_fx.TOKENIZER_CONFIG, f)
    tokenizer = Qwen2TokenizerFast.from_pretrained(scratch)
    ids_of = {t: tokenizer.convert_tokens_to_ids(t)
              for t in ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]}
    config = Qwen3VLConfig(text_config=dict(text_fx.TEXT, num_hidden_layers=TEXT_LAYERS),
                           vision_config=text_fx.VISION, image_token_id=ids_of["<|image_pad|>"],
                           video_token_id=ids_of["<|video_pad|>"], vision_start_token_id=ids_of["<|vision_start|>"],
                           vision_end_token_id=ids_of["<|vision_end|>"], tie_word_embeddings=True)
    text_encoder = Qwen3VLForConditionalGeneration(config).eval().float()
    text_fx.randomize(text_encoder, gen)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2,
                                                                         temporal_patch_size=2),
                                 tokenizer=tokenizer, video_processor=None)
    return tokenizer, text_encoder, processor


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------

class Recorder:
    """Copies the rows after every step of the denoising loop, and the prompt features the transformer reads."""

    def __init__(self):
        self.steps = []
        self.prompt_embeds = None
        step_call = h3_denoise.MiniMaxH3LoopSchedulerStep.__call__
        denoiser_call = h3_denoise.MiniMaxH3LoopDenoiser.__call__
        recorder = self

        def record_step(block, components, block_state, i, t):
            out = step_call(block, components, block_state, i, t)
            recorder.steps.append((block_state.latents.detach().clone(), block_state.audio_latents.detach().clone()))
            return out

        def record_features(block, components, block_state, i, t):
            if i == 0:
                recorder.prompt_embeds = block_state.prompt_embeds.detach().clone()
            return denoiser_call(block, components, block_state, i, t)

        h3_denoise.MiniMaxH3LoopSchedulerStep.__call__ = record_step
        h3_denoise.MiniMaxH3LoopDenoiser.__call__ = record_features


def run_case(pipe, recorder, case):
    name, prompt, height, width, num_frames, steps, seed, lift = case
    floor = MiniMaxH3ModularPipeline.min_duration
    if lift:
        MiniMaxH3ModularPipeline.min_duration = property(lambda self: 0.0)
    try:
        aligned = num_frames
        while aligned % 17 != 5:
            aligned += 1
        latent_frames = (aligned - 5) // 17 * 5 + 2
        audio_latents = int(round(aligned / 24 * 40))
        ratio = 4
        video_shape = (1, LATENT_CHANNELS, latent_frames, height // ratio, width // ratio)
        n_video = int(np.prod(video_shape))
        n_audio = 2 * audio_latents * AUDIO_CHANNELS
        draw = normals(seed, n_video + n_audio)
        video_noise = torch.from_numpy(draw[:n_video].copy()).view(video_shape)
        audio_rows = torch.from_numpy(draw[n_video:].copy()).view(2 * audio_latents, AUDIO_CHANNELS)
        # The pipeline's `audio_latents` input is (2, C, A); it packs it back to these rows.
        audio_input = audio_rows.view(2, audio_latents, AUDIO_CHANNELS).permute(0, 2, 1).contiguous()
        recorder.steps.clear()
        with torch.no_grad():
            out = pipe(prompt=prompt, height=height, width=width, num_frames=num_frames, num_inference_steps=steps,
                       latents=video_noise.clone(), audio_latents=audio_input.clone(), output_type="np",
                       output=["videos", "audio", "sampling_rate"])
    finally:
        MiniMaxH3ModularPipeline.min_duration = floor
    ids = pipe.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    videos = np.asarray(out["videos"])
    frames = torch.from_numpy(videos[0].astype(np.float32))  # [F, H, W, 3]
    audio = out["audio"][0].float()  # [2, samples]
    assert frames.shape == (aligned, height, width, 3), frames.shape
    assert out["sampling_rate"] == AUDIO_VAE["sampling_rate"]
    tensors = {
        f"{name}.prompt_ids": torch.tensor(ids, dtype=torch.int64),
        f"{name}.prompt_embeds": recorder.prompt_embeds[0].contiguous(),
        f"{name}.video_noise": video_noise.contiguous(),
        f"{name}.audio_noise": audio_rows.contiguous(),
        f"{name}.frames": frames.contiguous(),
        f"{name}.audio": audio.contiguous(),
    }
    for i, (v, a) in enumerate(recorder.steps):
        tensors[f"{name}.latents.{i}"] = v.contiguous()
        tensors[f"{name}.audio_latents.{i}"] = a.contiguous()
    clamped = float(((frames <= 0) | (frames >= 1)).float().mean())
    meta = dict(case=name, prompt=prompt, height=height, width=width, num_frames=num_frames, aligned_frames=aligned,
                latent_frames=latent_frames, audio_latents=audio_latents, num_inference_steps=steps,
                forwards=len(recorder.steps), seed=seed, min_duration_lifted=lift, tokens=len(ids),
                audio_samples=int(audio.shape[-1]), clamped_pixel_fraction=clamped)
    noise = {"video_noise": video_noise.contiguous(), "audio_noise": audio_rows.contiguous()}
    print(json.dumps(meta))
    return tensors, meta, noise


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/minimax_h3_pipeline")
    args = parser.parse_args()
    torch.manual_seed(2027)
    gen = torch.Generator().manual_seed(2027)
    out = args.out
    model_dir = os.path.join(out, "model")
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    os.makedirs(out, exist_ok=True)
    scratch = os.path.join(out, "scratch")

    tokenizer, text_encoder, processor = build_text(gen, scratch)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        transformer=build_transformer(gen),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        vae=build_vae(gen),
        audio_vae=build_audio_vae(gen),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    # The text encoder and the video VAE decoder's matrices are stored in bf16 (the text recipe draws bf16-exact
    # values; the decoder's are rounded here), which halves the files; the fp32 reference loads them back exactly.
    with torch.no_grad():
        for p in pipe.vae.decoder.parameters():
            if p.ndim >= 2:
                p.data = p.data.to(torch.bfloat16)
    pipe.text_encoder.to(torch.bfloat16)
    pipe.save_pretrained(model_dir, overwrite_modular_index=True)
    shutil.rmtree(scratch)
    loaded = ModularPipeline.from_pretrained(model_dir)
    loaded.load_components(torch_dtype=torch.float32)
    if loaded.processor is None:
        # transformers cannot load Qwen3VLProcessor without torchvision (its video processor): build it from the
        # saved parts, as saved.
        saved = os.path.join(model_dir, "processor")
        loaded.update_components(processor=Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(saved),
            tokenizer=Qwen2TokenizerFast.from_pretrained(saved), video_processor=None))
    for name in ["transformer", "text_encoder", "tokenizer", "vae", "audio_vae", "scheduler", "audio_scheduler"]:
        assert getattr(loaded, name) is not None, f"{name} did not load from the saved folder"
    assert loaded.text_encoder.dtype == torch.float32 and loaded.transformer.dtype == torch.float32
    recorder = Recorder()
    tensors, metas = {}, []
    for case in CASES:
        t, meta, noise = run_case(loaded, recorder, case)
        tensors.update(t)
        metas.append(meta)
        save_file(noise, os.path.join(out, f"noise_{case[0]}.safetensors"))
    save_file(tensors, os.path.join(out, "expected.safetensors"))
    manifest = dict(cases=metas, dit=DIT, vae=VAE, audio_vae=AUDIO_VAE, text_layers=TEXT_LAYERS,
                    versions=versions())
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
