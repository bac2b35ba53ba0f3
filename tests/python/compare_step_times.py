#!/usr/bin/env python3
"""Compares the cached-step times of `tf bench qwen-dit --json` runs made back to back by two binaries.

Usage: compare_step_times.py OLD1.json NEW1.json [OLD2.json NEW2.json ...]

Pairs alternate old, new. Prints the graph-replay cached step of each run and the new/old ratio of the means;
exits 1 when the new binary's mean cached step is more than 1% slower than the old one's, 2 on bad input.
"""

import json
import sys


def cached_ms(path):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        sys.exit(2)
    if isinstance(value, dict) and isinstance(value.get("cached_graph_ms"), (int, float)):
        return float(value["cached_graph_ms"])
    print(f"{path}: no cached_graph_ms (keys: {sorted(value) if isinstance(value, dict) else type(value)})",
          file=sys.stderr)
    sys.exit(2)


def main(paths):
    if len(paths) < 2 or len(paths) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    old = [cached_ms(p) for p in paths[0::2]]
    new = [cached_ms(p) for p in paths[1::2]]
    for i, (a, b) in enumerate(zip(old, new)):
        print(f"round {i + 1}: old {a:.2f} ms, new {b:.2f} ms")
    mo, mn = sum(old) / len(old), sum(new) / len(new)
    ratio = mn / mo
    verdict = "within 1%" if ratio <= 1.01 else "MORE THAN 1% SLOWER"
    print(f"cached step (graph replay): old {mo:.2f} ms, new {mn:.2f} ms, new/old {ratio:.4f}: {verdict}")
    return 0 if ratio <= 1.01 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
