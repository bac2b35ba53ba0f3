#!/usr/bin/env python3
"""Image PSNR and SSIM between two images: our FP8 path against our bf16 path and against diffusers.

SSIM is the standard one (Wang, Bovik, Sheikh and Simoncelli, 2004): an 11x11 Gaussian window with sigma 1.5
(normalized to sum 1), K1 = 0.01, K2 = 0.03, L the data range (255 for 8-bit PNGs, 1 for float images in [0, 1]),
local statistics over the window at every position where it fits inside the image (no padding), the SSIM map
averaged, on each RGB channel, and the three channel means averaged (what scikit-image's structural_similarity
gives with gaussian_weights=True, sigma=1.5, use_sample_covariance=False). PSNR is over all RGB values, with the same
peak. Alpha is left out. numpy only (PIL for PNGs, safetensors for float images).

Inputs are given in one of two ways:

  --dir D [--size WxH] [--steps 8,40]   the folder of tests/python/qwen_pipeline_reference.py, with ours beside
      the reference in D/WxH/stepsN/:
        ours.png, ours_steps.safetensors        `tf image` bf16 (-o, --dump-steps: `image` in [-1, 1])
        ours-fp8.png, ours-fp8_steps.safetensors   `tf image --precision fp8`
        reference.png, reference.safetensors    diffusers bf16 (`image` in [0, 1])
        fp32_image.png, fp32_image.safetensors  diffusers fp32 (only when the reference saved one)
      Pairs: FP8 vs ours bf16, FP8 vs diffusers bf16, FP8 vs diffusers fp32; and for scale ours bf16 vs diffusers
      bf16, ours bf16 vs diffusers fp32, diffusers bf16 vs fp32. Each pair on the PNGs (8 bits) and on the float
      images. Where the step dumps and D's fp32 floor steps are there, the FP8 path's per-step velocity against
      fp32 is reported beside ours bf16's and the floor (diffusers bf16 against fp32).
  --pair LABEL A B  (repeatable)      A and B: a PNG, or FILE.safetensors#TENSOR@RANGE with RANGE 01 (values in
      [0, 1]) or pm1 ([-1, 1]); a tensor is [1, C, H, W] or [C, H, W].

Exit 0 when every pair asked for was measured; 2 when an input is missing or malformed (what could be measured is
still written). Quality is reported, not judged: the issue sets no threshold.

Usage:
    python3 tests/python/image_quality.py --dir /tmp/qwen21p --steps 8,40 --json OUT.json
    python3 tests/python/image_quality.py --pair fp8-vs-bf16 a.png b.png
    python3 tests/python/image_quality.py --selftest
"""

import argparse
import json
import math
import os
import sys

import numpy as np

WINDOW, SIGMA, K1, K2 = 11, 1.5, 0.01, 0.03


class InputError(Exception):
    """A missing or malformed input (exit 2)."""


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------

def gaussian_window(size=WINDOW, sigma=SIGMA):
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    g = np.exp(-(x * x) / (2.0 * sigma * sigma))
    return g / g.sum()


def filter_valid(image, g):
    """Separable 'valid' filtering of a 2-D array with the 1-D kernel g along both axes (no padding)."""
    k = len(g)
    h, w = image.shape
    rows = np.zeros((h, w - k + 1), dtype=np.float64)
    for i in range(k):
        rows += g[i] * image[:, i:i + w - k + 1]
    out = np.zeros((h - k + 1, w - k + 1), dtype=np.float64)
    for i in range(k):
        out += g[i] * rows[i:i + h - k + 1, :]
    return out


