#!/usr/bin/env python3
"""Full-size Qwen-Image 2.1 pipeline reference run (diffusers 0.42.1 QwenImage21Pipeline, transformers Qwen3-VL).

Builds seeded random weights for the whole pipeline at the released architecture (the DiT at its default config,
the Qwen3-VL 8B text encoder, the VAE at its default config), with the project's Qwen tokenizer
(tests/tokenizer/fixtures/qwen-tokenizer.json.gz) and a Qwen3-VL processor, and saves it with save_pretrained as a
diffusers pipeline folder (safetensors) that `tf image --model` loads. It then reloads that folder with
QwenImage21Pipeline.from_pretrained (timed: the reference's load from page cache) and runs it in bf16 for one
prompt with injected noise, for each size and step count:

  - per-step velocities (the transformer's output on the target tokens, hooked) and latents after each step;
  - wall times per phase (encode, each step, decode, end to end), synchronized with the device;
  - peak device memory (torch.cuda.max_memory_allocated and max_memory_reserved) of each run;
  - the final image (PNG, and float in [0, 1]).

Then an fp32 run of the first --fp32-steps steps of each schedule (same weights, same noise) gives the floor: the
bf16 reference's per-step velocity rel L2 against fp32. tests/python/compare_pipeline.py judges `tf image` against
these files. Layout under --out (see docs/gpu-runs/README.md):

  model/                         the pipeline folder (model_index.json, transformer/, text_encoder/, vae/,
                                 scheduler/, processor/)
  prompt.txt                     the prompt, as given to both
  reference.json                 settings, timings, memory, floors (also printed)
  WxH/noise.safetensors          "noise": [1, 1, C, h, w] bf16, the pipeline's draw layout (tf image --noise)
  WxH/stepsN/reference.safetensors   velocity.{i}, latents.{i} [1, h*w, C] f32; image [1, 4, H, W] f32 in [0, 1]
  WxH/stepsN/reference.png       the bf16 reference image (RGBA)
  WxH/stepsN/fp32.safetensors    velocity.{i}, latents.{i} of the fp32 run, i < --fp32-steps
  WxH/stepsN/fp32_image.png, fp32_image.safetensors   with --fp32-images N: the whole schedule in fp32 (text
                                 encoder, DiT, VAE), image [1, 4, H, W] f32 in [0, 1]

Usage:
    python3 tests/python/qwen_pipeline_reference.py --out /tmp/qwen21p             # GPU, diffusers on PYTHONPATH
    python3 tests/python/qwen_pipeline_reference.py --out /tmp/qwen21p-tiny --tiny  # tiny configs, CPU, seconds
"""

import argparse
import gzip
import importlib.util
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import diffusers
import transformers
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

# transformers' video processor (part of a complete Qwen3-VL processor) needs torchvision; the GPU machine has it.
HAVE_TORCHVISION = importlib.util.find_spec("torchvision") is not None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TOKENIZER_GZ = os.path.join(REPO, "tests", "tokenizer", "fixtures", "qwen-tokenizer.json.gz")

DEFAULT_PROMPT = (
    "A red fox sitting on a mossy rock in a snowy pine forest at dawn, soft golden light, "
    "shallow depth of field, photograph"
)

# Qwen2/Qwen3 vocabulary ends at this id; the project's tokenizer.json appends seven MiniMax-H3 tokens after it,
# which the Qwen3-VL tokenizer does not have.
LAST_QWEN_TOKEN_ID = 151668
QWEN3_VL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                          vision_end_token_id=151653)

# Qwen3-VL-8B (text path as the Qwen-Image 2.1 pipeline reads it; the vision tower at its released shape).
TE_TEXT_FULL = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                    rms_norm_eps=1e-6, max_position_embeddings=262144, attention_bias=False,
                    bos_token_id=151643, eos_token_id=151645,
                    rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                         mrope_interleaved=True))
TE_VISION_FULL = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh", in_channels=3)
# Tiny: every path of the real structure, small widths; the vocabulary stays real (the tokenizer is the real one).
TE_TEXT_TINY = dict(vocab_size=151936, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-6,
                    max_position_embeddings=4096, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
                    rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[4, 2, 2],
                                         mrope_interleaved=True))
