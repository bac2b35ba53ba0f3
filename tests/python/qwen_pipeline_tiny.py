#!/usr/bin/env python3
"""A tiny complete Qwen-Image 2.1 model folder and the diffusers pipeline's fp32 results on it.

Builds, with seeded random weights, the folder a user would download, at toy size:

  tests/fixtures/qwen_pipeline/model/     QwenImage21Pipeline.save_pretrained: model_index.json, transformer/,
                                          text_encoder/ (Qwen3-VL), vae/, scheduler/, processor/ (a small
                                          byte-level BPE tokenizer trained here, with the Qwen special tokens)

then runs the diffusers pipeline in fp32 on the CPU for a few cases, starting from the packed noise of the portable
generator documented in crates/tf-engines/src/noise.rs (seeded, re-implemented below), and records:

  expected.safetensors   per case: template ids, prompt embeds, latents after every step, the VAE output in
                         [-1, 1] (before the uint8 conversion), the uint8 RGBA image the pipeline returns
  manifest.json          the cases (prompt, size, steps, seed, cfg), drop_idx, versions

Regenerate (from the repository root):
  /path/to/python tests/python/qwen_pipeline_tiny.py --out tests/fixtures/qwen_pipeline
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
import tokenizers
import transformers
from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                       QwenImage21Transformer2DModel)
from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
from transformers.processing_utils import ProcessorMixin

# Qwen3-VL's video processor needs torchvision, which has no build for this torch. Text-to-image never touches
# it, so the processor is built without one: the class check that would refuse `None` is relaxed for this script.
ProcessorMixin.check_argument_for_proper_class = lambda self, name, value: type(value)


def save_text_processor(self, save_directory, **kwargs):
    """What the processor's own save writes, less the absent video processor."""
    os.makedirs(save_directory, exist_ok=True)
    self.tokenizer.save_pretrained(save_directory)
    self.image_processor.save_pretrained(save_directory)
    with open(os.path.join(save_directory, "chat_template.jinja"), "w") as f:
        f.write(self.chat_template)


Qwen3VLProcessor.save_pretrained = save_text_processor

# ---------------------------------------------------------------------------------------------------------------
# Sizes. The three components must agree: DiT in_channels == VAE z_dim, DiT context_in_dim == TE hidden_size.
# ---------------------------------------------------------------------------------------------------------------

LATENT_CHANNELS = 16
TE_HIDDEN = 48

DIT = dict(patch_size=1, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
           attention_head_dim=16, num_attention_heads=2, context_in_dim=TE_HIDDEN, mlp_ratio=3,
           axes_dims_rope=(4, 6, 6), eps=1e-6, causal_condition=True)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
BPE_VOCAB = 448  # byte alphabet + merges, before the special tokens

SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096, shift=1.0, time_shift_type="exponential")

# (name, prompt, negative prompt, true_cfg_scale, height, width, steps, seed)
CASES = [
    ("short", "a red fox", None, 1.0, 64, 64, 3, 42),
    ("long", "A capybara wearing a wizard hat, reading an old book by candlelight in a stone tower, oil painting, "
             "warm light, fine detail", None, 1.0, 64, 96, 4, 7),
    ("cfg", "a lighthouse on a cliff at dusk", "blurry", 4.0, 96, 64, 3, 2026),
]

# A chat template covering what the pipeline asks of it: system/user/assistant turns whose content is a string or a
# list of {"type": "text"} items (the pipeline tokenizes a system message to count the rows it drops).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CORPUS = [
    "Comprehend and analyze the provided prompt.",
    "system", "user", "assistant",
    "a red fox in the snow, a blue bird on a branch, a green frog by the pond",
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "a lighthouse on a cliff at dusk, waves and rocks, dramatic sky, photograph",
    "the quick brown fox jumps over the lazy dog; portrait of a cat, watercolor, pastel colors",
    "an old stone tower in a misty forest, warm light, fine detail, high resolution, 4k, cinematic",
    "blurry, low quality, distorted, text, watermark, extra fingers, bad anatomy",
    "Numbers 0123456789 and symbols: , . ; : ! ? ( ) [ ] - _ ' \" / \\ + = * & % $ # @",
]


def versions():
    import safetensors

    return {
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
    }


# ---------------------------------------------------------------------------------------------------------------
# Noise: the portable generator of crates/tf-engines/src/noise.rs, independently written.
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


def packed_noise(seed, channels, lat_h, lat_w):
    """[1, h * w, channels]: drawn in (channels, h, w) order, packed channels-last like the pipeline packs."""
    draw = torch.from_numpy(normals(seed, channels * lat_h * lat_w)).view(channels, lat_h * lat_w)
    return draw.transpose(0, 1).contiguous()[None]


# ---------------------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------------------

def train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    # Qwen-style splitting: contractions, letters, single digits, punctuation runs, spaces; then byte-level.
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=4096)
    return fast


def randomize(module, gen, scale_2d, scale_1d, norm_base):
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if norm_base(name) else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * (scale_2d(p) if p.ndim >= 2 else scale_1d) + base)


