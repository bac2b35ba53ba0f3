#!/usr/bin/env python3
"""Runs a command while sampling the GPU's SM clock, power and temperature with nvidia-smi, then summarizes them.

    python3 tests/python/clock_trace.py --json OUT.json [--interval-ms 50] -- COMMAND [ARG...]

Tells whether the GPU keeps its clock under a workload: a step that runs slower inside a pipeline than alone may be
running at a lower clock (power or thermal limits), not doing more work. Prints the command's own output, then the
clock (MHz), power (W) and temperature (C) as min / median / max over the samples taken while it ran, with the
throttle reasons nvidia-smi reported, and the samples of the first second (how fast the clock ramps from idle).
Exits with the command's status; a missing nvidia-smi is reported and the command still runs.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

BASE_FIELDS = ["clocks.sm", "power.draw", "temperature.gpu"]
# The clock-limit reasons go by two names across drivers; the first one this nvidia-smi accepts is used.
REASON_FIELDS = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]


def pick_fields(smi):
    for reason in REASON_FIELDS + [None]:
        fields = BASE_FIELDS + ([reason] if reason else [])
        probe = subprocess.run(
            [smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return fields
    return None


def parse_row(line, fields):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(fields):
        return None
    try:
        return {
            "t": time.time(),
            "sm_mhz": float(parts[0]),
            "power_w": float(parts[1]),
            "temp_c": float(parts[2]),
            "throttle": parts[3] if len(parts) > 3 else "",
        }
    except ValueError:
        return None


def summary(values):
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--interval-ms", type=int, default=50)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command to run (put it after --)")

    smi = shutil.which("nvidia-smi")
    fields = pick_fields(smi) if smi else None
    sampler = None
    if fields is None:
        print("clock_trace: nvidia-smi missing or refusing the clock query; running the command without samples",
              file=sys.stderr)
    else:
        sampler = subprocess.Popen(
            [smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits", f"-lms={args.interval_ms}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
    samples = []
    start = time.time()
    proc = subprocess.Popen(command)
    # Read samples while the command runs (nvidia-smi writes a line per interval).
    if sampler is not None:
        import threading

        def read():
            for line in sampler.stdout:
                row = parse_row(line, fields)
                if row is not None:
                    samples.append(row)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    rc = proc.wait()
    end = time.time()
    if sampler is not None:
        sampler.terminate()
        try:
            sampler.wait(timeout=5)
        except subprocess.TimeoutExpired:
            sampler.kill()
        reader.join(timeout=2)

    during = [s for s in samples if start <= s["t"] <= end]
    busy = [s for s in during if s["power_w"] > 150.0]
    report = {
        "command": command,
        "exit": rc,
        "seconds": end - start,
        "samples": len(during),
        "sm_mhz": summary([s["sm_mhz"] for s in during]),
        "power_w": summary([s["power_w"] for s in during]),
        "temp_c": summary([s["temp_c"] for s in during]),
        "busy_samples": len(busy),
        "busy_sm_mhz": summary([s["sm_mhz"] for s in busy]),
        "busy_power_w": summary([s["power_w"] for s in busy]),
        "throttle_reasons": sorted({s["throttle"] for s in during}),
        "first_second": [
            {"at_s": round(s["t"] - start, 3), "sm_mhz": s["sm_mhz"], "power_w": s["power_w"]}
            for s in during
            if s["t"] - start <= 1.0
        ],
    }
    print(f"clock_trace: {len(during)} samples over {end - start:.1f} s")
    for key in ("sm_mhz", "power_w", "temp_c", "busy_sm_mhz", "busy_power_w"):
        v = report[key]
        if v is not None:
            print(f"  {key:>13}: min {v['min']:.0f}, median {v['median']:.0f}, max {v['max']:.0f}")
    print(f"  busy samples (power over 150 W): {len(busy)}; throttle reason masks seen: {report['throttle_reasons']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
