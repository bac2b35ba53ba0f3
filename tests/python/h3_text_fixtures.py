#!/usr/bin/env python3
"""Reference fixture for MiniMax H3's text conditioning (crates/tf-engines/src/minimax_h3/text.rs).

Builds a tiny random Qwen3-VL text encoder (transformers, fp32 on CPU) with a small Qwen2 tokenizer that carries
H3's seven extra special tokens at 151669-151675, saves them as the `text_encoder/` and `tokenizer/` components of
a diffusers MiniMax H3 folder, and records, for several prompts, the token ids under H3's prompt rules and the
hidden states that diffusers' H3 text encoder step reads: `text_encoder.model(input_ids, attention_mask=ones,
mm_token_type_ids=processor.create_mm_token_type_ids(...), use_cache=False, output_hidden_states=True)`, exactly as
`diffusers.modular_pipelines.minimax_h3.encoders.get_qwen3vl_prompt_embeds` calls it.

Output under tests/fixtures/minimax_h3_text/:

  model/text_encoder/     Qwen3VLForConditionalGeneration.save_pretrained (bf16-stored weights, tied embeddings)
  model/tokenizer/        Qwen2TokenizerFast.save_pretrained (tokenizer.json, tokenizer_config.json)
  expected.safetensors    per case `<case>.ids` (H3 rules), `<case>.diffusers_ids` (the diffusers step's
                          `tokenizer(prompt, add_special_tokens=False)`), `<case>.layer4`, `<case>.layer5`
                          (hidden_states[4] and [5], the last one a 6-layer model has before the norm) and
                          `<case>.layer6` (hidden_states[6]: the final norm's output, which H3 never reads)
  manifest.json           the cases (prompt, markup), the config and the versions

H3's prompt rules (re-implemented here independently of the Rust code): `\\(` and `\\)` become `(` and `)`; the text
is cut before every `embedding:` that follows whitespace and each piece is encoded alone; spelled added tokens form
their ids (markup "allowed", the reference's behaviour) or are plain text (markup "forbidden": the prompt is
untrusted); an empty result is the pad id 151643. The diffusers step encodes the prompt verbatim, so its ids differ
only for prompts with those escapes or splits, and for the forbidden markup; the manifest records where.

The tiny tokenizer is the committed Qwen tokenizer (tests/tokenizer/fixtures/qwen-tokenizer.json.gz) cut to its
first 2048 vocabulary entries (the 256 byte tokens and the first 1792 merges: every merge's parts rank below its
result, so the cut is a consistent BPE) plus all 33 added tokens at their ids (also entered in the BPE vocabulary
at those ids, which `tokenizers` and transformers then keep). The model's vocabulary therefore
spans 151676 rows; to keep the committed file small the hidden size is 8 and only the rows of ids the tokenizer
can produce are random (the rest are zero, which also shows a wrong row lookup). Attention has 2 query heads and
1 key/value head of 128 (the GPU kernels' head dim), MLP 32, 6 layers, RoPE theta 5e6 with Qwen3-VL's interleaved
M-RoPE (text-only input: all three axes carry the same position).

Regenerate (from the repository root):
  python3 tests/python/h3_text_fixtures.py --out tests/fixtures/minimax_h3_text
"""
import argparse
import gzip
import json
import os
import platform
import re
import shutil

import numpy as np
import safetensors
import tokenizers
import torch
from safetensors.torch import save_file

import diffusers
import transformers
from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

# Qwen3-VL's video processor needs torchvision; text conditioning never touches it, so the processor is built
# without one (only its `create_mm_token_type_ids` is used).
ProcessorMixin.check_argument_for_proper_class = lambda self, name, value: type(value)

REGULAR_VOCAB = 2048
LAYERS = 6
HIDDEN = 8
PAD_ID = 151643
FIRST_ADDED = 151643
LAST_ADDED = 151675

TEXT = dict(
    vocab_size=LAST_ADDED + 1,
    hidden_size=HIDDEN,
    intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
)
TOKENIZER_CONFIG = {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "bos_token": None,
                    "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None,
                    "model_max_length": 131072}
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])

LONG = ("A lighthouse keeper climbs the spiral stairs at dusk, lantern swinging, while waves break on the rocks "
        "below and gulls circle the beam. ") * 5

# (case, prompt, markup)
CASES = [
    ("plain", "a red fox runs through fresh snow at dawn", "allowed"),
    ("special", "<d>a quiet street after rain</d> <|cutoff|> neon signs hum <|h3_marker_3|>", "allowed"),
    ("special_forbidden", "<d>a quiet street after rain</d> <|cutoff|> neon signs hum <|h3_marker_3|>", "forbidden"),
    ("escapes", "a \\(bright\\) lantern embedding:style_a glows\nembedding:warm light, xembedding:no split",
     "allowed"),
    ("unicode", "café au lait — 夜の街 🌃 naïve façade", "allowed"),
    ("empty", "", "allowed"),
    ("long", LONG, "allowed"),
]


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


def tiny_tokenizer_json(full_path):
    full = json.loads(gzip.open(full_path).read())
    model = full["model"]
    vocab = {t: i for t, i in model["vocab"].items() if i < REGULAR_VOCAB}
    merges = model["merges"][: REGULAR_VOCAB - 256]
    for a, b in merges:
        assert a in vocab and b in vocab and (a + b) in vocab, (a, b)
    added = [t for t in full["added_tokens"] if FIRST_ADDED <= t["id"] <= LAST_ADDED]
    assert len(added) == LAST_ADDED - FIRST_ADDED + 1
    # The added tokens also enter the BPE vocabulary at their ids (no merge forms them): `tokenizers` numbers an
    # added token that is not in the vocabulary right after it, which would move them next to the cut vocabulary.
    for t in added:
        vocab[t["content"]] = t["id"]
    extras = {t["id"]: t["content"] for t in added if t["id"] >= 151669}
    assert extras[151669] == "<d>" and extras[151670] == "</d>" and extras[151671] == "<|cutoff|>", extras
    tiny = dict(full)
    tiny["added_tokens"] = added
    tiny["model"] = dict(model, vocab=vocab, merges=merges)
    return tiny


