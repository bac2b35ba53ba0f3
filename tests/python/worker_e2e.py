#!/usr/bin/env python3
"""End to end through a warm `tf worker`: load once, then K identical requests, timed from the client.

Two engines (--engine): `qwen_image` (image requests, the default; described first) and `minimax_h3` (video
requests, described after the image case).

Starts `tf worker --engine qwen_image --backend B --model DIR --precision P`, sends `load`, then K (default 3)
identical `generate` requests (the same prompt, size, step count and seed; each writes its own PNG under a
temporary folder), then `exit`, and checks the exit code (docs/WORKER.md). For every request it reports:

  client_ms     wall time from writing the request line to reading its final line (what a caller waits)
  worker_ms     the `ms` of the final line (the worker's own wall time for the job)
  phases        from the worker's log line "encode X s, N steps Y s, decode Z s, total T s" (the pipeline's own
                spans), and the same spans as the client sees them from the arrival times of the progress lines:
                encode (request sent -> `encode` line), steps (`encode` -> last `denoise`), decode (last `denoise`
                -> `decode`), write (`decode` -> final line: the PNG written, the reply sent)

The figure is the SECOND request: the worker warms the default size at load, so the first request should be no
slower, but a warm worker's steady state is what the second one shows. With --reference (reference.json of
tests/python/qwen_pipeline_reference.py, the same model folder and prompt) it prints diffusers bf16's end-to-end
time for the same size and step count from that run (its `cases[].timings.total_ms`, the pipeline call from the
prompt to the decoded image tensor, warm, no PNG) beside ours, with the ratio.

Goals (issue 16, Qwen-Image 2.1 at 1024x1024, 8 steps, warm): end to end bf16 <= 900 ms, FP8 <= 600 ms; encode
<= 10 ms; decode <= 60 ms. They are printed met / not met; they do not change the exit code unless
--require-goals is given.

MiniMax H3 (--engine minimax_h3): each request is a video in the nested shape LocalRouter sends (docs/WORKER.md,
"generate of a video"): {"op":"generate","id":..,"dir":<a fresh folder per request>,"request":{"video":{"prompt",
"width","height","seconds","steps","seed","audio":true}}}. --steps counts grid points, the final 0 included, as
`tf video --steps` and diffusers' num_inference_steps do (N points make N - 1 model calls). The phases:

  worker log    the worker's line "encode X s, N steps Y s, decode video Z s, audio A s, total T s; F frames (R
                asked)" (N is model calls; logged before the files are written, so it leaves the writing out)
  progress      encode (sent -> `encode`), steps (`encode` -> last `denoise`), video decode (last `denoise` ->
                `decode` 1/2), audio decode (`decode` 1/2 -> 2/2), write (last `decode` -> final line: the MP4 muxed
                by ffmpeg, or the raw frames and WAV written, and the reply sent)

Without ffmpeg a video request runs the whole pipeline, writes the raw frames and audio.wav, and is answered
`server_error` naming ffmpeg; with --allow-missing-ffmpeg that answer counts as a completed request (recorded with
"mp4": false and the error's text) when the raw frames are there; any other error still fails. With --reference
(the timing.json of tests/python/h3_pipeline_reference.py `timing`) it prints diffusers' phases from the LAST run
there with the same number of grid points (the warm one) beside ours, with ratios. There are no goals for H3.

--vary-prompt (image engine) gives request i the prompt with i short clauses appended, so every request is a prompt
length the worker has not seen: a new step shape, as in real traffic (the PNGs then differ by design).

--extra-worker-arg ARG (repeatable) appends ARG to the worker's command line, e.g. `--extra-worker-arg
--random-weights --extra-worker-arg 0`.

Exit codes: 0 measured; 1 a goal not met under --require-goals; 2 bad arguments or inputs; 3 the worker failed
(died, answered an error, timed out, or exited with a code other than 0); the worker's stderr tail is printed.

Usage:
    python3 tests/python/worker_e2e.py --model /tmp/qwen21p/model --precision fp8 \\
        --reference /tmp/qwen21p/reference.json --json OUT.json
    python3 tests/python/worker_e2e.py --tf target/release/tf --backend host \\
        --model tests/fixtures/qwen_pipeline/model --prompt "a fox" --size 64x64 --steps 3   # smoke run
    python3 tests/python/worker_e2e.py --engine minimax_h3 --model /tmp/h3t/model --size 768x448 --seconds 5 \\
        --steps 8 --requests 2 --allow-missing-ffmpeg --extra-worker-arg --random-weights --extra-worker-arg 0 \\
        --reference /tmp/h3t/timing.json --json OUT.json
    python3 tests/python/worker_e2e.py --engine minimax_h3 --tf target/release/tf --backend host \\
        --model tests/fixtures/minimax_h3_pipeline/model --prompt "waves" --size 32x16 --seconds 0.9 --steps 3 \\
        --requests 2   # smoke run
"""

import argparse
import collections
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

GOALS_MS = dict(end_to_end_bf16=900.0, end_to_end_fp8=600.0, encode=10.0, decode=60.0)
GOAL_SIZE, GOAL_STEPS = (1024, 1024), 8

# "tf worker: encode 0.012 s, 8 steps 0.861 s, decode 0.058 s, total 0.934 s"
PHASE_LINE = re.compile(r"encode ([0-9.]+) s, (\d+) steps ([0-9.]+) s, decode ([0-9.]+) s, total ([0-9.]+) s")
WARM_LINE = re.compile(r"warmed up at (\d+)x(\d+) in ([0-9.]+) s")
# The load's stored GEMM plans: "tf worker: stored GEMM shapes planned: 57 (9 kernels loaded)".
STORED_GEMMS_LINE = re.compile(r"stored GEMM shapes planned: (\d+) \((\d+) kernels loaded\)")
LOADED_LINE = re.compile(r"loaded (.+?) in ([0-9.]+) s; .*DiT precision (.+)$")
# MiniMax H3: "tf worker: encode 0.120 s, 7 steps 9.800 s, decode video 1.900 s, audio 0.100 s, total 12.000 s;
# 124 frames (120 asked)"
VIDEO_PHASE_LINE = re.compile(r"encode ([0-9.]+) s, (\d+) steps ([0-9.]+) s, decode video ([0-9.]+) s, audio "
                              r"([0-9.]+) s, total ([0-9.]+) s(?:; (\d+) frames \((\d+) asked\))?")
