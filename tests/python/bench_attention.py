#!/usr/bin/env python3
"""Times torch's scaled_dot_product_attention (flash and cuDNN backends) at one attention shape.

Called by `tf bench attention` so that our kernel and torch's are measured in the same run on the same GPU.
Prints one JSON object on the last line of stdout:
  {"torch": "<version>", "device": "<name>", "shape": {...}, "results": {"flash": {"ms": .., "tflops": ..}, ...}}
A backend that cannot run the shape reports {"error": "<why>"} instead of timings.
"""
import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queries", type=int, default=4096)
    parser.add_argument("--keys", type=int, default=4176)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device"}))
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    shape_q = (args.batch, args.heads, args.queries, args.head_dim)
    shape_k = (args.batch, args.heads, args.keys, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape_k, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_k, device=device, dtype=torch.bfloat16, generator=gen)
    flops = 4.0 * args.batch * args.heads * args.queries * args.keys * args.head_dim

    results = {}
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    for name, backend in backends:
        try:
            with sdpa_kernel([backend]):
                for _ in range(args.warmup):
                    F.scaled_dot_product_attention(q, k, v)
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    F.scaled_dot_product_attention(q, k, v)
                stop.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(stop) / args.iters
            results[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as exc:  # a backend unavailable for this shape or build
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}

    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device),
                "shape": {
                    "batch": args.batch,
                    "heads": args.heads,
                    "queries": args.queries,
                    "keys": args.keys,
                    "head_dim": args.head_dim,
                },
                "iters": args.iters,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
