"""Diagnose rank1_chunk at small key dims on the GPU (the bf16 fault that ``rank1_chunk._key_block``,
the key block padded to 64 for 16-bit I/O, works around; BENCHMARKS.md, "Small key dims in bf16").

    python3 benchmarks/diag_rank1_smallk.py [K | KxV ...] [--gated] [--bf16] [--bv-floor N]
                                                         (checks; each case with CUDA_LAUNCH_BLOCKING=1)
    python3 benchmarks/diag_rank1_smallk.py --time       (fwd+bwd at the 20M byte LM's shape)

Each case runs in its own process (an illegal memory access poisons the CUDA context): DeltaNet
(``--gated``: Gated DeltaNet) on ``rank1_chunk`` at B2 T300 H2 (V = 64 unless given as KxV), fp32 and bf16, against the float64 reference on the same leaves
(``ssmcraft.runtime.checking``: output, final state, dx, dq, dk, dbeta, dS0), outputs NaN-poisoned first
(an unwritten output shows as nan). ``--bv-floor N`` runs the family with its value block of the
non-autotuned kernels at least N (``rank1_chunk._bv``), to tell a value-block fault from a key-block one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch


def case(K: int, V: int, dtype: str, objective: str = "deltanet", bv_floor: int = 0) -> dict:
    """Errors of the DeltaNet objective on ``rank1_chunk`` (its own ``prepare``, whatever the backend
    would pick) against the float64 reference on the same (``dtype``-rounded) leaves."""
    import ssmcraft
    from ssmcraft.ops.rank1_chunk import chunk as R
    from ssmcraft.runtime.checking import reference_errors
    from ssmcraft.runtime.select import validated_call
    R.POISON = True
    if bv_floor:
        bv = R._bv
        R._bv = lambda v, *a: max(bv(v, *a), bv_floor)
    dt = getattr(torch, dtype)
    obj = ssmcraft.compile(objective)
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 300, 2
    ins = {"x": torch.randn(B, T, H, V, generator=g), "q": torch.randn(B, T, H, K, generator=g),
           "k": torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
           "beta": torch.rand(B, T, H, generator=g)}
    if objective == "gated_deltanet":
        ins["alpha"] = 0.9 + 0.1 * torch.rand(B, T, H, generator=g)
    ins = {n: t.to(dt).to("cuda", torch.float64) for n, t in ins.items()}      # the kernel's values, exactly
    S0 = torch.randn(B, H, V, K, generator=g, dtype=torch.float64).cuda()
    cmp = reference_errors(obj, lambda i, p, s: validated_call(R.prepare, obj, i, p, s, True), ins, {}, S0, g, dt)
    return cmp.errors          # an unwritten (NaN-poisoned) output or gradient shows as nan, by name


def timing():
    """DeltaNet fwd+bwd at the 20M byte LM's shape (B16 T512 H1 K16 V512, bf16): the chunked kernel
    against ``obj()`` (whatever family it picks) and FLA's recurrent kernel when importable."""
    from triton.testing import do_bench

    import ssmcraft
    from ssmcraft.ops.rank1_chunk import chunk as R
    B, T, H, K, V = 16, 512, 1, 16, 512
    dt = torch.bfloat16
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=dt) for _ in range(2))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dt)
    x = torch.randn(B, T, H, V, device="cuda", dtype=dt)
    beta = torch.rand(B, T, H, device="cuda", dtype=dt)
    leaves = [t.requires_grad_(True) for t in (q, k, x, beta)]
    dy = torch.randn(B, T, H, V, device="cuda", dtype=dt)
    obj = ssmcraft.compile("deltanet")
    rows = {"rank1_chunk.delta_rule": lambda: R.delta_rule(*leaves)[0],
            "obj()": lambda: obj(dict(q=q, k=k, x=x, beta=beta))[0]}
    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        rows["FLA fused_recurrent"] = lambda: fused_recurrent_delta_rule(q, k, x, beta, scale=1.0)[0]
    except ImportError as e:
        print(f"# FLA unavailable: {e}")
    for name, f in rows.items():
        f()
        fb = do_bench(lambda: torch.autograd.grad(f(), leaves, dy), rep=200)
        with torch.no_grad():
            fw = do_bench(f, rep=200)
        extra = f" ({obj.backend})" if name == "obj()" else ""
        print(f"B{B} T{T} H{H} K{K} V{V} bf16 {name}{extra}: fwd {fw:.3f} ms, fwd+bwd {fb:.3f} ms")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        timing()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        K, V, dtype, objective, floor = sys.argv[2:7]
        print(json.dumps(case(int(K), int(V), dtype, objective, int(floor))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", default=["16", "32", "64"], help="K or KxV (V = 64 unless given)")
    ap.add_argument("--gated", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--bv-floor", default="0")
    args = ap.parse_args()
    objective = "gated_deltanet" if args.gated else "deltanet"
    dtypes = ("bfloat16",) if args.bf16 else ("float32", "bfloat16")
    floor, sizes = args.bv_floor, args.sizes
    for size in sizes:
        K, V = (size.split("x") + ["64"])[:2]
        for dtype in dtypes:
            r = subprocess.run([sys.executable, __file__, "--case", K, V, dtype, objective, floor],
                               capture_output=True, text=True, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
            label = f"{objective} K={K:>3} V={V:>3} bv>={floor} {dtype:9s}"
            if r.returncode == 0:
                res = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{label} " + " ".join(f"{n} {v:.1e}" for n, v in res.items()))
            else:
                err = [ln for ln in r.stderr.splitlines() if "File" in ln and "ssmcraft" in ln or "Error" in ln][-8:]
                print(f"{label} FAILED rc={r.returncode}:\n    " + "\n    ".join(err))


if __name__ == "__main__":
    main()