def build_pipeline():
    gen = torch.Generator().manual_seed(20261202)
    tokenizer = train_tokenizer()
    vocab = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    te_text = dict(vocab_size=vocab, hidden_size=TE_HIDDEN, intermediate_size=80, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   max_position_embeddings=512,
                   rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[4, 2, 2],
                                        mrope_interleaved=True))
    te_vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TE_HIDDEN,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                     deepstack_visual_indexes=[0])
    te_config = Qwen3VLConfig(text_config=te_text, vision_config=te_vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    text_encoder = Qwen3VLForConditionalGeneration(te_config).eval().float()
    randomize(text_encoder, gen, lambda p: 0.3, 0.1,
              lambda n: n.endswith("norm.weight") or "layernorm" in n)

    transformer = QwenImage21Transformer2DModel(**DIT).eval()
    randomize(transformer, gen, lambda p: 0.2, 0.1, lambda n: n.endswith(("norm_q.weight", "norm_k.weight")))

    mean = (torch.randn(LATENT_CHANNELS, generator=gen) * 0.3).tolist()
    std = (torch.rand(LATENT_CHANNELS, generator=gen) * 1.5 + 0.5).tolist()
    vae = AutoencoderKLQwenImage21(base_dim=2, decoder_base_dim=2, z_dim=LATENT_CHANNELS, latents_mean=mean,
                                   latents_std=std).eval()
    randomize(vae, gen, lambda p: 1.0 / math.sqrt(p[0].numel()), 0.1, lambda n: n.endswith("gamma"))

    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    processor = make_processor(tokenizer)
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)


def make_processor(tokenizer):
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                            chat_template=CHAT_TEMPLATE)


def load_saved(model_dir):
    """The pipeline from the saved folder, component by component (the processor without its video part)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(model_dir, "processor"))
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir, subfolder="scheduler"),
        vae=AutoencoderKLQwenImage21.from_pretrained(model_dir, subfolder="vae").eval().float(),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(
            os.path.join(model_dir, "text_encoder"), dtype=torch.float32).eval(),
        processor=make_processor(tokenizer),
        transformer=QwenImage21Transformer2DModel.from_pretrained(model_dir, subfolder="transformer").eval().float(),
    )


# ---------------------------------------------------------------------------------------------------------------
# Reference runs
# ---------------------------------------------------------------------------------------------------------------

def run_case(pipe, case, tensors):
    name, prompt, negative, cfg, height, width, steps, seed = case
    lat_h, lat_w = 2 * (height // 32), 2 * (width // 32)
    noise = packed_noise(seed, LATENT_CHANNELS, lat_h, lat_w)
    tensors[f"{name}.noise"] = noise[0].clone()

    # The ids the processor gives the text encoder (one prompt: no padding).
    for tag, text in (("prompt", prompt), ("negative", negative)):
        if text is None:
            continue
        templated = pipe.prompt_template_t2i.format(text if text else " ")
        ids = pipe.processor(text=[templated], padding=True, padding_side="left", return_tensors="pt").input_ids
        tensors[f"{name}.{tag}_ids"] = ids[0].to(torch.int64).clone()

    decoded = []
    original_decode = pipe.vae.decode

    def recording_decode(*args, **kwargs):
        out = original_decode(*args, **kwargs)
        decoded.append(out[0].detach().clone())
        return out

    per_step = []

    def on_step_end(pipeline, i, t, kwargs):
        per_step.append(kwargs["latents"].detach().clone())
        if i == 0:
            tensors[f"{name}.prompt_embeds"] = kwargs["prompt_embeds"][0].detach().clone()
        return {}

    pipe.vae.decode = recording_decode
    try:
        with torch.no_grad():
            images = pipe(prompt=prompt, negative_prompt=negative, true_cfg_scale=cfg, height=height, width=width,
                          num_inference_steps=steps, latents=noise.clone(), output_type="np",
                          callback_on_step_end=on_step_end,
                          callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"]).images
    finally:
        pipe.vae.decode = original_decode
    assert len(per_step) == steps, (len(per_step), steps)
    assert len(decoded) == 1
    for i, latents in enumerate(per_step):
        tensors[f"{name}.latents.{i}"] = latents[0].contiguous()
    # The VAE output [channels, H, W] in [-1, 1], frame 0, before the image processor's uint8 conversion.
    tensors[f"{name}.decoded"] = decoded[0][0, :, 0].contiguous()
    u8 = (images[0] * 255).round().astype("uint8")  # what numpy_to_pil does
    tensors[f"{name}.image_u8"] = torch.from_numpy(np.ascontiguousarray(u8))
    return dict(name=name, prompt=prompt, negative_prompt=negative, true_cfg_scale=cfg, height=height, width=width,
                steps=steps, seed=seed, latent_height=lat_h, latent_width=lat_w,
                image_shape=list(u8.shape))


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures/qwen_pipeline")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    pipe = build_pipeline()
    model_dir = os.path.join(args.out, "model")
    shutil.rmtree(model_dir, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    pipe.save_pretrained(model_dir, safe_serialization=True)
    # Run from the saved folder, so the reference reads exactly the committed files.
    pipe = load_saved(model_dir)
    pipe.set_progress_bar_config(disable=True)

    tensors, cases = {}, []
    for case in CASES:
        cases.append(run_case(pipe, case, tensors))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "expected.safetensors"))
    manifest = dict(generator="tests/python/qwen_pipeline_tiny.py", versions=versions(), drop_idx=pipe._drop_idx,
                    use_kv_cache=True, dtype="float32", cases=cases, model_bytes=folder_bytes(model_dir))
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
