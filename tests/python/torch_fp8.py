"""FP8 e4m3 linear layers for the torch references, quantized the way our DiTs quantize (docs/ENGINES.md, "FP8").

- Weights: quantized once, per output channel: scale = amax / 448 (1 for an all-zero row), code =
  e4m3(w * (1 / scale)) rounded to nearest even and saturated to +-448.
- Activations: quantized per token (per row of the flattened input) on every call by the same rule.
- The product: `torch._scaled_mm` with row-wise scales (an [M, 1] f32 token scale and a [1, N] f32 channel scale),
  f32 accumulation, bf16 output (sm_90, torch >= 2.5). On the CPU, where `_scaled_mm` has no row-wise kernel, the
  same codes and scales are dequantized to f32 and multiplied (an emulation with the same rounding of the operands),
  so the --tiny smoke runs take the FP8 path too.

`convert(model, selector)` swaps the chosen `nn.Linear` modules for `Fp8RowwiseLinear` in place (their bf16 weights
are dropped), or for `Fp8HalfLinear` where the selector names one half of a layer's output rows (our `mlp_value` /
`mlp_gate`: one half of a fused SwiGLU input projection in FP8, the other in bf16; a module name `NAME@0` or `NAME@1`
in a group table). `parse_spec` reads our `--precision fp8:GROUP[,GROUP...][,ends=N]` groups, and `block_selector` maps
them onto a diffusers model's blocks through a per-model table of module names.

Self-check (CPU, a few seconds): python3 tests/python/torch_fp8.py
"""

import sys

import torch
from torch import nn

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
GROUPS = ("qkv", "out", "mlp_in", "mlp_value", "mlp_gate", "mlp_out", "adaln")
# The four GEMM groups `all` names (adaln is only ever named on its own, as in our --precision).
ALL_GEMM_GROUPS = ("qkv", "out", "mlp_in", "mlp_out")


