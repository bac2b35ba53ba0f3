#!/usr/bin/env python3
"""Reference fixtures for the Qwen-Image 2.1 DiT host reference (crates/tf-engines).

Builds tiny random-weight QwenImage21Transformer2DModel configs with diffusers, runs them in fp32 on CPU and
saves, per case, under tests/fixtures/qwen_dit/<case>/:

  model/              config.json + safetensors (diffusers save_pretrained layout; one case is sharded)
  step0.safetensors   forward inputs of the first step (names as the diffusers forward arguments)
  step1.safetensors   inputs of a second step (new timestep and target latents) for the cached KV mode
  expected.safetensors
      sample_full     forward(step0) without a KV cache, the whole joint sequence
      sample_extract  forward(step0, kv_cache_mode="extract") (only for causal_condition cases)
      sample_cached   forward(step1, kv_cache_mode="cached") with the cache extracted from step0: target rows only
      kv.{i}.k/.v     the extracted prefix K/V of layer i, [B, prefix, heads, head_dim] (post norm and RoPE)

Regenerate (from the repository root):
  python3 tests/python/qwen_dit_fixtures.py --out tests/fixtures/qwen_dit
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

import diffusers
from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

TINY = dict(
    patch_size=1,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    context_in_dim=24,
    mlp_ratio=3,
    axes_dims_rope=(4, 6, 6),
    eps=1e-6,
)

# Each case: VLM layout as a list of ("text", n) / ("image", h, w) items before the target, the target (h, w),
# batch size, timesteps of the two steps, right padding per sample (number of trailing padded text rows),
# causal_condition, and whether the model folder is saved sharded.
CASES = {
    # text | condition image | text | target, non-square grids, B=2 with right padding in sample 1.
    "cond_b2": dict(layout=[("text", 5), ("image", 4, 6), ("text", 3)], target=(6, 4), batch=2,
                    t0=[0.7, 0.35], t1=[0.5, 0.2], pad=[0, 2], causal=True, sharded=True),
    # plain text-to-image, no padding mask at all.
    "t2i": dict(layout=[("text", 6)], target=(4, 8), batch=1, t0=[0.9], t1=[0.6], pad=None, causal=True,
                sharded=False),
    # two condition images with no text between them (separate blocks), padding mask given but one row padded.
    "two_cond": dict(layout=[("text", 4), ("image", 2, 4), ("image", 4, 2), ("text", 2)], target=(4, 4), batch=1,
                     t0=[0.45], t1=[0.3], pad=[1], causal=True, sharded=False),
    # causal_condition = False: every token modulated by its sample's timestep, no KV cache.
    "no_causal": dict(layout=[("text", 5), ("image", 4, 4), ("text", 2)], target=(4, 6), batch=2,
                      t0=[0.9, 0.1], t1=None, pad=[0, 3], causal=False, sharded=False),
}


def randomize(model, gen):
    # Defaults leave zero-centred norms at 0 and RMSNorm weights at 1; re-draw everything so every tensor matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith(("norm_q.weight", "norm_k.weight")) else 0.0
            scale = 0.2 if p.ndim == 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + base)


def build_inputs(case, gen):
    batch = case["batch"]
    tgt_h, tgt_w = case["target"]
    mask_row, img_shapes, text_rows = [], [], 0
    for item in case["layout"]:
        if item[0] == "text":
            mask_row += [0] * item[1]
            text_rows += item[1]
        else:
            _, h, w = item
            assert (h * w) % 4 == 0
            mask_row += [1] * (h * w // 4)
            img_shapes.append((1, h, w))
    l_vlm = len(mask_row)
    mask_row += [1] * (tgt_h * tgt_w // 4)
    img_shapes.append((1, tgt_h, tgt_w))
    n_img = sum(h * w for _, h, w in img_shapes)
    img_mask = torch.tensor(mask_row, dtype=torch.bool).expand(batch, -1).contiguous()
    enc = torch.randn(batch, l_vlm, TINY["context_in_dim"], generator=gen)
    enc_mask = None
    if case["pad"] is not None:
        enc_mask = torch.ones(batch, l_vlm, dtype=torch.bool)
        text_pos = [i for i, m in enumerate(mask_row[:l_vlm]) if m == 0]
        for b, n_pad in enumerate(case["pad"]):
            for i in text_pos[len(text_pos) - n_pad:]:
                enc_mask[b, i] = False
    hidden = torch.randn(batch, n_img, TINY["in_channels"], generator=gen)
    return dict(hidden=hidden, enc=enc, img_mask=img_mask, enc_mask=enc_mask, img_shapes=img_shapes,
                n_tgt=tgt_h * tgt_w)


def bundle(inp, timestep):
    batch = inp["hidden"].shape[0]
    tensors = {
        "hidden_states": inp["hidden"].contiguous(),
        "encoder_hidden_states": inp["enc"].contiguous(),
        "timestep": torch.tensor(timestep, dtype=torch.float32),
        "img_mask": inp["img_mask"].to(torch.uint8).contiguous(),
        "img_shapes": torch.tensor([inp["img_shapes"]] * batch, dtype=torch.int64),
    }
    if inp["enc_mask"] is not None:
        tensors["encoder_hidden_states_mask"] = inp["enc_mask"].to(torch.uint8).contiguous()
    return tensors


def run(model, inp, timestep, kv_cache=None, mode=None):
    batch = inp["hidden"].shape[0]
    with torch.no_grad():
        return model(
            hidden_states=inp["hidden"],
            encoder_hidden_states=inp["enc"],
            timestep=torch.tensor(timestep, dtype=torch.float32),
            img_shapes=[inp["img_shapes"]] * batch,
            img_mask=inp["img_mask"],
            encoder_hidden_states_mask=inp["enc_mask"],
            kv_cache=kv_cache,
            kv_cache_mode=mode,
            return_dict=False,
        )[0]


def make_case(name, case, out_dir, seed):
    gen = torch.Generator().manual_seed(seed)
    model = QwenImage21Transformer2DModel(**TINY, causal_condition=case["causal"]).eval()
    randomize(model, gen)
    case_dir = os.path.join(out_dir, name)
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)
    model.save_pretrained(os.path.join(case_dir, "model"), max_shard_size="60KB" if case["sharded"] else "10GB")

    step0 = build_inputs(case, gen)
    save_file(bundle(step0, case["t0"]), os.path.join(case_dir, "step0.safetensors"))
    expected = {"sample_full": run(model, step0, case["t0"]).contiguous()}
    if case["causal"]:
        cache = QwenImage21KVCache(TINY["num_layers"])
        expected["sample_extract"] = run(model, step0, case["t0"], cache, "extract").contiguous()
        for i, layer in enumerate(cache.layer_caches):
            k, v = layer.get()
            expected[f"kv.{i}.k"] = k.contiguous()
            expected[f"kv.{i}.v"] = v.contiguous()
        # The next step: new target latents and timestep. The prefix inputs are re-drawn too, to show that the
        # cached step takes the prefix only from the cache.
        step1 = dict(step0)
        step1["hidden"] = torch.randn(step0["hidden"].shape, generator=gen)
        step1["enc"] = torch.randn(step0["enc"].shape, generator=gen)
        save_file(bundle(step1, case["t1"]), os.path.join(case_dir, "step1.safetensors"))
        expected["sample_cached"] = run(model, step1, case["t1"], cache, "cached").contiguous()
        # Consistency of the reference itself: extract == full, cached == an uncached run of step1's target rows
        # with step0's prefix.
        torch.testing.assert_close(expected["sample_extract"], expected["sample_full"], rtol=1e-5, atol=1e-6)
    save_file(expected, os.path.join(case_dir, "expected.safetensors"))
    return {k: list(v.shape) for k, v in expected.items() if not k.startswith("kv.")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures/qwen_dit")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    manifest = {
        "generator": "tests/python/qwen_dit_fixtures.py",
        "versions": {"diffusers": diffusers.__version__, "torch": torch.__version__,
                     "safetensors": __import__("safetensors").__version__},
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.items()},
        "cases": {},
    }
    for seed, (name, case) in enumerate(sorted(CASES.items())):
        manifest["cases"][name] = make_case(name, case, args.out, 1000 + seed)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    print(json.dumps(manifest["cases"], indent=2))


if __name__ == "__main__":
    main()
