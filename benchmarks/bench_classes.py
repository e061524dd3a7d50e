"""Every library objective through ``obj()`` at one shape, in one process: fwd and fwd+bwd ms and
the ratio to DeltaNet's fwd+bwd measured in the same run (the structure-class table).

Run on a CUDA machine:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_classes.py [--shape 8,2048,16,64,64] [--dtype bf16]
        [--only longhorn,wd_longhorn] [--specs my_layer.yaml,...] [--profile] [--json OUT.json]

Inputs as ``ssmcraft bench`` draws them (``commands.random_inputs``), timed as it times them
(``timing.obj_calls`` + ``timing.time_calls``: ``do_bench`` medians; fwd under ``no_grad``, fwd+bwd
``autograd.grad`` of ``y`` with respect to every input). ``--specs`` adds composed objectives (spec
files) after the library's. ``--profile`` adds each objective's GPU
kernels of one fwd+bwd (torch profiler: name, calls, total us), which says where the time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ssmcraft  # noqa: E402
from ssmcraft.compiler.library import library_names  # noqa: E402
from ssmcraft.runtime import timing  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402

REFERENCE = "deltanet"


def kernel_profile(fn, n: int = 3) -> list[tuple[str, int, float]]:
    """(kernel name, calls per fn(), GPU us per fn()) of ``n`` calls, largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count >= n:
            rows.append((e.key, e.count // n, us / n))
    return sorted(rows, key=lambda r: -r[2])


def measure(name: str, shape, dtype, profile: bool) -> dict:
    B, T, H, d, m = shape
    obj = ssmcraft.compile(name)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, torch.device("cuda"), requires_grad=True)
    y = obj(inputs, params, None, False)[0]
    dy = torch.randn_like(y)
    calls = timing.obj_calls(obj, inputs, params, None, False, dy)
    calls.pop("onethread", None)
    t = timing.time_calls(calls)
    row = {"spec": name, "kind": obj.ir.kind, "backend": obj.backend,
           "fwd_ms": t["eager_fwd_ms"], "fwd_bwd_ms": t["eager_fwd_bwd_ms"]}
    if profile:
        row["kernels"] = kernel_profile(calls["eager"]["fwd_bwd"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--only", default="", help="comma-separated objective names (default: the library)")
    ap.add_argument("--specs", default="", help="comma-separated spec files of composed objectives to add")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of one fwd+bwd")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_classes.py needs a CUDA device (timings under the interpreter mean nothing)")
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    names = [n for n in args.only.split(",") if n] or list(library_names())
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    names += [p for p in args.specs.split(",") if p]
    rows = []
    for name in names:
        try:
            row = measure(name, shape, dtype, args.profile)
        except Exception as e:  # noqa: BLE001: one objective's failure is a row of the table, not the end of it
            row = {"spec": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        rows.append(row)
        if "kernels" in row:
            print(f"-- {name} ({row['backend']}): GPU kernels of one fwd+bwd")
            for k, c, us in row["kernels"][:12]:
                print(f"   {us:10.1f} us  x{c:<3d} {k[:110]}")
        torch.cuda.empty_cache()
    ref = next((r["fwd_bwd_ms"] for r in rows if r["spec"] == REFERENCE and "fwd_bwd_ms" in r), None)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, shape B,T,H,d,m = {args.shape}, "
          f"{args.dtype}; ratio: fwd+bwd / {REFERENCE}'s fwd+bwd (same process)")
    print(f"| objective | kind | backend | fwd ms | fwd+bwd ms | x {REFERENCE} fwd+bwd |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['spec']} | - | {r['error'][:80]} | - | - | - |")
            continue
        ratio = f"{r['fwd_bwd_ms'] / ref:.2f}" if ref else "-"
        print(f"| {r['spec']} | {r['kind']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "dtype": args.dtype,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
