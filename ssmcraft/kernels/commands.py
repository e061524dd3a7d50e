"""``ssmcraft bench SPEC``: time what users call, ``obj(inputs)`` (fwd, fwd+bwd, achieved
bandwidth, HBM floor), or with ``--layer`` the mixer built on the objective (fwd+bwd).

The HBM floor is the bytes that must move (every input read once, the output written once;
for the backward also ``dy`` read and one gradient per input written) divided by the copy
bandwidth measured in the same process. Times are ``triton.testing.do_bench`` medians. The
headline is always the public path (``obj(...)``, whose ``backend`` is reported); for the
diagonal family the kernel-level entry (``diagonal.diagonal_scan``) is printed beside it as a
diagnostic: the gap between the two is host overhead.
"""
from __future__ import annotations

import json
import math
import sys


def add_arguments(p):
    p.add_argument("spec", help="an objective spec: a path, or a library name such as longhorn_diag")
    p.add_argument("--shape", default="8,2048,1,1536,16",
                   help="B,T,H,d,m (d = V values per head, m = K keys); default 8,2048,1,1536,16")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="input/output dtype (state is fp32)")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--layer", action="store_true",
                   help="time the mixer (ObjectiveMixer: projections, conv, recurrence, gate) fwd+bwd instead; "
                        "d_model = H*d, bf16 autocast")
    p.add_argument("--out", help="also write the results as JSON to this file")


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Achieved device copy bandwidth in bytes/s (read + write counted), median of do_bench."""
    import torch
    import triton.testing
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100)
    return 2 * n * 4 / (ms * 1e-3)


def bench_ms(fn, warmup: int = 10, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (triton.testing.do_bench)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def random_inputs(obj, B, T, H, d, m, dtype, device, seed: int = 0, requires_grad: bool = False):
    """Inputs and params for ``obj`` with values in the ranges its spec declares
    (positive -> softplus, bounded -> sigmoid, negative params -> -U(0.5, 1.5), S4D-real init
    for A). Returns (inputs, params) in the API layout ([B, T, H, n] / [B, T, H]; params [*shape])."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    ir, spec = obj.ir, obj.spec
    size = {ir.dims[0]: d, ir.dims[1]: m}
    inputs = {}
    for n, dims in ir.inputs.items():
        shape = [B, T, H] + [size[x] for x in dims]
        t = torch.randn(shape, generator=g)
        decl = spec.inputs.get(n) if hasattr(spec, "inputs") else None
        positive = getattr(decl, "positive", False)
        bounded = getattr(decl, "bounded", False)
        if bounded:
            t = torch.sigmoid(t + 2.0) if not positive else torch.sigmoid(t)
        elif positive:
            t = torch.nn.functional.softplus(t) * 0.5
        elif n == "k":
            t = t / math.sqrt(max(1, m))
        inputs[n] = t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
    params = {}
    for n, dims in ir.params.items():
        shape = [size[x] for x in dims]
        decl = spec.params.get(n)
        init = getattr(decl, "init", None)
        if init == "s4d_real" and len(shape) == 2:
            t = -torch.arange(1, shape[1] + 1, dtype=torch.float32).repeat(shape[0], 1)
        elif getattr(decl, "negative", False):
            t = -(torch.rand(shape, generator=g) + 0.5)
        else:
            t = torch.rand(shape, generator=g) * 0.5 + 0.5
        params[n] = t.to(device=device).requires_grad_(requires_grad)
    return inputs, params


def floor_bytes(inputs: dict, params: dict, out_numel: int, out_elt: int, backward: bool) -> int:
    """Bytes that must move: inputs read + output written (+ dy read and one gradient per input written)."""
    ins = sum(t.numel() * t.element_size() for t in inputs.values())
    ins += sum(t.numel() * t.element_size() for t in params.values())
    out = out_numel * out_elt
    return ins + out + ((out + ins) if backward else 0)


def run_bench(spec_arg, shape, dtype_name: str = "bf16", backward: bool = True) -> dict:
    """Time one objective's kernel; returns a dict of figures (see module docstring)."""
    import torch

    import ssmcraft
    from ssmcraft.errors import SsmcraftError
    from ssmcraft.kernels import diagonal

    if not torch.cuda.is_available():
        raise SsmcraftError("ssmcraft bench needs a CUDA device (timings under the interpreter mean nothing)")
    B, T, H, d, m = shape
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    dev = torch.device("cuda")
    obj = ssmcraft.compile(spec_arg)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, dev, requires_grad=backward)
    obj.prefer = "triton"

    def fwd():
        return obj(inputs, params, None, False)[0]
    fwd()
    use_diag = obj.backend.startswith(f"triton:{diagonal.BACKEND_NAME}")   # the family obj() ran (GLA: key-decay)
    backend = obj.backend
    with torch.no_grad():
        t_fwd = bench_ms(fwd)
    res = {"spec": obj.name, "kind": obj.ir.kind, "backend": backend, "shape": {"B": B, "T": T, "H": H, "d": d, "m": m},
           "dtype": dtype_name, "device": torch.cuda.get_device_name(), "fwd_ms": t_fwd}
    bw = copy_bandwidth(dev)
    res["copy_bandwidth_GBps"] = bw / 1e9
    y = fwd()
    fb = floor_bytes(inputs, params, y.numel(), y.element_size(), False)
    res["fwd_floor_ms"] = fb / bw * 1e3
    res["fwd_GBps"] = fb / (t_fwd * 1e-3) / 1e9
    res["fwd_x_floor"] = t_fwd / res["fwd_floor_ms"]
    if backward:
        dy = torch.randn_like(y)
        leaves = [t for t in list(inputs.values()) + list(params.values()) if t.requires_grad]

        def fwd_bwd():
            out = fwd()
            torch.autograd.grad(out, leaves, dy)
        t_fb = bench_ms(fwd_bwd)
        fbb = floor_bytes(inputs, params, y.numel(), y.element_size(), True)
        res.update({"fwd_bwd_ms": t_fb, "fwd_bwd_floor_ms": fbb / bw * 1e3, "fwd_bwd_GBps": fbb / (t_fb * 1e-3) / 1e9,
                    "fwd_bwd_x_floor": t_fb / (fbb / bw * 1e3)})
    if use_diag:
        with torch.no_grad():
            res["kernel_entry_fwd_ms"] = bench_ms(lambda: diagonal.diagonal_scan(obj, {**inputs, **params}, None, False)[0])
        res["configs"] = {str(k[0]): repr(v) for k, v in diagonal.tuned_configs().items()}
    return res


