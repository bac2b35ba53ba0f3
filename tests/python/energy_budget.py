#!/usr/bin/env python3
"""Splits a DiT step's measured joules into its GEMMs and everything else, against the joules its goal allows.

Usage: energy_budget.py --step STEP.json [--gemms GEMM_ENERGY.json] [--energy-key KEY] [--sm-count N]
                        [--compute-capability M.m] [--json OUT.json]

STEP.json is `tf bench h3-dit --json` or `tf bench qwen-dit --json` (its phases and its energy line: the graph step
for MiniMax H3, the cached step for Qwen-Image). GEMM_ENERGY.json is `tf bench int8-gemm --energy --json` (INT8) or
`tf bench int8-gemm --bf16 --energy --json` (bf16), run on the same kind of board: joules a call of each DiT block
GEMM, sustained for about a second. KEY picks which GEMM's energy stands for the step's: by default `cublaslt_energy`
for a bf16 step (cuBLASLt is the bf16 default) and `ours_energy` for an 8-bit step (our INT8 GEMM is the default).

At a power cap a step's time is its joules over the limit, so a goal in milliseconds is a budget in joules: the goal
times the limit. The GEMMs' share of it is what their block calls spend at their own sustained rate; the rest
(attention, the norms and elementwise passes) may spend what is left. Prints both, and the factor by which the rest
would have to shrink with the GEMMs as they are.

It also gives the clock bound: the step's MMA work (every phase's FLOPs) at the tensor cores' dense rate (bf16, or
8-bit for the block GEMM groups an `fp8:...,ends=0` precision names) at the SM clock the power cap held during the
measurement (the median NVML sampled). No step at that clock can be faster than that; what a goal leaves above it
is all the time the passes and every MMA's shortfall from the full rate may take. The SM count and compute capability come from the step JSON's `device` (benches from this build on)
or from --sm-count and --compute-capability. Without --gemms it gives the clock bound alone. Exit 0 on a report, 2
on bad input.
"""

import argparse
import json
import sys

# Block GEMM phases (as the benches name them): the GEMM group each belongs to (which an `fp8:...` precision names)
# and the `tf bench int8-gemm` shape that measures it.
BLOCK_GEMM_PHASES = {
    "h3": {
        "qkv GEMM": ("qkv", "h3_qkv"),
        "qkv GEMM + QK norm + RoPE": ("qkv", "h3_qkv"),
        "out GEMM": ("out", "h3_out"),
        "fc1 GEMM": ("mlp_in", "h3_fc1"),
        "fc2 GEMM": ("mlp_out", "h3_fc2"),
    },
    "qwen": {
        "qkv GEMM": ("qkv", "qwen_step_qkv"),
        "qkv GEMM+qk-norm+rope": ("qkv", "qwen_step_qkv"),
        "out GEMM": ("out", "qwen_step_out"),
        "gate_up GEMM": ("mlp_in", "qwen_step_mlp_in"),
        "down GEMM": ("mlp_out", "qwen_step_mlp_out"),
    },
}
# Dense tensor-core FLOPs a clock cycle an SM, by compute capability and operand type: sm_90's bf16 rate is the
# 989.4 TFLOP/s of an H100 SXM (132 SMs at 1830 MHz) over its SMs and clock; e4m3 and INT8 run at twice that.
DENSE_FLOPS_PER_CLOCK_PER_SM = {(9, 0): {"bf16": 4096, "8bit": 8192}}


