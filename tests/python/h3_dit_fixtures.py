#!/usr/bin/env python3
"""Reference fixtures for the MiniMax H3 DiT host reference (crates/tf-engines/src/minimax_h3).

Builds tiny random-weight MiniMaxH3Transformer3DModel configs with diffusers, runs them in fp32 on CPU and saves,
per case, under tests/fixtures/minimax_h3_dit/<case>/:

  model/                 config.json + safetensors (diffusers save_pretrained layout, or the original release
                         layout for the `original_*` twin)
  inputs.safetensors     the forward arguments by name: hidden_states, audio_hidden_states, encoder_hidden_states,
                         timestep (f32), timestep_indices, token_tags, video_indices, audio_indices, text_indices
                         (i64), position_ids (f64)
  expected.safetensors   sample, audio_sample (the diffusers forward, fp32)

The packed layouts come from the pipeline's own builders (MiniMaxH3PrepareLayoutStep.build_packed_sequence,
MiniMaxH3SetTimestepsStep.build_row_timesteps). layouts.safetensors holds those builders' outputs for a few
geometries (one at full size) and the "last" keyframe anchor over a sweep of frame counts, for the Rust layout
builder to match bit for bit.

The original-layout twin is made by inverting diffusers' single-file converter
(convert_minimax_h3_transformer_checkpoint_to_diffusers, qkv_layout="interleaved") and checked by converting it
back with that converter: the result must equal the diffusers state dict exactly and give identical outputs.

Regenerate (from the repository root):
  python3 tests/python/h3_dit_fixtures.py --out tests/fixtures/minimax_h3_dit
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

import diffusers
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames, video_latent_num_frames

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2

# B5-like: heads * head_dim (32) != hidden (24); 6 * rope_freq_dim = 12 of 16 channels rotated.
BASE = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=2,
            ffn_dim=40, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=20, freq_dim=16,
            time_embed_hidden_dim=32, time_embed_dim=12, rope_freq_dim=2, rope_theta=10000.0,
            norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5)

# Each case: config overrides, text tags, frames (17n+5), latent grid, keyframe anchors, batch, (video t, audio t),
# whether the RoPE tables are rounded to bf16 (as a bf16 run of the reference does), and whether the folder is
# sharded.
CASES = {
    # Image to video at the first frame: three distinct timesteps (audio, video, keyframes at 0.999), all three
    # tags (a keyframe vision block inside the text is tagged video), two refiner layers, pass-through channels.
    "fl2va_first": dict(cfg={}, text=[1, 1, 0, 0, 0, 1, 1, 1], frames=22, grid=(4, 6), anchors=("first",), batch=1,
                        t=(0.4, 0.1429), bf16_rope=False, sharded=False),
    # Keyframes at both ends, odd patched grid (3x5), 12 latent frames (the "last" anchor sums 12 spans), a
    # different head shape (3 x 8, 6 of 8 channels rotated), one refiner layer.
    "first_last_odd": dict(cfg=dict(num_attention_heads=3, attention_head_dim=8, hidden_size=20, ffn_dim=28,
                                    rope_freq_dim=1, num_refiner_layers=1),
                           text=[1, 0, 0, 0, 1, 1, 1], frames=39, grid=(6, 10), anchors=("first", "last"), batch=1,
                           t=(0.75, 0.3), bf16_rope=False, sharded=False),
    # Text to video, batch 2, full rotation (6 x 2 = head_dim 12, no pass-through), timesteps at both ends of the
    # range, sharded folder.
    "t2va_b2_full_rotary": dict(cfg=dict(num_attention_heads=2, attention_head_dim=12, hidden_size=16, ffn_dim=24),
                                text=[1, 1, 1, 1, 1], frames=22, grid=(4, 4), anchors=(), batch=2, t=(0.0, 1.0),
                                bf16_rope=False, sharded=True),
    # As fl2va_first with other weights and inputs, the RoPE tables rounded to bf16 the way the reference rounds
    # them in a bf16 run (cos/sin cast to the activation dtype).
    "bf16_rope_last": dict(cfg={}, text=[1, 1, 1, 0, 0, 1], frames=22, grid=(6, 4), anchors=("last",), batch=1,
                           t=(0.9, 0.55), bf16_rope=True, sharded=False),
}
# The twin in the original release layout: the weights and inputs of this diffusers case.
ORIGINAL_TWIN = "fl2va_first"

# Layout builder checks: (name, text tags, frames, latent grid, anchors, (video t, audio t)).
LAYOUTS = [
    ("full_448x768_56f", [TEXT_TAG] * 128, 56, (28, 48), (), (0.3, 0.2)),
    ("keyframes_448x768_56f", [1, 1, 0, 0, 0, 0, 1, 1, 1, 1], 56, (28, 48), ("first", "last"), (0.6, 0.45)),
    ("odd_6x10_39f", [1, 0, 1], 39, (6, 10), ("last",), (0.999, 0.5)),
]
ANCHOR_SWEEP = range(0, 60)  # frames 17n + 5: 2 .. 297 latent frames (the pairwise order matters from 16 on)


def randomize(model, gen):
    # Defaults leave RMSNorm weights at 1; re-draw every tensor so each one matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.ndim == 2 else 0.1))


def build_layout(text, frames, grid, anchors, t, patch=(1, 2, 2)):
    latent_frames = video_latent_num_frames(frames, 17, 5)
    audio_latents = audio_latent_num_frames(frames)
    tags = torch.tensor(text, dtype=torch.long)
    pos, token_tags, vid, aud, txt, n_cond_v, n_cond_a = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, latent_frames, grid[0], grid[1], audio_latents, patch, 2, AUDIO_TAG, VIDEO_TAG,
        keyframe_anchors=tuple(anchors))
    uniq, tidx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        vid, aud, n_cond_v, n_cond_a, txt.numel(), t[0], t[1], max(t[0], 0.999), 1.0)
    return dict(position_ids=pos, token_tags=token_tags, video_indices=vid, audio_indices=aud, text_indices=txt,
                timestep=uniq.to(torch.float32), timestep_indices=tidx, latent_frames=latent_frames,
                audio_latents=audio_latents, condition_rows=n_cond_v)


def run(model, inp, bf16_rope):
    original = model.rope.forward
    if bf16_rope:
        def rounded(position_ids):
            cos, sin = original(position_ids)
            return cos.to(torch.bfloat16).to(torch.float32), sin.to(torch.bfloat16).to(torch.float32)
        model.rope.forward = rounded
    try:
        with torch.no_grad():
            return model(**{k: v for k, v in inp.items()}, return_dict=False)
    finally:
        model.rope.forward = original


def forward_inputs(layout, cfg, batch, text_rows, gen):
    vp = cfg["in_channels"] * int(np.prod(cfg["patch_size"]))
    return dict(
        hidden_states=torch.randn(batch, layout["video_indices"].numel(), vp, generator=gen),
        audio_hidden_states=torch.randn(batch, layout["audio_indices"].numel(), cfg["audio_in_channels"],
                                        generator=gen),
        encoder_hidden_states=torch.randn(batch, text_rows, cfg["text_dim"], generator=gen),
        timestep=layout["timestep"],
        timestep_indices=layout["timestep_indices"],
        token_tags=layout["token_tags"],
        position_ids=layout["position_ids"],
        video_indices=layout["video_indices"],
        audio_indices=layout["audio_indices"],
        text_indices=layout["text_indices"],
    )


def to_original(state, cfg):
    """diffusers names -> the original release layout: the inverse of the single-file converter (interleaved)."""
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    glob = {"proj_in.": "video_patch_proj.", "audio_proj_in.": "audio_patch_proj.",
            "context_embedder.": "condition_proj.", "time_embedder.linear_1.": "time_embedder.proj_in.",
            "time_embedder.linear_2.": "time_embedder.proj_out.", "norm_out.norm.": "final_layer.norm.",
            "norm_out.linear.": "final_layer.adaln_proj.linear.", "proj_out.": "final_layer.video_out.",
            "audio_proj_out.": "final_layer.audio_out."}
    inner = {"norm1.weight": "norm1.weight", "norm2.weight": "norm2.weight",
             "attn.norm_q.weight": "attn.q_norm.weight", "attn.norm_k.weight": "attn.k_norm.weight",
             "attn.to_out.0.weight": "attn.out_proj.weight", "ff.net.0.proj.weight": "mlp.fc1.weight",
             "ff.net.2.weight": "mlp.fc2.weight", "adaln_proj.linear.weight": "adaln_proj.linear.weight",
             "adaln_proj.linear.bias": "adaln_proj.linear.bias"}
    out = {}
    for name, t in state.items():
        if name == "token_refiner.final_norm.weight":
            out[name] = t.clone()
            continue
        head = next((k for k in glob if name.startswith(k) and name[len(k):] in ("weight", "bias")), None)
        if head is not None:
            out[glob[head] + name[len(head):]] = t.clone()
            continue
        for dprefix, oprefix in (("token_refiner.refiner_blocks.", "token_refiner.blocks."),
                                 ("transformer_blocks.", "blocks.")):
            if name.startswith(dprefix):
                index, rest = name[len(dprefix):].split(".", 1)
                prefix = f"{oprefix}{index}."
                break
        else:
            raise KeyError(name)
        if rest in ("attn.to_k.weight", "attn.to_v.weight"):
            continue
        if rest == "attn.to_q.weight":
            parts = [state[name.replace("to_q", p)] for p in ("to_q", "to_k", "to_v")]
            fused = torch.stack([p.unflatten(0, (heads, hd)) for p in parts], dim=1)  # [heads, 3, hd, hidden]
            out[prefix + "attn.qkv_proj.weight"] = fused.flatten(0, 2).contiguous()
        elif rest == "ff.net.0.proj.weight":
            value, gate = torch.chunk(t, 2, dim=0)
            out[prefix + "mlp.fc1.weight"] = torch.cat([gate, value], dim=0).contiguous()
        else:
            out[prefix + inner[rest]] = t.clone()
    # Some original files carry the recomputed rotary buffer; the converter drops it.
    f = cfg["rope_freq_dim"]
    out["rope.inv_freq"] = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))
    return out


def make_case(name, case, out_dir, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = dict(BASE, **case["cfg"])
    model = MiniMaxH3Transformer3DModel(**cfg).eval()
    randomize(model, gen)
    layout = build_layout(case["text"], case["frames"], case["grid"], case["anchors"], case["t"],
                          tuple(cfg["patch_size"]))
    inp = forward_inputs(layout, cfg, case["batch"], len(case["text"]), gen)
    sample, audio = run(model, inp, case["bf16_rope"])

    case_dir = os.path.join(out_dir, name)
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)
    model.save_pretrained(os.path.join(case_dir, "model"), max_shard_size="40KB" if case["sharded"] else "10GB")
    save_file({k: v.contiguous() for k, v in inp.items()}, os.path.join(case_dir, "inputs.safetensors"))
    save_file({"sample": sample.contiguous(), "audio_sample": audio.contiguous()},
              os.path.join(case_dir, "expected.safetensors"))
    info = dict(seq_len=int(layout["position_ids"].shape[0]), timesteps=[round(float(v), 6) for v in inp["timestep"]],
                latent_frames=layout["latent_frames"], latent_grid=list(case["grid"]),
                audio_latents=layout["audio_latents"], keyframes=list(case["anchors"]), batch=case["batch"],
                bf16_rope=case["bf16_rope"], sharded=case["sharded"], layout="diffusers",
                sample=list(sample.shape), audio_sample=list(audio.shape),
                config={k: case["cfg"][k] for k in sorted(case["cfg"])})

    twin = None
    if name == ORIGINAL_TWIN:
        twin = make_original_twin(model, cfg, inp, sample, audio, case_dir, out_dir, info)
    return info, twin


def make_original_twin(model, cfg, inp, sample, audio, case_dir, out_dir, info):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    original = to_original(state, cfg)
    # Check the inversion with diffusers' own converter.
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        {k: v.clone() for k, v in original.items()}, cfg, qkv_layout="interleaved")
    assert set(back) == set(state), sorted(set(back) ^ set(state))
    for k in state:
        assert torch.equal(back[k], state[k]), k
    reloaded = MiniMaxH3Transformer3DModel(**cfg).eval()
    reloaded.load_state_dict(back, strict=True)
    s2, a2 = run(reloaded, inp, False)
    assert torch.equal(s2, sample) and torch.equal(a2, audio)

    name = f"original_{ORIGINAL_TWIN}"
    twin_dir = os.path.join(out_dir, name)
    shutil.rmtree(twin_dir, ignore_errors=True)
    os.makedirs(os.path.join(twin_dir, "model"))
    shutil.copy(os.path.join(case_dir, "model", "config.json"), os.path.join(twin_dir, "model", "config.json"))
    save_file(original, os.path.join(twin_dir, "model", "model.safetensors"))
    for f in ("inputs.safetensors", "expected.safetensors"):
        shutil.copy(os.path.join(case_dir, f), os.path.join(twin_dir, f))
    return name, dict(info, layout="original (qkv interleaved per head, fc1 [gate; value], rope.inv_freq kept)",
                      twin_of=ORIGINAL_TWIN)


def make_layouts(out_dir):
    tensors, meta = {}, {}
    for name, text, frames, grid, anchors, t in LAYOUTS:
        lay = build_layout(text, frames, grid, anchors, t)
        for key in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "timestep",
                    "timestep_indices"):
            tensors[f"{name}.{key}"] = lay[key].contiguous()
        meta[name] = dict(text_tags=text, frames=frames, latent_grid=list(grid), keyframes=list(anchors),
                          t_video=t[0], t_audio=t[1], seq_len=int(lay["position_ids"].shape[0]),
                          latent_frames=lay["latent_frames"], audio_latents=lay["audio_latents"])
    anchors = []
    for n in ANCHOR_SWEEP:
        frames = 17 * n + 5
        lay = build_layout([1, 1, 1], frames, (2, 2), ("last",), (0.5, 0.5))
        anchors.append(float(lay["position_ids"][3, 0]))
    tensors["last_anchor.frames"] = torch.tensor([17 * n + 5 for n in ANCHOR_SWEEP], dtype=torch.int64)
    tensors["last_anchor.time"] = torch.tensor(anchors, dtype=torch.float64)
    meta["last_anchor"] = dict(text_rows=3, latent_grid=[2, 2], frames="17n+5 for n in 0..60")
    save_file(tensors, os.path.join(out_dir, "layouts.safetensors"))
    return meta


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures/minimax_h3_dit")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    manifest = {
        "generator": "tests/python/h3_dit_fixtures.py",
        "versions": {"diffusers": diffusers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "safetensors": __import__("safetensors").__version__},
        "base_config": {k: list(v) if isinstance(v, tuple) else v for k, v in BASE.items()},
        "cases": {},
    }
    for seed, (name, case) in enumerate(sorted(CASES.items())):
        info, twin = make_case(name, case, args.out, 3000 + seed)
        manifest["cases"][name] = info
        if twin is not None:
            manifest["cases"][twin[0]] = twin[1]
    manifest["layouts"] = make_layouts(args.out)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    print(json.dumps({k: (v["sample"], v["audio_sample"]) for k, v in manifest["cases"].items()}, indent=1))


if __name__ == "__main__":
    main()
