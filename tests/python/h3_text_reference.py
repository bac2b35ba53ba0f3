#!/usr/bin/env python3
"""MiniMax H3's text conditioning in transformers on the GPU: the reference figures `tf bench h3-text` prints beside
its own (same run, same machine).

1. Timing: the Qwen3-VL-32B text config (hidden 5120, 64 query and 8 key/value heads of 128, MLP 25600, vocabulary
   151936, RoPE theta 5e6, interleaved M-RoPE [24, 20, 20]) with `--layers` decoder layers (50: H3 reads
   hidden_states[50]) built on the GPU in bf16 with transformers' random init, and one forward of `--tokens` random
   text ids to hidden_states[layers] timed with CUDA events, called as diffusers' H3 text step calls the encoder
   (`text_encoder.model(input_ids, attention_mask=ones, mm_token_type_ids=zeros, use_cache=False,
   output_hidden_states=True)`; text ids have token type 0, which is what `create_mm_token_type_ids` gives them).
   With exactly `--layers` layers transformers' last hidden state is the final norm's output; the work is the same
   layers plus one norm. The reference pipeline itself always runs the whole released stack (64 layers) to read
   hidden_states[50]: `--full-layers 64` times that too. Peak memory is torch.cuda.max_memory_allocated (weights
   and activations). The vision tower is built tiny (one block): text-only input never runs it.
2. Accuracy: the same width with `--accuracy-layers` layers (5: hidden_states[4] is the output of 4 decoder layers),
   seeded random weights rounded to bf16 (so bf16 storage is exact for everyone), one prompt tokenized by
   Qwen2TokenizerFast as diffusers does (`tokenizer(prompt, add_special_tokens=False)`, the committed Qwen
   tokenizer with H3's extra tokens), hidden_states[4] in fp32 (TF32 off: the truth) and in bf16 (the floor a bf16
   engine can reach). The model and tokenizer are saved as an H3 folder (`accuracy/text_encoder/`,
   `accuracy/tokenizer/`) for `tf bench h3-text --model`.

Writes OUT/reference.json, OUT/accuracy/ (folder, prompt.txt, reference.safetensors with ids, fp32 and bf16).

Usage (GPU machine): python3 tests/python/h3_text_reference.py --out /tmp/h3text
"""
import argparse
import gc
import gzip
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

import transformers
from transformers import Qwen2TokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

PROMPT = (
    "A lighthouse keeper climbs the spiral stairs at dusk with a brass lantern, the wind rattling the windows, "
    "while waves break white on the black rocks below and a flock of gulls circles the slowly turning beam. "
    "Rain begins to fall; far out at sea a small fishing boat rides the swell toward the harbour lights, its deck "
    "lamp swaying. The keeper's dog barks once at the thunder, then curls up by the iron stove."
)


def text_config(layers):
    return dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=layers,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, hidden_act="silu",
                attention_bias=False, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})


VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=5120, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])


def build(layers, dtype, seed):
    torch.manual_seed(seed)
    config = Qwen3VLConfig(text_config=text_config(layers), vision_config=VISION, image_token_id=151655,
                           video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
                           tie_word_embeddings=True)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval()


def forward(model, ids):
    return model.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.zeros_like(ids),
                       use_cache=False, output_hidden_states=True).hidden_states


def time_forward(layers, tokens, iters, seed):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.time()
    model = build(layers, torch.bfloat16, seed)
    torch.cuda.synchronize()
    built_s = time.time() - started
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 151643, (1, tokens), generator=gen).cuda()
    with torch.no_grad():
        for _ in range(2):
            h = forward(model, ids)[layers]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            h = forward(model, ids)[layers]
        end.record()
        end.synchronize()
    ms = start.elapsed_time(end) / iters
    assert torch.isfinite(h.float()).all()
    peak = torch.cuda.max_memory_allocated()
    print(f"transformers bf16, {layers} layers (random init on the GPU, {weights / 1e9:.2f} GB, built in "
          f"{built_s:.1f} s): {tokens} tokens to hidden_states[{layers}] {ms:.3f} ms, peak {peak / 1e9:.2f} GB")
    del model, h
    gc.collect()
    torch.cuda.empty_cache()
    return dict(layers=layers, tokens=tokens, iters=iters, ms=ms, peak_allocated_bytes=peak, weight_bytes=weights,
                build_s=built_s)


def write_tokenizer(source_gz, folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "wb") as f:
        f.write(gzip.open(source_gz).read())
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "bos_token": None,
                   "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None,
                   "model_max_length": 262144}, f)


def accuracy(out, layers, seed, tokenizer_gz):
    folder = os.path.join(out, "accuracy")
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    write_tokenizer(tokenizer_gz, os.path.join(folder, "tokenizer"))
    tokenizer = Qwen2TokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
    assert tokenizer.convert_tokens_to_ids("<d>") == 151669
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with open(os.path.join(folder, "prompt.txt"), "w") as f:
        f.write(PROMPT)
    layer = layers - 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build(layers, torch.float32, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            p.copy_(p.to(torch.bfloat16).float())
        input_ids = torch.tensor([ids], device="cuda")
        fp32 = forward(model, input_ids)[layer][0].float().cpu()
        model.to(torch.bfloat16)
        bf16 = forward(model, input_ids)[layer][0].float().cpu()
    model.save_pretrained(os.path.join(folder, "text_encoder"))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    rel = float((bf16 - fp32).norm() / fp32.norm())
    print(f"accuracy: {len(ids)} tokens, hidden_states[{layer}] of a {layers}-layer full-width model: transformers "
          f"bf16 against fp32 relative L2 {rel:.3e}")
    features_file = os.path.join(folder, "reference.safetensors")
    save_file({"ids": torch.tensor(ids, dtype=torch.int64), "fp32": fp32.contiguous(), "bf16": bf16.contiguous()},
              features_file)
    return dict(layers=layers, layer=layer, tokens=len(ids), bf16_vs_fp32=rel, features_file=features_file,
                folder=folder, prompt_file=os.path.join(folder, "prompt.txt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/h3text")
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--full-layers", type=int, default=64, help="0 skips the whole-stack timing")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--accuracy-layers", type=int, default=5, help="0 skips the accuracy run")
    parser.add_argument("--tokenizer", default="tests/tokenizer/fixtures/qwen-tokenizer.json.gz")
    parser.add_argument("--json", default=None, help="also copy reference.json here")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summary = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                   transformers=transformers.__version__)
    summary["timing"] = time_forward(args.layers, args.tokens, args.iters, seed=0)
    if args.full_layers:
        summary["timing"]["full_stack"] = time_forward(args.full_layers, args.tokens, args.iters, seed=0)
    if args.accuracy_layers:
        summary["accuracy"] = accuracy(args.out, args.accuracy_layers, seed=1, tokenizer_gz=args.tokenizer)
    path = os.path.join(args.out, "reference.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    if args.json:
        shutil.copy(path, args.json)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
