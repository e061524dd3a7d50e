"""GPU checks and timings of the rank-r family (``rankr``: multi-key Longhorn, Woodbury updates;
``ssmcraft.ops.rankr_row.recurrent``, the general generator row-tiled).

    PYTHONUNBUFFERED=1 python benchmarks/bench_rankr_row.py [--quick] [--json OUT.json]

1. Correctness, fp32 and bf16: output, final state and every gradient (inputs and initial state,
   with a gradient on the final state) of ``longhorn_2key`` against the float64 reference loop
   (on the bf16-rounded inputs for bf16), outputs NaN-poisoned first, at a small shape with
   several row blocks and odd T, and at the Longhorn shape B=8, T=2048, H=1, K=16, V=1536 (fp32).
2. Timings, bf16, B=8, T=2048, H=1, K=16, V=1536 (``triton.testing.do_bench`` median), in one
   process: ``longhorn_2key`` (rows per program swept), Longhorn exact on ``rank1_row`` (the
   rank-1 anchor: the same recurrence with one key), and the HBM floor (bytes / measured copy
   bandwidth). Forward and forward+backward. Runs on CPU with ``--quick`` under
   ``TRITON_INTERPRET=1`` (tiny shapes; a smoke test of the script only).
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
from common import Report, bench_ms, copy_bandwidth, floor_bytes, random_inputs  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402
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
            max_err=max_err, worst=worst, status="ok" if ok else "FAIL")
    return ok


def _once_ms(fn):
    """One timed call (the interpreter: do_bench needs a GPU driver)."""
    import time
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def timings(rep, dev, B, T, H, K, V, blocks):
    dt = torch.bfloat16
    timer = bench_ms if dev == "cuda" else _once_ms
    bw = copy_bandwidth(dev) if dev != "cpu" else None
    for name in ("longhorn_2key", "longhorn"):
        obj = ssmcraft.compile(name)
        ins, _ = random_inputs(obj, B, T, H, V, K, dt, dev, seed=1)
        leaves = {k: v.detach().requires_grad_() for k, v in ins.items()}
        obj.prefer = "interpret" if dev == "cpu" else "triton"
        y, _ = obj(ins, output_final_state=False)
        dy = torch.randn_like(y)
        for bv in (blocks if name == "longhorn_2key" else [None]):
            RR.ROW_BLOCK = bv
            obj._paths.clear()       # the runner is kept per call signature: rebuild it with this block

            def fwd():
                with torch.no_grad():
                    return obj(ins, output_final_state=False)[0]

            def fwd_bwd():
                out = obj(leaves, output_final_state=False)[0]
                return torch.autograd.grad(out, list(leaves.values()), dy)

            f_ms, fb_ms = timer(fwd), timer(fwd_bwd)
            row = dict(objective=name, backend=obj.backend, rows_per_program=bv or "rule", fwd_ms=f_ms, fwd_bwd_ms=fb_ms)
            if bw:
                row["floor_fwd_ms"] = floor_bytes(ins, {}, y.numel(), y.element_size(), False) / bw * 1e3
                row["floor_fwd_bwd_ms"] = floor_bytes(ins, {}, y.numel(), y.element_size(), True) / bw * 1e3
            rep.add(**row)
    RR.ROW_BLOCK = None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test under TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-large", action="store_true", help="skip the fp32 check at the timed shape")
    ap.add_argument("--blocks", default="16,32,64,128,default", help="rows per program to time (default: the rule)")
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
    if not (args.quick or args.no_large):
        ok &= check(rep, obj, 8, 2048, 1, 16, 1536, torch.float32, dev)
    G.POISON = RR.POISON = False
    shape = (1, 4, 1, 8, 16) if args.quick else (8, 2048, 1, 16, 1536)
    blocks = [None if b == "default" else int(b) for b in args.blocks.split(",")]
    timings(rep, dev, *shape, blocks=[8] if args.quick else blocks)
    rep.set("all_checks_ok", bool(ok))
    rep.write(args.json)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
