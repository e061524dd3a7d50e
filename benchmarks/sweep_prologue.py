"""The generated prologue's backward tiles (``ssmcraft.ops.codegen.prologue``: rows per program from
``BUDGET[True]`` fp32 per value tile, and warps) swept per objective at the issue-27 shape: the
forward + backward of the computed slots alone (``slots.computed_slots``), bf16 leaves.

    PYTHONUNBUFFERED=1 python3 benchmarks/sweep_prologue.py [--shape 8,2048,16,64,64]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ssmcraft  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.ops.codegen import prologue as P  # noqa: E402
from ssmcraft.ops.common.slots import computed_slots  # noqa: E402
from ssmcraft.runtime import timing  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,2048,16,64,64")
    ap.add_argument("--only", default="longhorn_2key,longhorn,wd_longhorn,gated_longhorn")
    ap.add_argument("--budgets", default="4096,1024,512,256")
    ap.add_argument("--warps", default="2,4,8")
    args = ap.parse_args(argv)
    B, T, H, d, m = (int(x) for x in args.shape.split(","))
    tiles, default = P._tiles, P.BUDGET[True]
    print(f"{torch.cuda.get_device_name()} shape {args.shape} bf16: prologue fwd+bwd ms (backward tiles swept)")
    for name in args.only.split(","):
        obj = ssmcraft.compile(name)
        inputs, params = random_inputs(obj, B, T, H, d, m, torch.bfloat16, torch.device("cuda"), requires_grad=True)
        leaves = [t for t in (*inputs.values(), *params.values()) if t.requires_grad]
        outs = computed_slots(obj, inputs, params)
        gs = {s: torch.randn_like(o) for s, o in outs.items()}

        def step():
            o = computed_slots(obj, inputs, params)
            torch.autograd.grad([o[s] for s in gs], leaves, [gs[s] for s in gs], allow_unused=True)
        with torch.no_grad():
            fwd = timing.bench_ms(lambda: computed_slots(obj, inputs, params))
        row = []
        for budget in (int(x) for x in args.budgets.split(",")):
            for warps in (int(x) for x in args.warps.split(",")):
                def fixed(pro, V, K, N, backward=False, warps=warps):
                    R, BV, BK, w = tiles(pro, V, K, N, backward)
                    return R, BV, BK, warps if backward else w
                P._tiles, P.BUDGET[True] = fixed, budget
                row.append(f"{budget}/{warps}w {timing.bench_ms(step):.3f}")
                P._tiles, P.BUDGET[True] = tiles, default
        print(f"  {name:15s} fwd {fwd:.3f} | fwd+bwd by backward budget/warps: {', '.join(row)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
