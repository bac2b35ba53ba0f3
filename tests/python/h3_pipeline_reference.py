#!/usr/bin/env python3
"""MiniMax H3 text-to-video end to end in diffusers 0.42.1 (`MiniMaxH3ModularPipeline`) on the GPU: the accuracy
reference `tf video --dump-steps` is compared with (tests/python/compare_h3_pipeline.py), and the end-to-end timing
reference `tf video --random-weights` is put beside.

accuracy --out DIR [--steps 8] [--seed 0]
  DIR/model/   a complete H3 folder in the pipeline's own save layout (`save_pretrained`), seeded random weights:
      transformer/   the released DiT widths (hidden 5376, 56 heads of 128, ffn 14336, 24 latent and 32 audio
                     channels, patch 1x2x2, time embedding 256 -> 5376 -> 2688) with 4 blocks (of 50) and 2 refiner
                     blocks, text width 1024 (the reduced text encoder's); weights as h3_dit_reference.py draws them
      text_encoder/  Qwen3-VL with the released text layout at reduced width: 51 layers (the pipeline reads
                     hidden_states[50]; with 50 the last entry would be the final norm's output), hidden 1024, 8
                     query and 2 key/value heads of 128, MLP 3072, vocabulary 151936, RoPE as released; a one-block
                     vision tower (text-only prompts never run it); weights as h3_text_fixtures.py draws them
      tokenizer/, processor/   copies of tests/fixtures/minimax_h3_pipeline/model's (the small Qwen2 tokenizer with
                     H3's added tokens at their released ids)
      vae/           AutoencoderKLMiniMaxH3 at its released config, weights as h3_video_vae_reference.py draws them
      audio_vae/     AutoencoderKLMiniMaxH3Audio at its released config, weights as h3_audio_vae_reference.py draws
                     them (SnakeBeta alpha/beta re-drawn, conv_post gain set for an RMS of about 0.3)
      scheduler/, audio_scheduler/   MiniMaxH3Scheduler, shift 12 and 3
    Storage: bf16, except the modules each class keeps in fp32 (`_keep_in_fp32_modules`: the DiT's patch
    projections, time embedder and output heads, the video VAE's encoder and norms, the whole audio VAE), stored
    in fp32. Both runs below therefore compute with the same values.
  DIR/prompt.txt, DIR/noise.safetensors (`video_noise` [1, 24, F, h, w], `audio_noise` [2 A, 32]: the portable
    generator of crates/tf-engines/src/nn/sampling/noise.rs from --seed, video first; `tf video --noise`).
  Two pipeline runs at 768x448 (width x height), 120 frames (5 s; the pipeline snaps to 124), --steps grid points
  (steps - 1 model calls), the noise injected: fp32 (TF32 off) and bf16 (`load_components(torch_dtype=bf16)`, the
  fp32-pinned modules in fp32, PyTorch's default TF32 settings: what a user runs). Each writes
  DIR/reference_{fp32,bf16}.safetensors:
      prompt_embeds [tokens, 1024] f32         what the DiT read
      latents.init, audio_latents.init         the injected rows: video [rows, 96], audio [2 A, 32]
      latents.{i}, audio_latents.{i}           the rows after model call i (i = 0 .. calls - 1)
      sigmas, audio_sigmas                     the two schedules' grids (calls + 1 points, terminal 0), f32
      frames [F, H, W, 3] f32 in [0, 1]        the pipeline's "np" output
      audio [2, samples] f32                   the soundtrack
  The scheduler step is x_{i+1} = x_i + (sigma_i - sigma_{i+1}) v_i, v the DiT's (data-ward) velocity, so
  v_i = (x_{i+1} - x_i) / (sigma_i - sigma_{i+1}) with x_0 = the .init rows.
  DIR/reference.json: versions, device, dims (and what was reduced), per run and phase times, peak memory.

timing --out DIR [--seed 0]
  DIR/model/ with modular_model_index.json, tokenizer/, processor/, scheduler/, audio_scheduler/, vae/ and
  audio_vae/ (released configs, seeded random weights as above), and transformer/config.json (the released DiT,
  50 blocks) and text_encoder/config.json (the released Qwen3-VL 32B) without weight files. The pipeline is built
  on the device: the DiT at the released config with random weights made there in bf16 (its fp32 modules in
  fp32), the text encoder at the released widths with 51 of its 64 layers (only hidden_states[50] is read; the
  other 13 would not fit beside the DiT) made there in bf16, the VAEs from DIR/model. Three runs at 768x448, 5 s:
  8 grid points, the default 50 (49 model calls), 8 again; per run the wall time, the phases (text encode,
  denoise = the DiT calls and scheduler steps, video decode, audio decode; CUDA synchronized at every boundary)
  and the peak allocated / reserved device bytes. DIR/timing.json.

--tiny shrinks every dimension to toy size (the fixture's configs, a 24x16 canvas) for a CPU smoke run of the
script itself; its JSON says "tiny": true and its numbers are no reference.

Usage (GPU machine, diffusers on PYTHONPATH, from the repository root):
    python3 tests/python/h3_pipeline_reference.py accuracy --out /tmp/h3p --steps 8
    python3 tests/python/h3_pipeline_reference.py timing --out /tmp/h3t
Smoke runs: add --tiny --device cpu.
"""
import argparse
import gc
import json
import os
import shutil
import sys
import time
import traceback

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import h3_dit_reference as dit_ref  # noqa: E402  (the DiT config, weight draw and on-device build)
import h3_pipeline_fixtures as fx  # noqa: E402  (noise generator, step recorder, tiny configs, processor saving)
import h3_text_fixtures as text_fx  # noqa: E402  (the text encoder's weight draw)
import h3_text_reference as text_ref  # noqa: E402  (the released Qwen3-VL 32B text config)
import h3_video_vae_reference as vvae_ref  # noqa: E402  (the released video VAE's weight draw)