def ssim_channel(x, y, data_range):
    """Mean SSIM of two 2-D arrays (float64) over every window position inside the image."""
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {x.shape} vs {y.shape}")
    if min(x.shape) < WINDOW:
        raise ValueError(f"images of {x.shape} are smaller than the {WINDOW}x{WINDOW} window")
    g = gaussian_window()
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    mu_x, mu_y = filter_valid(x, g), filter_valid(y, g)
    xx, yy, xy = filter_valid(x * x, g), filter_valid(y * y, g), filter_valid(x * y, g)
    var_x, var_y, cov = xx - mu_x * mu_x, yy - mu_y * mu_y, xy - mu_x * mu_y
    num = (2.0 * mu_x * mu_y + c1) * (2.0 * cov + c2)
    den = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return float(np.mean(num / den))


def ssim(a, b, data_range):
    """SSIM of two [H, W, C] images: the mean of the per-channel SSIMs, and the per-channel values."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"image shapes differ: {a.shape} vs {b.shape}")
    per = [ssim_channel(a[:, :, c], b[:, :, c], data_range) for c in range(a.shape[2])]
    return float(np.mean(per)), per


def psnr(a, b, data_range):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(data_range * data_range / mse)


def rel_l2(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cosine(a, b):
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---------------------------------------------------------------------------------------------------------------
# Reading images
# ---------------------------------------------------------------------------------------------------------------

def load_tensors(path):
    if not os.path.exists(path):
        raise InputError(f"{path} is missing")
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001 (any parse failure of a malformed file)
        raise InputError(f"{path}: cannot read it as safetensors ({exc})") from exc


def read_image(spec):
    """(array [H, W, 3] float64, data range, description) from a PNG path or FILE.safetensors#TENSOR@RANGE."""
    if "#" in spec or spec.endswith(".safetensors"):
        path, _, rest = spec.partition("#")
        name, _, value_range = (rest or "image").partition("@")
        value_range = value_range or "01"
        if value_range not in ("01", "pm1"):
            raise InputError(f"{spec}: the range must be 01 or pm1, got {value_range!r}")
        tensors = load_tensors(path)
        if name not in tensors:
            raise InputError(f"{path}: no tensor {name!r} (have {sorted(tensors)[:12]})")
        x = np.asarray(tensors[name], dtype=np.float64)
        if x.ndim == 4:
            if x.shape[0] != 1:
                raise InputError(f"{spec}: batch of {x.shape[0]}; one image expected")
            x = x[0]
        if x.ndim != 3 or x.shape[0] < 3:
            raise InputError(f"{spec}: shape {list(tensors[name].shape)}; [1, C, H, W] or [C, H, W] with C >= 3")
        if not np.isfinite(x).all():
            raise InputError(f"{spec}: non-finite values")
        if value_range == "pm1":
            x = (x + 1.0) / 2.0
        x = np.clip(x[:3], 0.0, 1.0).transpose(1, 2, 0)
        return x, 1.0, f"{os.path.basename(path)}#{name} (float, {value_range})"
    if not os.path.exists(spec):
        raise InputError(f"{spec} is missing")
    from PIL import Image

    try:
        with Image.open(spec) as image:
            array = np.asarray(image.convert("RGB"), dtype=np.float64)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{spec}: cannot read it as an image ({exc})") from exc
    return array, 255.0, f"{os.path.basename(spec)} (8-bit)"


def compare(label, spec_a, spec_b):
    a, range_a, desc_a = read_image(spec_a)
    b, range_b, desc_b = read_image(spec_b)
    if range_a != range_b:
        raise InputError(f"{label}: {spec_a} and {spec_b} are of different kinds (8-bit and float)")
    if a.shape != b.shape:
        raise InputError(f"{label}: {spec_a} is {list(a.shape)}, {spec_b} is {list(b.shape)}")
    s, per = ssim(a, b, range_a)
    return dict(pair=label, a=spec_a, b=spec_b, kind="png" if range_a == 255.0 else "float",
                height=a.shape[0], width=a.shape[1], psnr_db=psnr(a, b, range_a), ssim=s, ssim_rgb=per,
                a_desc=desc_a, b_desc=desc_b)


# ---------------------------------------------------------------------------------------------------------------
# The pipeline folder
# ---------------------------------------------------------------------------------------------------------------

