"""Probe: how many cuBLASLt configurations run row-wise FP8 (and INT8) GEMMs at the DiT shapes, and how fast.

cuBLASLt's heuristic offers one algorithm for an FP8 GEMM with outer-vector (row-wise) scales on sm_90, so the
engine's timed selection has nothing to choose from. This probe walks the configuration space the library
exposes instead: every algorithm id (`cublasLtMatmulAlgoGetIds`), and for each its tiles x stages (with `--full`
also every CTA swizzling, custom option and cluster shape: millions of checks a shape), each kept only if
`cublasLtMatmulAlgoCheck` accepts it with the GEMM's own descriptors and a 32 MiB workspace (the engine's). Every
accepted configuration is timed briefly; the fastest few are re-timed sustained (100 calls back to back, best of
three rounds, alternated with the heuristic's choice) and their output compared with the product of the codes and
scales. The INT8 forms with scales and bf16 output, which the heuristic refuses on sm_90, come first: any
configuration the check accepts for them would make INT8 GEMMs free of the int32 round trip. Prints one JSON
object; `--json PATH` writes it too.

Loads the same library the engine does: `$TF_CUBLASLT` or libcublasLt.so.13 from the CUDA toolkit.
"""

import argparse
import ctypes
import itertools
import json
import os
import time

import torch

from int8_gemm_probe import quant_int8_rows
from torch_fp8 import quantize_rows as quant_fp8_rows

SHAPES = {  # name: (M tokens, N outputs, K)
    "h3_qkv": (6026, 21504, 5376),
    "h3_out": (6026, 5376, 7168),
    "h3_fc1_half": (6026, 14336, 5376),
    "h3_fc2": (6026, 5376, 14336),
    "qwen_qkv": (4096, 12288, 4096),
    "qwen_out": (4096, 4096, 4096),
    "qwen_mlp_in": (4096, 24576, 4096),
    "qwen_mlp_out": (4096, 4096, 12288),
}

WORKSPACE = 32 << 20
COMPUTE_32F, COMPUTE_32I = 68, 72
R_32F, R_32I, R_8I, R_16BF, R_E4M3 = 0, 10, 3, 14, 28
POINTER_MODE, ALPHA_DEVICE_VECTOR_BETA_ZERO = 2, 3
TRANSA, TRANSB, A_SCALE_POINTER, B_SCALE_POINTER, FAST_ACCUM, A_SCALE_MODE, B_SCALE_MODE = 3, 4, 17, 18, 25, 31, 32
OUTER_VEC_32F = 3
PREF_MAX_WORKSPACE = 1
CAP_SPLITK, CAP_SWIZZLE, CAP_TILES, CAP_CUSTOM_MAX, CAP_STAGES = 0, 2, 6, 7, 13
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_SWIZZLE, CFG_CUSTOM, CFG_STAGES, CFG_INNER, CFG_CLUSTER = 0, 1, 2, 4, 5, 6, 7, 8
CLUSTERS = [0, 2, 3, 5, 6, 4, 8]  # auto, 1x1, 2x1, 1x2, 2x2, 4x1, 1x4


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load():
    path = os.environ.get("TF_CUBLASLT")
    for cand in [path, "/usr/local/cuda/targets/x86_64-linux/lib/libcublasLt.so.13", "libcublasLt.so.13"]:
        if not cand:
            continue
        try:
            return ctypes.CDLL(cand), cand
        except OSError:
            continue
    raise SystemExit("libcublasLt.so.13 not found: set TF_CUBLASLT")


LIB, LIB_PATH = load()
VP = ctypes.c_void_p
_I, _S, _U64 = ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
for _name, _args in {
    "cublasLtCreate": [VP],
    "cublasLtMatmulDescCreate": [VP, _I, _I],
    "cublasLtMatmulDescSetAttribute": [VP, _I, VP, _S],
    "cublasLtMatrixLayoutCreate": [VP, _I, _U64, _U64, ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [VP],
    "cublasLtMatmulPreferenceSetAttribute": [VP, _I, VP, _S],
    "cublasLtMatmulPreferenceDestroy": [VP],
    "cublasLtMatmulAlgoGetHeuristic": [VP, VP, VP, VP, VP, VP, VP, _I, VP, VP],
    "cublasLtMatmulAlgoGetIds": [VP, _I, _I, _I, _I, _I, _I, _I, VP, VP],
    "cublasLtMatmulAlgoInit": [VP, _I, _I, _I, _I, _I, _I, _I, VP],
    "cublasLtMatmulAlgoCheck": [VP, VP, VP, VP, VP, VP, VP, VP],
    "cublasLtMatmulAlgoCapGetAttribute": [VP, _I, VP, _S, VP],
    "cublasLtMatmulAlgoConfigSetAttribute": [VP, _I, VP, _S],
    "cublasLtMatmulAlgoConfigGetAttribute": [VP, _I, VP, _S, VP],
    "cublasLtMatmul": [VP, VP, VP, VP, VP, VP, VP, VP, VP, VP, VP, VP, VP, VP, _S, VP],
}.items():
    getattr(LIB, _name).argtypes = _args
    getattr(LIB, _name).restype = _I
LIB.cublasLtGetVersion.restype = _S
LIB.cublasLtGetVersion.argtypes = []


def ok(code, what):
    if code != 0:
        raise RuntimeError(f"{what} -> status {code}")


def set_attr(fn, obj, attr, value):
    ok(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


def cap_u32_list(algo, attr):
    written = ctypes.c_size_t(0)
    LIB.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
    count = written.value // 4
    if count == 0:
        return []
    buf = (ctypes.c_uint32 * count)()
    ok(
        LIB.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, ctypes.sizeof(buf), ctypes.byref(written)),
        "cap list",
    )
    return list(buf)


def cap_i32(algo, attr):
    value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
    code = LIB.cublasLtMatmulAlgoCapGetAttribute(
        ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written)
    )
    return value.value if code == 0 else None


