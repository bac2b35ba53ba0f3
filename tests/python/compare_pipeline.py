#!/usr/bin/env python3
"""Judges `tf image` against the diffusers pipeline reference of qwen_pipeline_reference.py.

For every case of DIR/reference.json (a size and a step count, folder DIR/WxH/stepsN) it reads our outputs:

  ours.json               the `tf image --json` summary (timings per phase, peak device memory, load time)
  ours_steps.safetensors  what `tf image --dump-steps FILE` writes: velocity.{i} per step, optionally latents.{i}
                          and image (the decoded image before the u8 conversion, in [-1, 1])
  ours.png                the image `tf image -o` writes

(the formats are in docs/gpu-runs/README.md) and prints a markdown report: per-step velocity rel L2 and cosine
against the fp32 reference and the ratio to the floor (the bf16 reference's own rel L2 against fp32), against the
bf16 reference on every step, the final image PSNR, the wall time per phase and end to end, ours and the
reference's, and peak device memory.

Criterion (exit 1 when any fails): on every step with an fp32 reference, ours / floor <= --max-ratio (1.5); ours
faster end to end and in every phase (encode, step 0, the mean cached step, decode); our peak device memory no higher than the reference's (--memory-baseline: torch's reserved
bytes by default, the memory torch holds from the driver, as ours does; `allocated` is stricter). Exit 2 when an
input is missing or malformed.

Usage:
    python3 tests/python/compare_pipeline.py --dir /tmp/qwen21p [--json OUT.json]
    python3 tests/python/compare_pipeline.py --dir /tmp/qwen21p-tiny --selftest   # fake "ours" from the reference
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class InputError(Exception):
    """A missing or malformed input: the comparison cannot be made (exit 2)."""


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def psnr(a, b, peak):
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)


# ---------------------------------------------------------------------------------------------------------------
# Reading our outputs
# ---------------------------------------------------------------------------------------------------------------

def read_summary(path):
    """The `tf image --json` object: the whole file, or else its last line that parses as a JSON object."""
    if not os.path.exists(path):
        raise InputError(f"{path} is missing (did `tf image --json` run? see its .log beside it)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        value = json.loads(text)
        if isinstance(value, dict):
            return value
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise InputError(f"{path}: no JSON object in it ({len(text)} bytes)")


def lookup(obj, *paths):
    """The first of the dotted `paths` present in `obj` (the documented name first, then accepted aliases)."""
    for path in paths:
        node = obj
        for key in path.split("."):
            if isinstance(node, dict) and key in node:
                node = node[key]
            else:
                node = None
                break
        if node is not None:
            return node
    return None


def seconds_to_ms(value):
    if value is None:
        return None
    if isinstance(value, list):
        return [v * 1000.0 for v in value]
    return value * 1000.0


def our_timings(summary, path):
    t = lookup(summary, "timings_ms", "timings") or {}
    encode = lookup(t, "encode", "encode_ms")
    steps = lookup(t, "steps", "steps_ms", "step_ms")
    decode = lookup(t, "decode", "decode_ms")
    total = lookup(t, "total", "total_ms", "end_to_end", "end_to_end_ms")
    load = lookup(t, "load", "load_ms")
    if load is None:
        load = lookup(summary, "load_ms")
    # The same spans in seconds (`timings.encode_s`..., `load.seconds`), as `tf image --json` first printed them.
    encode = encode if encode is not None else seconds_to_ms(lookup(t, "encode_s"))
    steps = steps if steps is not None else seconds_to_ms(lookup(t, "steps_s"))
    decode = decode if decode is not None else seconds_to_ms(lookup(t, "decode_s"))
    total = total if total is not None else seconds_to_ms(lookup(t, "total_s"))
    load = load if load is not None else seconds_to_ms(lookup(summary, "load.seconds", "load_s"))
    missing = [name for name, v in (("encode", encode), ("steps", steps), ("decode", decode), ("total", total))
               if v is None]
    if missing:
        raise InputError(f"{path}: timings_ms lacks {', '.join(missing)} (have: {sorted(t) if t else 'nothing'})")
    if not isinstance(steps, list) or not steps:
        raise InputError(f"{path}: timings_ms.steps must be a non-empty list of per-step milliseconds")
    return dict(encode=float(encode), steps=[float(v) for v in steps], decode=float(decode), total=float(total),
                load=None if load is None else float(load))


def our_peak(summary):
    value = lookup(summary, "peak_device_bytes", "memory.peak_device_bytes", "peak_bytes", "memory.peak_bytes",
                   "load.peak_device_bytes")
    return None if value is None else int(value)


def read_png(path):
    from PIL import Image

    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert(image.mode if image.mode in ("RGB", "RGBA") else "RGBA")))


# ---------------------------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------------------------

def compare_case(root, case, max_ratio, memory_baseline):
    name = case["name"]
    case_dir = os.path.join(root, name)
    steps = case["steps"]
    result = dict(name=name, steps=steps, checks=[], notes=[])

    ref = load_file(os.path.join(case_dir, "reference.safetensors"))
    fp32_path = os.path.join(case_dir, "fp32.safetensors")
    fp32 = load_file(fp32_path) if os.path.exists(fp32_path) else {}
    floors = {f["step"]: f["velocity_rel_l2"] for f in case.get("floor", [])}

    dump_path = os.path.join(case_dir, "ours_steps.safetensors")
    if not os.path.exists(dump_path):
        raise InputError(f"{dump_path} is missing (run `tf image ... --dump-steps {dump_path}`)")
    ours = load_file(dump_path)
    summary_path = os.path.join(case_dir, "ours.json")
    summary = read_summary(summary_path)

    # Velocities, per step.
    rows = []
    for i in range(steps):
        key = f"velocity.{i}"
        if key not in ours:
            raise InputError(f"{dump_path}: {key} missing (have {len(ours)} tensors; {steps} steps expected)")
        v = ours[key].float()
        v16 = ref[key].float()
        if v.shape != v16.shape:
            raise InputError(f"{dump_path}: {key} has shape {list(v.shape)}, the reference {list(v16.shape)}")
        if not torch.isfinite(v).all():
            raise InputError(f"{dump_path}: {key} has non-finite values")
        row = dict(step=i, vs_bf16_rel_l2=rel_l2(v, v16), vs_bf16_cosine=cosine(v, v16))
        if key in fp32 and i in floors:
            v32 = fp32[key].float()
            row.update(vs_fp32_rel_l2=rel_l2(v, v32), vs_fp32_cosine=cosine(v, v32), floor=floors[i])
            row["ratio"] = row["vs_fp32_rel_l2"] / floors[i] if floors[i] > 0 else math.inf
            row["pass"] = row["ratio"] <= max_ratio
            result["checks"].append(dict(check=f"step {i} velocity ratio {row['ratio']:.3f} <= {max_ratio}",
                                         passed=row["pass"]))
        lkey = f"latents.{i}"
        if lkey in ours and lkey in ref:
            row["latents_vs_bf16_rel_l2"] = rel_l2(ours[lkey].float(), ref[lkey].float())
        rows.append(row)
    if not any("ratio" in r for r in rows):
        result["notes"].append("no fp32 reference step: the velocity criterion could not be judged")
        result["checks"].append(dict(check="fp32 floor available", passed=False))
    result["velocity"] = rows

    # Final image.
    image = {}
    png_path = os.path.join(case_dir, "ours.png")
    if os.path.exists(png_path):
        a, b = read_png(png_path), read_png(os.path.join(case_dir, "reference.png"))
        if a.shape[:2] != b.shape[:2]:
            raise InputError(f"{png_path}: {list(a.shape)} pixels, the reference {list(b.shape)}")
        channels = min(a.shape[2], b.shape[2])
        image["png_psnr_db"] = psnr(a[..., :channels].float(), b[..., :channels].float(), 255.0)
        image["png_channels"] = channels
    else:
        result["notes"].append(f"{png_path} missing: no PNG PSNR")
    if "image" in ours:
        ours01 = (ours["image"].float().clamp(-1, 1) + 1) / 2
        if ours01.shape == ref["image"].shape:
            image["float_psnr_db"] = psnr(ours01, ref["image"].float(), 1.0)
        else:
            result["notes"].append(f"dumped image shape {list(ours01.shape)} != reference {list(ref['image'].shape)}")
    result["image"] = image

    # Times.
    t = our_timings(summary, summary_path)
    r = case["timings"]
    if len(t["steps"]) != steps:
        raise InputError(f"{summary_path}: {len(t['steps'])} step times for {steps} steps")
    phases = [
        ("encode", r["encode_ms"], t["encode"]),
        ("step 0 (full, KV extract)", r["steps_ms"][0], t["steps"][0]),
    ]
    if steps > 1:
        phases.append(("steps 1.. mean (cached)", sum(r["steps_ms"][1:]) / (steps - 1),
                       sum(t["steps"][1:]) / (steps - 1)))
    phases += [
        ("all steps", sum(r["steps_ms"]), sum(t["steps"])),
        ("decode", r["decode_ms"], t["decode"]),
        ("end to end", r["total_ms"], t["total"]),
    ]
    result["timings"] = [dict(phase=p, reference_ms=a, ours_ms=b, speedup=a / b if b > 0 else math.inf)
                         for p, a, b in phases]
    result["steps_ms"] = dict(reference=r["steps_ms"], ours=t["steps"])
    result["ours_load_ms"] = t["load"]
    faster = t["total"] < r["total_ms"]
    result["checks"].append(dict(check=f"end to end {t['total']:.1f} ms < reference {r['total_ms']:.1f} ms",
                                 passed=faster))
    # Every phase too: a fresh process must not lose a phase that the end-to-end figure hides.
    for phase, ref_ms, ours_ms in phases:
        if phase in ("all steps", "end to end"):
            continue
        result["checks"].append(dict(check=f"{phase} {ours_ms:.1f} ms < reference {ref_ms:.1f} ms",
                                     passed=ours_ms < ref_ms))

    # Memory.
    peak = our_peak(summary)
    ref_peak = case.get("memory", {}).get(f"peak_{memory_baseline}_bytes")
    result["memory"] = dict(ours_peak_bytes=peak, reference=case.get("memory", {}), baseline=memory_baseline)
    if peak is None:
        raise InputError(f"{summary_path}: peak_device_bytes missing")
    if ref_peak is None:
        result["notes"].append("the reference has no device memory figures (CPU run): memory not judged")
    else:
        result["checks"].append(dict(
            check=f"peak memory {peak / 2**30:.2f} GiB <= reference {memory_baseline} {ref_peak / 2**30:.2f} GiB",
            passed=peak <= ref_peak))
    result["passed"] = all(c["passed"] for c in result["checks"])
    return result


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

def fmt(value, spec=".4g"):
    return "-" if value is None else format(value, spec)


def markdown(reference, results, reference_load_s):
    lines = [f"# Qwen-Image 2.1 pipeline: tf image vs diffusers {reference['versions']['diffusers']} "
             f"({reference['device']}, {reference['dtype']})", ""]
    for res in results:
        lines += [f"## {res['name']}: {'PASS' if res['passed'] else 'FAIL'}", ""]
        lines += ["| step | ours vs fp32 rel L2 | floor (bf16 ref vs fp32) | ratio | cosine vs fp32 "
                  "| ours vs bf16 ref rel L2 | cosine vs bf16 ref |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in res["velocity"]:
            lines.append(f"| {row['step']} | {fmt(row.get('vs_fp32_rel_l2'))} | {fmt(row.get('floor'))} "
                         f"| {fmt(row.get('ratio'), '.3f')} | {fmt(row.get('vs_fp32_cosine'), '.6f')} "
                         f"| {fmt(row['vs_bf16_rel_l2'])} | {fmt(row['vs_bf16_cosine'], '.6f')} |")
        lines += ["", "| phase | reference ms | ours ms | speedup |", "| --- | --- | --- | --- |"]
        for row in res["timings"]:
            lines.append(f"| {row['phase']} | {row['reference_ms']:.1f} | {row['ours_ms']:.1f} "
                         f"| {row['speedup']:.2f}x |")
        if res["ours_load_ms"] is not None or reference_load_s is not None:
            ref_load = "-" if reference_load_s is None else f"{reference_load_s * 1000:.0f}"
            ours_load = "-" if res["ours_load_ms"] is None else f"{res['ours_load_ms']:.0f}"
            lines.append(f"| load (page cache) | {ref_load} | {ours_load} | |")
        mem = res["memory"]
        ref_mem = mem["reference"]
        gib = lambda v: "-" if v is None else f"{v / 2**30:.2f} GiB"  # noqa: E731
        lines += ["", f"Peak device memory: ours {gib(mem['ours_peak_bytes'])}; reference allocated "
                      f"{gib(ref_mem.get('peak_allocated_bytes'))}, reserved {gib(ref_mem.get('peak_reserved_bytes'))}"
                      f" (criterion against {mem['baseline']})."]
        image = res["image"]
        lines.append(f"Final image PSNR: PNG {fmt(image.get('png_psnr_db'), '.2f')} dB, float "
                     f"{fmt(image.get('float_psnr_db'), '.2f')} dB.")
        lines += ["", "Checks:"] + [f"- {'ok  ' if c['passed'] else 'FAIL'} {c['check']}" for c in res["checks"]]
        lines += [f"- note: {n}" for n in res["notes"]] + [""]
    return "\n".join(lines)


def run(root, max_ratio, memory_baseline, cases_filter=None):
    ref_path = os.path.join(root, "reference.json")
    if not os.path.exists(ref_path):
        raise InputError(f"{ref_path} missing: run qwen_pipeline_reference.py --out {root} first")
    with open(ref_path) as f:
        reference = json.load(f)
    cases = [c for c in reference["cases"] if not cases_filter or c["name"] in cases_filter]
    if not cases:
        raise InputError(f"no case of {ref_path} selected (have {[c['name'] for c in reference['cases']]})")
    results = [compare_case(root, case, max_ratio, memory_baseline) for case in cases]
    return reference, results


# ---------------------------------------------------------------------------------------------------------------
# Self-test: fake "ours" from the reference itself
# ---------------------------------------------------------------------------------------------------------------

def make_fake_ours(root, error_vs_floor, time_factor, memory_factor, seed=0, seconds_format=False):
    """Writes ours.* into every case folder: velocities = fp32 (bf16 where no fp32) plus noise sized to
    error_vs_floor x floor, times = reference x time_factor, peak = reference reserved x memory_factor."""
    with open(os.path.join(root, "reference.json")) as f:
        reference = json.load(f)
    g = torch.Generator().manual_seed(seed)
    for case in reference["cases"]:
        case_dir = os.path.join(root, case["name"])
        ref = load_file(os.path.join(case_dir, "reference.safetensors"))
        fp32_path = os.path.join(case_dir, "fp32.safetensors")
        fp32 = load_file(fp32_path) if os.path.exists(fp32_path) else {}
        floors = {f["step"]: f["velocity_rel_l2"] for f in case.get("floor", [])}
        tensors = {}
        for i in range(case["steps"]):
            base = fp32.get(f"velocity.{i}", ref[f"velocity.{i}"]).float()
            target = error_vs_floor * floors.get(i, 0.01)
            noise = torch.randn(base.shape, generator=g)
            tensors[f"velocity.{i}"] = base + noise * (target * base.norm() / noise.norm())
            tensors[f"latents.{i}"] = ref[f"latents.{i}"].float()
        image01 = ref["image"].float()
        tensors["image"] = (image01 + 0.01 * torch.randn(image01.shape, generator=g)).clamp(0, 1) * 2 - 1
        save_file(tensors, os.path.join(case_dir, "ours_steps.safetensors"))
        shutil.copyfile(os.path.join(case_dir, "reference.png"), os.path.join(case_dir, "ours.png"))
        t = case["timings"]
        # time_factor scales every phase, or names the one phase made 1.2x slower (the rest 0.7x).
        fast = 0.7 if time_factor == "decode" else time_factor
        decode_factor = 1.2 if time_factor == "decode" else time_factor
        peak = case.get("memory", {}).get("peak_reserved_bytes")
        summary = dict(width=case["width"], height=case["height"], steps=case["steps"],
                       timings_ms=dict(load=1000.0, encode=t["encode_ms"] * fast,
                                       steps=[v * fast for v in t["steps_ms"]],
                                       decode=t["decode_ms"] * decode_factor, total=t["total_ms"] * fast),
                       peak_device_bytes=int((peak if peak is not None else 2**30) * memory_factor))
        if seconds_format:
            ms = summary.pop("timings_ms")
            summary["timings"] = dict(encode_s=ms["encode"] / 1000, steps_s=[v / 1000 for v in ms["steps"]],
                                      decode_s=ms["decode"] / 1000, total_s=ms["total"] / 1000)
            summary["load"] = dict(seconds=ms["load"] / 1000, resident_bytes=1)
        with open(os.path.join(case_dir, "ours.json"), "w") as f:
            f.write("progress lines may precede the summary\n" + json.dumps(summary) + "\n")


def selftest(root, max_ratio):
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        fake = os.path.join(tmp, "run")
        os.makedirs(fake)
        shutil.copyfile(os.path.join(root, "reference.json"), os.path.join(fake, "reference.json"))
        with open(os.path.join(root, "reference.json")) as f:
            reference = json.load(f)
        for case in reference["cases"]:
            os.makedirs(os.path.join(fake, case["name"]))
            for name in ("reference.safetensors", "fp32.safetensors", "reference.png"):
                src = os.path.join(root, case["name"], name)
                if os.path.exists(src):
                    shutil.copyfile(src, os.path.join(fake, case["name"], name))
        for label, error, time_factor, memory_factor, expect, seconds_format in (
            ("within the floor, faster, less memory", 0.8, 0.7, 0.9, True, False),
            ("the same, timings in seconds", 0.8, 0.7, 0.9, True, True),
            ("velocity error 3x the floor", 3.0, 0.7, 0.9, False, False),
            ("slower end to end", 0.8, 1.2, 0.9, False, False),
            ("slower end to end, timings in seconds", 0.8, 1.2, 0.9, False, True),
            ("one phase slower", 0.8, "decode", 0.9, False, False),
            ("more peak memory", 0.8, 0.7, 1.1, False, False),
        ):
            make_fake_ours(fake, error, time_factor, memory_factor, seconds_format=seconds_format)
            _, results = run(fake, max_ratio, "reserved")
            passed = all(r["passed"] for r in results)
            # On a CPU reference there is no memory figure, so the memory case cannot fail there.
            cpu = all("peak_reserved_bytes" not in c.get("memory", {}) for c in reference["cases"])
            if label == "more peak memory" and cpu:
                expect = True
            ratios = [row["ratio"] for r in results for row in r["velocity"] if "ratio" in row]
            print(f"selftest: {label}: {'pass' if passed else 'fail'} (expected {'pass' if expect else 'fail'}); "
                  f"velocity ratios {', '.join(f'{x:.3f}' for x in ratios)}", flush=True)
            if passed != expect:
                failures.append(label)
        print(markdown(reference, results, reference.get("reference_load_s")), flush=True)
        os.remove(os.path.join(fake, reference["cases"][0]["name"], "ours_steps.safetensors"))
        try:
            run(fake, max_ratio, "reserved")
            failures.append("a missing dump was not reported")
        except InputError as exc:
            print(f"selftest: missing dump reported: {exc}", flush=True)
    if failures:
        print(f"selftest FAILED: {failures}", flush=True)
        return 1
    print("selftest passed", flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="the --out folder of qwen_pipeline_reference.py")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all), e.g. 1024x1024/steps8")
    ap.add_argument("--max-ratio", type=float, default=1.5)
    ap.add_argument("--memory-baseline", choices=["reserved", "allocated"], default="reserved")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--selftest", action="store_true",
                    help="check this script on fake outputs made from the reference (a copy; --dir is not modified)")
    args = ap.parse_args()
    if args.selftest:
        return selftest(args.dir, args.max_ratio)
    try:
        reference, results = run(args.dir, args.max_ratio, args.memory_baseline,
                                 args.cases.split(",") if args.cases else None)
    except InputError as exc:
        print(f"compare_pipeline: {exc}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(passed=False, error=str(exc)), f, indent=1)
        return 2
    print(markdown(reference, results, reference.get("reference_load_s")), flush=True)
    passed = all(r["passed"] for r in results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(passed=passed, reference_load_s=reference.get("reference_load_s"), cases=results), f,
                      indent=1)
    print("PASS" if passed else "FAIL", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