def run_layer_bench(spec_arg, shape) -> dict:
    """Time the mixer on an objective, fwd and fwd+bwd, bf16 autocast: h [B, T, H*d] -> [B, T, H*d]."""
    import torch

    from ssmcraft.errors import SsmcraftError
    from ssmcraft.layers.config import mixer_config
    from ssmcraft.layers.mixer import ObjectiveMixer

    if not torch.cuda.is_available():
        raise SsmcraftError("ssmcraft bench needs a CUDA device (timings under the interpreter mean nothing)")
    B, T, H, d, m = shape
    cfg = mixer_config({"kind": "objective", "objective": spec_arg, "heads": H, "state_size": m, "expand": 1})
    mixer = ObjectiveMixer(cfg, H * d).cuda()
    h = torch.randn(B, T, H * d, device="cuda", requires_grad=True)

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return mixer(h)
    y = fwd()
    dy = torch.randn_like(y)
    with torch.no_grad():
        t_fwd = bench_ms(fwd)
    t_fb = bench_ms(lambda: torch.autograd.grad(fwd(), [h, *mixer.parameters()], dy, allow_unused=True))
    return {"spec": mixer.obj.name, "kind": mixer.obj.ir.kind, "backend": mixer.last_backend, "layer": True,
            "shape": {"B": B, "T": T, "H": H, "d": d, "m": m}, "dtype": "bf16 autocast",
            "device": torch.cuda.get_device_name(), "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb,
            "tokens_per_s_fwd_bwd": B * T / (t_fb * 1e-3)}


def _print(res: dict) -> None:
    s = res["shape"]
    if res.get("layer"):
        print(f"mixer on {res['spec']} ({res['kind']}) on {res['device']}, backend {res['backend']}, "
              f"B={s['B']} T={s['T']} H={s['H']} d={s['d']} m={s['m']} {res['dtype']}")
        print(f"  fwd {res['fwd_ms']:.3f} ms   fwd+bwd {res['fwd_bwd_ms']:.3f} ms   "
              f"({res['tokens_per_s_fwd_bwd']:.0f} tokens/s fwd+bwd)")
        return
    print(f"{res['spec']} ({res['kind']}) on {res['device']}, backend {res['backend']}, "
          f"B={s['B']} T={s['T']} H={s['H']} d={s['d']} m={s['m']} {res['dtype']}")
    print(f"  copy bandwidth     {res['copy_bandwidth_GBps']:8.0f} GB/s")
    print(f"  fwd                {res['fwd_ms']:8.3f} ms   {res['fwd_GBps']:7.0f} GB/s   "
          f"{res['fwd_x_floor']:5.2f}x the HBM floor ({res['fwd_floor_ms']:.3f} ms)")
    if "fwd_bwd_ms" in res:
        print(f"  fwd+bwd            {res['fwd_bwd_ms']:8.3f} ms   {res['fwd_bwd_GBps']:7.0f} GB/s   "
              f"{res['fwd_bwd_x_floor']:5.2f}x the HBM floor ({res['fwd_bwd_floor_ms']:.3f} ms)")
    if "kernel_entry_fwd_ms" in res:
        print(f"  diagnostic: kernel entry diagonal_scan fwd {res['kernel_entry_fwd_ms']:.3f} ms "
              f"(obj() overhead {res['fwd_ms'] - res['kernel_entry_fwd_ms']:+.3f} ms)")
    for k, v in res.get("configs", {}).items():
        print(f"  config ({k})  {v}")


def run(args) -> int:
    from ssmcraft.errors import SsmcraftError
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        raise SsmcraftError(f"--shape must be B,T,H,d,m integers, got {args.shape!r}")
    if len(shape) != 5 or min(shape) < 1:
        raise SsmcraftError(f"--shape must be five positive integers B,T,H,d,m, got {args.shape!r}")
    if args.layer:
        res = run_layer_bench(args.spec, shape)
    else:
        res = run_bench(args.spec, shape, args.dtype, backward=not args.no_backward)
    _print(res)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