def config(algo):
    out = {}
    for name, attr, ctype in [
        ("id", CFG_ID, ctypes.c_int32),
        ("tile", CFG_TILE, ctypes.c_uint32),
        ("stages", CFG_STAGES, ctypes.c_uint32),
        ("splitk", CFG_SPLITK, ctypes.c_int32),
        ("swizzle", CFG_SWIZZLE, ctypes.c_uint32),
        ("custom", CFG_CUSTOM, ctypes.c_uint32),
        ("inner", CFG_INNER, ctypes.c_uint16),
        ("cluster", CFG_CLUSTER, ctypes.c_uint16),
    ]:
        value, written = ctype(0), ctypes.c_size_t(0)
        code = LIB.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attr, ctypes.byref(value), ctypes.sizeof(value), ctypes.byref(written)
        )
        out[name] = value.value if code == 0 else None
    return out


class Problem:
    """One row-major GEMM Y[M,N] = X[M,K] W[N,K]^T in cuBLASLt's column-major terms, as the engine issues it."""

    def __init__(self, handle, kind, m, n, k):
        self.handle, self.kind, self.m, self.n, self.k = handle, kind, m, n, k
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        # fp8: e4m3 codes, row-wise scales, bf16 out (the engine's FP8 GEMM). int8: exact int32 products.
        # int8_rowwise: INT8 codes with row-wise scales and bf16 out; int8_alpha: INT8 with the channel scales as a
        # device alpha vector, bf16 out (the heuristic offers neither on sm_90; the walk asks every configuration).
        if kind == "fp8":
            self.x, self.xs = quant_fp8_rows(x)
            self.w, self.ws = quant_fp8_rows(w)
            out_dtype, types = torch.bfloat16, (COMPUTE_32F, R_32F, R_E4M3, R_E4M3, R_16BF, R_16BF)
        else:
            self.x, self.xs = quant_int8_rows(x)
            self.w, self.ws = quant_int8_rows(w)
            if kind == "int8":
                out_dtype, types = torch.int32, (COMPUTE_32I, R_32I, R_8I, R_8I, R_32I, R_32I)
            else:
                out_dtype, types = torch.bfloat16, (COMPUTE_32I, R_32F, R_8I, R_8I, R_16BF, R_16BF)
        self.xs, self.ws = self.xs.reshape(-1).contiguous(), self.ws.reshape(-1).contiguous()
        self.y = torch.empty(m, n, device="cuda", dtype=out_dtype)
        if kind == "int8":
            self.alpha, self.beta = ctypes.c_int32(1), ctypes.c_int32(0)
        elif kind == "int8_alpha":
            self.alpha, self.beta = VP(self.ws.data_ptr()), ctypes.c_float(0.0)
        else:
            self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.types = types
        self.desc = VP()
        ok(LIB.cublasLtMatmulDescCreate(ctypes.byref(self.desc), types[0], types[1]), "desc")
        set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, TRANSA, ctypes.c_int32(1))
        set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, TRANSB, ctypes.c_int32(0))
        if kind in ("fp8", "int8_rowwise"):
            set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, A_SCALE_POINTER, VP(self.ws.data_ptr()))
            set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, B_SCALE_POINTER, VP(self.xs.data_ptr()))
            if kind == "fp8":
                set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, FAST_ACCUM, ctypes.c_int8(1))
            set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, A_SCALE_MODE, ctypes.c_int32(OUTER_VEC_32F))
            set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, B_SCALE_MODE, ctypes.c_int32(OUTER_VEC_32F))
        if kind == "int8_alpha":
            mode = ctypes.c_int32(ALPHA_DEVICE_VECTOR_BETA_ZERO)
            set_attr(LIB.cublasLtMatmulDescSetAttribute, self.desc, POINTER_MODE, mode)
        self.a, self.b, self.d = VP(), VP(), VP()
        ok(LIB.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), types[2], k, n, k), "layout a")
        ok(LIB.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), types[3], k, m, k), "layout b")
        ok(LIB.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), types[5], n, m, n), "layout d")
        self.workspace = torch.empty(WORKSPACE, device="cuda", dtype=torch.uint8)
        self.stream = VP(torch.cuda.current_stream().cuda_stream)

    def heuristic(self, requested=32):
        pref = VP()
        ok(LIB.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        set_attr(LIB.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE, ctypes.c_uint64(WORKSPACE))
        results = (HeuristicResult * requested)()
        found = ctypes.c_int(0)
        code = LIB.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a, self.b, self.d, self.d, pref, requested, results, ctypes.byref(found)
        )
        LIB.cublasLtMatmulPreferenceDestroy(pref)
        if code != 0:
            return []
        return [results[i].algo for i in range(found.value) if results[i].state == 0]

    def check(self, algo):
        result = HeuristicResult()
        code = LIB.cublasLtMatmulAlgoCheck(
            self.handle, self.desc, self.a, self.b, self.d, self.d, ctypes.byref(algo), ctypes.byref(result)
        )
        return code == 0 and result.state == 0 and result.workspace <= WORKSPACE

    def expected(self):
        """The product the GEMM should give, from the codes and scales in f32 (int32 exact for `int8`)."""
        prod = self.x.float() @ self.w.float().t()
        if self.kind == "int8":
            return prod
        if self.kind == "int8_alpha":
            return prod * self.ws[None, :]
        return prod * self.xs[:, None] * self.ws[None, :]

    def run(self, algo):
        alpha = self.alpha if isinstance(self.alpha, VP) else ctypes.byref(self.alpha)
        code = LIB.cublasLtMatmul(
            self.handle, self.desc, alpha, VP(self.w.data_ptr()), self.a,
            VP(self.x.data_ptr()), self.b, ctypes.byref(self.beta), VP(self.y.data_ptr()), self.d,
            VP(self.y.data_ptr()), self.d, ctypes.byref(algo), VP(self.workspace.data_ptr()), WORKSPACE,
            self.stream,
        )
        if code != 0:
            raise RuntimeError(f"cublasLtMatmul -> status {code}")

    def time(self, algo, iters, rounds=1):
        best = float("inf")
        for _ in range(rounds):
            self.run(algo)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                self.run(algo)
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / iters)
        return best

    def enumerate(self, full, max_seconds):
        """Checks configurations of every algorithm id: tiles x stages (swizzle off, custom option 0, cluster
        chosen by the library), or with `full` also every swizzle, custom option and cluster shape. Stops after
        `max_seconds` (the result says so)."""
        deadline = time.time() + max_seconds
        ids = (ctypes.c_int * 512)()
        count = ctypes.c_int(0)
        ok(LIB.cublasLtMatmulAlgoGetIds(self.handle, *self.types, 512, ids, ctypes.byref(count)), "GetIds")
        accepted, tried, per_id = [], 0, {}
        self.truncated = False
        for algo_id in list(ids)[: count.value]:
            base = Algo()
            if LIB.cublasLtMatmulAlgoInit(self.handle, *self.types, algo_id, ctypes.byref(base)) != 0:
                continue
            tiles = cap_u32_list(base, CAP_TILES) or [0]
            stages = cap_u32_list(base, CAP_STAGES) or [0]
            swizzles = [0, 1] if cap_i32(base, CAP_SWIZZLE) and full else [0]
            customs = range((cap_i32(base, CAP_CUSTOM_MAX) or 0) + 1) if full else range(1)
            clusters = CLUSTERS if full else [0]
            kept = 0
            for tile, stage, swizzle, custom, cluster in itertools.product(tiles, stages, swizzles, customs, clusters):
                if time.time() > deadline:
                    self.truncated = True
                    break
                algo = Algo()
                ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
                try:
                    set_attr(LIB.cublasLtMatmulAlgoConfigSetAttribute, ctypes.byref(algo), CFG_TILE, ctypes.c_uint32(tile))
                    set_attr(LIB.cublasLtMatmulAlgoConfigSetAttribute, ctypes.byref(algo), CFG_STAGES, ctypes.c_uint32(stage))
                    set_attr(LIB.cublasLtMatmulAlgoConfigSetAttribute, ctypes.byref(algo), CFG_SWIZZLE, ctypes.c_uint32(swizzle))
                    set_attr(LIB.cublasLtMatmulAlgoConfigSetAttribute, ctypes.byref(algo), CFG_CUSTOM, ctypes.c_uint32(custom))
                    set_attr(LIB.cublasLtMatmulAlgoConfigSetAttribute, ctypes.byref(algo), CFG_CLUSTER, ctypes.c_uint16(cluster))
                except RuntimeError:
                    continue
                tried += 1
                if self.check(algo):
                    accepted.append(algo)
                    kept += 1
            per_id[algo_id] = {
                "tiles": len(tiles), "stages": len(stages), "swizzles": len(swizzles),
                "custom_options": len(customs), "accepted": kept,
            }
        return accepted, tried, per_id, list(ids)[: count.value]


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def probe(handle, kind, name, m, n, k, screen_limit, top, full, max_seconds):
    prob = Problem(handle, kind, m, n, k)
    flops = 2.0 * m * n * k
    heur = prob.heuristic()
    out = {"shape": name, "kind": kind, "m": m, "n": n, "k": k, "heuristic_results": len(heur)}
    first = heur[0] if heur else None
    if first is not None:
        out["heuristic_first"] = config(first)
    expected = prob.expected()
    started = time.time()
    accepted, tried, per_id, ids = prob.enumerate(full, max_seconds)
    out.update(algo_ids=ids, configs_tried=tried, configs_accepted=len(accepted), per_id=per_id,
               walk="full" if full else "tiles x stages", walk_truncated=prob.truncated)
    out["enumerate_s"] = round(time.time() - started, 3)
    screened = []
    for algo in accepted[:screen_limit]:
        try:
            screened.append((prob.time(algo, 3), algo))
        except RuntimeError as err:
            screened.append((float("inf"), algo))
            out.setdefault("run_failures", []).append(str(err))
    screened.sort(key=lambda t: t[0])
    out["screened"] = len(screened)
    finalists = [a for t, a in screened[:top] if t != float("inf")]
    rows = []
    heur_best = float("inf")
    results = {i: float("inf") for i in range(len(finalists))}
    for _ in range(3):  # alternate the heuristic's choice with the finalists, sustained
        if first is not None:
            heur_best = min(heur_best, prob.time(first, 100))
        for i, algo in enumerate(finalists):
            results[i] = min(results[i], prob.time(algo, 100))
    for i, algo in enumerate(finalists):
        prob.run(algo)
        torch.cuda.synchronize()
        rows.append({"config": config(algo), "ms": round(results[i], 4),
                     "rate": round(flops / results[i] / 1e9, 1),
                     "vs_heuristic": round(results[i] / heur_best, 4) if first is not None else None,
                     "rel_l2_to_expected": rel_l2(prob.y.float(), expected)})
    if first is not None:
        prob.run(first)
        torch.cuda.synchronize()
        out["heuristic_rel_l2_to_expected"] = rel_l2(prob.y.float(), expected)
        out["heuristic_ms"] = round(heur_best, 4)
        out["heuristic_rate"] = round(flops / heur_best / 1e9, 1)
    out["finalists"] = rows
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the JSON object here too")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from SHAPES")
    parser.add_argument("--kinds", default="int8_rowwise,int8_alpha,fp8,int8", help="comma-separated kinds")
    parser.add_argument("--full", action="store_true",
                        help="walk swizzling, custom options and cluster shapes too (millions of checks a shape)")
    parser.add_argument("--max-seconds", type=float, default=20.0, help="checking time a shape may take, at most")
    parser.add_argument("--screen-limit", type=int, default=400, help="configurations timed briefly, at most")
    parser.add_argument("--top", type=int, default=6, help="configurations re-timed sustained")
    args = parser.parse_args()
    handle = VP()
    ok(LIB.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    report = {"library": LIB_PATH, "version": LIB.cublasLtGetVersion(), "device": torch.cuda.get_device_name(),
              "results": []}
    for kind in args.kinds.split(","):
        for name in args.shapes.split(","):
            if kind.startswith("int8") and not name.startswith("h3_"):
                continue
            m, n, k = SHAPES[name]
            try:
                row = probe(handle, kind, name, m, n, k, args.screen_limit, args.top, args.full, args.max_seconds)
            except RuntimeError as err:
                row = {"shape": name, "kind": kind, "error": str(err)}
            best = min((f["ms"] for f in row.get("finalists", [])), default=None)
            print(f"{kind} {name}: heuristic {row.get('heuristic_ms')} ms ({row.get('heuristic_results')} offered), "
                  f"{row.get('configs_accepted')} of {row.get('configs_tried')} configurations accepted"
                  f"{' (walk cut short)' if row.get('walk_truncated') else ''}, best {best} ms "
                  f"(rel L2 {min((f['rel_l2_to_expected'] for f in row.get('finalists', [])), default=None)})",
                  flush=True)
            report["results"].append(row)
            if args.json:  # after every shape, so a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    fh.write(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