# MiniMax H3's load report: "tf worker: loaded in 3.21 s, 123 B resident", "tf worker: dit precision: fp8", and
# which ffmpeg muxes the videos (or a warning that none was found).
H3_LOADED_LINE = re.compile(r"tf worker: loaded in ([0-9.]+) s, (\d+) B resident")
PRECISION_LINE = re.compile(r"tf worker: ([A-Za-z0-9 ]+?) precision: (.+)$")
# Both engines end their phase line with "; GEMM plans built in the request: 3 (12.5 ms)".
# --vary-prompt: the clause request i appends i times (a few tokens each).
VARY_CLAUSE = ", with more detail"
PLANS_LINE = re.compile(r"GEMM plans built in the request: (\d+) \(([0-9.]+) ms\)")
# Qwen-Image: "tf worker: wrote image_0.png (4200123 B): PNG encode 6.5 ms, file write 2.1 ms".
PNG_LINE = re.compile(r"wrote .* \((\d+) B\): PNG encode ([0-9.]+) ms, file write ([0-9.]+) ms")
# Every job's last line: "tf worker: job "e2e_2" done in 663 ms; board energy 412.3 J (622 W mean); device memory
# held: 21.84 GiB in 812 allocations" (the energy part only where the worker could read the board's counter).
HELD_LINE = re.compile(r"done in \d+ ms(?:; board energy ([0-9.]+) J \(([0-9.]+) W mean\))?; "
                       r"device memory held: ([0-9.]+) GiB in (\d+) allocations")
# Driver work between progress notes (only logged when there was some): "tf worker: driver work up to denoise 1/8:
# device allocations 26 (4.1 ms), frees 0 (0.0 ms), graph captures 0 (0.0 ms), instantiations 0 (0.0 ms)".
DRIVER_LINE = re.compile(r"driver work up to (\w+) (\d+)/(\d+): device allocations (\d+) \(([0-9.]+) ms\), frees (\d+) "
                         r"\(([0-9.]+) ms\), graph captures (\d+) \(([0-9.]+) ms\), instantiations (\d+) \(([0-9.]+) ms\)")
# The engine's host work in the same span, when it built a workspace or ran a step eagerly: "tf worker: host work up
# to denoise 1/8: workspace builds 1 (2.3 ms), eager step enqueues 1 (4.0 ms), step waits 1 (80.2 ms)".
HOST_LINE = re.compile(r"host work up to (\w+) (\d+)/(\d+): workspace builds (\d+) \(([0-9.]+) ms\), eager step enqueues "
                       r"(\d+) \(([0-9.]+) ms\), step waits (\d+) \(([0-9.]+) ms\)")
# Enqueues that waited: "tf worker: slow enqueues up to denoise 1/8: cuBLASLt matmul 77x9216x3072 Fp8E4m3 70.2 ms; ...".
SLOW_LINE = re.compile(r"slow enqueues up to (\w+) (\d+)/(\d+): (.+)$")
FFMPEG_LINE = re.compile(r"tf worker: (?:videos are muxed by (.+)|warning: (.*ffmpeg.*))$", re.IGNORECASE)
STDERR_EVENTS = (PNG_LINE, PHASE_LINE, VIDEO_PHASE_LINE, WARM_LINE, LOADED_LINE, H3_LOADED_LINE, PRECISION_LINE, FFMPEG_LINE,
                 HELD_LINE, DRIVER_LINE, HOST_LINE, SLOW_LINE, STORED_GEMMS_LINE)


class WorkerFailed(Exception):
    """The worker died, answered an error, timed out, or exited badly (exit 3)."""


class Worker:
    """A `tf worker` child: one reader thread per pipe, lines stamped with their arrival time."""

    EOF = object()

    def __init__(self, argv, env=None, stderr_keep=400):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, bufsize=0)
        self.lines = queue.Queue()
        self.stderr_tail = collections.deque(maxlen=stderr_keep)
        self.stderr_lock = threading.Lock()
        self.stderr_events = []  # (time, line) of lines that matter: phase, warm-up, load reports
        self.threads = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self.threads:
            t.start()

    def _read_stdout(self):
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.put((time.perf_counter(), raw.decode("utf-8", "replace").rstrip("\n")))
        self.lines.put((time.perf_counter(), Worker.EOF))

    def _read_stderr(self):
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            now = time.perf_counter()
            with self.stderr_lock:
                self.stderr_tail.append(line)
                if any(r.search(line) for r in STDERR_EVENTS):
                    self.stderr_events.append((now, line))

    def tail(self, n=30):
        with self.stderr_lock:
            return list(self.stderr_tail)[-n:]

    def events(self):
        with self.stderr_lock:
            return list(self.stderr_events)

    def send(self, obj):
        data = (json.dumps(obj) + "\n").encode("utf-8")
        t = time.perf_counter()
        try:
            view = memoryview(data)
            while view:
                written = self.proc.stdin.write(view)
                view = view[written:]
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailed(f"writing to the worker failed ({exc}): {self.describe_exit()}") from exc
        return t

    def read(self, deadline, what):
        """The next stdout line as (arrival time, parsed object); WorkerFailed on EOF, timeout or non-JSON."""
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise WorkerFailed(f"timed out waiting for {what}")
        try:
            t, line = self.lines.get(timeout=remaining)
        except queue.Empty:
            raise WorkerFailed(f"timed out waiting for {what}") from None
        if line is Worker.EOF:
            raise WorkerFailed(f"the worker closed its output while we waited for {what}: {self.describe_exit()}")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise WorkerFailed(f"a line that is not JSON on the worker's stdout while waiting for {what}: "
                               f"{line[:300]!r}") from None
        if not isinstance(obj, dict):
            raise WorkerFailed(f"a JSON line that is not an object while waiting for {what}: {line[:300]!r}")
        return t, obj

    def final(self, deadline, what):
        """The next line that carries `ok` (other lines before it are skipped): (arrival time, object)."""
        while True:
            t, obj = self.read(deadline, what)
            if "ok" in obj:
                return t, obj

    def describe_exit(self, wait_s=5.0):
        try:
            code = self.proc.wait(timeout=wait_s)
            return f"it exited with code {code}"
        except subprocess.TimeoutExpired:
            return "it is still running"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def bad_input(message):
    """A bad argument or input file: say so and exit 2."""
    print(f"worker_e2e: {message}", flush=True)
    sys.exit(2)


