"""Probe: INT8 (IMMA, int32 out) against FP8 row-wise and bf16 GEMMs at MiniMax H3's step shapes.

Times each GEMM sustained (back to back, as inside a step, so the card sits at its power cap) through torch's
cuBLASLt paths (`torch._int_mm`, `torch._scaled_mm` with row-wise scales, `torch.mm`), and measures the product
error of per-token x per-output-channel 8-bit codes against the f64 product, on Gaussian rows and on rows with
a few outlier channels. Prints one JSON object; `--json PATH` writes it too.
"""

import argparse
import json
import time

import torch

from torch_fp8 import quantize_rows as quant_fp8_rows


SHAPES = {  # name: (M, N, K) at S = 6026, hidden 5376, 56 x 128 heads, ffn 14336
    "qkv": (6026, 21504, 5376),
    "out": (6026, 5376, 7168),
    "fc1": (6026, 28672, 5376),
    "fc1_half": (6026, 14336, 5376),
    "fc2": (6026, 5376, 14336),
}


def quant_int8_rows(x):
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 127.0
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def speed(name, m, n, k, iters):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    flops = 2.0 * m * n * k
    out = {"shape": name, "m": m, "n": n, "k": k}
    out["bf16_ms"] = timed(lambda: torch.mm(x, w.t()), iters)
    xq8, xs8 = quant_fp8_rows(x)
    wq8, ws8 = quant_fp8_rows(w)
    try:
        out["fp8_rowwise_ms"] = timed(
            lambda: torch._scaled_mm(xq8, wq8.t(), scale_a=xs8, scale_b=ws8.t(), out_dtype=torch.bfloat16), iters
        )
    except Exception as err:  # noqa: BLE001 - report what the stack refuses
        out["fp8_rowwise_error"] = str(err)[:300]
    xqi, _ = quant_int8_rows(x)
    wqi, _ = quant_int8_rows(w)
    for label, b in (("int8_ms", wqi.t()), ("int8_rowmajor_b_ms", wqi.t().contiguous())):
        try:
            out[label] = timed(lambda b=b: torch._int_mm(xqi, b), iters)
        except Exception as err:  # noqa: BLE001
            out[label.replace("_ms", "_error")] = str(err)[:300]
    for key in list(out):
        if key.endswith("_ms"):
            out[key.replace("_ms", "_tflops")] = flops / (out[key] * 1e-3) / 1e12
    return out


def accuracy(outliers, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, n, k = 1024, 1024, 5376
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float64)
    if outliers:
        cols = torch.randperm(k, generator=gen, device="cuda")[:8]
        x[:, cols] *= 30.0
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float64) * 0.02
    exact = x @ w.t()

    def rel(y):
        return float((y.double() - exact).norm() / exact.norm())

    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    res = {"outliers": outliers, "bf16": rel(xb.float() @ wb.float().t())}
    xq, xs = quant_fp8_rows(xb)
    wq, ws = quant_fp8_rows(wb)
    res["fp8_rowwise"] = rel((xq.float() * xs) @ (wq.float() * ws).t())
    xq, xs = quant_int8_rows(xb)
    wq, ws = quant_int8_rows(wb)
    res["int8_rowwise"] = rel(torch._int_mm(xq, wq.t()).double() * xs.double() * ws.double().t())
    return res


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    started = time.time()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "speed": [speed(name, *shape, args.iters) for name, shape in SHAPES.items()],
        "accuracy": [accuracy(False), accuracy(True)],
    }
    report["wall_s"] = time.time() - started
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