class BadInput(Exception):
    pass


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: {exc}") from exc
    if not isinstance(value, dict):
        raise BadInput(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise BadInput(f"{what}: expected a number, found {value!r}")
    return float(value)


def step_parts(step, path):
    """(model, phases, energy) of a bench JSON: H3's graph step or Qwen-Image's cached step."""
    if "energy_graph_step" in step:
        model, energy = "h3", step["energy_graph_step"]
        phases = (step.get("phases") or {}).get("phases")
    elif "energy_cached_step" in step:
        model, energy = "qwen", step["energy_cached_step"]
        phases = ((step.get("phases") or {}).get("cached") or {}).get("phases")
    else:
        raise BadInput(f"{path}: no energy line (energy_graph_step or energy_cached_step): run the bench on a board "
                       "whose energy NVML reads")
    if not isinstance(energy, dict) or "error" in energy:
        why = energy.get("error") if isinstance(energy, dict) else energy
        raise BadInput(f"{path}: the step's energy was not measured ({why})")
    if not isinstance(phases, list) or not phases:
        raise BadInput(f"{path}: no phases: run the bench with --phases")
    for i, phase in enumerate(phases):
        if not isinstance(phase, dict):
            raise BadInput(f"{path}: phase {i}: expected an object with phase, calls, ms and flops, found {phase!r}")
    return model, phases, energy


def gemm_joules(gemms, path, key):
    """Joules a call and milliseconds a call of every measured shape, for `key`'s GEMM."""
    out = {}
    for row in gemms.get("results") or []:
        energy = row.get(key) if isinstance(row, dict) else None
        if not isinstance(energy, dict) or "joules_per_call" not in energy:
            continue
        shape = row.get("shape")
        out[shape] = (number(energy["joules_per_call"], f"{path}: {shape} {key}.joules_per_call"),
                      number(energy.get("ms_per_call", 0.0), f"{path}: {shape} {key}.ms_per_call"))
    if not out:
        keys = sorted({k for row in gemms.get("results") or [] if isinstance(row, dict) for k in row
                       if k.endswith("_energy")})
        have = f"it has {', '.join(keys)}: pick one with --energy-key" if keys else "was it run with --energy?"
        raise BadInput(f"{path}: no result carries {key} with joules_per_call ({have})")
    return out


def mma_operands(model, precision):
    """phase name -> "8bit" for `model`'s phases whose every MMA runs on 8-bit operands, from a resolved precision
    (`bf16`, or `fp8:GROUPS,ends=N[,...]`), or a reason the phases' operand types cannot be told apart."""
    if precision == "bf16":
        return {}, None
    if not precision.startswith("fp8:"):
        return None, f"precision {precision!r} does not name its groups (a bench from this build writes the resolved one)"
    groups, ends, attention = set(), None, "bf16"
    for item in precision[len("fp8:"):].split(","):
        key, _, value = item.partition("=")
        if key == "ends":
            ends = value
        elif key == "attn":
            attention = value
        elif key in ("gemm", "accum"):
            continue
        else:
            groups.add(key)
    if "all" in groups:
        groups |= {"qkv", "out", "mlp_in", "mlp_out"}
    if {"mlp_value", "mlp_gate"} <= groups:
        groups.add("mlp_in")
    if ends != "0":
        return None, f"{precision}: blocks kept in bf16 at the ends share their phases with the 8-bit blocks"
    if attention != "bf16":
        return None, f"{precision}: the attention's 8-bit MMAs are not separated in its phase"
    return {phase: "8bit" for phase, (group, _) in BLOCK_GEMM_PHASES[model].items() if group in groups}, None


def clock_bound(step, step_path, model, phases, energy, sm_count=None, capability=None):
    """The step's MMA FLOPs at the dense rate at the measured median SM clock, or why it is not computed."""
    precision = str(step.get("precision_resolved", step.get("precision", "bf16")))
    eight_bit, why = mma_operands(model, precision)
    if eight_bit is None:
        return {"skipped": why}
    device = step.get("device") if isinstance(step.get("device"), dict) else {}
    if sm_count is None and "sm_count" in device:
        sm_count = int(number(device["sm_count"], f"{step_path}: device.sm_count"))
    if capability is None and isinstance(device.get("compute_capability"), list):
        cc = device["compute_capability"]
        if len(cc) != 2:
            raise BadInput(f"{step_path}: device.compute_capability: expected [major, minor], found {cc!r}")
        capability = (int(number(cc[0], f"{step_path}: compute capability")),
                      int(number(cc[1], f"{step_path}: compute capability")))
    if sm_count is None or capability is None:
        return {"skipped": f"{step_path} names no device (SM count, compute capability): pass --sm-count and "
                           "--compute-capability"}
    if sm_count <= 0:
        raise BadInput(f"SM count {sm_count}: expected a positive count")
    rates = DENSE_FLOPS_PER_CLOCK_PER_SM.get(capability)
    if rates is None:
        return {"skipped": f"no dense tensor rate known here for compute capability {capability[0]}.{capability[1]}"}
    clock = energy.get("sm_clock_median_mhz")
    if clock is None:
        return {"skipped": f"{step_path}: the energy line has no SM clock"}
    clock = number(clock, f"{step_path}: sm_clock_median_mhz")
    if clock <= 0:
        raise BadInput(f"{step_path}: sm_clock_median_mhz {clock}: expected a positive clock")
    cycles_per_ms = sm_count * clock * 1e6 / 1000.0
    mma = []
    for phase in phases:
        name = phase.get("phase")
        flops = number(phase.get("flops", 0.0), f"{step_path}: phase {name!r} flops")
        if flops <= 0:
            continue
        ms = number(phase.get("ms"), f"{step_path}: phase {name!r} ms")
        operands = eight_bit.get(name, "bf16")
        floor = flops / (rates[operands] * cycles_per_ms)
        mma.append({"phase": name, "operands": operands, "flops": flops, "step_ms": ms, "full_rate_ms": floor,
                    "share_of_full_rate": floor / ms if ms > 0 else None})
    if not mma:
        raise BadInput(f"{step_path}: no phase carries FLOPs")
    return {"sm_count": sm_count, "compute_capability": list(capability), "sm_clock_median_mhz": clock,
            "dense_tflops_at_clock": {k: v * cycles_per_ms / 1e9 for k, v in rates.items()},
            "mma_flops": sum(p["flops"] for p in mma), "bound_ms": sum(p["full_rate_ms"] for p in mma),
            "mma_phases": sorted(mma, key=lambda p: -p["step_ms"])}


def step_report(step, step_path, sm_count=None, capability=None):
    """What every report holds: the step's time, joules and draw, its goal's time, and its clock bound with the room
    the goal leaves above it; with the step's model, phases and energy line."""
    model, phases, energy = step_parts(step, step_path)
    report = {
        "model": model, "precision": str(step.get("precision", "bf16")),
        "step_ms": number(energy.get("replay_ms"), f"{step_path}: replay_ms"),
        "step_joules": number(energy.get("joules_per_step"), f"{step_path}: joules_per_step"),
        "mean_watts": number(energy.get("mean_watts"), f"{step_path}: mean_watts"),
        "limit_watts": number(energy.get("limit_watts"), f"{step_path}: limit_watts"),
        "clock_bound": clock_bound(step, step_path, model, phases, energy, sm_count, capability),
    }
    goal = energy.get("goal") if isinstance(energy.get("goal"), dict) else None
    if goal is not None:
        report["goal_ms"] = number(goal.get("goal_ms"), f"{step_path}: goal.goal_ms")
    bound = report["clock_bound"]
    if "bound_ms" in bound and "goal_ms" in report:
        bound["goal_room_ms"] = report["goal_ms"] - bound["bound_ms"]
        bound["room_now_ms"] = report["step_ms"] - bound["bound_ms"]
    return report, phases, goal


def budget(step, step_path, gemms, gemms_path, key=None, sm_count=None, capability=None):
    """The step's report, and with GEMM energy (`gemms`) its joules split into the block GEMMs and the rest."""
    report, phases, goal = step_report(step, step_path, sm_count, capability)
    if gemms is None:
        return report
    model, precision = report["model"], report["precision"]
    if key is None:
        key = "cublaslt_energy" if precision == "bf16" else "ours_energy"
    per_call = gemm_joules(gemms, gemms_path, key)
    joules, watts = report["step_joules"], report["mean_watts"]

    groups, missing, others = [], [], []
    phase_ms_total = 0.0
    for phase in phases:
        name = phase.get("phase")
        ms = number(phase.get("ms"), f"{step_path}: phase {name!r} ms")
        calls = int(number(phase.get("calls"), f"{step_path}: phase {name!r} calls"))
        phase_ms_total += ms
        group_shape = BLOCK_GEMM_PHASES[model].get(name)
        if group_shape is None:
            others.append((name, ms))
            continue
        shape = group_shape[1]
        if shape not in per_call:
            missing.append(shape)
            continue
        j_call, ms_call = per_call[shape]
        groups.append({"phase": name, "shape": shape, "calls": calls, "step_ms": ms,
                       "sustained_ms": calls * ms_call, "joules": calls * j_call})
    if missing:
        raise BadInput(f"{gemms_path}: no {key} for {', '.join(sorted(set(missing)))}")
    if not groups:
        raise BadInput(f"{step_path}: none of the block GEMM phases {sorted(BLOCK_GEMM_PHASES[model])} is there")

    gemm_j = sum(g["joules"] for g in groups)
    gemm_ms = sum(g["step_ms"] for g in groups)
    rest_j = joules - gemm_j
    rest_ms = phase_ms_total - gemm_ms
    # The rest's phases at the rest's mean draw (an estimate: the sampler cannot tell phases of a few ms apart).
    rest_watts = rest_j / rest_ms * 1000.0 if rest_ms > 0 else 0.0
    rest_phases = sorted(({"phase": name, "step_ms": ms, "joules_estimate": ms * rest_watts / 1000.0}
                          for name, ms in others), key=lambda p: -p["step_ms"])
    report.update({
        "gemm_energy_key": key,
        "gemms": groups, "gemm_joules": gemm_j, "gemm_phase_ms": gemm_ms,
        "rest_joules": rest_j, "rest_phase_ms": rest_ms, "phases_ms": phase_ms_total,
        "rest_mean_watts": rest_watts, "rest_phases": rest_phases,
    })
    # The other bound: every phase at the step's mean draw (the GEMMs in the step run a little faster than sustained
    # alone, the power limit averaging over the lighter phases between them).
    flat_gemm_j = gemm_ms * watts / 1000.0
    flat_rest_j = rest_ms * watts / 1000.0
    report["flat_gemm_joules"] = flat_gemm_j
    report["flat_rest_joules"] = flat_rest_j
    if goal is not None:
        allowed = number(goal.get("joules_allowed"), f"{step_path}: goal.joules_allowed")
        report["goal_joules"] = allowed
        report["rest_allowed_joules"] = allowed - gemm_j
        report["rest_factor_needed"] = (allowed - gemm_j) / rest_j if rest_j > 0 else None
        report["flat_rest_factor_needed"] = (allowed - flat_gemm_j) / flat_rest_j if flat_rest_j > 0 else None
    return report


def describe(r):
    head = (f"{r['model']} {r['precision']} step: {r['step_ms']:.2f} ms, {r['step_joules']:.2f} J "
            f"({r['mean_watts']:.0f} W mean of a {r['limit_watts']:.0f} W limit)")
    if "gemms" not in r:
        return "\n".join([head + "; no GEMM energy given (--gemms): the clock bound alone"] + describe_bound(r))
    lines = [head + f"; GEMM energy from {r['gemm_energy_key']}"]
    for g in r["gemms"]:
        lines.append(f"  {g['phase']:<28} {g['calls']:>3} calls: {g['joules']:8.2f} J at their sustained rate "
                     f"({g['sustained_ms']:.2f} ms sustained, {g['step_ms']:.2f} ms in the step)")
    share = r["gemm_joules"] / r["step_joules"] if r["step_joules"] > 0 else float("nan")
    lines.append(f"  block GEMMs: {r['gemm_joules']:.2f} J ({share:.1%} of the step's), {r['gemm_phase_ms']:.2f} ms "
                 f"of its {r['phases_ms']:.2f} ms of phases")
    lines.append(f"  everything else (attention, norms, passes): {r['rest_joules']:.2f} J over "
                 f"{r['rest_phase_ms']:.2f} ms ({r['rest_mean_watts']:.0f} W mean)")
    for p in r["rest_phases"][:4]:
        lines.append(f"    {p['phase']:<30} {p['step_ms']:8.2f} ms, about {p['joules_estimate']:.2f} J at that mean")
    if "goal_joules" in r:
        left = r["rest_allowed_joules"]
        head = f"  goal {r['goal_ms']:.0f} ms: {r['goal_joules']:.2f} J at the limit; "
        if left <= 0:
            lines.append(head + f"the block GEMMs alone spend {r['gemm_joules']:.2f} J, more than all of it")
        else:
            factor = r["rest_factor_needed"]
            what = f"{factor:.3f}x of what it spends now" if factor is not None else "any amount"
            lines.append(head + f"with the GEMMs as they are, everything else may spend {left:.2f} J ({what})")
        flat = r.get("flat_rest_factor_needed")
        if flat is not None:
            lines.append(f"  with every phase at the step's mean draw instead: GEMMs {r['flat_gemm_joules']:.2f} J, the "
                         f"rest {r['flat_rest_joules']:.2f} J, which may spend {flat:.3f}x of that")
    return "\n".join(lines + describe_bound(r))


def describe_bound(r):
    lines = []
    bound = r["clock_bound"]
    if "bound_ms" not in bound:
        lines.append(f"  clock bound: not computed: {bound['skipped']}")
        return lines
    rates = ", ".join(f"{v:.0f} TFLOP/s {k}" for k, v in bound["dense_tflops_at_clock"].items())
    lines.append(f"  clock bound: {bound['mma_flops'] / 1e12:.1f} TFLOP of MMAs at {bound['sm_count']} SMs' dense rates at "
                 f"the median {bound['sm_clock_median_mhz']:.0f} MHz ({rates}) take {bound['bound_ms']:.2f} ms")
    for p in bound["mma_phases"][:6]:
        share = p["share_of_full_rate"]
        lines.append(f"    {p['phase']:<30} {p['step_ms']:8.2f} ms in the step, {p['full_rate_ms']:8.2f} ms at the full "
                     f"{p['operands']} rate"
                     + (f" ({share:.1%})" if share is not None else ""))
    if "goal_room_ms" in bound:
        room = bound["goal_room_ms"]
        if room <= 0:
            lines.append(f"  goal {r['goal_ms']:.0f} ms: below the clock bound; no step at this clock meets it")
        else:
            lines.append(f"  goal {r['goal_ms']:.0f} ms: leaves {room:.2f} ms above the bound for every pass and every "
                         f"MMA's shortfall from the full rate, which take {bound['room_now_ms']:.2f} ms now "
                         f"({room / bound['room_now_ms']:.3f}x of that)")
    return lines


def capability_arg(text):
    try:
        major, minor = text.split(".")
        return int(major), int(minor)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MAJOR.MINOR, like 9.0") from exc


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", required=True, help="tf bench h3-dit / qwen-dit --json output (with --phases)")
    parser.add_argument("--gemms", help="tf bench int8-gemm [--bf16] --energy --json output (without it: the clock "
                                            "bound alone)")
    parser.add_argument("--energy-key", help="ours_energy, cublaslt_energy or fp8_energy (default: the step's own)")
    parser.add_argument("--sm-count", type=int, help="SMs of the board (when the step JSON names no device)")
    parser.add_argument("--compute-capability", type=capability_arg,
                        help="MAJOR.MINOR of the board (when the step JSON names no device)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    try:
        gemms = load(args.gemms) if args.gemms else None
        report = budget(load(args.step), args.step, gemms, args.gemms, args.energy_key, args.sm_count,
                        args.compute_capability)
    except BadInput as exc:
        print(f"energy_budget: {exc}", file=sys.stderr)
        return 2
    print(describe(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
