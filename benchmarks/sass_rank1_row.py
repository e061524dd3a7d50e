"""Offline SASS of the per-row kernels (``rank1_row_fwd``/``rank1_row_bwd``, ``rankr_row_kernels``):
no GPU needed. Each kernel is compiled for sm_90 with Triton's bundled ptxas, as the timed case
launches it (bf16 key vectors, outputs and dy; fp32 row factors, K = V = 64), and printed:
registers, spilled bytes (stack), and per loop its instruction count with the opcodes that say
most about a latency-bound loop (global/local/shared memory, barriers, shuffles, FMAs).

    python3 benchmarks/sass_rank1_row.py [--bv 8] [--warps 1] [--cases longhorn,wd,gated,keydecay,rankr]

A change to these kernels can be weighed here (spills, barriers per step) before any device time.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("TRITON_INTERPRET", None)       # compiled kernels only (see sass_count.py)


from sass_count import loops, sm90  # noqa: E402
from ssmcraft.ops.rank1_row.bwd import rank1_row_bwd_kernel  # noqa: E402
from ssmcraft.ops.rank1_row.fwd import rank1_row_fwd_kernel  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.rankr_row.kernels import rankr_row_bwd_kernel, rankr_row_fwd_kernel  # noqa: E402

OPS = ("LDL", "STL", "LDG", "STG", "LDS", "STS", "BAR", "SHFL", "FFMA")
# rank-1 cases: (MODES of a, c, p, oc, oh; CONSTS; GROUPS of v, q, oq), as the objectives bind them
RANK1 = {"longhorn": ((0, 2, 2, 0, 0), (1.0, 0., 0., 1.0, 0.), (0, 0, 3)),
         "wd": ((2, 2, 2, 0, 0), (0., 0., 0., 1.0, 0.), (0, 0, 3)),
         "gated": ((1, 2, 2, 0, 0), (0., 0., 0., 1.0, 0.), (0, 0, 3)),   # u = alpha k: alpha moved into c
         # a decay per key (mode 3), decay-then-explicit: u = alpha o k its own tensor, v = q = k
         "keydecay": ((3, 2, 2, 0, 0), (0., 0., 0., 1.0, 0.), (1, 1, 3))}
INTS = {"T", "H", "V", "K", "SEG", "NC", "NV", "NB", "NG", "ZS", "s0_sb", "s0_sh", "s0_sg", "s0_sk", "s0_sv"}
BF16 = {"U", "Vv", "Q", "OQ", "Y", "DY"}
FLOATS = {"BITS"}


def compile_count(fn, consts: dict, warps: int, sig: dict | None = None):
    """(registers, stack bytes, [(instructions, opcode Counter)] per loop) of ``fn`` for sm_90."""
    sig, attrs = dict(sig or {}), {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        if a not in sig:
            sig[a] = "i32" if a in INTS else "fp32" if a in FLOATS else ("*bf16" if a in BF16 else "*fp32")
        # what Triton specialises at launch: 16-byte aligned pointers, K and V divisible by 16
        if isinstance(sig[a], tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(sig[a]))})
        elif sig[a].startswith("*") or a in ("K", "V"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    regs, stack, sass = sm90(fn, sig, consts, attrs, warps)
    return regs, stack, loops(sass)


def rank1_consts(case: str, BV: int, which: str) -> dict:
    modes, consts, groups = RANK1[case]
    chunk = R.CHUNK if case == "longhorn" else R.DECAY_CHUNK      # the intervals the host passes
    common = dict(BV=BV, BK=64, CHUNK=chunk, PF=16, GROUPS=groups, CU=None, CO=None, VARLEN=False)
    if which == "fwd":
        absent = {n: None for n, m in zip(("A", "C", "P", "OC", "OH"), modes) if m == 0}
        return dict(common, MODES=modes, CONSTS=consts, S0=None, **absent)
    absent = {n: None for n, m in zip(("A", "C", "P", "OC"), modes[:4]) if m == 0}
    absent.update({"D" + n: None for n in list(absent)})
    if case == "longhorn":
        absent["SCR"] = None                      # a == 1: exact reconstruction, no kept states
    distinct = [0] + [i for i, g in zip((1, 2, 3), groups) if g == i]
    index = tuple(distinct.index(s) if s in distinct else 0 for s in (1, 2, 3))
    return dict(common, MODES=modes[:4] + (0,), CONSTS=consts[:4] + (0.,), INDEX=index, DHT=None,
                CP=R.next_pow2(chunk), ONE_LOOP=bool(R.ONE_LOOP), **absent)


def rankr_cases(BV: int):
    """longhorn_2key's binding: kv = (k, k2, q), per-row c_rl and p_r, oc = 1, no oh."""
    common = dict(BV=BV, BK=64, CHUNK=64, PF=16, NKV=3, L=2, R=2, UI=(0, 1), VI=(0, 1), OQI=2, CM=(2,) * 4,
                  CC=(0.,) * 4, PM=(2, 2), PC=(0., 0.), OC=None, OM=(0, 0), OCC=(1.0, 0.), CU=None, CO=None,
                  VARLEN=False)
    kv, f4, f2 = ("*bf16",) * 3, ("*fp32",) * 4, ("*fp32",) * 2
    yield "fwd", rankr_row_fwd_kernel, dict(common, OH=None, S0=None), {"kv": kv, "cs": f4, "ps": f2, "Y": "*bf16"}
    yield "bwd", rankr_row_bwd_kernel, dict(common, DHT=None, DOC=None), \
        {"kv": kv, "cs": f4, "ps": f2, "dcs": f4, "dps": f2, "DY": "*bf16"}


def show(label, res) -> None:
    regs, stack, lps = res
    print(f"{label:22s} registers {regs:3d}  stack {stack:4d} bytes")
    for n, ops in lps:
        if n > 1:
            print(f"    loop of {n:5d} instructions: " + ", ".join(f"{o} {ops[o]}" for o in OPS if ops[o]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bv", type=int, default=8, help="rows per program")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--cases", default="longhorn,wd,gated,rankr")
    args = ap.parse_args(argv)
    for case in args.cases.split(","):
        if case == "rankr":
            for which, fn, consts, sig in rankr_cases(args.bv):
                show(f"longhorn_2key {which}", compile_count(fn, consts, args.warps, sig))
            continue
        show(f"{case} fwd", compile_count(rank1_row_fwd_kernel, rank1_consts(case, args.bv, "fwd"), args.warps))
        show(f"{case} bwd", compile_count(rank1_row_bwd_kernel, rank1_consts(case, args.bv, "bwd"), args.warps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