def quantize_rows(t):
    """Per-row e4m3 codes of `t` ([..., K]) and their f32 scales ([..., 1]): amax / 448, 1 for an all-zero row."""
    tf = t.float()
    amax = tf.abs().amax(dim=-1, keepdim=True)
    # A subnormal amax would give a zero scale: keep it at the smallest normal f32 (its codes are zeros anyway).
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).clamp(min=torch.finfo(torch.float32).tiny)
    # .to(float8_e4m3fn) turns out-of-range values into NaN, not +-448: saturate first.
    codes = (tf * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return codes, scale


_SCALED_MM_BIAS = {}


def scaled_mm_takes_bias(device):
    """Whether `torch._scaled_mm` with row-wise scales takes a bf16 bias on `device` (probed once per device).

    Raises when row-wise scaled FP8 GEMMs do not run there at all (an older torch or GPU): the caller reports it.
    """
    key = str(device)
    if key not in _SCALED_MM_BIAS:
        a = torch.ones(16, 32, device=device).to(FP8)
        b = torch.ones(16, 32, device=device).to(FP8)
        sa = torch.ones(16, 1, device=device)
        sb = torch.ones(1, 16, device=device)
        torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        try:
            bias = torch.ones(16, device=device, dtype=torch.bfloat16)
            torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
            _SCALED_MM_BIAS[key] = True
        except RuntimeError:
            _SCALED_MM_BIAS[key] = False
    return _SCALED_MM_BIAS[key]


class Fp8RowwiseLinear(nn.Module):
    """An `nn.Linear` in FP8 e4m3: per-output-channel weight scales, per-token activation scales, bf16 output."""

    def __init__(self, weight_codes, weight_scale, bias, fuse_bias):
        super().__init__()
        self.out_features, self.in_features = weight_codes.shape
        # The bias stays a bf16 parameter: diffusers reads a module's dtype from its first floating parameter
        # (get_parameter_dtype), which must not be the e4m3 codes.
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float().contiguous())
        self.register_buffer("weight_codes", weight_codes.contiguous())
        self.fuse_bias = fuse_bias

    @classmethod
    def from_linear(cls, linear):
        with torch.no_grad():
            codes, scale = quantize_rows(linear.weight)
        fuse_bias = linear.weight.is_cuda and linear.bias is not None and scaled_mm_takes_bias(linear.weight.device)
        return cls(codes, scale, linear.bias, fuse_bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"

    def forward(self, x):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xq, sx = quantize_rows(x2)
        if x2.is_cuda:
            y = torch._scaled_mm(xq, self.weight_codes.t(), scale_a=sx, scale_b=self.weight_scale,
                                 bias=self.bias if self.fuse_bias else None, out_dtype=torch.bfloat16)
            if self.bias is not None and not self.fuse_bias:
                y = y + self.bias
        else:
            # CPU emulation: the same codes and scales, dequantized, multiplied in f32, rounded once to bf16.
            w = self.weight_codes.float() * self.weight_scale.t()
            y = (xq.float() * sx) @ w.t()
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(torch.bfloat16)
        return y.reshape(*lead, self.out_features)


class Fp8HalfLinear(nn.Module):
    """An `nn.Linear` whose output rows are two halves, one in FP8 (`Fp8RowwiseLinear`) and one in bf16, the outputs
    concatenated in the layer's order: half `fp8_half` (0: the first rows) runs in FP8."""

    def __init__(self, fp8, bf16, fp8_half):
        super().__init__()
        self.fp8 = fp8
        self.bf16 = bf16
        self.fp8_half = fp8_half

    @classmethod
    def from_linear(cls, linear, fp8_half):
        n = linear.out_features // 2
        rows = (slice(0, n), slice(n, 2 * n))
        halves = []
        for h in (0, 1):
            part = nn.Linear(linear.in_features, n, bias=linear.bias is not None, device=linear.weight.device,
                             dtype=linear.weight.dtype)
            with torch.no_grad():
                part.weight.copy_(linear.weight[rows[h]])
                if linear.bias is not None:
                    part.bias.copy_(linear.bias[rows[h]])
            halves.append(part)
        fp8 = Fp8RowwiseLinear.from_linear(halves[fp8_half])
        return cls(fp8, halves[1 - fp8_half], fp8_half)

    def extra_repr(self):
        return f"half {self.fp8_half} of the output rows in e4m3, the other in bf16"

    def forward(self, x):
        a, b = self.fp8(x), self.bf16(x).to(torch.bfloat16)
        return torch.cat([a, b] if self.fp8_half == 0 else [b, a], dim=-1)


def gemm_shape_ok(linear, device):
    """`_scaled_mm` needs K and N to be multiples of 16 on the GPU; the CPU emulation takes any shape."""
    if torch.device(device).type != "cuda":
        return True
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert(model, selector):
    """Swaps every `nn.Linear` of `model` for which `selector(name, module)` is true for an `Fp8RowwiseLinear`, or,
    where it returns ("half", h), for an `Fp8HalfLinear` with half `h` in FP8.

    Returns {"converted": [names], "skipped": [names whose shape `_scaled_mm` refuses]}. The bf16 weights of the
    converted layers are freed once nothing else holds them.
    """
    # Names only, so each bf16 weight is dropped as soon as its layer is swapped (no second copy of the model).
    chosen = [(name, sel) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and (sel := selector(name, m))]
    converted, skipped = [], []
    for name, sel in chosen:
        linear = model.get_submodule(name)
        half = sel[1] if isinstance(sel, tuple) else None
        if not gemm_shape_ok(linear, linear.weight.device) or (half is not None and linear.out_features % 32):
            skipped.append(name)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if half is None:
            parent._modules[child] = Fp8RowwiseLinear.from_linear(linear)
        else:
            parent._modules[child] = Fp8HalfLinear.from_linear(linear, half)
        del linear
        converted.append(name if half is None else f"{name}@{half}")
    return {"converted": converted, "skipped": skipped}


def parse_spec(spec, default):
    """Our `--precision` FP8 spelling: `fp8` (the model's `default`), or `[fp8:]GROUP[,GROUP...][,ends=N]`.

    Returns (groups, ends) with groups a tuple in block order; `ends` defaults to 1 as in our engine.
    """
    text = spec.strip()
    if text == "fp8":
        text = default
    if text.startswith("fp8:"):
        text = text[len("fp8:"):]
    groups, ends, named = set(), 1, False
    for item in (s.strip() for s in text.split(",")):
        if item.startswith("ends="):
            try:
                ends = int(item[len("ends="):])
            except ValueError:
                raise ValueError(f"FP8 spec {spec!r}: {item!r} is not a block count") from None
            if ends < 0:
                raise ValueError(f"FP8 spec {spec!r}: ends must be >= 0")
            continue
        named = True
        if item == "all":
            groups.update(ALL_GEMM_GROUPS)
        elif item in GROUPS:
            groups.add(item)
        elif item != "none":
            raise ValueError(f"FP8 spec {spec!r}: unknown group {item!r} (one of {', '.join(GROUPS)}, all, none)")
    if not named:
        raise ValueError(f"FP8 spec {spec!r} names no group")
    # Both halves of mlp_in are mlp_in.
    if {"mlp_value", "mlp_gate"} <= groups or "mlp_in" in groups:
        groups -= {"mlp_value", "mlp_gate"}
        groups.add("mlp_in")
    return tuple(g for g in GROUPS if g in groups), ends


def spec_string(groups, ends):
    return f"fp8:{','.join(groups) or 'none'},ends={ends}"


def block_selector(blocks_prefix, num_blocks, group_modules, groups, ends):
    """A `convert` selector: in blocks `ends .. num_blocks - ends` of `blocks_prefix`, the modules that
    `group_modules` (group -> module names inside a block) lists for `groups`."""
    for g in groups:
        if g not in group_modules:
            raise ValueError(f"this model has no FP8 group {g!r} (it has {', '.join(group_modules)})")
    # Module name -> None (the whole layer in FP8) or the set of its output-row halves in FP8 (`NAME@H` entries).
    inside = {}
    for g in groups:
        for entry in group_modules[g]:
            name, at, half = entry.partition("@")
            if not at:
                inside[name] = None
            elif inside.get(name, set()) is not None:
                inside.setdefault(name, set()).add(int(half))
    inside = {n: (None if h is not None and h == {0, 1} else h) for n, h in inside.items()}
    fp8_blocks = set(range(ends, num_blocks - ends))

    def select(name, _module):
        if not name.startswith(blocks_prefix + "."):
            return False
        index, _, rest = name[len(blocks_prefix) + 1:].partition(".")
        if not (index.isdigit() and int(index) in fp8_blocks and rest in inside):
            return False
        halves = inside[rest]
        return True if halves is None else ("half", min(halves))

    return select


def _rows_of(linear, start, end):
    """A bias-free `nn.Linear` of rows `start..end` of `linear`'s weight."""
    part = nn.Linear(linear.in_features, end - start, bias=False, device=linear.weight.device,
                     dtype=linear.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(linear.weight[start:end])
    return part


def module_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _self_check():
    """Fp8RowwiseLinear against the bf16 linear on random data (CPU emulation, or _scaled_mm when a GPU is here)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    failures = 0
    for k, n, bias in ((256, 384, False), (320, 128, True)):
        lin = nn.Linear(k, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
            if bias:
                lin.bias.copy_(0.1 * torch.randn(n, generator=g))
        lin = lin.to(device=device, dtype=torch.bfloat16)
        # Rows of different magnitudes: per-token scales must follow each one.
        x = (torch.randn(2, 37, k, generator=g) * torch.logspace(-2, 2, 37).view(1, 37, 1)).to(device, torch.bfloat16)
        with torch.no_grad():
            ref = torch.nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            y_bf16 = lin(x)
            q = Fp8RowwiseLinear.from_linear(lin)
            y = q(x)
        err = float((y.double() - ref).norm() / ref.norm())
        err_bf16 = float((y_bf16.double() - ref).norm() / ref.norm())
        row_err = ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        ok = y.dtype == torch.bfloat16 and y.shape == y_bf16.shape and err < 0.05 and row_err < 0.08
        failures += not ok
        print(f"{device} K={k} N={n} bias={bias}: fp8 rel L2 {err:.4e} (bf16 {err_bf16:.4e}), worst row {row_err:.4e}: "
              f"{'ok' if ok else 'FAIL'}")
    codes, scale = quantize_rows(torch.tensor([[0.0, 0.0], [1e6, -3.0]]))
    ok = bool(torch.equal(scale.flatten(), torch.tensor([1.0, 1e6 / E4M3_MAX]))) and float(codes[1, 0].float()) == E4M3_MAX
    failures += not ok
    print(f"zero row scale 1, amax row saturates to 448: {'ok' if ok else 'FAIL'}")
    groups, ends = parse_spec("fp8:qkv,out,mlp_out,ends=1", "")
    ok = groups == ("qkv", "out", "mlp_out") and ends == 1 and parse_spec("fp8", "all,ends=2") == (ALL_GEMM_GROUPS, 2)
    failures += not ok
    ok = ok and parse_spec("mlp_value,mlp_gate,ends=0", "") == (("mlp_in",), 0) \
        and parse_spec("qkv,mlp_gate", "") == (("qkv", "mlp_gate"), 1)
    print(f"spec parsing: {'ok' if ok else 'FAIL'}")
    # One half of a layer in FP8: that half's rows are the FP8 layer of those rows, the other half's the bf16 layer's.
    k, n = 128, 64
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
    lin = lin.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(3, 5, k, generator=g).to(device, torch.bfloat16)
    with torch.no_grad():
        y = Fp8HalfLinear.from_linear(lin, 0)(x)
        first = Fp8RowwiseLinear.from_linear(_rows_of(lin, 0, n // 2))(x)
        second = _rows_of(lin, n // 2, n)(x)
    ok = bool(torch.equal(y[..., : n // 2], first)) and bool(torch.equal(y[..., n // 2:], second))
    select = block_selector("blocks", 3, {"mlp_value": ("ff@0",), "mlp_gate": ("ff@1",), "mlp_in": ("ff",)},
                            ("mlp_gate",), 0)
    ok = ok and select("blocks.1.ff", None) == ("half", 1) and not select("blocks.1.other", None)
    failures += not ok
    print(f"half of a layer in FP8: {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_self_check())
