"""GPU checks and timings of the rank-r per-row family (``rankr``: multi-key Longhorn, Woodbury updates;
``ssmcraft.ops.rankr_row.recurrent``).

    PYTHONUNBUFFERED=1 python benchmarks/bench_rankr_row.py [--quick] [--json OUT.json]
        [--shape 8,2048,16,64,64] [--variants new,old,bwd=16x2,budget=512] [--profile]

1. Correctness, fp32 and bf16: output, final state and every gradient (inputs and initial state,
   with a gradient on the final state) of ``longhorn_2key`` against the float64 reference loop
   (on the bf16-rounded inputs for bf16), outputs NaN-poisoned first, at a small shape with
   several row blocks and odd T, at d = m = 64 with the rule's rows (eight row blocks), there also
   with the key gradients summed on the host (``ATOMIC_SUMS`` off), and at B=8, T=2048, H=1, K=16,
   V=1536 (fp32: 96 row blocks add into each key gradient).
2. Timings through ``obj()`` (``ssmcraft.bench.classes_commands.measure``, as ``ssmcraft bench --classes``
   times them), bf16, at ``--shape`` (B,T,H,d,m), in one process: Longhorn (the anchor of the
   target ratio; again at the end, to see drift), then ``longhorn_2key`` under each variant, with
   the ratio to Longhorn's fwd+bwd. A variant is ``+``-joined settings: ``new`` (the defaults),
   ``old`` (``ATOMIC_SUMS`` off: partials summed on the host), ``atomic=0|1``, ``fwd=BVxW`` /
   ``bwd=BVxW`` (rows per program x warps, ``rank1_row.set_config``), ``chunk=N`` (the backward's
   checkpoint interval), ``budget=N`` (the prologue backward's fp32 values per tile,
   ``codegen.prologue.BUDGET``), ``pf=N`` (the L2 prefetch distance in steps, ``rank1_row.PREFETCH``).
   ``--profile``: each row's kernels (GPU us per fwd+bwd). Runs on CPU with ``--quick`` under
   ``TRITON_INTERPRET=1`` (checks at tiny shapes only).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import ssmcraft  # noqa: E402
from checks import TOL, compare, dtype_name, reference  # noqa: E402
from common import Report, random_inputs  # noqa: E402
from ssmcraft.ops.codegen import prologue as P  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R1  # noqa: E402
from ssmcraft.ops.rankr_row import recurrent as RR  # noqa: E402

def check(rep, obj, B, T, H, K, V, dtype, dev, seed=0):
    ins, _ = random_inputs(obj, B, T, H, V, K, torch.float64, dev, seed=seed)
    ins = {k: v.to(dtype).double() for k, v in ins.items()}          # the reference on the values the kernel sees
    h0 = (torch.randn(B, H, V, K, device=dev, dtype=torch.float64) * 0.5).float().double()
    obj.prefer = "interpret" if dev == "cpu" else "triton"
    cmp = compare(reference(obj, ins, None, h0, torch.Generator().manual_seed(seed + 1)),
                  lambda i, p, s: obj(i, None, s, True), dtype)
    ok = cmp.within(TOL[dtype])
    worst, max_err = cmp.worst
    rep.add(check=obj.name, dtype=dtype_name(dtype), shape=f"{B},{T},{H},{K},{V}", backend=obj.backend,
            atomic_sums=RR.ATOMIC_SUMS,
            max_err=max_err, worst=worst, status="ok" if ok else "FAIL")
    return ok


def apply_variant(text: str):
    """Set a variant's module constants (module docstring); returns the function that restores them."""
    saved = (RR.ATOMIC_SUMS, RR.CHUNK, dict(P.BUDGET), dict(R1._CONFIG_OVERRIDE), R1.PREFETCH)

    def restore():
        RR.ATOMIC_SUMS, RR.CHUNK, R1.PREFETCH = saved[0], saved[1], saved[4]
        P.BUDGET.update(saved[2])
        R1._CONFIG_OVERRIDE.clear()
        R1._CONFIG_OVERRIDE.update(saved[3])
    cfg = {}
    for item in text.split("+"):
        key, _, val = item.partition("=")
        if key == "new":
            continue
        if key == "old" or key == "atomic":
            RR.ATOMIC_SUMS = key == "atomic" and val == "1"
        elif key in ("fwd", "bwd"):
            bv, nw = val.split("x")
            cfg[key] = (int(bv), int(nw))
        elif key == "chunk":
            RR.CHUNK = int(val)
        elif key == "budget":
            P.BUDGET[True] = int(val)
        elif key == "pf":
            R1.PREFETCH = int(val)
        else:
            raise SystemExit(f"bench_rankr_row: variant {text!r}: unknown setting {item!r}")
    if cfg:
        R1.set_config(**cfg)
    return restore


def timings(rep, shape, variants, profile):
    """Longhorn, ``longhorn_2key`` under each variant, Longhorn again: fwd and fwd+bwd through ``obj()``."""
    from ssmcraft.bench.classes_commands import measure
    ref = None
    for name, variant in [("longhorn", "new"), *(("longhorn_2key", v) for v in variants), ("longhorn", "new")]:
        restore = apply_variant(variant)
        try:
            row = measure(name, name, shape, torch.bfloat16, profile)
        finally:
            restore()
        ref = ref or row["fwd_bwd_ms"]
        rep.add(objective=name, variant=variant, backend=row["backend"], fwd_ms=row["fwd_ms"],
                fwd_bwd_ms=row["fwd_bwd_ms"], x_longhorn=row["fwd_bwd_ms"] / ref)
        for k, c, us in row.get("kernels", [])[:10]:
            print(f"     {us:9.1f} us  x{c:<2d} {k[:100]}", flush=True)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test under TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-large", action="store_true", help="skip the fp32 check at the timed shape")
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m of the timings")
    ap.add_argument("--variants", default="new,old", help="comma-separated variants to time (module docstring)")
    ap.add_argument("--profile", action="store_true", help="each timed row's kernels")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rep = Report("bench_rankr_row")
    G.POISON = RR.POISON = True             # outputs NaN-filled before the kernels run
    obj = ssmcraft.compile("longhorn_2key")
    ok = True
    RR.ROW_BLOCK = 4
    for dtype in (torch.float32, torch.bfloat16):
        ok &= check(rep, obj, 2, 5 if args.quick else 257, 2, 8 if args.quick else 16, 10 if args.quick else 200, dtype, dev)
    RR.ROW_BLOCK = None
    for dtype in (torch.float32, torch.bfloat16):       # the class table's K = V = 64, the rule's rows
        ok &= check(rep, obj, 2, 5 if args.quick else 131, 2, 8 if args.quick else 64, 10 if args.quick else 64, dtype, dev)
    RR.ATOMIC_SUMS = False                  # the host sum of the row blocks' partials, at eight row blocks
    ok &= check(rep, obj, 2, 5 if args.quick else 131, 2, 8 if args.quick else 64, 10 if args.quick else 64,
                torch.float32, dev)
    RR.ATOMIC_SUMS = True
    if not (args.quick or args.no_large):
        ok &= check(rep, obj, 8, 2048, 1, 16, 1536, torch.float32, dev)
    G.POISON = RR.POISON = False
    if dev == "cuda":
        timings(rep, tuple(int(x) for x in args.shape.split(",")), args.variants.split(","), args.profile)
    rep.set("all_checks_ok", bool(ok))
    rep.write(args.json)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