TE_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])

DIT_FULL = {}  # QwenImage21Transformer2DModel defaults: 32 layers, 32 x 128 heads, context 4096, 64 channels
DIT_TINY = dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, context_in_dim=48, mlp_ratio=3, axes_dims_rope=(4, 6, 6))

VAE_FULL = {}  # AutoencoderKLQwenImage21 defaults: z_dim 64, base 96, decoder base 144, RGBA
VAE_TINY = dict(base_dim=2, decoder_base_dim=4, z_dim=16, latents_mean=[0.1 * ((i * 7) % 5 - 2) for i in range(16)],
                latents_std=[0.5 + 0.1 * ((i * 3) % 7) for i in range(16)])

# The Qwen-Image 2.1 scheduler shape: resolution-dependent exponential shift (mu = 1.15 at 1024x1024).
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096, shift=1.0)

# Renders what the pipeline asks of the processor: role blocks of text (and image placeholders), then optionally the
# assistant prompt. The pipeline counts the tokens of the rendered system block (14) as rows to drop.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


class Device:
    def __init__(self, name):
        self.name = name
        self.cuda = name.startswith("cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def now(self):
        self.sync()
        return time.perf_counter()

    def memory(self):
        if not self.cuda:
            return {}
        return dict(allocated_bytes=torch.cuda.memory_allocated(), reserved_bytes=torch.cuda.memory_reserved())

    def peak(self):
        if not self.cuda:
            return {}
        return dict(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                    peak_reserved_bytes=torch.cuda.max_memory_reserved())

    def reset_peak(self, release_cache=False):
        # Timed runs keep the allocator's cache (warm, as in a serving process); the warm-up starts from an empty
        # cache, so its reserved peak is what one request needs.
        if self.cuda:
            if release_cache:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------------------------------------
# Building the pipeline folder
# ---------------------------------------------------------------------------------------------------------------

def build_transformer(config, seed, device):
    # The rule of tests/python/qwen_dit_reference.py (default init under manual_seed(seed), every 1-D weight moved
    # off its default), so the same seed gives the same DiT as that script's.
    torch.manual_seed(seed)
    with torch.device(device):
        model = QwenImage21Transformer2DModel(**config)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(seed + 1)
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, device=device))
    return model.to(torch.bfloat16).eval()


def build_text_encoder(text_config, vision_config, seed, device):
    config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False,
                           **QWEN3_VL_TOKEN_IDS)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    # Every parameter redrawn from our own seeded generator: the weights depend on the seed only, not on the
    # library's init. Matrices N(0, 0.02) (the config's initializer_range); norm weights around 1 so a wrong norm
    # shows; biases small.
    g = torch.Generator(device=device).manual_seed(seed + 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * 0.02)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32))
    return model.to(torch.bfloat16).eval()


def build_vae(config, seed, device, latent_hw=(8, 8)):
    torch.manual_seed(seed + 20)
    with torch.device(device):
        vae = AutoencoderKLQwenImage21(**config)
    g = torch.Generator(device=device).manual_seed(seed + 21)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(0.1 * torch.randn(p.shape, generator=g, device=device))
            elif p.ndim == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device=device))
    vae = vae.eval()
    # Random weights decode to a near-constant or a saturated image; rescale the last conv so the pre-clamp output
    # of a random latent has std 0.5: the image then has contrast and is rarely clipped, so PSNR means something.
    captured = {}
    handle = vae.decoder.conv_out.register_forward_hook(lambda m, a, out: captured.__setitem__("out", out.detach()))
    try:
        z = torch.randn(1, vae.config.z_dim, 1, *latent_hw, generator=g, device=device)
        with torch.no_grad():
            vae.decode(z, return_dict=False)
    finally:
        handle.remove()
    std = float(captured["out"].float().std())
    if not math.isfinite(std) or std == 0.0:
        raise RuntimeError(f"VAE with random weights decodes to std {std}; cannot calibrate it")
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.5 / std)
        if vae.decoder.conv_out.bias is not None:
            vae.decoder.conv_out.bias.mul_(0.5 / std)
    return vae.to(torch.bfloat16), std


