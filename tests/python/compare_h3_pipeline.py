#!/usr/bin/env python3
"""Compares `tf video --dump-steps` with the diffusers H3 pipeline reference of tests/python/h3_pipeline_reference.py
(accuracy mode) step by step.

--dir DIR holds reference_fp32.safetensors (the truth), reference_bf16.safetensors (diffusers in bf16: the floor) and
reference.json; --ours FILE is the dump: `prompt_embeds` [tokens, text width], `latents.{i}` [video rows, C ph pw] and
`audio_latents.{i}` [2 A, C] after model call i, `frames` [F, H, W, 3] f32 in [0, 1], `audio` [2, samples] f32.
The schedules (`sigmas`, `audio_sigmas`) and the injected rows (`latents.init`, `audio_latents.init`) come from the
fp32 reference.

Per model call i, each run's velocity is recovered from its own consecutive rows: the H3 scheduler steps
x_{i+1} = x_i + (sigma_i - sigma_{i+1}) v_i (v the DiT's data-ward velocity), so v_i = (x_{i+1} - x_i) /
(sigma_i - sigma_{i+1}), x_0 the injected rows. For video and audio: relative L2 and cosine of ours against fp32,
of bf16 against fp32 (the floor), and ratio = ours / floor. Also the prompt features' relative L2 (ours and the
floor), the frames' PSNR (peak 1.0) and the soundtrack's SNR in dB for ours vs fp32, bf16 vs fp32 and ours vs bf16.

Passes when every call's video and audio velocity ratio is at most --max-ratio. Exit 0 pass, 1 fail, 2 a tensor
missing or of the wrong shape (named on stderr).

Usage: python3 tests/python/compare_h3_pipeline.py --dir /tmp/h3p --ours /tmp/h3p/ours.safetensors \
           [--json OUT] [--max-ratio 1.5]
"""
import argparse
import json
import math
import os
import sys

import torch
from safetensors import safe_open


class Missing(Exception):
    pass


def load(path, what):
    if not os.path.isfile(path):
        raise Missing(f"{what}: no file {path}")
    out = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
    return out


def need(tensors, name, what, shape=None):
    if name not in tensors:
        raise Missing(f"{what}: no tensor `{name}`")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise Missing(f"{what}: `{name}` has shape {list(t.shape)}, expected {list(shape)}")
    return t.double()


def rel_l2(a, b):
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else (0.0 if float(a.norm()) == 0 else math.inf)


def cosine(a, b):
    a, b = a.flatten(), b.flatten()
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else math.nan


def ratio(ours, floor):
    if floor > 0:
        return ours / floor
    return 1.0 if ours == 0 else math.inf