def h3_pieces(prompt):
    """`\\(` -> `(`, `\\)` -> `)`, then cut before every `embedding:` that follows whitespace."""
    text = prompt.replace("\\(", "(").replace("\\)", ")")
    return [p for p in re.split(r"(?<=\s)(?=embedding:)", text) if p]


def h3_ids(prompt, markup, tokenizer, plain):
    ids = []
    for piece in h3_pieces(prompt):
        if markup == "allowed":
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        else:
            ids += plain.encode(piece, add_special_tokens=False).ids
    return ids or [PAD_ID]


def randomize(model, gen):
    """Every text parameter re-drawn (norms around 1), rounded to bf16 so bf16 storage is exact."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                value = 0.8 + 0.4 * torch.rand(p.shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                value = torch.zeros(p.shape)
                rows = list(range(REGULAR_VOCAB)) + list(range(FIRST_ADDED, LAST_ADDED + 1))
                value[rows] = torch.randn(len(rows), p.shape[1], generator=gen)
            elif p.dim() == 2:
                bound = 1.5 / p.shape[1] ** 0.5
                value = (torch.rand(p.shape, generator=gen) * 2 - 1) * bound
            else:
                value = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(value.to(torch.bfloat16).float())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/minimax_h3_text")
    parser.add_argument("--tokenizer", default="tests/tokenizer/fixtures/qwen-tokenizer.json.gz")
    args = parser.parse_args()
    torch.manual_seed(2026)
    gen = torch.Generator().manual_seed(2026)

    out = args.out
    model_dir = os.path.join(out, "model")
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    os.makedirs(model_dir)

    # Tokenizer: written, loaded back as the class diffusers' H3 step declares, and saved in its component folder
    # (`tokenizer/`, as `ModularPipeline.save_pretrained` saves each component).
    scratch = os.path.join(out, "tokenizer.scratch")
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, "tokenizer.json"), "w") as f:
        json.dump(tiny_tokenizer_json(args.tokenizer), f, ensure_ascii=False)
    with open(os.path.join(scratch, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f)
    Qwen2TokenizerFast.from_pretrained(scratch).save_pretrained(os.path.join(model_dir, "tokenizer"))
    shutil.rmtree(scratch)
    tokenizer = Qwen2TokenizerFast.from_pretrained(os.path.join(model_dir, "tokenizer"))
    ids_of = {t: tokenizer.convert_tokens_to_ids(t) for t in ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                              "<|vision_end|>", "<|h3_marker_6|>", "<d>"]}
    assert ids_of["<|h3_marker_6|>"] == LAST_ADDED and ids_of["<d>"] == 151669, ids_of
    # The plain encoder: the saved tokenizer.json with no added tokens, so spelled ones are ordinary text.
    plain_json = json.load(open(os.path.join(model_dir, "tokenizer", "tokenizer.json")))
    plain_json["added_tokens"] = []
    plain = tokenizers.Tokenizer.from_str(json.dumps(plain_json))

    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=ids_of["<|image_pad|>"],
                           video_token_id=ids_of["<|video_pad|>"], vision_start_token_id=ids_of["<|vision_start|>"],
                           vision_end_token_id=ids_of["<|vision_end|>"], tie_word_embeddings=True)
    text_encoder = Qwen3VLForConditionalGeneration(config).eval().float()
    randomize(text_encoder, gen)
    text_encoder.to(torch.bfloat16).save_pretrained(os.path.join(model_dir, "text_encoder"))
    # The reference runs the saved weights in fp32, as loaded back.
    text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
        os.path.join(model_dir, "text_encoder"), dtype=torch.float32).eval()
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2,
                                                                         temporal_patch_size=2),
                                 tokenizer=tokenizer, video_processor=None)

    tensors, cases = {}, []
    for case, prompt, markup in CASES:
        ids = h3_ids(prompt, markup, tokenizer, plain)
        diffusers_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids], dtype=torch.long)
        mm = torch.tensor(processor.create_mm_token_type_ids([ids]), dtype=torch.long)
        assert int(mm.abs().sum()) == 0, "text-only prompts carry no vision tokens"
        with torch.no_grad():
            hidden = text_encoder.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                        mm_token_type_ids=mm, use_cache=False, output_hidden_states=True).hidden_states
        assert len(hidden) == LAYERS + 1
        tensors[f"{case}.ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"{case}.diffusers_ids"] = torch.tensor(diffusers_ids or [-1], dtype=torch.int64)
        for layer in (4, 5, 6):
            tensors[f"{case}.layer{layer}"] = hidden[layer][0].contiguous()
        added = sorted({i for i in ids if i >= FIRST_ADDED})
        cases.append(dict(case=case, prompt=prompt, markup=markup, tokens=len(ids), added_ids=added,
                          same_as_diffusers=ids == diffusers_ids))
        print(f"{case}: {len(ids)} ids ({'same as' if ids == diffusers_ids else 'unlike'} diffusers' verbatim "
              f"{len(diffusers_ids)}), added {added}")
    save_file(tensors, os.path.join(out, "expected.safetensors"))
    manifest = dict(layers=LAYERS, hidden=HIDDEN, regular_vocab=REGULAR_VOCAB, text_config=TEXT, cases=cases,
                    versions=versions())
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
