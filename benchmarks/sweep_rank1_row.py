"""Per-row rank-1 family at the issue-27 shape through ``obj()``: a correctness check of every
objective of the family (float64 reference, NaN-poisoned outputs, odd T) at a small shape, then
(BV, warps) of the forward and backward kernels swept for Longhorn, wd_longhorn and
gated_longhorn, DeltaNet's fwd+bwd in the same process as the reference.

    PYTHONUNBUFFERED=1 python3 benchmarks/sweep_rank1_row.py [--shape 8,2048,16,64,64] [--no-check]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.runtime import timing  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from bench_rank1_row import check  # noqa: E402

FAMILY = ("longhorn", "wd_longhorn", "gated_longhorn")


def calls(name, shape):
    B, T, H, d, m = shape
    obj = ssmcraft.compile(name)
    inputs, params = random_inputs(obj, B, T, H, d, m, torch.bfloat16, torch.device("cuda"), requires_grad=True)
    y = obj(inputs, params, None, False)[0]
    c = timing.obj_calls(obj, inputs, params, None, False, torch.randn_like(y))["eager"]
    return obj, c


def timed(c):
    with torch.no_grad():
        f = timing.bench_ms(c["fwd"])
    return f, timing.bench_ms(c["fwd_bwd"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,2048,16,64,64")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--configs", default="16x2,8x1,16x1,16x4,32x4,8x2")
    ap.add_argument("--chunks", default=str(R.DECAY_CHUNK),
                    help="checkpoint intervals of a decay's backward (rank1_row.DECAY_CHUNK) to sweep")
    ap.add_argument("--profile", action="store_true", help="GPU kernels of one fwd+bwd at each objective's best")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    ok = True
    if not args.no_check:
        R.POISON = True
        for name in FAMILY + ("deltanet", "gated_deltanet"):
            obj = ssmcraft.compile(name)
            for dt in (torch.float32, torch.bfloat16):
                ok &= check(obj, 2, 300, 2, 64, 64, dt)
                ok &= check(obj, 1, 131, 1, 16, 40, dt)
        R.POISON = False
    cfgs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    _, dn = calls("deltanet", shape)
    ref = timed(dn)[1]
    print(f"{torch.cuda.get_device_name()} shape {args.shape} bf16; deltanet fwd+bwd {ref:.3f} ms")
    rows = []
    chunks = [int(x) for x in args.chunks.split(",")]
    default_chunk = R.DECAY_CHUNK
    for name in FAMILY:
        obj, c = calls(name, shape)
        for chunk in (chunks if name != "longhorn" else [R.CHUNK]):    # Longhorn: a == 1, no kept states
            R.DECAY_CHUNK = chunk
            for cf in cfgs:
                R.set_config(fwd=cf, bwd=cf)
                f, fb = timed(c)
                rows.append((name, cf + (chunk,), f, fb))
                print(f"  {name:15s} BV={cf[0]:3d} warps={cf[1]} chunk={chunk}: fwd {f:.3f} fwd+bwd {fb:.3f} ms",
                      flush=True)
        R.set_config()
        R.DECAY_CHUNK = default_chunk
    best = {}
    for name, cf, f, fb in rows:
        bf = best.setdefault(name, {"f": (1e9, None), "fb": (1e9, None)})
        bf["f"] = min(bf["f"], (f, cf))
        bf["fb"] = min(bf["fb"], (fb, cf))
    print("| objective | best fwd ms (cfg) | best fwd+bwd ms (cfg) | x deltanet |")
    for name, bf in best.items():
        print(f"| {name} | {bf['f'][0]:.3f} {bf['f'][1]} | {bf['fb'][0]:.3f} {bf['fb'][1]} | {bf['fb'][0] / ref:.2f} |")
    if args.profile:
        from ssmcraft.bench.classes_commands import kernel_profile
        for name, bf in best.items():
            cf = bf["fb"][1]
            R.set_config(fwd=cf[:2], bwd=cf[:2])
            R.DECAY_CHUNK = cf[2]
            print(f"-- {name} at {cf}: GPU kernels of one fwd+bwd")
            for k, n, us in kernel_profile(calls(name, shape)[1]["fwd_bwd"])[:8]:
                print(f"   {us:9.1f} us x{n} {k[:90]}")
    print("checks", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