SOURCES = {
    # name: (PNG, float tensor spec)
    "ours-fp8": ("ours-fp8.png", "ours-fp8_steps.safetensors#image@pm1"),
    "ours-bf16": ("ours.png", "ours_steps.safetensors#image@pm1"),
    "diffusers-bf16": ("reference.png", "reference.safetensors#image@01"),
    "diffusers-fp32": ("fp32_image.png", "fp32_image.safetensors#image@01"),
}
# (a, b, required): the FP8 pairs the issue asks for, then the bf16 paths' own distances for scale.
PAIRS = [
    ("ours-fp8", "ours-bf16", True),
    ("ours-fp8", "diffusers-bf16", True),
    ("ours-fp8", "diffusers-fp32", False),
    ("ours-bf16", "diffusers-bf16", False),
    ("ours-bf16", "diffusers-fp32", False),
    ("diffusers-bf16", "diffusers-fp32", False),
]


def velocities(case_dir, case):
    """The FP8 path's per-step velocity against fp32 (where the floor run has the step) and against ours bf16."""
    fp8_path = os.path.join(case_dir, "ours-fp8_steps.safetensors")
    bf16_path = os.path.join(case_dir, "ours_steps.safetensors")
    if not (os.path.exists(fp8_path) and os.path.exists(bf16_path)):
        return None
    fp8, bf16 = load_tensors(fp8_path), load_tensors(bf16_path)
    fp32_path = os.path.join(case_dir, "fp32.safetensors")
    fp32 = load_tensors(fp32_path) if os.path.exists(fp32_path) else {}
    floors = {f["step"]: f["velocity_rel_l2"] for f in case.get("floor", [])}
    rows = []
    for i in range(case["steps"]):
        key = f"velocity.{i}"
        if key not in fp8 or key not in bf16:
            raise InputError(f"{case_dir}: {key} missing in a step dump")
        row = dict(step=i, fp8_vs_bf16_rel_l2=rel_l2(fp8[key], bf16[key]),
                   fp8_vs_bf16_cosine=cosine(fp8[key], bf16[key]))
        if key in fp32:
            row.update(fp8_vs_fp32_rel_l2=rel_l2(fp8[key], fp32[key]), fp8_vs_fp32_cosine=cosine(fp8[key], fp32[key]),
                       bf16_vs_fp32_rel_l2=rel_l2(bf16[key], fp32[key]), floor=floors.get(i))
            if row["floor"]:
                row["fp8_ratio_to_floor"] = row["fp8_vs_fp32_rel_l2"] / row["floor"]
                row["bf16_ratio_to_floor"] = row["bf16_vs_fp32_rel_l2"] / row["floor"]
        rows.append(row)
    last = case["steps"] - 1
    final = {}
    if f"latents.{last}" in fp8 and f"latents.{last}" in bf16:
        final["fp8_vs_bf16_final_latents_rel_l2"] = rel_l2(fp8[f"latents.{last}"], bf16[f"latents.{last}"])
    return dict(steps=rows, **final)


