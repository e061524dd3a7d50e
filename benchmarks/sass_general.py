"""Offline instruction counts of the general family's generated kernels: no GPU needed.

Triton compiles an objective's fused forward and backward kernels (``ssmcraft.ops.general``) for
sm_90 on this machine (``sass_count.sm90``) at a given row block and warp count; printed per
kernel: registers, stack bytes, and per loop its instruction count and the opcodes that say where
a step's time goes (barriers, shuffles, global loads, local-memory spills, special functions).
This is how the generator's factored printing and the row-block rule were weighed before device
time was spent.

    python3 benchmarks/sass_general.py --objective huber_longhorn --rows 8 --warps 1
    python3 benchmarks/sass_general.py --objective cauchy_delta --rows 64 --warps 4 --uneven

Shapes: K = 64 (``--BK``), bf16 inputs and outputs, fp32 states; ``--uneven`` keeps the masks of a
padded tile (EVEN off).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)    # compiled kernels only (see sass_count.py)

from sass_count import loops, sm90  # noqa: E402

OPS = ("BAR", "SHFL", "LDG", "LDS", "STL", "LDL", "MUFU")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objective", default="huber_longhorn")
    ap.add_argument("--rows", type=int, default=8, help="rows per program (BV; the rule gives 8 at K=64)")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--BK", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--uneven", action="store_true", help="a padded tile: the masks stay (EVEN off)")
    args = ap.parse_args(argv)
    import ssmcraft
    from ssmcraft.compiler.cache import import_file
    from ssmcraft.ops.general import recurrent as G
    src = G.generated_source(ssmcraft.compile(args.objective).ir)
    with tempfile.TemporaryDirectory(prefix="sass_general_") as d:
        path = Path(d) / "gen.py"
        path.write_text(src)
        mod = import_file(path, f"sass_general_{args.objective}", src)
    known = dict(BV=args.rows, BK=args.BK, CHUNK=args.chunk, PF=16, EVEN=not args.uneven, HAS_S0=True, STORE_ST=True,
                 STORE_CK=True, HAS_DHT=True, STORE_DS0=True, VARLEN=False,
                 ATOMIC=args.rows < 64)     # row blocks of d = 64 add shared gradients (recurrent.ATOMIC_SUMS)
    for kernel in ("general_fwd_kernel", "general_bwd_kernel"):
        fn = getattr(mod, kernel)
        consts = {k: v for k, v in known.items() if k in fn.arg_names}
        sig, attrs = {}, {}
        for i, a in enumerate(fn.arg_names):
            if a in consts:
                sig[a] = "constexpr"
            elif a in ("T", "H", "V", "K", "NC"):
                sig[a] = "i32"
                if a in ("K", "V"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:       # leaves, y and dy in bf16; states, checkpoints, scratch and gradients in fp32
                sig[a] = "*bf16" if (a.startswith("P_") or a in ("Y", "DY")) else "*fp32"
                attrs[(i,)] = [["tt.divisibility", 16]]
        regs, stack, sass = sm90(fn, sig, consts, attrs, args.warps)
        print(f"{args.objective} {kernel} (rows {args.rows}, {args.warps} warps): {regs} registers, {stack} stack bytes")
        for n, ops in loops(sass):
            if n > 1:
                print(f"  loop: {n} instructions; " + ", ".join(f"{op} {ops.get(op, 0)}" for op in OPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
