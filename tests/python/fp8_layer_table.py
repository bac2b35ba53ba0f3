#!/usr/bin/env python3
"""The FP8 layer-group table of the Qwen-Image 2.1 DiT: each GEMM group's error against its share of the step time.

Reads, for every FP8 variant run by the `qwen21-fp8-groups` bundle step (a folder per variant holding its
--precision spec in spec.txt and the compare.json that compare_outputs.py wrote
(ours vs fp32, the diffusers bf16 floor, their ratio, per step kind)), and the per-phase times of one eager cached
step from `tf bench qwen-dit --phases --json` in bf16 and in FP8. Prints one row per variant:

  variant | cached-step rel L2 / floor | extract (target rows) rel L2 / floor | cosine | share of the bf16 step its
  GEMMs take | their time in FP8 | the step in FP8

so a group whose error is large for the time it saves stays in bf16. Nothing here judges; the table is the record
(docs/ENGINES.md).

Usage: python3 tests/python/fp8_layer_table.py --groups-dir /tmp/qwen21g --bench-bf16 bf16.json
       --bench-fp8 fp8.json [--json out.json]
"""

import argparse
import json
import os
import sys

# The bench's phase names of each group's GEMM, and of the kernels FP8 adds in front of a group.
GROUP_PHASES = {
    "qkv": ["qkv GEMM"],
    "out": ["out GEMM", "attention quantize"],
    "mlp_in": ["gate_up GEMM"],
    "mlp_out": ["down GEMM"],
}


def load(path):
    with open(path) as fh:
        return json.load(fh)


def phase_ms(bench, kind, names):
    """Milliseconds of the named phases in one eager step of `kind` (cached/full), or None."""
    phases = (bench.get("phases") or {}).get(kind) or {}
    rows = phases.get("phases") or []
    found = [r["ms"] for r in rows if r.get("phase") in names]
    return sum(found) if found else None


def step_ms(bench, kind):
    phases = (bench.get("phases") or {}).get(kind) or {}
    return phases.get("step_ms")


def groups_of(variant):
    """The GEMM groups a --precision spec runs in FP8 (each variant's folder holds its spec in spec.txt)."""
    spec = variant.split(":", 1)[1] if ":" in variant else "qkv,out,mlp_in,mlp_out"
    groups = set()
    for item in spec.split(","):
        if item == "all":
            groups |= set(GROUP_PHASES)
        elif item in GROUP_PHASES:
            groups.add(item)
    return sorted(groups, key=list(GROUP_PHASES).index)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups-dir", required=True)
    ap.add_argument("--bench-bf16", required=True)
    ap.add_argument("--bench-fp8", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    bf16 = load(args.bench_bf16) if os.path.exists(args.bench_bf16) else {}
    fp8 = load(args.bench_fp8) if args.bench_fp8 and os.path.exists(args.bench_fp8) else {}
    bf16_step = step_ms(bf16, "cached")
    rows = []
    variants = [v for v in os.listdir(args.groups_dir) if os.path.isdir(os.path.join(args.groups_dir, v))]
    for variant in sorted(variants, key=lambda v: (len(v), v)):
        compare = os.path.join(args.groups_dir, variant, "compare.json")
        if not os.path.exists(compare):
            print(f"{variant}: no compare.json (did its forward fail?)")
            continue
        result = load(compare)
        by = {(r["step"], r["rows"]): r for r in result.get("rows", [])}
        cached = by.get(("cached", "all rows"))
        extract = by.get(("extract", "target rows"))
        spec_file = os.path.join(args.groups_dir, variant, "spec.txt")
        spec = open(spec_file).read().strip() if os.path.exists(spec_file) else variant
        groups = groups_of(spec)
        names = [n for g in groups for n in GROUP_PHASES[g]]
        bf16_group = phase_ms(bf16, "cached", [n for n in names if n != "attention quantize"])
        rows.append({
            "variant": spec,
            "groups": groups,
            "cached_ratio": cached and cached["ratio"],
            "cached_rel_l2": cached and cached["ours_rel_l2"],
            "cached_cosine": cached and cached["ours_cosine"],
            "extract_ratio": extract and extract["ratio"],
            "bf16_group_ms": bf16_group,
            "bf16_group_share": (bf16_group / bf16_step) if (bf16_group and bf16_step) else None,
        })

    fmt = lambda v, f: ("-" if v is None else format(v, f))
    print(f"bf16 eager cached step: {fmt(bf16_step, '.2f')} ms; FP8 (default mode) eager cached step: "
          f"{fmt(step_ms(fp8, 'cached'), '.2f')} ms")
    if fp8:
        for g, names in GROUP_PHASES.items():
            b = phase_ms(bf16, "cached", [n for n in names if n != "attention quantize"])
            f = phase_ms(fp8, "cached", names)
            print(f"  {g:<8} GEMMs (with their FP8 quantize pass): bf16 {fmt(b, '.2f')} ms, default FP8 mode {fmt(f, '.2f')} ms")
    print()
    print("| FP8 variant | groups | cached step rel L2 / floor | extract (target rows) / floor | cached cosine | "
          "their GEMMs' share of the bf16 step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        share = r["bf16_group_share"]
        print(f"| {r['variant']} | {', '.join(r['groups'])} | {fmt(r['cached_ratio'], '.2f')} | "
              f"{fmt(r['extract_ratio'], '.2f')} | {fmt(r['cached_cosine'], '.6f')} | "
              f"{'-' if share is None else f'{100 * share:.1f}%'} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bf16_cached_step_ms": bf16_step, "fp8_cached_step_ms": step_ms(fp8, "cached"),
                       "rows": rows}, fh, indent=2)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