from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler,  # noqa: E402
                       MiniMaxH3Transformer3DModel)
from diffusers.modular_pipelines import ModularPipeline  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import decoders as h3_decoders  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import denoise as h3_denoise  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import encoders as h3_encoders  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (  # noqa: E402
    align_num_frames, audio_latent_num_frames, video_latent_num_frames)
from transformers import (Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig,  # noqa: E402
                          Qwen3VLForConditionalGeneration, Qwen3VLProcessor)

FIXTURE_MODEL = os.path.join(HERE, "..", "fixtures", "minimax_h3_pipeline", "model")
PROMPT = ("A red fox trots along a snowy ridge at sunrise, its breath steaming in the cold air, while pine trees "
          "sway in the wind and distant crows call over the quiet valley below.")
NUM_FRAMES = 120  # 5 s at 24 fps; the pipeline snaps it to 124 (17 n + 5)
TEXT_LAYERS = 51  # hidden_states[50] is read: 51 layers keep it a decoder layer's output, not the final norm's

# The reduced text encoder of the accuracy set: the released layout at a quarter of the width.
ACCURACY_TEXT = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                     intermediate_size=3072)
DIT_BLOCKS, DIT_REFINERS = 4, 2

DEVICE = "cuda"


def log(msg):
    print(msg, flush=True)


def sync():
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def free():
    gc.collect()
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


