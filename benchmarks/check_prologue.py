"""The public path of every library objective whose computed slots come from the fused prologue
(``ssmcraft.ops.codegen.prologue``), on the GPU: ``obj(...)`` against the float64 reference loop on
the same leaves, output, final state and every gradient (inputs, params, initial state), in fp32
and bf16, every kernel output NaN-poisoned first; each case is run twice (the second call goes
through the direct launches of ``ssmcraft.ops.common.launch``) and both calls are checked.

GPU:  python3 benchmarks/check_prologue.py
CPU:  TRITON_INTERPRET=1 python3 benchmarks/check_prologue.py --tiny   (smoke test of the script)

Prints one line per (objective, dtype, call) with the worst relative RMS error and where; exits 1
if one is over tolerance (fp32 1e-4, bf16 2e-2) or an output was left unwritten.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import TOL, compare, dtype_name, reference, summary  # noqa: E402
from common import device_name, random_inputs  # noqa: E402

import ssmcraft  # noqa: E402
from ssmcraft.ops.keydecay_chunk import chunk as keydecay_chunk  # noqa: E402
from ssmcraft.ops.codegen import prologue  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as rank1_chunk  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as rank1_row  # noqa: E402

# (Gated DeltaNet's alpha beta is formed in the chunked rank-1 kernels: bench_rank1_chunk checks it)
OBJECTIVES = ["longhorn", "gated_longhorn", "wd_longhorn", "hgrn"]


def check(name, dtype, B, T, H, d, m, dev, interpret):
    obj = ssmcraft.compile(name)
    obj.prefer = "interpret" if interpret else "triton"
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, dev, seed=3)
    if "k" in ins and name != "hgrn":
        ins["k"] = torch.nn.functional.normalize(ins["k"], dim=-1)
    ins = {k: v.to(dtype).double() for k, v in ins.items()}          # the values the kernel sees
    S0 = 0.5 * torch.randn(B, H, d, m, device=dev, dtype=torch.float64)
    ref = reference(obj, ins, {k: v.double() for k, v in params.items()}, S0, torch.Generator().manual_seed(1))
    rows = []
    for call in (1, 2):
        cmp = compare(ref, lambda i, p, s: obj(i, p, s, True), dtype)
        rows.append(cmp.within(TOL[dtype]))
        print(f"{name:15s} {dtype_name(dtype):9s} call {call}  {obj.backend:32s} {summary(cmp, TOL[dtype])}")
    return all(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes under the interpreter (CPU)")
    args = ap.parse_args()
    interpret = args.tiny
    dev = "cpu" if args.tiny else "cuda"
    for mod in (prologue, rank1_row, rank1_chunk, keydecay_chunk):
        mod.POISON = True
    B, T, H, d, m = (1, 7, 2, 8, 4) if args.tiny else (2, 301, 3, 64, 16)
    print(f"check_prologue on {device_name()}, B={B} T={T} H={H} d={d} m={m}")
    ok = True
    for name in OBJECTIVES:
        for dtype in (torch.float32, torch.bfloat16):
            if interpret and dtype == torch.bfloat16 and name == "hgrn":
                # the interpreter runs the key-decay kernels wrong on bf16 inputs (GLA too, 1e10 off,
                # while the GPU matches FLA to 3e-3: BENCHMARKS.md): checked on the GPU only
                print(f"{name:15s} bfloat16  not checked under the interpreter (key-decay kernels, bf16)")
                continue
            ok &= check(name, dtype, B, T, H, d, m, dev, interpret)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