def parse_size(text):
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return w, h


def read_prompt(args):
    if args.prompt is not None:
        return args.prompt, "--prompt"
    path = os.path.join(os.path.dirname(os.path.abspath(args.model.rstrip("/"))), "prompt.txt")
    if not os.path.exists(path):
        bad_input(f"no --prompt and no {path} (qwen_pipeline_reference.py writes it beside the model folder)")
    with open(path, encoding="utf-8") as f:
        return f.read(), path


def reference_case(path, width, height, steps):
    """diffusers' timings for WxH and `steps` from a qwen_pipeline_reference.py reference.json, or None."""
    try:
        with open(path) as f:
            ref = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        bad_input(f"--reference {path}: {exc}")
    name = f"{width}x{height}/steps{steps}"
    for case in ref.get("cases", []):
        if case.get("name") == name or (case.get("width"), case.get("height"), case.get("steps")) == (
                width, height, steps):
            t = case["timings"]
            return dict(name=name, dtype=ref.get("dtype"), device=ref.get("device"),
                        diffusers=ref.get("versions", {}).get("diffusers"), total_ms=t["total_ms"],
                        encode_ms=t.get("encode_ms"), steps_sum_ms=t.get("steps_sum_ms"),
                        decode_ms=t.get("decode_ms"), prompt=ref.get("prompt"))
    have = [c.get("name") for c in ref.get("cases", [])]
    bad_input(f"{path} has no case {name} (has {have}); run the reference with that size and step count")


def h3_reference(path, width, height, steps, seconds):
    """diffusers' phases from the LAST run with `steps` grid points in an h3_pipeline_reference.py timing.json."""
    try:
        with open(path) as f:
            ref = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        bad_input(f"--reference {path}: {exc}")
    runs = ref.get("runs")
    if not isinstance(runs, list) or not runs:
        bad_input(f"{path} has no runs (written with --folder-only?); run h3_pipeline_reference.py timing without it")
    matching = [r for r in runs if r.get("steps") == steps]
    if not matching:
        bad_input(f"{path} has no run with {steps} grid points (has {[r.get('steps') for r in runs]})")
    if (ref.get("width"), ref.get("height")) != (width, height):
        bad_input(f"{path} ran at {ref.get('width')}x{ref.get('height')}, not {width}x{height}")
    asked = ref.get("num_frames_requested")
    if asked is not None and asked != max(1, round(seconds * 24)):
        print(f"worker_e2e: note: the reference asked for {asked} frames; --seconds {seconds} asks for "
              f"{max(1, round(seconds * 24))}", flush=True)
    run = matching[-1]
    phases = run.get("phases", {})

    def ms(key):
        v = phases.get(key)
        return None if v is None else float(v) * 1e3

    return dict(path=path, run_index=runs.index(run), steps=steps, model_calls=run.get("model_calls"),
                dtype="bf16", device=ref.get("device"), diffusers=ref.get("versions", {}).get("diffusers"),
                attention_backend=ref.get("attention_backend"), frames=run.get("frames"),
                total_ms=float(run["wall_s"]) * 1e3, encode_ms=ms("text_encode_s"), steps_sum_ms=ms("denoise_s"),
                dit_forward_ms=ms("dit_forward_s"), video_decode_ms=ms("video_decode_s"),
                audio_decode_ms=ms("audio_decode_s"), peaks=run.get("peaks"), prompt=ref.get("prompt"))


def phase_from_log(events, after, before):
    """The worker's own phase line logged in (after, before]: dict in ms, or None."""
    for t, line in events:
        if after < t <= before:
            plans = PLANS_LINE.search(line)
            planned = {} if plans is None else dict(gemm_plans_built=int(plans.group(1)),
                                                     gemm_planning_ms=float(plans.group(2)))
            m = PHASE_LINE.search(line)
            if m:
                return dict(encode_ms=float(m.group(1)) * 1e3, steps=int(m.group(2)),
                            steps_ms=float(m.group(3)) * 1e3, decode_ms=float(m.group(4)) * 1e3,
                            total_ms=float(m.group(5)) * 1e3, **planned)
            m = VIDEO_PHASE_LINE.search(line)
            if m:
                return dict(**planned, encode_ms=float(m.group(1)) * 1e3, steps=int(m.group(2)),
                            steps_ms=float(m.group(3)) * 1e3, video_decode_ms=float(m.group(4)) * 1e3,
                            audio_decode_ms=float(m.group(5)) * 1e3, total_ms=float(m.group(6)) * 1e3,
                            frames=None if m.group(7) is None else int(m.group(7)),
                            frames_asked=None if m.group(8) is None else int(m.group(8)))
    return None


def plans_text(phases):
    """The GEMM plans a request built (shapes its load did not plan), as the worker logged them."""
    if phases.get("gemm_plans_built") is None:
        return "GEMM plans built: not logged"
    return f"GEMM plans built: {phases['gemm_plans_built']} ({phases['gemm_planning_ms']:.1f} ms)"


def held_text(result):
    """The device memory the worker held after the request, and the board's energy over it, as it logged them."""
    if result.get("device_held_gib") is None:
        return "device memory held: not logged"
    energy = ""
    if result.get("board_energy_j") is not None:
        energy = f"board energy {result['board_energy_j']:.1f} J ({result['board_mean_w']:.0f} W mean); "
    return (f"{energy}device memory held after it: {result['device_held_gib']:.2f} GiB "
            f"({result['device_allocs']} allocations)")