def reset_peaks():
    sync()
    if DEVICE.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peaks():
    if not DEVICE.startswith("cuda"):
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def plain(value):
    """A JSON-safe copy of a config value."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Phase timing: the pipeline's blocks, wrapped at class level, synchronized at every boundary
# ---------------------------------------------------------------------------------------------------------------

class PhaseTimer:
    PHASES = {
        "text_encode": h3_encoders.MiniMaxH3TextEncoderStep,
        "denoise": h3_denoise.MiniMaxH3DenoiseStep,
        "video_decode": h3_decoders.MiniMaxH3VideoDecodeStep,
        "audio_decode": h3_decoders.MiniMaxH3AudioDecodeStep,
    }

    def __init__(self):
        self.times = {}
        self.dit_s = 0.0
        self.dit_calls = 0
        for phase, cls in self.PHASES.items():
            self._wrap(phase, cls)
        denoiser_call = h3_denoise.MiniMaxH3LoopDenoiser.__call__
        timer = self

        def timed_denoiser(block, components, block_state, i, t):
            sync()
            t0 = time.perf_counter()
            out = denoiser_call(block, components, block_state, i, t)
            sync()
            timer.dit_s += time.perf_counter() - t0
            timer.dit_calls += 1
            return out

        h3_denoise.MiniMaxH3LoopDenoiser.__call__ = timed_denoiser

    def _wrap(self, phase, cls):
        inner = cls.__call__
        timer = self

        def timed(block, *args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = inner(block, *args, **kwargs)
            sync()
            timer.times[phase] = timer.times.get(phase, 0.0) + time.perf_counter() - t0
            return out

        cls.__call__ = timed

    def reset(self):
        self.times = {}
        self.dit_s = 0.0
        self.dit_calls = 0

    def report(self):
        out = {f"{k}_s": v for k, v in self.times.items()}
        out["dit_forward_s"] = self.dit_s
        out["dit_calls"] = self.dit_calls
        return out


class InitRows:
    """The rows the loop starts from (the injected noise after the pipeline's packing)."""

    def __init__(self):
        self.video = None
        self.audio = None
        inner = h3_denoise.MiniMaxH3LoopDenoiser.__call__
        rows = self

        def record(block, components, block_state, i, t):
            if i == 0:
                rows.video = block_state.latents.detach().float().cpu().clone()
                rows.audio = block_state.audio_latents.detach().float().cpu().clone()
            return inner(block, components, block_state, i, t)

        h3_denoise.MiniMaxH3LoopDenoiser.__call__ = record


# Installed once (each wraps the class's current __call__): the recorder of the fixture, the init rows, the timer.
RECORDER = fx.Recorder()
INIT_ROWS = InitRows()
TIMER = PhaseTimer()


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------

def dit_config(tiny, text_dim, layers, refiners):
    if tiny:
        return dict(fx.DIT, num_layers=layers, num_refiner_layers=refiners, text_dim=text_dim)
    return dit_ref.full_config(dict(num_layers=layers, num_refiner_layers=refiners, text_dim=text_dim), tiny=False)


def text_configs(tiny, released):
    """(text config, vision config) for the text encoder: tiny, the accuracy set's reduced width, or released."""
    if tiny:
        text = dict(text_fx.TEXT, num_hidden_layers=TEXT_LAYERS)
    else:
        text = text_ref.text_config(TEXT_LAYERS)
        if not released:
            text.update(ACCURACY_TEXT)
    vision = dict(text_fx.VISION, out_hidden_size=text["hidden_size"])
    return text, vision


def qwen_config(text, vision, tokenizer):
    ids = {t: tokenizer.convert_tokens_to_ids(t)
           for t in ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)


def load_tokenizer_and_processor(model_dir):
    tokenizer = Qwen2TokenizerFast.from_pretrained(os.path.join(model_dir, "tokenizer"))
    saved = os.path.join(model_dir, "processor")
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(saved),
                                 tokenizer=Qwen2TokenizerFast.from_pretrained(saved), video_processor=None)
    return tokenizer, processor


# ---------------------------------------------------------------------------------------------------------------
# Components with seeded random weights
# ---------------------------------------------------------------------------------------------------------------

def to_storage(model, keep):
    """bf16 storage, except the parameters of the modules the class keeps in fp32 (matched as diffusers does)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            pinned = any(k in name.split(".") for k in keep)
            p.data = p.data.to(torch.float32 if pinned else torch.bfloat16)
    return model


def build_transformer(cfg, seed):
    with torch.device(DEVICE):
        model = MiniMaxH3Transformer3DModel(**cfg)
    dit_ref.randomize(model, seed, DEVICE)
    return to_storage(model.eval(), MiniMaxH3Transformer3DModel._keep_in_fp32_modules)


def build_text_encoder(config, seed):
    with torch.device(DEVICE):
        model = Qwen3VLForConditionalGeneration(config).eval()
    text_fx.randomize(model, torch.Generator().manual_seed(seed))
    return model.to(torch.bfloat16)


def build_video_vae(tiny, seed):
    if tiny:
        model = fx.build_vae(torch.Generator().manual_seed(seed))
    else:
        vvae_ref.DEVICE = DEVICE
        model = vvae_ref.build(seed, {})
    return to_storage(model.eval(), AutoencoderKLMiniMaxH3._keep_in_fp32_modules)


def build_audio_vae(tiny, seed):
    """The released audio VAE with h3_audio_vae_reference.py's weight recipe (that script builds it inline)."""
    if tiny:
        return fx.build_audio_vae(torch.Generator().manual_seed(seed)).eval()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    c = 32
    mean = (torch.randn(c, generator=gen) * 0.5).tolist()
    std = (torch.rand(c, generator=gen) + 0.5).tolist()
    model = AutoencoderKLMiniMaxH3Audio(latents_mean=mean, latents_std=std).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("decoder.") and (name.endswith(".alpha") or name.endswith(".beta")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = model.to(DEVICE)
    z = torch.randn(2, c, 40, generator=gen).to(DEVICE)
    captured = {}
    hook = model.decoder.conv_post.register_forward_hook(lambda m, i, o: captured.setdefault("pre", o.detach()))
    with torch.no_grad():
        lat = z * torch.tensor(std, device=DEVICE).view(1, -1, 1) + torch.tensor(mean, device=DEVICE).view(1, -1, 1)
        model.decode(lat, return_dict=False)
    hook.remove()
    rms = float(captured["pre"].float().pow(2).mean().sqrt())
    with torch.no_grad():
        model.decoder.conv_post.weight_g.mul_(0.3 / max(rms, 1e-12))
    return model


def schedulers():
    return MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)


