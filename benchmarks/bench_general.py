"""The general family's objectives through ``obj()`` at one shape, in one process, beside their
anchors: fwd and fwd+bwd ms, as ``bench_classes.py`` measures them, plus (``--sweep``) the same for
each forced (rows per program, num_warps, checkpoint interval, ``recurrent.ATOMIC_SUMS``), (``--profile``)
each row's GPU kernels of one fwd+bwd, and (``--fla``) FLA's ``fused_recurrent_delta_rule`` at
the same shape (per-head beta, K = d, V = m; what ``cauchy_delta``, a sequential per-head update,
is held against).

Run on a CUDA machine:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_general.py [--shape 8,2048,16,64,64] [--dtype bf16]
        [--only deltanet,longhorn,huber_longhorn,cauchy_delta,momentum_longhorn]
        [--sweep huber_longhorn:4:1,huber_longhorn:8:1:16,huber_longhorn:16:1:16:0,cauchy_delta:64:16] [--profile] [--fla]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import timing_table  # noqa: E402
from ssmcraft.bench.classes_commands import measure  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.runtime import timing  # noqa: E402

ONLY = "deltanet,longhorn,huber_longhorn,cauchy_delta,momentum_longhorn"


def fla_delta_rule(shape, dtype) -> dict:
    """FLA's ``fused_recurrent_delta_rule`` (q, k L2-normalised as cauchy_delta's are; beta per
    head): fwd and fwd+bwd ms (gradients of q, k, v, beta), timed as ``measure`` times ``obj()``."""
    from fla.ops.delta_rule import fused_recurrent_delta_rule
    B, T, H, d, m = shape
    dev = torch.device("cuda")
    q = torch.nn.functional.normalize(torch.randn(B, T, H, m, device=dev), dim=-1).to(dtype).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, m, device=dev), dim=-1).to(dtype).requires_grad_()
    v = torch.randn(B, T, H, d, device=dev, dtype=dtype).requires_grad_()
    beta = torch.rand(B, T, H, device=dev, dtype=dtype).requires_grad_()
    dy = torch.randn(B, T, H, d, device=dev, dtype=dtype)

    def fwd():
        return fused_recurrent_delta_rule(q, k, v, beta)[0]

    with torch.no_grad():
        f = timing.bench_ms(fwd)
    fb = timing.bench_ms(lambda: torch.autograd.grad(fwd(), (q, k, v, beta), dy))
    return {"spec": "FLA fused_recurrent_delta_rule", "kind": "anchor", "backend": "fla", "fwd_ms": f, "fwd_bwd_ms": fb}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--only", default=ONLY, help="comma-separated objective names, timed by the rules")
    ap.add_argument("--sweep", default="", help="comma-separated NAME:ROWS:WARPS[:CHUNK[:ATOMIC]], each timed with that "
                    "config forced (CHUNK: the backward's checkpoint interval; ATOMIC 0/1: recurrent.ATOMIC_SUMS)")
    ap.add_argument("--profile", action="store_true", help="print each row's GPU kernels of one fwd+bwd")
    ap.add_argument("--fla", action="store_true", help="add FLA's fused_recurrent_delta_rule")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_general.py needs a CUDA device")
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    runs = [(n, None) for n in args.only.split(",") if n]
    runs += [(c[0], tuple(int(x) for x in c[1:])) for c in (s.split(":") for s in args.sweep.split(",") if s)]
    rows = []
    keys = ("rows", "warps", "chunk", "atomic")
    atomic = G.ATOMIC_SUMS
    for name, cfg in runs:
        G.CONFIG.clear()
        if cfg is not None:
            G.CONFIG.update(zip(keys[:3], cfg[:3]))
            G.ATOMIC_SUMS = bool(cfg[3]) if len(cfg) > 3 else atomic
        try:
            row = measure(name, name, shape, dtype, args.profile)
            row["config"] = "rule" if cfg is None else ", ".join(f"{k} {v}" for k, v in zip(keys, cfg))
        except Exception as e:  # noqa: BLE001: one failure is a row of the table
            row = {"spec": name, "config": str(cfg), "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        G.CONFIG.clear()
        G.ATOMIC_SUMS = atomic
        rows.append(row)
        print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
        for k in row.get("kernels", ()):
            print(f"    {k[2]:10.1f} us  {k[1]}x  {k[0][:100]}", flush=True)
        torch.cuda.empty_cache()
    if args.fla:
        rows.append(fla_delta_rule(shape, dtype) | {"config": "FLA's"})
    timing_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B,T,H,d,m = {args.shape}, {args.dtype}",
                 rows, [("objective", "spec"), ("backend", "backend"), ("config", "config"), ("fwd ms", "fwd_ms"),
                        ("fwd+bwd ms", "fwd_bwd_ms")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