def psnr(a, b):
    mse = float((a - b).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def snr(a, ref):
    noise = float((a - ref).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)


def finite_or_none(x):
    return x if isinstance(x, float) and math.isfinite(x) else (None if isinstance(x, float) else x)


def clean(value):
    """JSON has no inf / nan: they become null (the table prints them)."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return finite_or_none(value)


def velocities(tensors, what, prefix, init, sigmas, calls, shape):
    out, prev = [], init
    for i in range(calls):
        x = need(tensors, f"{prefix}.{i}", what, shape)
        out.append((x - prev) / float(sigmas[i] - sigmas[i + 1]))
        prev = x
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ours", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-ratio", type=float, default=1.5)
    args = ap.parse_args()

    meta = {}
    meta_path = os.path.join(args.dir, "reference.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    try:
        fp32 = load(os.path.join(args.dir, "reference_fp32.safetensors"), "fp32 reference")
        bf16 = load(os.path.join(args.dir, "reference_bf16.safetensors"), "bf16 reference")
        ours = load(args.ours, "ours")
        sigmas = need(fp32, "sigmas", "fp32 reference")
        audio_sigmas = need(fp32, "audio_sigmas", "fp32 reference")
        calls = sigmas.numel() - 1
        if audio_sigmas.numel() != calls + 1 or calls < 1:
            raise Missing(f"fp32 reference: {sigmas.numel()} video and {audio_sigmas.numel()} audio grid points")
        init_v = need(fp32, "latents.init", "fp32 reference")
        init_a = need(fp32, "audio_latents.init", "fp32 reference")
        extra = sorted(k for k in ours if k.startswith(("latents.", "audio_latents."))
                       and k.split(".")[-1].isdigit() and int(k.split(".")[-1]) >= calls)
        if extra:
            raise Missing(f"ours: {len(extra)} step tensors beyond the reference's {calls} model calls ({extra[0]})")
        vel = {}
        for name, run in (("fp32", fp32), ("bf16", bf16), ("ours", ours)):
            vel[name] = (velocities(run, name, "latents", init_v, sigmas, calls, init_v.shape),
                         velocities(run, name, "audio_latents", init_a, audio_sigmas, calls, init_a.shape))
        pe = {n: need(r, "prompt_embeds", n, fp32["prompt_embeds"].shape if n != "fp32" else None)
              for n, r in (("fp32", fp32), ("bf16", bf16), ("ours", ours))}
        frames = {n: need(r, "frames", n, fp32["frames"].shape if n != "fp32" else None)
                  for n, r in (("fp32", fp32), ("bf16", bf16), ("ours", ours))}
        audio = {n: need(r, "audio", n, fp32["audio"].shape if n != "fp32" else None)
                 for n, r in (("fp32", fp32), ("bf16", bf16), ("ours", ours))}
    except Missing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    steps = []
    for i in range(calls):
        row = {"call": i, "sigma": float(sigmas[i]), "audio_sigma": float(audio_sigmas[i])}
        for m, key in ((0, "video"), (1, "audio")):
            truth = vel["fp32"][m][i]
            o, fl = vel["ours"][m][i], vel["bf16"][m][i]
            ours_rel, floor_rel = rel_l2(o, truth), rel_l2(fl, truth)
            row[key] = {"rel_l2": ours_rel, "cosine": cosine(o, truth), "floor_rel_l2": floor_rel,
                        "floor_cosine": cosine(fl, truth), "ratio": ratio(ours_rel, floor_rel)}
        steps.append(row)

    def worst(key):
        # NaN sorts as the worst.
        return max(steps, key=lambda r: math.inf if math.isnan(r[key]["ratio"]) else r[key]["ratio"])

    worst_video, worst_audio = worst("video"), worst("audio")
    passed = all(r[k]["ratio"] <= args.max_ratio for r in steps for k in ("video", "audio"))
    pe_ours, pe_floor = rel_l2(pe["ours"], pe["fp32"]), rel_l2(pe["bf16"], pe["fp32"])
    result = {
        "tiny": bool(meta.get("tiny", False)),
        "reference_dir": args.dir,
        "ours": args.ours,
        "max_ratio": args.max_ratio,
        "passed": passed,
        "calls": calls,
        "worst_video": {"call": worst_video["call"], **worst_video["video"]},
        "worst_audio": {"call": worst_audio["call"], **worst_audio["audio"]},
        "prompt_embeds": {"rel_l2": pe_ours, "floor_rel_l2": pe_floor, "ratio": ratio(pe_ours, pe_floor),
                          "cosine": cosine(pe["ours"], pe["fp32"]), "tokens": int(pe["fp32"].shape[0])},
        "frames_psnr_db": {"ours_vs_fp32": psnr(frames["ours"], frames["fp32"]),
                           "bf16_vs_fp32": psnr(frames["bf16"], frames["fp32"]),
                           "ours_vs_bf16": psnr(frames["ours"], frames["bf16"]),
                           "shape": list(frames["fp32"].shape)},
        "audio_snr_db": {"ours_vs_fp32": snr(audio["ours"], audio["fp32"]),
                         "bf16_vs_fp32": snr(audio["bf16"], audio["fp32"]),
                         "ours_vs_bf16": snr(audio["ours"], audio["bf16"]),
                         "shape": list(audio["fp32"].shape)},
        "steps": steps,
    }

    if result["tiny"]:
        print("NOTE: the reference was made with --tiny (toy sizes): not an acceptance result")
    print(f"{'call':>4} {'sigma':>7} | {'video rel':>10} {'floor':>10} {'ratio':>6} {'cos':>9} | "
          f"{'audio rel':>10} {'floor':>10} {'ratio':>6} {'cos':>9}")
    for r in steps:
        v, a = r["video"], r["audio"]
        print(f"{r['call']:>4} {r['sigma']:>7.4f} | {v['rel_l2']:>10.3e} {v['floor_rel_l2']:>10.3e} "
              f"{v['ratio']:>6.2f} {v['cosine']:>9.6f} | {a['rel_l2']:>10.3e} {a['floor_rel_l2']:>10.3e} "
              f"{a['ratio']:>6.2f} {a['cosine']:>9.6f}")
    print(f"prompt_embeds rel L2: ours {pe_ours:.3e}, floor {pe_floor:.3e} (ratio {result['prompt_embeds']['ratio']:.2f})")
    fp, au = result["frames_psnr_db"], result["audio_snr_db"]
    print(f"frames PSNR dB: ours vs fp32 {fp['ours_vs_fp32']:.2f}, bf16 vs fp32 {fp['bf16_vs_fp32']:.2f}, "
          f"ours vs bf16 {fp['ours_vs_bf16']:.2f}")
    print(f"audio SNR dB: ours vs fp32 {au['ours_vs_fp32']:.2f}, bf16 vs fp32 {au['bf16_vs_fp32']:.2f}, "
          f"ours vs bf16 {au['ours_vs_bf16']:.2f}")
    print(f"worst video ratio {result['worst_video']['ratio']:.3f} at call {result['worst_video']['call']}, worst "
          f"audio ratio {result['worst_audio']['ratio']:.3f} at call {result['worst_audio']['call']} (limit "
          f"{args.max_ratio}): {'PASS' if passed else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(clean(result), f, indent=1)
            f.write("\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
