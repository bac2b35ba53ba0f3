#!/usr/bin/env python3
"""Compares our MiniMax H3 DiT outputs with the diffusers references of h3_dit_reference.py.

Reads --dir/reference.safetensors (sample_fp32, audio_sample_fp32, sample_bf16, audio_sample_bf16) and ours
(--ours, default --dir/ours.safetensors, written by `tf forward --backend gpu --model DIR/model --inputs
DIR/inputs.safetensors --out DIR/ours.safetensors`), and per output (sample, audio_sample) prints and writes: the
relative L2 and cosine of ours against diffusers fp32, the floor (diffusers bf16 against fp32), the ratio ours /
floor, which must be <= --max-ratio, and the largest absolute difference. Exit status 1 when a ratio is over the
limit, an output is not finite, a shape differs or a file is missing.

--precision names the precision `ours` ran in and sets the default criterion: bf16 1.5x the floor, fp8 (any
`fp8...` mode of `tf forward --precision`) 4x the floor (issue 16's acceptance for the default FP8 mode);
--max-ratio overrides it. --baseline FILE (our bf16 outputs) adds the relative L2 and cosine of ours against it.

Usage: python3 tests/python/compare_h3_outputs.py --dir /tmp/h3dit [--ours FILE] [--precision bf16|fp8]
       [--baseline FILE] [--max-ratio R] [--json out.json]
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file

OUTPUTS = ("sample", "audio_sample")


def rel_l2(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def compare(ref, ours, max_ratio, baseline=None):
    """One row per output; each says whether it passes (`baseline`, our bf16 outputs, only reported)."""
    rows = []
    for name in OUTPUTS:
        row = {"output": name}
        fp32, bf16 = ref.get(f"{name}_fp32"), ref.get(f"{name}_bf16")
        mine = ours.get(name)
        if fp32 is None or bf16 is None:
            row.update(ok=False, error=f"reference lacks {name}_fp32 / {name}_bf16")
        elif mine is None:
            row.update(ok=False, error=f"ours lacks {name} (has {sorted(ours)})")
        elif mine.shape != fp32.shape:
            row.update(ok=False, error=f"shape {list(mine.shape)} != reference {list(fp32.shape)}")
        else:
            mine, fp32, bf16 = mine.float(), fp32.float(), bf16.float()
            err, floor = rel_l2(mine, fp32), rel_l2(bf16, fp32)
            ratio = err / floor if floor > 0 else float("inf")
            row.update(
                shape=list(mine.shape),
                ours_rel_l2=err,
                ours_cosine=cosine(mine, fp32),
                ours_max_abs=float((mine - fp32).abs().max()),
                floor_rel_l2=floor,
                floor_cosine=cosine(bf16, fp32),
                floor_max_abs=float((bf16 - fp32).abs().max()),
                ratio=ratio,
                finite=bool(torch.isfinite(mine).all()),
            )
            base = (baseline or {}).get(name)
            if base is not None and base.shape == mine.shape:
                row.update(vs_baseline_rel_l2=rel_l2(mine, base.float()),
                           vs_baseline_cosine=cosine(mine, base.float()),
                           baseline_rel_l2=rel_l2(base.float(), fp32))
            row["ok"] = row["finite"] and ratio <= max_ratio
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="the --out folder of h3_dit_reference.py")
    ap.add_argument("--ours", default=None, help="our outputs (default: DIR/ours.safetensors)")
    ap.add_argument("--precision", default="bf16",
                    help="the precision ours ran in: bf16 (criterion 1.5x the floor) or fp8... (4x)")
    ap.add_argument("--baseline", default=None, help="our bf16 outputs, to report ours against them")
    ap.add_argument("--max-ratio", type=float, default=None, help="override the precision's criterion")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.max_ratio is None:
        args.max_ratio = 4.0 if args.precision.startswith("fp8") else 1.5

    ref_path = os.path.join(args.dir, "reference.safetensors")
    ours_path = args.ours or os.path.join(args.dir, "ours.safetensors")
    missing = [p for p in (ref_path, ours_path) if not os.path.exists(p)]
    if missing:
        for p in missing:
            print(f"{p} missing{' (did tf forward fail?)' if p == ours_path else ''}", flush=True)
        rows = [{"output": n, "ok": False, "error": f"missing {', '.join(missing)}"} for n in OUTPUTS]
    else:
        baseline = None
        if args.baseline:
            if os.path.exists(args.baseline):
                baseline = load_file(args.baseline)
            else:
                print(f"{args.baseline} missing: no comparison with our bf16 outputs", flush=True)
        rows = compare(load_file(ref_path), load_file(ours_path), args.max_ratio, baseline)
    passed = all(r["ok"] for r in rows)

    header = (f"{'output':<13} {'ours rel L2':>12} {'ours cos':>10} {'floor rel L2':>13} {'floor cos':>10} "
              f"{'ratio':>7} {'ours max|d|':>12}  ok")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['output']:<13} {r['error']}  NO")
            continue
        print(f"{r['output']:<13} {r['ours_rel_l2']:>12.4e} {r['ours_cosine']:>10.6f} {r['floor_rel_l2']:>13.4e} "
              f"{r['floor_cosine']:>10.6f} {r['ratio']:>7.3f} {r['ours_max_abs']:>12.4e}  "
              f"{'yes' if r['ok'] else 'NO'}")
        if "vs_baseline_rel_l2" in r:
            print(f"{'':<13} vs our bf16: rel L2 {r['vs_baseline_rel_l2']:.4e}, cosine {r['vs_baseline_cosine']:.6f}; "
                  f"our bf16 vs fp32 {r['baseline_rel_l2']:.4e}")
    print(f"criterion ({args.precision}): ours / floor <= {args.max_ratio} for every output, all finite: "
          f"{'PASS' if passed else 'FAIL'}", flush=True)
    if args.json:
        summary = {"reference": ref_path, "ours": ours_path, "precision": args.precision,
                   "baseline": args.baseline, "max_ratio": args.max_ratio, "rows": rows, "pass": passed}
        meta = os.path.join(args.dir, "reference.json")
        if os.path.exists(meta):
            with open(meta) as f:
                acc = json.load(f).get("accuracy", {})
            summary["case"] = {k: acc.get(k) for k in ("case", "seq_len", "timesteps", "config")}
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
