"""What the chunked kernels' exact decay gradient costs where no decay is tiny: each objective timed
through ``obj()`` with it (``EXACT_DECAY_GRAD``: the family's ``*_bwd_da_kernel`` after the gradient
kernels, rewriting d a term by term in the chunks holding a decay below e^LOG_EXACT_DA, and in
``rank1_chunk`` the coefficients its gradient kernel stores in those chunks) and without it, beside
DeltaNet, in one process:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_exact_decay.py [--shape 8,2048,16,64,64]
        [--only gated_deltanet,kda_like,rank2_head_gated] [--profile]

Without it a tiny or zero decay gives wrong gradients: the switch exists for this measurement only.
The draws are the benchmark's own (no tiny decays), so both rows compute the same.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from ssmcraft.bench.classes_commands import REFERENCE, class_specs, measure  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R1  # noqa: E402
from ssmcraft.ops.rank1_keydecay_chunk import chunk as RK  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--only", default="gated_deltanet,kda_like,rank2_head_gated")
    ap.add_argument("--profile", action="store_true", help="each row's largest kernels")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    dt = torch.bfloat16
    rows = [("-", measure(REFERENCE, REFERENCE, shape, dt, args.profile))]
    for name, spec in class_specs(tuple(args.only.split(",")))[1:]:      # [0]: the reference, timed above
        for exact in (True, False):
            R1.EXACT_DECAY_GRAD = RK.EXACT_DECAY_GRAD = exact
            rows.append(("da kernel" if exact else "none", measure(name, spec, shape, dt, args.profile)))
            print(f"row {name} [{rows[-1][0]}]: fwd {rows[-1][1]['fwd_ms']:.3f} ms, "
                  f"fwd+bwd {rows[-1][1]['fwd_bwd_ms']:.3f} ms", flush=True)
            for k, c, us in rows[-1][1].get("kernels", [])[:6]:
                print(f"   {us:10.1f} us  x{c:<3d} {k[:100]}", flush=True)
        R1.EXACT_DECAY_GRAD = RK.EXACT_DECAY_GRAD = True
    ref = rows[0][1]["fwd_bwd_ms"]
    print(f"| objective | exact decay gradient | backend | fwd ms | fwd+bwd ms | x {REFERENCE} |\n|---|---|---|---|---|---|")
    for how, r in rows:
        print(f"| {r['spec']} | {how} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
              f"{r['fwd_bwd_ms'] / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