# Counted work per span: the fields after "phase step/of", as (name, type), in the order the line gives them.
DRIVER_FIELDS = [("allocs", int), ("alloc_ms", float), ("frees", int), ("free_ms", float), ("captures", int),
                 ("capture_ms", float), ("instantiations", int), ("instantiate_ms", float)]
HOST_FIELDS = [("workspace_builds", int), ("workspace_build_ms", float), ("eager_steps", int),
               ("eager_enqueue_ms", float), ("step_waits", int), ("step_wait_ms", float)]


def spans_from_log(events, after, pattern, fields):
    """The lines `pattern` matches logged after `after` (this request's): dicts of phase, step, of and `fields`."""
    spans = []
    for t, line in events:
        m = pattern.search(line) if t > after else None
        if m:
            g = m.groups()
            span = dict(phase=g[0], step=int(g[1]), of=int(g[2]))
            span.update({name: kind(value) for (name, kind), value in zip(fields, g[3:])})
            spans.append(span)
    return spans


def driver_work_from_log(events, after):
    """The driver work lines logged after `after` (this request's), as dicts in ms."""
    return spans_from_log(events, after, DRIVER_LINE, DRIVER_FIELDS)


def host_work_from_log(events, after):
    """The engine's host work lines logged after `after` (this request's), as dicts in ms."""
    return spans_from_log(events, after, HOST_LINE, HOST_FIELDS)


def detail_text(result):
    """A request's step intervals (client side) and the driver work the worker logged, one line."""
    cp = result.get("client_phases_ms") or {}
    steps = " ".join(f"{v:.1f}" for v in cp.get("step_intervals") or [])
    work = "; ".join(
        f"up to {w['phase']} {w['step']}/{w['of']}: allocs {w['allocs']} ({w['alloc_ms']:.1f} ms), frees {w['frees']} "
        f"({w['free_ms']:.1f} ms), captures {w['captures']} ({w['capture_ms']:.1f} ms), instantiations "
        f"{w['instantiations']} ({w['instantiate_ms']:.1f} ms)" for w in result.get("driver_work") or [])
    host = "; ".join(
        f"up to {w['phase']} {w['step']}/{w['of']}: workspace builds {w['workspace_builds']} "
        f"({w['workspace_build_ms']:.1f} ms), eager enqueues {w['eager_steps']} ({w['eager_enqueue_ms']:.1f} ms), "
        f"step waits {w['step_waits']} ({w['step_wait_ms']:.1f} ms)" for w in result.get("host_work") or [])
    slow = "; ".join(f"up to {w['phase']} {w['step']}/{w['of']}: {w['calls']}" for w in result.get("slow_enqueues") or [])
    return (f"  step intervals (ms): {steps or '-'}; driver work: {work or 'none logged'}; "
            f"host work: {host or 'none logged'}; slow enqueues: {slow or 'none'}")


def is_ffmpeg_missing(obj):
    """A final error line that names ffmpeg (no MP4 could be made; the raw frames and WAV were written instead)."""
    return obj.get("ok") is False and "ffmpeg" in str(obj.get("error", "")).lower()


def generate(worker, index, request, timeout_s, allow_missing_ffmpeg=False):
    t_send = worker.send(request)
    deadline = t_send + timeout_s
    progress = []
    while True:
        t, obj = worker.read(deadline, f"the reply to request {index + 1}")
        if "ok" in obj:
            break
        if "progress" in obj:
            p = obj["progress"]
            progress.append((t, p.get("phase"), p.get("step"), p.get("of")))
        # Any other line is ignored (the protocol allows only these two shapes; be lenient).
    video = "request" in request
    missing_ffmpeg = video and allow_missing_ffmpeg and is_ffmpeg_missing(obj)
    if not obj.get("ok") and not missing_ffmpeg:
        raise WorkerFailed(f"request {index + 1} answered {obj.get('type', 'an error')}: {obj.get('error')}")
    t_final = t
    result = dict(request=index + 1, client_ms=(t_final - t_send) * 1e3, worker_ms=obj.get("ms"),
                  files=obj.get("files"), seed=obj.get("seed"), progress_lines=len(progress))
    if video:
        result["mp4"] = bool(obj.get("ok"))
        if missing_ffmpeg:
            result["error"] = obj.get("error")
            result["error_type"] = obj.get("type")
    encode = [t for t, ph, _, _ in progress if ph == "encode"]
    denoise = [t for t, ph, _, _ in progress if ph == "denoise"]
    decode = [t for t, ph, _, _ in progress if ph == "decode"]
    result["denoise_lines"] = len(denoise)
    if video and encode and denoise and decode:
        # `decode` 1/2 ends the video decode, 2/2 the audio decode (1/1: video only).
        result["client_phases_ms"] = dict(
            encode=(encode[0] - t_send) * 1e3,
            steps=(denoise[-1] - encode[0]) * 1e3,
            step_intervals=[(b - a) * 1e3 for a, b in zip([encode[0]] + denoise[:-1], denoise)],
            video_decode=(decode[0] - denoise[-1]) * 1e3,
            audio_decode=(decode[1] - decode[0]) * 1e3 if len(decode) > 1 else None,
            write=(t_final - decode[-1]) * 1e3,
        )
    elif encode and denoise and decode:
        result["client_phases_ms"] = dict(
            encode=(encode[0] - t_send) * 1e3,
            steps=(denoise[-1] - encode[0]) * 1e3,
            step_intervals=[(b - a) * 1e3 for a, b in zip([encode[0]] + denoise[:-1], denoise)],
            decode=(decode[-1] - denoise[-1]) * 1e3,
            write=(t_final - decode[-1]) * 1e3,
        )
    # The worker logs its phase line before it writes the reply; stderr is another pipe, so give it a moment.
    wait_until = time.perf_counter() + 2.0
    phases = phase_from_log(worker.events(), t_send, float("inf"))
    while phases is None and time.perf_counter() < wait_until:
        time.sleep(0.01)
        phases = phase_from_log(worker.events(), t_send, float("inf"))
    # An image job logs its PNG line after the phase line and before the reply.
    png_wait = time.perf_counter() + 0.5
    while phases is not None and "decode_ms" in phases and "png_encode_ms" not in phases:
        for t, line in worker.events():
            m = PNG_LINE.search(line) if t > t_send else None
            if m:
                phases.update(png_bytes=int(m.group(1)), png_encode_ms=float(m.group(2)),
                              file_write_ms=float(m.group(3)))
        if time.perf_counter() > png_wait:
            break
        time.sleep(0.01)
    result["worker_phases_ms"] = phases
    # The job's last log line (written before the reply): the device memory the worker holds after it.
    held_wait = time.perf_counter() + 0.5
    while "device_held_gib" not in result and time.perf_counter() < held_wait:
        for t, line in worker.events():
            m = HELD_LINE.search(line) if t > t_send else None
            if m:
                result.update(device_held_gib=float(m.group(3)), device_allocs=int(m.group(4)))
                if m.group(1) is not None:
                    result.update(board_energy_j=float(m.group(1)), board_mean_w=float(m.group(2)))
        if "device_held_gib" not in result:
            time.sleep(0.01)
    result["driver_work"] = driver_work_from_log(worker.events(), t_send)
    result["host_work"] = host_work_from_log(worker.events(), t_send)
    result["slow_enqueues"] = [dict(phase=m.group(1), step=int(m.group(2)), of=int(m.group(3)), calls=m.group(4))
                               for t, line in worker.events() if t > t_send
                               for m in [SLOW_LINE.search(line)] if m]
    return result, t_final


