"""Offline SASS of the chunked rank-1 key-decay kernels (``ssmcraft.ops.rank1_keydecay_chunk``): no
GPU needed. Each kernel is compiled for sm_90 with Triton's bundled ptxas as the timed KDA-like case
launches it (bf16 I/O, K = V = 64, chunk 64, u = a o v, p's scale fused; fp32 g, states and
scratch) at 4 and 8 warps, and printed: registers, spilled bytes (stack), the counts of the
opcodes that say most about these kernels (local memory = spills, barriers, shuffles, MUFU = exp/log),
the instruction count and the size of each loop body left (``sass_count.loops``; the leaf loops run
LEAF times, or SUB times in the backward's programs that turn the diagonal products away).

    python3 benchmarks/sass_rank1_keydecay.py [--kernels prep,fwd_state,bwd_state,bwd_wy,bwd_out] [--leaf 4] [--chunk 32] [--fast 0]

A change to these kernels can be weighed here (spills above all) before any device time.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("TRITON_INTERPRET", None)       # compiled kernels only (see sass_count.py)

from sass_count import loops, sm90  # noqa: E402
from ssmcraft.ops.rank1_keydecay_chunk import chunk as R, kernels as KK  # noqa: E402

OPS = ("LDL", "STL", "LDG", "STG", "BAR", "SHFL", "MUFU")
FP32 = {"g", "Ds", "h0", "ht", "dht", "dh0", "dvs", "dlas"}
INTS = {"T", "NT"}
SHAPE = dict(H=16, K=64, V=64, BT=64, BK=64, PREC="tf32", VARLEN=False)
KERNELS = {   # name -> (kernel, its constexprs besides SHAPE and the family's sub-block ones, ``chunk._diag``)
    "prep": (KK.rank1_keydecay_chunk_prep_kernel, dict(BV=64, U_MODE=KK.U_IS_AV.value, HAS_PS=True)),
    "fwd_state": (KK.rank1_keydecay_chunk_fwd_state_kernel, dict(BV=64, STORE_H=True, HAS_H0=False, STORE_HT=False)),
    "bwd_state": (KK.rank1_keydecay_chunk_bwd_state_kernel, dict(BV=64, HAS_DHT=False, STORE_DH0=False)),
    "bwd_wy": (KK.rank1_keydecay_chunk_bwd_wy_kernel, dict(BV=64, U_MODE=KK.U_IS_AV.value, HAS_PS=True)),
    "bwd_out": (KK.rank1_keydecay_chunk_bwd_out_kernel, dict(BV=64)),
}


def count(kernel, consts: dict, warps: int) -> tuple[int, int, dict, int, list]:
    """(registers, stack bytes, {opcode: count}, instructions, loop body sizes) of an autotuned kernel
    compiled for sm_90."""
    fn = kernel.fn
    consts = {k: v for k, v in {**SHAPE, **consts}.items() if k in fn.arg_names}
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        sig[a] = "i32" if a in INTS else ("*fp32" if a in FP32 else "*bf16")
        if sig[a].startswith("*"):      # what Triton specialises at launch: 16-byte aligned pointers
            attrs[(i,)] = [["tt.divisibility", 16]]
    regs, stack, sass = sm90(fn, sig, consts, attrs, warps)
    lines = sass.splitlines()
    n = sum(1 for ln in lines if ln.strip().startswith("/*") and ";" in ln)
    return (regs, stack, {op: sum(1 for ln in lines if f" {op}" in ln) for op in OPS}, n,
            [size for size, _ in loops(sass)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--leaf", type=int, default=None, help="rows of the elementwise diagonal blocks, forward and backward "
                    "(chunk.LEAF_FWD, LEAF_BWD)")
    ap.add_argument("--chunk", type=int, default=SHAPE["BT"], help="chunk size BT (chunk.CHUNK: 16, 32 or 64)")
    ap.add_argument("--fast", type=int, default=int(R.FAST_DIAG), help="1: the diagonal sub-blocks' products "
                    "(chunk.FAST_DIAG), 0: their elementwise sums only")
    args = ap.parse_args(argv)
    SHAPE["BT"] = args.chunk
    R.FAST_DIAG = bool(args.fast)
    if args.leaf:
        R.LEAF_FWD = R.LEAF_BWD = args.leaf
    for name in args.kernels.split(","):
        kernel, consts = KERNELS[name]
        consts = {**R._diag(SHAPE["BT"], name.startswith("bwd")), **consts}
        for warps in (4, 8):
            regs, stack, ops, n, bodies = count(kernel, consts, warps)
            print(f"{name:10s} {warps} warps: {regs} registers, {stack} bytes spilled; "
                  + ", ".join(f"{op} {k}" for op, k in ops.items())
                  + f"; {n} instructions, loop bodies {bodies}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