def write_tokenizer_json(path):
    with gzip.open(TOKENIZER_GZ, "rt", encoding="utf-8") as f:
        data = json.load(f)
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] <= LAST_QWEN_TOKEN_ID]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def build_processor(workdir, patch_size):
    os.makedirs(workdir, exist_ok=True)
    tokenizer_json = os.path.join(workdir, "tokenizer.json")
    write_tokenizer_json(tokenizer_json)
    special = dict(unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   model_max_length=262144)
    try:
        tokenizer = Qwen2Tokenizer(tokenizer_file=tokenizer_json, errors="replace", add_prefix_space=False,
                                   **special)
        check_tokenizer(tokenizer, tokenizer_json)
    except Exception as exc:  # transformers versions differ in how Qwen2Tokenizer takes a tokenizer.json
        log(f"Qwen2Tokenizer(tokenizer_file=...) unusable here ({str(exc)[:200]}); using PreTrainedTokenizerFast")
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, **special)
        check_tokenizer(tokenizer, tokenizer_json)
    from transformers import Qwen2VLImageProcessor

    image_processor = Qwen2VLImageProcessor(patch_size=patch_size, temporal_patch_size=2, merge_size=2,
                                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    if HAVE_TORCHVISION:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        video_processor = Qwen3VLVideoProcessor(patch_size=patch_size, temporal_patch_size=2, merge_size=2)
    else:
        video_processor = None
        allow_missing_video_processor()
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    if video_processor is None:
        processor.video_processor = _no_video_processor()
    return processor


def _no_video_processor():
    """Stands in for the video processor when saving without torchvision: saves an empty entry."""
    from transformers.utils import PushToHubMixin

    class NoVideoProcessor(PushToHubMixin):
        _auto_class = None

        def to_dict(self):
            return {}

    return NoVideoProcessor()


def template_text(prompt):
    return (f"<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
            f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def check_tokenizer(tokenizer, tokenizer_json, prompt=DEFAULT_PROMPT):
    """The transformers tokenizer must give the ids of the tokenizer.json itself (what `tf` reads)."""
    import tokenizers

    text = template_text(prompt)
    expected = tokenizers.Tokenizer.from_file(tokenizer_json).encode(text, add_special_tokens=False).ids
    got = tokenizer(text, add_special_tokens=False)["input_ids"]
    if list(got) != list(expected):
        raise RuntimeError(f"tokenizer ids differ from tokenizer.json's: {list(got)[:20]}... vs {expected[:20]}...")


def allow_missing_video_processor():
    """Without torchvision transformers has no video processor; text-to-image never uses one, so accept None.

    Only for hosts without torchvision (smoke runs); the GPU machine has it and saves a complete processor.
    """
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    if getattr(check, "accepts_missing_video", False):
        return

    def lenient(self, name, argument):
        if name == "video_processor" and argument is None:
            return None
        return check(self, name, argument)

    lenient.accepts_missing_video = True
    ProcessorMixin.check_argument_for_proper_class = lenient


def same_transformer(model, folder):
    """True when `folder` holds this transformer (e.g. saved by qwen_dit_reference.py with the same seed): same
    config and equal tensors at a few places (input, first and last block, output)."""
    from safetensors import safe_open

    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        log(f"--reuse-transformer {folder}: no config.json there; saving our own")
        return False
    with open(config_path) as f:
        saved = json.load(f)
    ours = dict(model.config)
    differing = [k for k, v in ours.items() if not k.startswith("_") and k in saved
                 and json.dumps(saved[k]) != json.dumps(list(v) if isinstance(v, tuple) else v)]
    if differing:
        log(f"--reuse-transformer {folder}: config differs in {differing}; saving our own")
        return False
    last = model.config.num_layers - 1
    names = ["img_in.weight", "transformer_blocks.0.attn.norm_q.weight", f"transformer_blocks.{last}.attn.to_v.weight",
             "proj_out.weight"]
    state = model.state_dict()
    shards = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")]
    found = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in names:
                if name in f.keys():
                    found[name] = f.get_tensor(name)
    for name in names:
        if name not in found or not torch.equal(found[name].to(state[name].device, state[name].dtype), state[name]):
            log(f"--reuse-transformer {folder}: tensor {name} differs or is missing; saving our own")
            return False
    return True


def folder_bytes(path):
    total = 0
    for root, _, files in os.walk(path, followlinks=True):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def build_and_save(args, dev, summary):
    tiny = args.tiny
    model_dir = os.path.join(args.out, "model")
    if os.path.exists(model_dir):
        shutil.rmtree(model_dir)
    t0 = time.perf_counter()
    dit_config, te_text, te_vision = (DIT_TINY, TE_TEXT_TINY, TE_VISION_TINY) if tiny else (
        DIT_FULL, TE_TEXT_FULL, TE_VISION_FULL)
    if args.layers is not None:
        # Smoke runs at full width: fewer decoder layers in both models, a one-block vision tower.
        dit_config = dict(dit_config, num_layers=args.layers)
        te_text = dict(te_text, num_hidden_layers=args.layers)
        te_vision = dict(te_vision, depth=1, deepstack_visual_indexes=[0])
    transformer = build_transformer(dit_config, args.seed, dev.name)
    dev.sync()
    log(f"transformer built: {sum(p.numel() for p in transformer.parameters()) / 1e9:.3f} B parameters")
    text_encoder = build_text_encoder(te_text, te_vision, args.seed, dev.name)
    dev.sync()
    log(f"text encoder built: {sum(p.numel() for p in text_encoder.parameters()) / 1e9:.3f} B parameters")
    vae, vae_raw_std = build_vae(VAE_TINY if tiny else VAE_FULL, args.seed, dev.name)
    dev.sync()
    log(f"vae built: {sum(p.numel() for p in vae.parameters()) / 1e6:.1f} M parameters (conv_out rescaled from "
        f"std {vae_raw_std:.4g} to 0.5)")
    processor = build_processor(os.path.join(args.out, "tokenizer-src"), te_vision["patch_size"])
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)
    summary["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reuse = args.reuse_transformer and same_transformer(transformer, args.reuse_transformer)
    if reuse:
        # What save_pretrained writes, component by component, with the transformer folder linked, not rewritten.
        os.makedirs(model_dir)
        pipe.save_config(model_dir)
        for name in ("scheduler", "vae", "text_encoder", "processor"):
            getattr(pipe, name).save_pretrained(os.path.join(model_dir, name))
        os.symlink(os.path.abspath(args.reuse_transformer), os.path.join(model_dir, "transformer"))
        log(f"transformer: linked to {args.reuse_transformer} (same weights)")
    else:
        pipe.save_pretrained(model_dir, safe_serialization=True)
    summary["transformer_linked_from"] = os.path.abspath(args.reuse_transformer) if reuse else None
    summary["save_s"] = time.perf_counter() - t0
    summary["model_bytes"] = folder_bytes(model_dir)
    summary["drop_rows"] = pipe._drop_idx
    log(f"pipeline built in {summary['build_s']:.1f}s, saved in {summary['save_s']:.1f}s "
        f"({summary['model_bytes'] / 2**30:.2f} GiB) to {model_dir}; system rows dropped: {pipe._drop_idx}")
    del pipe, transformer, text_encoder, vae
    if dev.cuda:
        torch.cuda.empty_cache()
    return model_dir, processor


def load_pipeline(model_dir, dev, dtype, processor):
    t0 = time.perf_counter()
    # Without torchvision the saved processor cannot be loaded (no video processor class): hand it over built.
    extra = {} if HAVE_TORCHVISION else dict(processor=processor)
    # Loaded on the host, then moved: the way a user runs it, and no device-map hooks in the timed forwards.
    pipe = QwenImage21Pipeline.from_pretrained(model_dir, dtype=dtype, **extra).to(dev.name)
    pipe.set_progress_bar_config(disable=True)
    load_s = dev.now() - t0
    return pipe, load_s


def fp32_copy(pipe, dev):
    """The same weights in fp32, built fresh so non-persistent buffers (RoPE, timestep tables) are fp32 too."""
    with torch.device(dev.name):
        transformer = QwenImage21Transformer2DModel.from_config(pipe.transformer.config)
    transformer.load_state_dict(pipe.transformer.state_dict())
    config = pipe.text_encoder.config
    with torch.device(dev.name):
        text_encoder = Qwen3VLForConditionalGeneration(config)
    text_encoder.load_state_dict(pipe.text_encoder.state_dict())
    text_encoder = text_encoder.to(torch.float32)
    transformer = transformer.to(torch.float32).eval()
    text_encoder.eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe32 = QwenImage21Pipeline(scheduler=scheduler, vae=pipe.vae, text_encoder=text_encoder,
                                 processor=pipe.processor, transformer=transformer)
    pipe32.set_progress_bar_config(disable=True)
    return pipe32


# ---------------------------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------------------------

class Recorder:
    """Hooks the transformer and the text encoder: velocities per step and synchronized phase boundaries."""

    def __init__(self, pipe, dev, target_tokens, stop_after=None):
        self.dev = dev
        self.pipe = pipe
        self.target_tokens = target_tokens
        self.stop_after = stop_after
        self.velocities, self.latents = [], []
        self.step_start, self.step_end = [], []
        self.te_start, self.te_end = [], []
        self.handles = [
            pipe.transformer.register_forward_pre_hook(lambda m, a: self.step_start.append(dev.now())),
            pipe.transformer.register_forward_hook(self._velocity),
            pipe.text_encoder.register_forward_pre_hook(lambda m, a: self.te_start.append(dev.now())),
            pipe.text_encoder.register_forward_hook(lambda m, a, o: self.te_end.append(dev.now())),
        ]

    def _velocity(self, module, args, output):
        out = output[0] if isinstance(output, (tuple, list)) else output.sample
        self.velocities.append(out[:, -self.target_tokens:].detach().clone())

    def on_step_end(self, pipe, index, timestep, kwargs):
        self.step_end.append(self.dev.now())
        self.latents.append(kwargs["latents"].detach().clone())
        if self.stop_after is not None and index + 1 >= self.stop_after:
            pipe._interrupt = True
        return {}

    def remove(self):
        for handle in self.handles:
            handle.remove()


def run_pipeline(pipe, dev, prompt, noise_packed, width, height, steps, stop_after=None, output_type="pt"):
    recorder = Recorder(pipe, dev, noise_packed.shape[1], stop_after)
    try:
        t0 = dev.now()
        with torch.no_grad():
            result = pipe(prompt=prompt, height=height, width=width, num_inference_steps=steps,
                          latents=noise_packed, output_type=output_type, return_dict=False,
                          callback_on_step_end=recorder.on_step_end, use_kv_cache=True)
        t_end = dev.now()
    finally:
        recorder.remove()
    ran = len(recorder.step_end)
    expected = steps if stop_after is None else min(steps, stop_after)
    if ran != expected or len(recorder.velocities) != expected or len(recorder.step_start) != expected:
        raise RuntimeError(f"expected {expected} steps, recorded {ran} step ends, {len(recorder.velocities)} "
                           f"velocities and {len(recorder.step_start)} transformer calls (true CFG on?)")
    ms = lambda a, b: (b - a) * 1000.0  # noqa: E731
    timings = dict(
        encode_ms=ms(t0, recorder.step_start[0]),
        text_encoder_forward_ms=sum(ms(a, b) for a, b in zip(recorder.te_start, recorder.te_end)),
        steps_ms=[ms(a, b) for a, b in zip(recorder.step_start, recorder.step_end)],
        decode_ms=ms(recorder.step_end[-1], t_end) if output_type != "latent" else None,
        total_ms=ms(t0, t_end),
    )
    timings["steps_sum_ms"] = sum(timings["steps_ms"])
    recorder.sigmas = [float(v) for v in pipe.scheduler.sigmas]
    recorder.euler_rel_l2 = euler_check(noise_packed, recorder)
    image = result[0] if output_type != "latent" else None
    return recorder, timings, image


def euler_check(noise_packed, recorder):
    """Worst rel L2 of each recorded latent against an Euler step from the recorded velocity.

    Shows the hook captured the velocity the sampler used: x_i = x_(i-1) + (sigma_(i+1) - sigma_i) * v_i.
    """
    worst = 0.0
    previous = noise_packed
    for i, (v, x) in enumerate(zip(recorder.velocities, recorder.latents)):
        step = torch.tensor(recorder.sigmas[i + 1] - recorder.sigmas[i], dtype=torch.float32, device=v.device)
        expected = (previous.to(torch.float32) + step * v).to(v.dtype)
        worst = max(worst, rel_l2(x.float(), expected.float()))
        previous = x
    if not worst < 1e-3:
        raise RuntimeError(f"recorded latents are not Euler steps of the recorded velocities (rel L2 {worst:.3g}): "
                           "the transformer hook did not capture what the sampler used")
    return worst


def fp32_image_runs(pipe32, dev, args, summary, channels, step_counts):
    """The whole schedule in fp32 for the cases with these step counts: the fp32 image beside the bf16 one.

    The text encoder and DiT are the fp32 copy's; the VAE is an fp32 copy of the bf16 one (the pipeline casts the
    latents to the VAE's dtype). A failure here is logged and recorded (case["fp32_image"]["error"]), not raised:
    the bf16 runs and the floor are done by then, and reference.json is still written.
    """
    import copy

    try:
        vae32 = copy.deepcopy(pipe32.vae).to(torch.float32).eval()
        pipe_img = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(pipe32.scheduler.config),
                                       vae=vae32, text_encoder=pipe32.text_encoder, processor=pipe32.processor,
                                       transformer=pipe32.transformer)
        pipe_img.set_progress_bar_config(disable=True)
    except Exception as exc:  # noqa: BLE001 (recorded; the rest of the run stands)
        summary["fp32_images_error"] = f"{type(exc).__name__}: {exc}"
        log(f"fp32 images: could not build the fp32 VAE pipeline: {summary['fp32_images_error']}")
        return
    for case in summary["cases"]:
        if case["steps"] not in step_counts:
            continue
        width, height, steps = case["width"], case["height"], case["steps"]
        lat_h, lat_w = height // 16, width // 16
        size_dir = os.path.join(args.out, f"{width}x{height}")
        case_dir = os.path.join(size_dir, f"steps{steps}")
        t0 = time.perf_counter()
        try:
            noise = load_file(os.path.join(size_dir, "noise.safetensors"))["noise"]
            packed = noise.view(1, channels, lat_h * lat_w).transpose(1, 2).float().contiguous().to(dev.name)
            _, timings, image = run_pipeline(pipe_img, dev, args.prompt, packed, width, height, steps)
            image = image.float().cpu().contiguous()
            save_file({"image": image}, os.path.join(case_dir, "fp32_image.safetensors"))
            to_png(image, os.path.join(case_dir, "fp32_image.png"))
            bf16 = load_file(os.path.join(case_dir, "reference.safetensors"))["image"].float()
            mse = float(((bf16.double() - image.double()) ** 2).mean())
            psnr_bf16 = math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse)
            case["fp32_image"] = dict(seconds=time.perf_counter() - t0, timings=timings, image=image_stats(image),
                                      bf16_vs_fp32_float_psnr_db=psnr_bf16)
            log(f"{case['name']}: fp32 image in {time.perf_counter() - t0:.1f}s (end to end "
                f"{timings['total_ms']:.0f} ms); diffusers bf16 against it: PSNR {psnr_bf16:.2f} dB (float)")
        except Exception as exc:  # noqa: BLE001 (recorded; the rest of the run stands)
            case["fp32_image"] = dict(error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)
            log(f"{case['name']}: fp32 image failed: {case['fp32_image']['error']}")
            if dev.cuda:
                torch.cuda.empty_cache()
    del pipe_img, vae32