def fmt_ms(v):
    return "-" if v is None else f"{v:.1f}"


def print_comparison(title, rows):
    """Prints `title` and a markdown table of (label, ours ms, diffusers ms) rows with their ratios; returns the
    ratios that exist, by label."""
    print("", flush=True)
    print(title, flush=True)
    print("", flush=True)
    print("| | ours ms | diffusers bf16 ms | ours / diffusers |", flush=True)
    print("| --- | --- | --- | --- |", flush=True)
    ratios = {}
    for label, ours, theirs in rows:
        ratio = ours / theirs if ours is not None and theirs else None
        if ratio is not None:
            ratios[label] = ratio
        print(f"| {label} | {fmt_ms(ours)} | {fmt_ms(theirs)} | {'-' if ratio is None else f'{ratio:.3f}'} |",
              flush=True)
    return ratios


def join_worker_args(argv):
    """`--extra-worker-arg --random-weights` as `--extra-worker-arg=--random-weights` (argparse would take a value
    that starts with a dash for an option of its own)."""
    out = []
    i = 0
    while i < len(argv):
        if argv[i] == "--extra-worker-arg" and i + 1 < len(argv):
            out.append(f"--extra-worker-arg={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def output_digest(folder):
    """sha256 over the names and bytes of the files in a job folder, and what is there."""
    h = hashlib.sha256()
    names = sorted(os.listdir(folder))
    for name in names:
        h.update(name.encode("utf-8") + b"\0")
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    frames = sum(1 for n in names if n.startswith("frame_") and n.endswith(".png"))
    return h.hexdigest(), dict(frame_pngs=frames, audio_wav="audio.wav" in names, video_mp4="video.mp4" in names,
                               files=len(names))


def report_video(summary, requests, reference, args):
    """MiniMax H3: the figure (the second request), its phases, and diffusers' beside them with --reference."""
    fig = requests[1] if len(requests) > 1 else requests[0]
    wp = fig.get("worker_phases_ms") or {}
    cp = fig.get("client_phases_ms") or {}
    phases = dict(encode_ms=wp.get("encode_ms", cp.get("encode")), steps_ms=wp.get("steps_ms", cp.get("steps")),
                  video_decode_ms=wp.get("video_decode_ms", cp.get("video_decode")),
                  audio_decode_ms=wp.get("audio_decode_ms", cp.get("audio_decode")))
    summary["figure"] = dict(request=fig["request"], client_ms=fig["client_ms"], worker_ms=fig["worker_ms"],
                             worker_total_ms=wp.get("total_ms"), write_ms=cp.get("write"), mp4=fig["mp4"],
                             model_calls=wp.get("steps", fig.get("denoise_lines")), frames=wp.get("frames"),
                             phases_from="worker log" if wp else "progress lines", **phases)
    if not fig["mp4"]:
        summary["figure"]["error"] = fig.get("error")
    summary["same_output_every_request"] = len({r.get("output_sha256") for r in requests}) == 1
    width, height = summary["width"], summary["height"]
    ref = reference or {}
    rows = [("end to end (client wall)", fig["client_ms"], ref.get("total_ms")),
            ("worker `ms`", fig["worker_ms"], None),
            ("pipeline total (worker log)", wp.get("total_ms"), ref.get("total_ms")),
            ("encode", phases["encode_ms"], ref.get("encode_ms")),
            ("all steps", phases["steps_ms"], ref.get("steps_sum_ms")),
            ("video decode", phases["video_decode_ms"], ref.get("video_decode_ms")),
            ("audio decode", phases["audio_decode_ms"], ref.get("audio_decode_ms")),
            ("write (MP4 or raw frames)", cp.get("write"), None)]
    ratios = print_comparison(
        f"## tf worker minimax_h3, {args.precision}, {width}x{height}, {args.seconds:g} s, {args.steps} grid "
        f"points: request {fig['request']} of {len(requests)} (warm)", rows)
    if reference:
        summary["reference"] = reference
        summary["ratios_to_reference"] = ratios
        summary["ratio_to_reference"] = fig["client_ms"] / reference["total_ms"]
        summary["speedup_over_reference"] = reference["total_ms"] / fig["client_ms"]
        peak = (reference.get("peaks") or {}).get("peak_allocated_bytes")
        print(f"\nend to end: ours {fig['client_ms']:.1f} ms vs diffusers bf16 {reference['total_ms']:.1f} ms "
              f"(run {reference['run_index'] + 1} of {reference['path']}, {reference.get('model_calls')} model "
              f"calls, peak {peak / 2**30 if peak else float('nan'):.1f} GiB): ratio "
              f"{summary['ratio_to_reference']:.3f} (speed-up {summary['speedup_over_reference']:.2f}x). The "
              "reference's figure is its pipeline call to the decoded frames and audio (no files); ours is the "
              "client's wall time, the files written.", flush=True)
    mp4 = ("every request wrote video.mp4" if all(r["mp4"] for r in requests) else
           f"no MP4 (ffmpeg missing; the raw frames and WAV were written): {str(fig.get('error'))[:160]} ...")
    print(f"phases from the {summary['figure']['phases_from']}; {fig['denoise_lines']} denoise progress lines, "
          f"{wp.get('frames', '?')} frames; {mp4}; every request "
          f"wrote the same output: {summary['same_output_every_request']}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="diffusers-format Qwen-Image (or MiniMax H3) folder")
    ap.add_argument("--engine", default="qwen_image", choices=["qwen_image", "minimax_h3"],
                    help="the worker's --engine (default qwen_image); minimax_h3 sends video requests")
    ap.add_argument("--seconds", type=float, default=5.0, help="minimax_h3: the video's length (default 5)")
    ap.add_argument("--extra-worker-arg", action="append", default=[], metavar="ARG",
                    help="appended to the worker's command line (repeatable)")
    ap.add_argument("--allow-missing-ffmpeg", action="store_true",
                    help="minimax_h3: a final error naming ffmpeg (raw frames written, no MP4) counts as completed")
    ap.add_argument("--tf", default="tf", help="the tf binary (default: tf on PATH)")
    ap.add_argument("--backend", default="gpu", choices=["gpu", "host", "auto"])
    ap.add_argument("--precision", default="bf16", help="bf16, fp8 or fp8:GROUPS (the worker's --precision)")
    ap.add_argument("--prompt", default=None, help="default: the text of MODEL/../prompt.txt")
    ap.add_argument("--vary-prompt", action="store_true",
                    help="qwen_image: request i appends i short clauses to the prompt, so that every request has a "
                         "prompt length the worker has not seen (a new step shape), as real traffic does")
    ap.add_argument("--size", type=parse_size, default=(1024, 1024), help="WIDTHxHEIGHT (default 1024x1024)")
    ap.add_argument("--steps", type=int, default=8, help="minimax_h3: grid points (N - 1 model calls)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", "-k", type=int, default=3, help="identical generate requests (default 3)")
    ap.add_argument("--reference", default=None, help="reference.json of qwen_pipeline_reference.py, or for "
                    "minimax_h3 timing.json of h3_pipeline_reference.py timing")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--load-timeout", type=float, default=600.0, help="seconds for the load reply")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds for each generate reply")
    ap.add_argument("--exit-timeout", type=float, default=60.0, help="seconds for the exit reply and the exit")
    ap.add_argument("--keep-outputs", default=None, metavar="DIR",
                    help="copy the outputs here (default: the temporary folder is removed)")
    ap.add_argument("--require-goals", action="store_true", help="exit 1 when a goal is not met (qwen_image)")
    args = ap.parse_args(join_worker_args(sys.argv[1:]))
    video = args.engine == "minimax_h3"
    if args.requests < 1:
        bad_input("--requests must be at least 1")
    if args.steps < (2 if video else 1):
        bad_input(f"--steps must be at least {2 if video else 1}")
    if video and not 0 < args.seconds <= 60:
        bad_input("--seconds must be above 0 and at most 60")
    if not os.path.isdir(args.model):
        bad_input(f"--model {args.model} is not a folder")
    tf = shutil.which(args.tf) or (args.tf if os.path.exists(args.tf) else None)
    if tf is None:
        bad_input(f"no tf binary at {args.tf!r} (not on PATH, not a file)")
    prompt, prompt_from = read_prompt(args)
    width, height = args.size
    if not args.reference:
        reference = None
    elif video:
        reference = h3_reference(args.reference, width, height, args.steps, args.seconds)
    else:
        reference = reference_case(args.reference, width, height, args.steps)
    if reference and reference.get("prompt") is not None and reference["prompt"] != prompt:
        print(f"worker_e2e: note: the prompt differs from the reference's ({prompt_from})", flush=True)

    argv = [tf, "worker", "--engine", args.engine, "--backend", args.backend, "--model", args.model,
            "--precision", args.precision] + args.extra_worker_arg
    out_dir = tempfile.mkdtemp(prefix="worker_e2e-")
    summary = dict(argv=argv, engine=args.engine, backend=args.backend, precision=args.precision, width=width,
                   height=height, steps=args.steps, seed=args.seed, prompt=prompt, prompt_from=prompt_from,
                   requests=[], plan_cache=os.environ.get("TF_PLAN_CACHE"))
    if video:
        summary.update(seconds=args.seconds, audio=True, extra_worker_args=args.extra_worker_arg,
                       allow_missing_ffmpeg=args.allow_missing_ffmpeg, ffmpeg_env=os.environ.get("TF_FFMPEG"))
    print(f"worker_e2e: {' '.join(argv)}", flush=True)
    what = (f"video {width}x{height}, {args.seconds:g} s with audio, {args.steps} grid points" if video else
            f"{width}x{height}, {args.steps} steps")
    print(f"worker_e2e: {args.requests} x generate {what}, seed {args.seed}; "
          f"prompt from {prompt_from} ({len(prompt)} chars)", flush=True)
    rc = 0
    worker = None
    try:
        worker = Worker(argv)
        t0 = worker.send({"op": "load"})
        t_load, reply = worker.final(t0 + args.load_timeout, "the load reply")
        if not reply.get("ok"):
            raise WorkerFailed(f"load answered {reply.get('type', 'an error')}: {reply.get('error')}")
        summary["load"] = dict(client_ms=(t_load - t0) * 1e3, worker_ms=reply.get("ms"),
                               resident_bytes=reply.get("resident"))
        # The worker logs which ffmpeg it will use just before the load reply; stderr is another pipe.
        wait_until = time.perf_counter() + 2.0
        while video and time.perf_counter() < wait_until and not any(
                FFMPEG_LINE.search(line) for _, line in worker.events()):
            time.sleep(0.01)
        for _, line in worker.events():
            m = WARM_LINE.search(line)
            if m:
                summary["load"]["warm_up"] = dict(width=int(m.group(1)), height=int(m.group(2)),
                                                  ms=float(m.group(3)) * 1e3)
            m = STORED_GEMMS_LINE.search(line)
            if m:
                summary["load"]["stored_gemm_shapes"] = int(m.group(1))
                summary["load"]["stored_gemm_kernels_loaded"] = int(m.group(2))
                print(f"load: {m.group(1)} stored GEMM shapes planned, {m.group(2)} kernels loaded")
            m = LOADED_LINE.search(line)
            if m:
                summary["load"]["variant"] = m.group(1)
                summary["load"]["dit_precision"] = m.group(3).strip()
            if video:
                m = PRECISION_LINE.search(line)
                if m:
                    summary["load"].setdefault("precision", {})[m.group(1)] = m.group(2).strip()
                    if m.group(1).lower() in ("dit", "transformer"):
                        summary["load"]["dit_precision"] = m.group(2).strip()
                m = FFMPEG_LINE.search(line)
                if m:
                    summary["load"]["ffmpeg"] = m.group(1) or f"none: {m.group(2)}"
        if video and "dit_precision" not in summary["load"]:
            precisions = summary["load"].get("precision", {})
            if precisions:
                summary["load"]["dit_precision"] = "; ".join(f"{k} {v}" for k, v in precisions.items())
        resident = reply.get("resident")
        print(f"load: {summary['load']['client_ms']:.0f} ms (worker {reply.get('ms')} ms), resident "
              f"{resident / 2**30 if isinstance(resident, int) else float('nan'):.2f} GiB; "
              f"DiT precision {summary['load'].get('dit_precision', '?')}; warm-up "
              f"{fmt_ms(summary['load'].get('warm_up', {}).get('ms'))} ms", flush=True)

        if video:
            for i in range(args.requests):
                job_dir = os.path.join(out_dir, f"video_{i}")
                os.makedirs(job_dir)
                request = {"op": "generate", "id": f"e2e_{i + 1}", "dir": job_dir,
                           "request": {"video": {"prompt": prompt, "width": width, "height": height,
                                                 "seconds": args.seconds, "steps": args.steps, "seed": args.seed,
                                                 "audio": True}}}
                result, _ = generate(worker, i, request, args.request_timeout, args.allow_missing_ffmpeg)
                digest, found = output_digest(job_dir)
                result["output_sha256"] = digest
                result["output"] = found
                if result["mp4"] and not found["video_mp4"]:
                    raise WorkerFailed(f"request {i + 1} answered ok but {job_dir}/video.mp4 does not exist")
                if not result["mp4"] and not found["frame_pngs"]:
                    raise WorkerFailed(f"request {i + 1} answered {result['error']!r} and wrote no raw frames")
                summary["requests"].append(result)
                wp = result.get("worker_phases_ms") or {}
                cp = result.get("client_phases_ms") or {}
                made = ("video.mp4" if result["mp4"] else
                        f"no MP4 (ffmpeg missing): {found['frame_pngs']} frame PNGs"
                        f"{' + audio.wav' if found['audio_wav'] else ''}")
                print(f"request {i + 1}: client {result['client_ms']:.1f} ms, worker {fmt_ms(result['worker_ms'])} ms, "
                      f"{made}; worker log: encode {fmt_ms(wp.get('encode_ms'))}, {wp.get('steps', '?')} steps "
                      f"{fmt_ms(wp.get('steps_ms'))}, video decode {fmt_ms(wp.get('video_decode_ms'))}, audio decode "
                      f"{fmt_ms(wp.get('audio_decode_ms'))}, total {fmt_ms(wp.get('total_ms'))} ms, "
                      f"{wp.get('frames', '?')} frames; progress lines: encode {fmt_ms(cp.get('encode'))}, steps "
                      f"{fmt_ms(cp.get('steps'))}, video decode {fmt_ms(cp.get('video_decode'))}, audio decode "
                      f"{fmt_ms(cp.get('audio_decode'))}, write {fmt_ms(cp.get('write'))} ms; "
                      f"{plans_text(wp)}; {held_text(result)}", flush=True)
                print(detail_text(result), flush=True)
        else:
            for i in range(args.requests):
                # --vary-prompt: request i adds i clauses, so every request is a new prompt length (a new step shape).
                text = prompt + VARY_CLAUSE * i if args.vary_prompt else prompt
                request = {"op": "generate", "id": f"e2e_{i + 1}", "prompt": text, "width": width, "height": height,
                           "steps": args.steps, "seed": args.seed, "output": os.path.join(out_dir, f"image_{i}.png")}
                result, _ = generate(worker, i, request, args.request_timeout)
                path = request["output"]
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        result["png_sha256"] = hashlib.sha256(f.read()).hexdigest()
                else:
                    raise WorkerFailed(f"request {i + 1} answered ok but {path} does not exist")
                summary["requests"].append(result)
                wp = result.get("worker_phases_ms") or {}
                cp = result.get("client_phases_ms") or {}
                print(f"request {i + 1}: client {result['client_ms']:.1f} ms, worker {result['worker_ms']} ms; "
                      f"worker log: encode {fmt_ms(wp.get('encode_ms'))}, steps {fmt_ms(wp.get('steps_ms'))}, "
                      f"decode {fmt_ms(wp.get('decode_ms'))}, total {fmt_ms(wp.get('total_ms'))} ms; progress lines: "
                      f"encode {fmt_ms(cp.get('encode'))}, steps {fmt_ms(cp.get('steps'))}, decode "
                      f"{fmt_ms(cp.get('decode'))}, write {fmt_ms(cp.get('write'))} ms (PNG encode "
                      f"{fmt_ms(wp.get('png_encode_ms'))}, file {fmt_ms(wp.get('file_write_ms'))} ms); "
                      f"{plans_text(wp)}; {held_text(result)}", flush=True)
                print(detail_text(result), flush=True)

        t_exit = worker.send({"op": "exit"})
        _, reply = worker.final(t_exit + args.exit_timeout, "the exit reply")
        try:
            code = worker.proc.wait(timeout=max(1.0, t_exit + args.exit_timeout - time.perf_counter()))
        except subprocess.TimeoutExpired:
            raise WorkerFailed("the worker answered exit but did not end") from None
        summary["exit"] = dict(reply=reply, code=code)
        print(f"exit: {json.dumps(reply)}, exit code {code}", flush=True)
        if not reply.get("ok") or code != 0:
            raise WorkerFailed(f"exit answered {json.dumps(reply)} and the worker ended with code {code}")
        if reply.get("device_bytes") not in (None, 0) or reply.get("device_allocs") not in (None, 0):
            print(f"worker_e2e: note: device memory still held after unload: {json.dumps(reply)}", flush=True)
    except WorkerFailed as exc:
        rc = 3
        summary["error"] = str(exc)
        print(f"worker_e2e: FAILED: {exc}", flush=True)
        if worker is not None:
            tail = worker.tail()
            summary["stderr_tail"] = tail
            print("worker_e2e: last lines of the worker's stderr:", flush=True)
            for line in tail:
                print(f"  | {line}", flush=True)
    finally:
        if worker is not None:
            worker.kill()
        if args.keep_outputs and os.path.isdir(out_dir):
            os.makedirs(args.keep_outputs, exist_ok=True)
            for name in sorted(os.listdir(out_dir)):
                src = os.path.join(out_dir, name)
                if os.path.isdir(src):
                    shutil.copytree(src, os.path.join(args.keep_outputs, name), dirs_exist_ok=True)
                else:
                    shutil.copyfile(src, os.path.join(args.keep_outputs, name))
        shutil.rmtree(out_dir, ignore_errors=True)

    # The figure: the second request (the first when only one ran).
    requests = summary["requests"]
    goals = []
    if requests and video:
        report_video(summary, requests, reference, args)
    elif requests:
        fig = requests[1] if len(requests) > 1 else requests[0]
        wp = fig.get("worker_phases_ms") or {}
        cp = fig.get("client_phases_ms") or {}
        encode = wp.get("encode_ms", cp.get("encode"))
        decode = wp.get("decode_ms", cp.get("decode"))
        summary["figure"] = dict(request=fig["request"], client_ms=fig["client_ms"], worker_ms=fig["worker_ms"],
                                 encode_ms=encode, steps_ms=wp.get("steps_ms", cp.get("steps")), decode_ms=decode,
                                 phases_from="worker log" if wp else "progress lines")
        hashes = {r.get("png_sha256") for r in requests}
        summary["same_png_every_request"] = len(hashes) == 1
        summary["vary_prompt"] = bool(args.vary_prompt)
        fp8 = args.precision.startswith("fp8")
        e2e_goal = GOALS_MS["end_to_end_fp8" if fp8 else "end_to_end_bf16"]
        at_goal_shape = (width, height) == GOAL_SIZE and args.steps == GOAL_STEPS
        goals = [
            dict(goal=f"end to end ({'FP8' if fp8 else 'bf16'}) <= {e2e_goal:.0f} ms", value_ms=fig["client_ms"],
                 met=fig["client_ms"] <= e2e_goal),
            dict(goal=f"encode <= {GOALS_MS['encode']:.0f} ms", value_ms=encode,
                 met=None if encode is None else encode <= GOALS_MS["encode"]),
            dict(goal=f"decode <= {GOALS_MS['decode']:.0f} ms", value_ms=decode,
                 met=None if decode is None else decode <= GOALS_MS["decode"]),
        ]
        summary["goals"] = dict(apply=at_goal_shape, items=goals)
        ref = reference or {}
        rows = [("end to end (client wall)", fig["client_ms"], ref.get("total_ms")),
                ("worker `ms`", fig["worker_ms"], None),
                ("encode", encode, ref.get("encode_ms")),
                ("all steps", summary["figure"]["steps_ms"], ref.get("steps_sum_ms")),
                ("decode", decode, ref.get("decode_ms"))]
        print_comparison(f"## tf worker, {args.precision}, {width}x{height}, {args.steps} steps: request "
                         f"{fig['request']} of {len(requests)} (warm)", rows)
        if reference:
            summary["reference"] = reference
            summary["ratio_to_reference"] = fig["client_ms"] / reference["total_ms"]
            summary["speedup_over_reference"] = reference["total_ms"] / fig["client_ms"]
            print(f"\nend to end: ours {fig['client_ms']:.1f} ms vs diffusers {reference['dtype']} "
                  f"{reference['total_ms']:.1f} ms from the same run: ratio {summary['ratio_to_reference']:.3f} "
                  f"(speed-up {summary['speedup_over_reference']:.2f}x). The reference's figure is its pipeline call "
                  "to the decoded image tensor (no PNG); ours is the client's wall time, the PNG written.",
                  flush=True)
        print(f"phases from the {summary['figure']['phases_from']}; every request wrote the same PNG: "
              f"{summary['same_png_every_request']}", flush=True)
        print("\nGoals (issue 16" + ("" if at_goal_shape else
                                      f"; they are for {GOAL_SIZE[0]}x{GOAL_SIZE[1]} with {GOAL_STEPS} steps, "
                                      "so here informational only") + "):", flush=True)
        for g in goals:
            state = "unknown" if g["met"] is None else ("met" if g["met"] else "NOT met")
            print(f"- {g['goal']}: {fmt_ms(g['value_ms'])} ms: {state}", flush=True)

    summary["exit_code"] = rc
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    if rc == 0 and args.require_goals and any(g["met"] is False for g in goals):
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