def run_dir(root, size, step_counts):
    ref_path = os.path.join(root, "reference.json")
    reference = {}
    if os.path.exists(ref_path):
        with open(ref_path) as f:
            reference = json.load(f)
    cases, missing = [], []
    for steps in step_counts:
        name = f"{size}/steps{steps}"
        case_dir = os.path.join(root, size, f"steps{steps}")
        ref_case = next((c for c in reference.get("cases", []) if c.get("name") == name), None)
        result = dict(case=name, pairs=[], skipped=[])
        for a, b, required in PAIRS:
            for kind, index in (("png", 0), ("float", 1)):
                spec_a = os.path.join(case_dir, SOURCES[a][index])
                spec_b = os.path.join(case_dir, SOURCES[b][index])
                absent = [p for p in (spec_a.split("#")[0], spec_b.split("#")[0]) if not os.path.exists(p)]
                if absent:
                    result["skipped"].append(dict(pair=f"{a} vs {b}", kind=kind, missing=absent))
                    if required:
                        missing.append(f"{name}: {a} vs {b} ({kind}): {', '.join(absent)} missing")
                    continue
                r = compare(f"{a} vs {b}", spec_a, spec_b)
                print(f"{name}: {a} vs {b} ({kind}): PSNR {r['psnr_db']:.2f} dB, SSIM {r['ssim']:.5f}", flush=True)
                result["pairs"].append(r)
        if ref_case is not None:
            v = velocities(case_dir, ref_case)
            if v is not None:
                result["velocity"] = v
        cases.append(result)
    return dict(dir=root, size=size, cases=cases, missing=missing)


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def markdown(summary):
    lines = []
    for case in summary["cases"]:
        lines += ["", f"## {case['case']}", "", "| pair | PNG PSNR dB | PNG SSIM | float PSNR dB | float SSIM |",
                  "| --- | --- | --- | --- | --- |"]
        by_pair = {}
        for r in case["pairs"]:
            by_pair.setdefault(r["pair"], {})[r["kind"]] = r
        for pair, kinds in by_pair.items():
            png, flt = kinds.get("png", {}), kinds.get("float", {})
            lines.append(f"| {pair} | {fmt(png.get('psnr_db'), '.2f')} | {fmt(png.get('ssim'), '.5f')} "
                         f"| {fmt(flt.get('psnr_db'), '.2f')} | {fmt(flt.get('ssim'), '.5f')} |")
        absent = sorted({m for s in case["skipped"] for m in s["missing"]})
        if absent:
            lines.append(f"- pairs skipped, missing: {', '.join(absent)}")
        v = case.get("velocity")
        if v:
            lines += ["", "| step | FP8 vs fp32 rel L2 | ours bf16 vs fp32 | floor | FP8 / floor | ours bf16 / floor "
                          "| FP8 vs ours bf16 |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for row in v["steps"]:
                if "fp8_vs_fp32_rel_l2" not in row:
                    continue
                lines.append(f"| {row['step']} | {row['fp8_vs_fp32_rel_l2']:.4g} | {row['bf16_vs_fp32_rel_l2']:.4g} "
                             f"| {fmt(row.get('floor'), '.4g')} | {fmt(row.get('fp8_ratio_to_floor'), '.3f')} "
                             f"| {fmt(row.get('bf16_ratio_to_floor'), '.3f')} | {row['fp8_vs_bf16_rel_l2']:.4g} |")
            every = [row["fp8_vs_bf16_rel_l2"] for row in v["steps"]]
            lines.append(f"\nFP8 vs ours bf16 velocity rel L2 over all {len(every)} steps: min {min(every):.4g}, "
                         f"median {float(np.median(every)):.4g}, max {max(every):.4g}"
                         + (f"; final latents rel L2 {v['fp8_vs_bf16_final_latents_rel_l2']:.4g}"
                            if "fp8_vs_bf16_final_latents_rel_l2" in v else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Self-test (CPU, seconds)
# ---------------------------------------------------------------------------------------------------------------

def ssim_brute(x, y, data_range):
    """SSIM by the definition, one window at a time (slow; for checking ssim_channel on small images)."""
    g = gaussian_window()
    w2 = np.outer(g, g)
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    values = []
    for i in range(x.shape[0] - WINDOW + 1):
        for j in range(x.shape[1] - WINDOW + 1):
            px, py = x[i:i + WINDOW, j:j + WINDOW], y[i:i + WINDOW, j:j + WINDOW]
            mx, my = (w2 * px).sum(), (w2 * py).sum()
            vx, vy = (w2 * (px - mx) ** 2).sum(), (w2 * (py - my) ** 2).sum()
            cxy = (w2 * (px - mx) * (py - my)).sum()
            values.append((2 * mx * my + c1) * (2 * cxy + c2) / ((mx * mx + my * my + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def selftest():
    import tempfile

    failures = []

    def check(name, ok, detail):
        print(f"selftest: {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    rng = np.random.default_rng(0)
    g = gaussian_window()
    check("window", abs(g.sum() - 1.0) < 1e-12 and len(g) == 11 and abs(g[5] - g.max()) == 0.0,
          f"sum {g.sum():.15f}, centre {g[5]:.6f}")
    # A smooth image with texture, 8-bit range.
    yy, xx = np.mgrid[0:64, 0:80]
    base = np.stack([127 + 60 * np.sin(xx / 5.0 + c) * np.cos(yy / 7.0) for c in range(3)], axis=2)
    base = np.clip(base + rng.normal(0, 8, base.shape), 0, 255)
    s, _ = ssim(base, base, 255.0)
    check("identical -> 1", abs(s - 1.0) < 1e-12, f"{s!r}")
    check("identical -> PSNR inf", psnr(base, base, 255.0) == math.inf, "inf")
    last = 1.0
    for sigma in (2.0, 8.0, 32.0):
        noisy = np.clip(base + rng.normal(0, sigma, base.shape), 0, 255)
        s, _ = ssim(base, noisy, 255.0)
        check(f"noise sigma {sigma} lowers it", s < last and s < 1.0, f"{s:.5f} (< {last:.5f})")
        last = s
    noisy = np.clip(base + rng.normal(0, 8.0, base.shape), 0, 255)
    sa, _ = ssim(base, noisy, 255.0)
    sb, _ = ssim(noisy, base, 255.0)
    check("symmetric", abs(sa - sb) < 1e-12, f"{sa:.12f} vs {sb:.12f}")
    # Constant images: variances and covariance vanish, so SSIM is the luminance term alone, everywhere.
    a, b, c1 = 100.0, 140.0, (K1 * 255.0) ** 2
    expected = (2 * a * b + c1) / (a * a + b * b + c1)
    s, _ = ssim(np.full((16, 16, 3), a), np.full((16, 16, 3), b), 255.0)
    check("constant images: luminance term", abs(s - expected) < 1e-12, f"{s:.12f} vs {expected:.12f}")
    # A brightness offset on a textured image: the same value from the definition, window by window.
    x = base[:20, :24, 0]
    y = np.clip(x * 0.9 + 12 + rng.normal(0, 5, x.shape), 0, 255)
    fast, brute = ssim_channel(x, y, 255.0), ssim_brute(x, y, 255.0)
    check("separable filter = definition (20x24)", abs(fast - brute) < 1e-10, f"{fast:.12f} vs {brute:.12f}")
    # A fixed case made from integer patterns (no random numbers), against the value scikit-image 0.26's
    # structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255) gives.
    i, j = np.mgrid[0:24, 0:32].astype(np.float64)
    x = np.stack([(i * 37 + j * 11 + c * 50) % 256 for c in range(3)], axis=2)
    y = np.clip(x * 0.75 + 30 + ((i * 5 + j * 3) % 9)[..., None], 0, 255)
    s, _ = ssim(x, y, 255.0)
    check("fixed case against scikit-image", abs(s - 0.95818272888265) < 1e-12, f"{s:.14f} vs 0.95818272888265")
    # Inverting the texture gives a negative structure term.
    s, _ = ssim(base, 255.0 - base, 255.0)
    check("inverted image -> SSIM < 0", s < 0.0, f"{s:.5f}")
    # PSNR of a known MSE: every value off by 1 on 255 -> 20 log10(255) = 48.13 dB.
    p = psnr(base, base + 1.0, 255.0)
    check("PSNR of a uniform offset of 1", abs(p - 20 * math.log10(255.0)) < 1e-9, f"{p:.4f} dB")
    # Float images through the file readers: a PNG pair and a safetensors pair in [-1, 1] and [0, 1].
    try:
        from PIL import Image
        from safetensors.numpy import save_file
    except ImportError as exc:
        check("file readers", False, f"PIL or safetensors missing: {exc}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            u8 = base.round().astype(np.uint8)
            u8n = noisy.round().astype(np.uint8)
            alpha = np.full(u8.shape[:2] + (1,), 255, np.uint8)
            Image.fromarray(np.concatenate([u8, alpha], axis=2), "RGBA").save(os.path.join(tmp, "a.png"))
            Image.fromarray(u8n, "RGB").save(os.path.join(tmp, "b.png"))
            r = compare("png", os.path.join(tmp, "a.png"), os.path.join(tmp, "b.png"))
            s, _ = ssim(u8.astype(float), u8n.astype(float), 255.0)
            check("PNG reader (RGBA vs RGB)", abs(r["ssim"] - s) < 1e-12, f"SSIM {r['ssim']:.5f}")
            chw = (base / 255.0).transpose(2, 0, 1)[None].astype(np.float32)
            chw4 = np.concatenate([chw, np.ones_like(chw[:, :1])], axis=1)
            save_file({"image": chw4 * 2 - 1}, os.path.join(tmp, "ours.safetensors"))
            save_file({"image": chw4}, os.path.join(tmp, "ref.safetensors"))
            r = compare("float", os.path.join(tmp, "ours.safetensors#image@pm1"),
                        os.path.join(tmp, "ref.safetensors#image@01"))
            check("float readers ([-1, 1] vs [0, 1])", r["ssim"] > 0.999999 and r["psnr_db"] > 100,
                  f"SSIM {r['ssim']:.8f}, PSNR {r['psnr_db']:.1f} dB")
            try:
                compare("mixed", os.path.join(tmp, "a.png"), os.path.join(tmp, "ref.safetensors#image@01"))
                check("8-bit against float refused", False, "accepted")
            except InputError as exc:
                check("8-bit against float refused", True, str(exc)[:80])
    if failures:
        print(f"selftest FAILED: {failures}", flush=True)
        return 1
    print("selftest passed", flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="the --out folder of qwen_pipeline_reference.py")
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--steps", default="8,40", help="step counts of the cases (default 8,40)")
    ap.add_argument("--pair", nargs=3, action="append", default=[], metavar=("LABEL", "A", "B"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--selftest", action="store_true", help="check SSIM and PSNR on synthetic images (CPU)")
    args = ap.parse_args()
    if args.selftest:
        return selftest()
    if not args.dir and not args.pair:
        ap.error("give --dir, --pair or --selftest")
    summary = dict(method=dict(ssim=f"Gaussian {WINDOW}x{WINDOW}, sigma {SIGMA}, K1 {K1}, K2 {K2}, valid "
                                    "window positions, per RGB channel then averaged; L = 255 (PNG) or 1 (float)",
                               psnr="over RGB, peak 255 (PNG) or 1 (float)"), cases=[], pairs=[], missing=[])
    rc = 0
    try:
        if args.dir:
            try:
                steps = [int(v) for v in args.steps.split(",")]
            except ValueError:
                ap.error(f"--steps: a comma-separated list of integers, got {args.steps!r}")
            found = run_dir(args.dir, args.size, steps)
            summary.update(dir=found["dir"], size=found["size"], cases=found["cases"], missing=found["missing"])
        for label, a, b in args.pair:
            r = compare(label, a, b)
            print(f"{label} ({r['kind']}): PSNR {r['psnr_db']:.2f} dB, SSIM {r['ssim']:.5f}", flush=True)
            summary["pairs"].append(r)
    except InputError as exc:
        summary["error"] = str(exc)
        print(f"image_quality: {exc}", flush=True)
        rc = 2
    if summary["missing"]:
        print("image_quality: pairs the issue asks for could not be made:\n  " + "\n  ".join(summary["missing"]),
              flush=True)
        rc = 2
    print(markdown(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