def save_folder(model_dir, **components):
    """Saves the given components with the pipeline's own save_pretrained, then puts the fixture's tokenizer and
    processor files in place (the saved ones are re-serializations of them)."""
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**components)
    pipe.save_pretrained(model_dir, overwrite_modular_index=True)
    for name in ("tokenizer", "processor"):
        shutil.rmtree(os.path.join(model_dir, name), ignore_errors=True)
        shutil.copytree(os.path.join(FIXTURE_MODEL, name), os.path.join(model_dir, name))


# ---------------------------------------------------------------------------------------------------------------
# Noise and runs
# ---------------------------------------------------------------------------------------------------------------

def make_noise(pipe, width, height, seed):
    aligned = align_num_frames(NUM_FRAMES, pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk)
    latent_frames = video_latent_num_frames(aligned, pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk)
    audio_latents = audio_latent_num_frames(aligned, pipe.fps)
    ratio = pipe.vae_spatial_compression_ratio
    shape = (1, pipe.vae_latent_channels, latent_frames, height // ratio, width // ratio)
    n_video = int(np.prod(shape))
    channels = pipe.audio_latent_channels
    draw = fx.normals(seed, n_video + 2 * audio_latents * channels)
    video = torch.from_numpy(draw[:n_video].copy()).view(shape)
    audio = torch.from_numpy(draw[n_video:].copy()).view(2 * audio_latents, channels)
    meta = dict(aligned_frames=aligned, latent_frames=latent_frames, audio_latents=audio_latents,
                video_noise_shape=list(shape), audio_noise_shape=list(audio.shape))
    return video, audio, meta


def move_to_device(pipe):
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            comp.to(DEVICE)


def run_pipeline(pipe, width, height, steps, video_noise=None, audio_noise=None, seed=0):
    """One text-to-video run; returns (output, phase report, wall seconds, peaks)."""
    kwargs = {}
    if video_noise is not None:
        kwargs["latents"] = video_noise.clone()
        a = audio_noise.shape[0] // 2
        # The pipeline's `audio_latents` input is (2, C, A); it packs it back to the [2 A, C] rows.
        kwargs["audio_latents"] = audio_noise.view(2, a, -1).permute(0, 2, 1).contiguous()
    else:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    RECORDER.steps.clear()
    TIMER.reset()
    reset_peaks()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = pipe(prompt=PROMPT, height=height, width=width, num_frames=NUM_FRAMES, num_inference_steps=steps,
                   output_type="np", output=["videos", "audio", "sampling_rate"], **kwargs)
    sync()
    wall = time.perf_counter() - t0
    return out, TIMER.report(), wall, peaks()


def collect(pipe, out):
    """The named tensors of one run (the names `tf video --dump-steps` writes, plus the schedules)."""
    videos = np.asarray(out["videos"])
    tensors = {
        "prompt_embeds": RECORDER.prompt_embeds[0].float().cpu().contiguous(),
        "latents.init": INIT_ROWS.video.contiguous(),
        "audio_latents.init": INIT_ROWS.audio.contiguous(),
        "frames": torch.from_numpy(videos[0].astype(np.float32)).contiguous(),
        "audio": out["audio"][0].float().cpu().contiguous(),
        "sigmas": pipe.scheduler.sigmas.float().cpu().contiguous(),
        "audio_sigmas": pipe.audio_scheduler.sigmas.float().cpu().contiguous(),
    }
    for i, (v, a) in enumerate(RECORDER.steps):
        tensors[f"latents.{i}"] = v.float().cpu().contiguous()
        tensors[f"audio_latents.{i}"] = a.float().cpu().contiguous()
    calls = len(RECORDER.steps)
    for key in ("sigmas", "audio_sigmas"):
        if tensors[key].numel() != calls + 1:
            raise RuntimeError(f"{key} has {tensors[key].numel()} points for {calls} model calls")
    return tensors


def set_tf32(enabled):
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def base_summary(args, mode):
    return {
        "generator": "tests/python/h3_pipeline_reference.py",
        "mode": mode,
        "tiny": args.tiny,
        "seed": args.seed,
        "versions": fx.versions(),
        "device": torch.cuda.get_device_name(0) if DEVICE.startswith("cuda") else DEVICE,
        "attention_backend": os.environ.get("DIFFUSERS_ATTN_BACKEND", "native"),
        "prompt": PROMPT,
        "width": args.width,
        "height": args.height,
        "num_frames_requested": NUM_FRAMES,
    }


# ---------------------------------------------------------------------------------------------------------------
# accuracy
# ---------------------------------------------------------------------------------------------------------------

def accuracy(args):
    out_dir = args.out
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(out_dir, exist_ok=True)
    summary_path = os.path.join(out_dir, "reference.json")
    summary = base_summary(args, "accuracy")
    summary["steps"] = args.steps
    set_tf32(False)

    t0 = time.perf_counter()
    fixture_tokenizer = Qwen2TokenizerFast.from_pretrained(os.path.join(FIXTURE_MODEL, "tokenizer"))
    _, fixture_processor = load_tokenizer_and_processor(FIXTURE_MODEL)
    text, vision = text_configs(args.tiny, released=False)
    text_encoder = build_text_encoder(qwen_config(text, vision, fixture_tokenizer), args.seed + 11)
    log(f"text encoder built: {sum(p.numel() for p in text_encoder.parameters()) / 1e9:.3f}B parameters")
    cfg = dit_config(args.tiny, text["hidden_size"], 2 if args.tiny else DIT_BLOCKS, 1 if args.tiny else DIT_REFINERS)
    transformer = build_transformer(cfg, args.seed + 12)
    log(f"transformer built: {sum(p.numel() for p in transformer.parameters()) / 1e9:.3f}B parameters")
    vae = build_video_vae(args.tiny, args.seed + 13)
    audio_vae = build_audio_vae(args.tiny, args.seed + 14)
    log("VAEs built; saving the folder")
    video_sched, audio_sched = schedulers()
    save_folder(model_dir, transformer=transformer, text_encoder=text_encoder, tokenizer=fixture_tokenizer,
                processor=fixture_processor, vae=vae, audio_vae=audio_vae, scheduler=video_sched,
                audio_scheduler=audio_sched)
    params = {name: sum(p.numel() for p in m.parameters())
              for name, m in (("transformer", transformer), ("text_encoder", text_encoder), ("vae", vae),
                              ("audio_vae", audio_vae))}
    summary["dims"] = {
        "transformer": plain(dict(transformer.config)),
        "text_encoder": {"text_config": plain(text), "vision_config": plain(vision)},
        "vae": plain(dict(vae.config)),
        "audio_vae": plain(dict(audio_vae.config)),
        "scheduler_shift": 12.0,
        "audio_scheduler_shift": 3.0,
        "parameters": params,
    }
    summary["reduced"] = (
        "toy sizes everywhere (--tiny): the fixture's configs; not a reference" if args.tiny else
        f"transformer: released widths, {DIT_BLOCKS} of 50 blocks, {DIT_REFINERS} refiner blocks (as released), text "
        f"width {text['hidden_size']} (the reduced text encoder's) instead of 5120; text encoder: {TEXT_LAYERS} of 64 "
        f"layers, hidden {text['hidden_size']} instead of 5120, {text['num_attention_heads']} query / "
        f"{text['num_key_value_heads']} key-value heads of 128 instead of 64 / 8, MLP {text['intermediate_size']} "
        "instead of 25600, released vocabulary, one-block vision tower (unused by text prompts); tokenizer: the "
        "fixture's small one (2048 regular tokens plus H3's added tokens); VAEs and schedulers: as released")
    summary["weights"] = ("seeded random: the DiT as h3_dit_reference.py, the text encoder as h3_text_fixtures.py, "
                          "the video VAE as h3_video_vae_reference.py, the audio VAE as h3_audio_vae_reference.py; "
                          "stored bf16 except each class's _keep_in_fp32_modules (fp32)")
    del transformer, text_encoder, vae, audio_vae
    free()
    summary["build_and_save_s"] = time.perf_counter() - t0
    summary["model_bytes"] = folder_bytes(model_dir)
    log(f"folder {model_dir}: {summary['model_bytes'] / 1e9:.2f} GB, built and saved in "
        f"{summary['build_and_save_s']:.1f}s")
    with open(os.path.join(out_dir, "prompt.txt"), "w") as f:
        f.write(PROMPT)
    write_json(summary_path, summary)

    summary["runs"] = {}
    noise = None
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, None)):
        if tf32 is None:  # the pipeline as a user runs it: PyTorch's default TF32 settings
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = True
        else:
            set_tf32(tf32)
        t0 = time.perf_counter()
        reset_peaks()
        pipe = ModularPipeline.from_pretrained(model_dir)
        # The processor is built from its saved parts (transformers' loader wants torchvision for its video half).
        pipe.load_components(names=["transformer", "text_encoder", "tokenizer", "vae", "audio_vae", "scheduler",
                                    "audio_scheduler"], torch_dtype=dtype)
        _, processor = load_tokenizer_and_processor(model_dir)
        pipe.update_components(processor=processor)
        for comp in ("transformer", "text_encoder", "tokenizer", "vae", "audio_vae", "scheduler", "audio_scheduler"):
            if getattr(pipe, comp) is None:
                raise RuntimeError(f"{comp} did not load from {model_dir}")
        move_to_device(pipe)
        sync()
        load_s = time.perf_counter() - t0
        load_peaks = peaks()
        if noise is None:
            video_noise, audio_noise, noise_meta = make_noise(pipe, args.width, args.height, args.seed)
            save_file({"video_noise": video_noise.contiguous(), "audio_noise": audio_noise.contiguous()},
                      os.path.join(out_dir, "noise.safetensors"))
            summary["noise"] = noise_meta
            noise = True
        log(f"{name}: loaded in {load_s:.1f}s; running {args.steps} grid points at {args.width}x{args.height}")
        out, phases, wall, run_peaks = run_pipeline(pipe, args.width, args.height, args.steps, video_noise,
                                                    audio_noise)
        tensors = collect(pipe, out)
        if tensors["latents.init"].numel() != video_noise.numel():
            raise RuntimeError("the loop's initial video rows are not the injected noise")
        save_file(tensors, os.path.join(out_dir, f"reference_{name}.safetensors"))
        frames = tensors["frames"]
        run = {
            "dtype": str(dtype),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "component_dtypes": {c: str(getattr(pipe, c).dtype) for c in
                                 ("transformer", "text_encoder", "vae", "audio_vae")},
            "load_s": load_s,
            "load_peaks": load_peaks,
            "wall_s": wall,
            "phases": phases,
            "peaks": run_peaks,
            "model_calls": len(RECORDER.steps),
            "tokens": int(tensors["prompt_embeds"].shape[0]),
            "frames_shape": list(frames.shape),
            "audio_shape": list(tensors["audio"].shape),
            "sampling_rate": int(out["sampling_rate"]),
            "clamped_pixel_fraction": float(((frames <= 0) | (frames >= 1)).float().mean()),
            "clamped_audio_fraction": float((tensors["audio"].abs() >= 1).float().mean()),
            "sigmas": tensors["sigmas"].tolist(),
            "audio_sigmas": tensors["audio_sigmas"].tolist(),
            "finite": all(bool(torch.isfinite(t).all()) for t in tensors.values()),
        }
        summary["runs"][name] = run
        summary["calls"] = run["model_calls"]
        summary["frames"] = int(frames.shape[0])
        write_json(summary_path, summary)
        log(f"{name}: {wall:.1f}s ({', '.join(f'{k} {v:.2f}' for k, v in phases.items() if k.endswith('_s'))}), "
            f"{run['model_calls']} model calls, {run['frames_shape'][0]} frames, peak "
            f"{(run_peaks['peak_allocated_bytes'] or 0) / 2**30:.1f} GiB")
        del pipe, out, tensors
        free()
    set_tf32(False)
    log(f"wrote {summary_path}")


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------