def to_png(image01, path):
    from PIL import Image

    array = (image01[0].float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255.0).round().astype(np.uint8)
    mode = {4: "RGBA", 3: "RGB", 1: "L"}[array.shape[2]]
    Image.fromarray(array if mode != "L" else array[:, :, 0], mode=mode).save(path)


def image_stats(image01):
    x = image01.float()
    return dict(mean=float(x.mean()), std=float(x.std()), clipped_fraction=float(((x <= 0) | (x >= 1)).float().mean()))


def parse_sizes(text):
    sizes = []
    for item in text.split(","):
        w, h = (int(v) for v in item.lower().split("x"))
        if w % 32 or h % 32 or w <= 0 or h <= 0:
            raise SystemExit(f"--sizes: {item} must be positive multiples of 32 (the pipeline floors to 32)")
        sizes.append((w, h))
    return sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke run of this script)")
    ap.add_argument("--sizes", default=None, help="WxH[,WxH...] (default 1024x1024; tiny 64x64)")
    ap.add_argument("--steps", default=None, help="step counts (default 8,40; tiny 2,3)")
    ap.add_argument("--fp32-steps", type=int, default=2, help="steps of the fp32 floor run per schedule (0: none)")
    ap.add_argument("--fp32-images", default=None, metavar="N[,N...]",
                    help="also run the fp32 copy through the whole schedule of these step counts (text encoder, "
                         "DiT and VAE in fp32) and save its image: WxH/stepsN/fp32_image.png and "
                         "fp32_image.safetensors (image [1, C, H, W] in [0, 1]); an anchor for image PSNR/SSIM")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--layers", type=int, default=None,
                    help="smoke runs: this many layers in the text encoder and the DiT (full width otherwise)")
    ap.add_argument("--reuse-transformer", default=None, metavar="DIR",
                    help="link this saved transformer folder (qwen_dit_reference.py --out X writes X/transformer) "
                         "instead of writing the same weights again, when its config and tensors match ours")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes or ("64x64" if args.tiny else "1024x1024"))
    step_counts = [int(v) for v in (args.steps or ("2,3" if args.tiny else "8,40")).split(",")]
    if any(n < 1 for n in step_counts):
        raise SystemExit("--steps: every count must be at least 1")
    dev = Device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    summary = dict(
        versions=dict(diffusers=diffusers.__version__, transformers=transformers.__version__,
                      torch=torch.__version__),
        device=torch.cuda.get_device_name(0) if dev.cuda else "cpu",
        tiny=args.tiny, layers=args.layers, seed=args.seed, prompt=args.prompt, scheduler=SCHEDULER, use_kv_cache=True,
        dtype="bfloat16", noise_tensor="noise", cases=[],
    )
    with open(os.path.join(args.out, "prompt.txt"), "w", encoding="utf-8") as f:
        f.write(args.prompt)
    if shutil.disk_usage(args.out).free < (5 if args.tiny else 40) * 2**30 and not args.tiny:
        log(f"warning: only {shutil.disk_usage(args.out).free / 2**30:.1f} GiB free under {args.out}")

    model_dir, processor = build_and_save(args, dev, summary)
    pipe, load_s = load_pipeline(model_dir, dev, torch.bfloat16, processor)
    summary["reference_load_s"] = load_s
    summary["resident"] = dev.memory()
    log(f"reference pipeline loaded in {load_s:.1f}s from the saved folder; resident {dev.memory()}")
    ids = pipe.processor(text=[template_text(args.prompt)], return_tensors="pt").input_ids[0].tolist()
    summary["prompt_ids"] = ids
    summary["text_rows"] = len(ids) - pipe._drop_idx
    check_tokenizer(pipe.processor.tokenizer, os.path.join(model_dir, "processor", "tokenizer.json"), args.prompt)
    log(f"prompt: {len(ids)} tokens, {summary['text_rows']} rows after dropping {pipe._drop_idx} system rows")
    channels = pipe.transformer.config.in_channels

    # Warm-up: the first call pays for kernel loading and library handles; not timed as a case.
    w0, h0 = sizes[0]
    g = torch.Generator().manual_seed(args.seed + 100)
    warm = torch.randn(1, (h0 // 16) * (w0 // 16), channels, generator=g).to(dev.name, torch.bfloat16)
    dev.reset_peak(release_cache=True)
    _, warm_timings, _ = run_pipeline(pipe, dev, args.prompt, warm, w0, h0, 2)
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
        for steps in step_counts:
            case_dir = os.path.join(size_dir, f"steps{steps}")
            os.makedirs(case_dir, exist_ok=True)
            dev.reset_peak()
            before = dev.memory()
            recorder, timings, image = run_pipeline(pipe, dev, args.prompt, packed.to(dev.name), width, height,
                                                    steps)
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
            to_png(image, os.path.join(case_dir, "reference.png"))
            case["image"] = image_stats(image)
            case["velocity_norms"] = [float(v.float().norm()) for v in recorder.velocities]
            if not all(math.isfinite(n) for n in case["velocity_norms"]):
                raise RuntimeError(f"{case['name']}: non-finite velocity norms {case['velocity_norms']}")
            runs[(width, height, steps)] = (recorder.velocities, recorder.latents)
            summary["cases"].append(case)
            log(f"{case['name']}: encode {timings['encode_ms']:.1f} ms, steps {timings['steps_sum_ms']:.1f} ms "
                f"(mean {timings['steps_sum_ms'] / steps:.1f}), decode {timings['decode_ms']:.1f} ms, "
                f"end to end {timings['total_ms']:.1f} ms; peak {case['memory']}")

    fp32_images = [int(v) for v in args.fp32_images.split(",")] if args.fp32_images else []
    if args.fp32_steps > 0 or fp32_images:
        t0 = time.perf_counter()
        pipe32 = fp32_copy(pipe, dev)
        summary["fp32_build_s"] = time.perf_counter() - t0
        log(f"fp32 copy built in {summary['fp32_build_s']:.1f}s; resident {dev.memory()}")
        for case in summary["cases"] if args.fp32_steps > 0 else []:
            width, height, steps = case["width"], case["height"], case["steps"]
            lat_h, lat_w = height // 16, width // 16
            size_dir = os.path.join(args.out, f"{width}x{height}")
            noise = load_file(os.path.join(size_dir, "noise.safetensors"))["noise"]
            packed = noise.view(1, channels, lat_h * lat_w).transpose(1, 2).float().contiguous().to(dev.name)
            stop = min(args.fp32_steps, steps)
            t1 = time.perf_counter()
            recorder, timings32, _ = run_pipeline(pipe32, dev, args.prompt, packed, width, height, steps,
                                                  stop_after=stop, output_type="latent")
            velocities16, latents16 = runs[(width, height, steps)]
            tensors, floors = {}, []
            for i, (v32, x32) in enumerate(zip(recorder.velocities, recorder.latents)):
                tensors[f"velocity.{i}"] = v32.float().cpu().contiguous()
                tensors[f"latents.{i}"] = x32.float().cpu().contiguous()
                floors.append(dict(step=i, velocity_rel_l2=rel_l2(velocities16[i].float(), v32.float()),
                                   velocity_cosine=cosine(velocities16[i].float(), v32.float()),
                                   latents_rel_l2=rel_l2(latents16[i].float(), x32.float())))
            save_file(tensors, os.path.join(size_dir, f"steps{steps}", "fp32.safetensors"))
            case["fp32"] = dict(steps=stop, seconds=time.perf_counter() - t1, timings=timings32,
                                euler_check_rel_l2=recorder.euler_rel_l2)
            case["floor"] = floors
            log(f"{case['name']}: floor (bf16 vs fp32 velocity rel L2 per step) "
                + ", ".join(f"{f['velocity_rel_l2']:.4g}" for f in floors))
        if fp32_images:
            fp32_image_runs(pipe32, dev, args, summary, channels, fp32_images)
        del pipe32
    summary["total_s"] = time.perf_counter() - started
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    log(f"done in {summary['total_s']:.1f}s; summary in {os.path.join(args.out, 'reference.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
