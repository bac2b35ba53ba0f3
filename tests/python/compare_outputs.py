#!/usr/bin/env python3
"""Compares `tf forward --backend gpu` outputs with the diffusers references of qwen_dit_reference.py.

For every size folder under --dir (e.g. /tmp/qwen21/1024x1024) it reads reference.safetensors (extract_fp32,
extract_bf16, cached_fp32, cached_bf16) and our samples (ours_step0.safetensors from --kv-cache extract,
ours_step1.safetensors from --kv-cache cached), and prints, per step: relative L2 and cosine of ours vs fp32,
the floor (diffusers bf16 vs fp32), and the ratio ours / floor, which must be <= --max-ratio (1.5).
Exit status 1 when a ratio is over the limit or an output is missing.

Usage: python3 tests/python/compare_outputs.py --dir /tmp/qwen21 [--sizes 1024x1024,1280x768] [--json out.json]
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file


def rel_l2(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="1024x1024,1280x768")
    ap.add_argument("--max-ratio", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rows = []
    failed = False
    for size in args.sizes.split(","):
        case = os.path.join(args.dir, size)
        ref_path = os.path.join(case, "reference.safetensors")
        if not os.path.exists(ref_path):
            print(f"{size}: {ref_path} missing", flush=True)
            failed = True
            continue
        ref = load_file(ref_path)
        for step, ours_file, key in (("extract", "ours_step0.safetensors", "extract"), ("cached", "ours_step1.safetensors", "cached")):
            path = os.path.join(case, ours_file)
            if not os.path.exists(path):
                print(f"{size}/{step}: {path} missing (did tf forward fail?)", flush=True)
                failed = True
                continue
            ours = load_file(path)["sample"].float()
            fp32 = ref[f"{key}_fp32"].float()
            bf16 = ref[f"{key}_bf16"].float()
            if ours.shape != fp32.shape:
                print(f"{size}/{step}: shape {tuple(ours.shape)} != reference {tuple(fp32.shape)}", flush=True)
                failed = True
                continue
            views = [("all rows", ours, fp32, bf16)]
            if step == "extract":
                n = ref["cached_fp32"].shape[1]
                views.append(("target rows", ours[:, -n:], fp32[:, -n:], bf16[:, -n:]))
            for label, o, r, f in views:
                err, floor = rel_l2(o, r), rel_l2(f, r)
                ratio = err / floor if floor > 0 else float("inf")
                row = {
                    "size": size,
                    "step": step,
                    "rows": label,
                    "ours_rel_l2": err,
                    "ours_cosine": cosine(o, r),
                    "floor_rel_l2": floor,
                    "floor_cosine": cosine(f, r),
                    "ratio": ratio,
                    "finite": bool(torch.isfinite(o).all()),
                }
                row["ok"] = row["finite"] and ratio <= args.max_ratio
                failed |= not row["ok"]
                rows.append(row)

    header = f"{'size':<10} {'step':<8} {'rows':<12} {'ours rel L2':>12} {'ours cos':>10} {'floor rel L2':>13} {'floor cos':>10} {'ratio':>7}  ok"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size']:<10} {r['step']:<8} {r['rows']:<12} {r['ours_rel_l2']:>12.4e} {r['ours_cosine']:>10.6f} "
            f"{r['floor_rel_l2']:>13.4e} {r['floor_cosine']:>10.6f} {r['ratio']:>7.3f}  {'yes' if r['ok'] else 'NO'}"
        )
    print(f"criterion: ours / floor <= {args.max_ratio} on every row: {'PASS' if not failed else 'FAIL'}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "pass": not failed}, fh, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