def patch_index(model_dir, missing):
    """Enters the components saved as config only in the index, as save_pretrained enters a saved component."""
    path = os.path.join(model_dir, "modular_model_index.json")
    with open(path) as f:
        index = json.load(f)
    for name, (library, cls) in missing.items():
        index[name] = [library, cls, {"pretrained_model_name_or_path": model_dir, "revision": None,
                                      "subfolder": name, "type_hint": [library, cls], "variant": None}]
    write_json(path, index)


def device_text_encoder(config):
    """The text encoder made on the device in bf16 with transformers' random init (no host copy)."""
    with torch.device(DEVICE):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def check_device_memory(dit_config, text_config):
    """Stops with the cause when the bf16 DiT and text encoder cannot both be resident on this GPU (diffusers' pipeline
    holds them together), instead of an out-of-memory error halfway through building them."""
    if not DEVICE.startswith("cuda"):
        return
    try:
        with torch.device("meta"):
            dit_params = sum(p.numel() for p in MiniMaxH3Transformer3DModel(**dit_config).parameters())
            text_params = sum(p.numel() for p in Qwen3VLForConditionalGeneration._from_config(
                text_config, dtype=torch.bfloat16).parameters())
    except Exception as e:  # the size check is advice: a failure to size the models must not stop the run
        log(f"could not size the pipeline ahead ({type(e).__name__}: {e}); building it anyway")
        return
    need = 2 * (dit_params + text_params)
    total = torch.cuda.get_device_properties(0).total_memory
    if total < need:
        sys.exit(f"h3_pipeline_reference.py timing: diffusers' bf16 pipeline keeps its DiT ({dit_params / 1e9:.1f}B "
                 f"parameters) and text encoder ({text_params / 1e9:.1f}B) on the GPU together, {need / 2**30:.1f} GiB "
                 f"of weights before any activation, and this GPU has {total / 2**30:.1f} GiB: run it on a larger "
                 f"card (an H200); `--folder-only` still writes the folder for `tf video`")


def timing(args):
    out_dir = args.out
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(out_dir, exist_ok=True)
    summary_path = os.path.join(out_dir, "timing.json")
    summary = base_summary(args, "timing")

    # The folder: small components saved, the DiT and the text encoder as config only.
    t0 = time.perf_counter()
    tokenizer, processor = load_tokenizer_and_processor(FIXTURE_MODEL)
    vae = build_video_vae(args.tiny, args.seed + 13)
    audio_vae = build_audio_vae(args.tiny, args.seed + 14)
    video_sched, audio_sched = schedulers()
    save_folder(model_dir, tokenizer=tokenizer, processor=processor, vae=vae, audio_vae=audio_vae,
                scheduler=video_sched, audio_scheduler=audio_sched)
    del vae, audio_vae
    free()
    text_full, vision = text_configs(args.tiny, released=True)
    if args.tiny:
        dit_full = dit_config(True, text_full["hidden_size"], 3, 1)
    else:
        dit_full = dit_ref.full_config({}, tiny=False)
    with torch.device("meta"):
        MiniMaxH3Transformer3DModel(**dit_full).save_config(os.path.join(model_dir, "transformer"))
    # The folder holds the released config (64 layers); --tiny keeps the built 51.
    released_text = dict(text_full, num_hidden_layers=TEXT_LAYERS if args.tiny else 64)
    qwen_config(released_text, vision, tokenizer).save_pretrained(os.path.join(model_dir, "text_encoder"))
    patch_index(model_dir, {"transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
                            "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration")})
    with open(os.path.join(out_dir, "prompt.txt"), "w") as f:
        f.write(PROMPT)
    summary["folder_s"] = time.perf_counter() - t0
    summary["model_bytes"] = folder_bytes(model_dir)
    log(f"folder {model_dir} written ({summary['model_bytes'] / 1e9:.2f} GB, no DiT or text weights) in "
        f"{summary['folder_s']:.1f}s")
    if args.folder_only:
        write_json(summary_path, summary)
        log("--folder-only: no diffusers run")
        return
    check_device_memory(dit_full, qwen_config(dict(text_full, num_hidden_layers=TEXT_LAYERS), vision, tokenizer))

    # The pipeline on the device.
    reset_peaks()
    t0 = time.perf_counter()
    dit_ref.DEVICE = DEVICE
    transformer = dit_ref.device_model(dit_full, args.seed + 100)
    sync()
    dit_s = time.perf_counter() - t0
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e9:.2f}B parameters made on {DEVICE} "
        f"in {dit_s:.1f}s")
    t1 = time.perf_counter()
    text_config = qwen_config(dict(text_full, num_hidden_layers=TEXT_LAYERS), vision, tokenizer)
    text_encoder = device_text_encoder(text_config)
    sync()
    text_s = time.perf_counter() - t1
    log(f"text encoder: {sum(p.numel() for p in text_encoder.parameters()) / 1e9:.2f}B parameters "
        f"({TEXT_LAYERS} layers) made on {DEVICE} in {text_s:.1f}s")
    t1 = time.perf_counter()
    vae = AutoencoderKLMiniMaxH3.from_pretrained(os.path.join(model_dir, "vae"), torch_dtype=torch.bfloat16)
    audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(os.path.join(model_dir, "audio_vae"),
                                                            torch_dtype=torch.bfloat16)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer,
                           processor=processor, vae=vae.eval(), audio_vae=audio_vae.eval(),
                           scheduler=MiniMaxH3Scheduler.from_pretrained(model_dir, subfolder="scheduler"),
                           audio_scheduler=MiniMaxH3Scheduler.from_pretrained(model_dir, subfolder="audio_scheduler"))
    move_to_device(pipe)
    sync()
    vae_s = time.perf_counter() - t1
    summary["build"] = {
        "transformer_s": dit_s, "text_encoder_s": text_s, "vaes_and_pipeline_s": vae_s,
        "total_s": time.perf_counter() - t0, **peaks(),
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "transformer_weight_bytes": sum(p.numel() * p.element_size() for p in transformer.parameters()),
        "text_encoder_parameters": sum(p.numel() for p in text_encoder.parameters()),
        "text_encoder_weight_bytes": sum(p.numel() * p.element_size() for p in text_encoder.parameters()),
    }
    summary["dims"] = {
        "transformer": plain(dit_full),
        "text_encoder_built": {"text_config": plain(dict(text_full, num_hidden_layers=TEXT_LAYERS)),
                               "vision_config": plain(vision)},
        "text_encoder_folder_layers": released_text["num_hidden_layers"],
        "vae": plain(dict(vae.config)),
        "audio_vae": plain(dict(audio_vae.config)),
    }
    summary["reduced"] = (
        "toy sizes everywhere (--tiny): the fixture's configs; not a reference" if args.tiny else
        f"text encoder: {TEXT_LAYERS} of the released 64 layers built (only hidden_states[50] is read, so the "
        "output is the same computation; the other 13 layers would not fit beside the DiT); everything else as "
        "released")
    summary["weights"] = ("random, made on the device in bf16 (the DiT's fp32 modules in fp32; the text encoder "
                          "with transformers' init); VAEs seeded random from the folder (bf16 load, the fp32 pins "
                          "kept)")
    write_json(summary_path, summary)
    log(f"pipeline on {DEVICE}: {summary['build']['total_s']:.1f}s, "
        f"{(summary['build']['peak_allocated_bytes'] or 0) / 2**30:.1f} GiB allocated")

    summary["runs"] = []
    for steps in (8, 50, 8):
        log(f"run: {steps} grid points at {args.width}x{args.height}, {NUM_FRAMES} frames requested")
        out, phases, wall, run_peaks = run_pipeline(pipe, args.width, args.height, steps, seed=args.seed)
        frames = np.asarray(out["videos"])[0]
        run = {"steps": steps, "model_calls": len(RECORDER.steps), "wall_s": wall, "phases": phases,
               "peaks": run_peaks, "frames": int(frames.shape[0]), "frame_shape": list(frames.shape[1:]),
               "audio_samples": int(out["audio"][0].shape[-1]), "tokens": int(RECORDER.prompt_embeds.shape[1]),
               "finite": bool(np.isfinite(frames).all())}
        summary["runs"].append(run)
        write_json(summary_path, summary)
        log(f"  {wall:.1f}s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k.endswith("_s")))
        del out, frames
        free()

    log("")
    log(f"{'grid points':>11} {'calls':>5} {'total s':>8} {'text s':>7} {'denoise s':>9} {'DiT s':>7} "
        f"{'video s':>7} {'audio s':>7} {'peak GiB':>8}")
    for r in summary["runs"]:
        p = r["phases"]
        log(f"{r['steps']:>11} {r['model_calls']:>5} {r['wall_s']:>8.2f} {p.get('text_encode_s', 0):>7.2f} "
            f"{p.get('denoise_s', 0):>9.2f} {p.get('dit_forward_s', 0):>7.2f} {p.get('video_decode_s', 0):>7.2f} "
            f"{p.get('audio_decode_s', 0):>7.2f} {(r['peaks']['peak_allocated_bytes'] or 0) / 2**30:>8.1f}")
    log(f"wrote {summary_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("accuracy", "timing"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="cuda")
        p.add_argument("--tiny", action="store_true", help="toy sizes for a CPU smoke run of the script")
        if name == "accuracy":
            p.add_argument("--steps", type=int, default=8, help="grid points (num_inference_steps)")
        else:
            p.add_argument("--folder-only", action="store_true",
                           help="write the config-only folder and prompt.txt, then stop (for runs of ours alone)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.width, args.height = (24, 16) if args.tiny else (768, 448)
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        log("error: torch sees no CUDA device (use --tiny --device cpu for a smoke run)")
        return 2
    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        if args.mode == "accuracy":
            if args.steps < 2:
                log("error: --steps must be at least 2 (the grid includes the terminal 0)")
                return 2
            accuracy(args)
        else:
            timing(args)
    except Exception as exc:  # one clear line, the traceback on stderr
        traceback.print_exc()
        log(f"error: h3_pipeline_reference {args.mode} failed: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
