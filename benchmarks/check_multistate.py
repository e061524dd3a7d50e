"""Momentum Longhorn (two states) on the generated general kernel: correctness against the
float64 reference (output, both final states, every gradient incl. both initial states, outputs
NaN-poisoned) and fwd / fwd+bwd time, in one run.

GPU:  python3 benchmarks/check_multistate.py                      (B=8, T=2048, H=24, d=64, m=16)
CPU:  TRITON_INTERPRET=1 python3 benchmarks/check_multistate.py --tiny   (the same checks, no timing)

Prints one line per check (relative RMS error; fp32 kernel vs float64 reference on a shorter
sequence) and the timings; exits 1 if an error is over 1e-4 or an output was left unwritten.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import TOL, reference_errors  # noqa: E402
from common import bench_ms, device_name  # noqa: E402

import ssmcraft  # noqa: E402
from ssmcraft.ops.general import recurrent as G  # noqa: E402


def inputs(obj, B, T, H, d, m, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ins = {"x": torch.randn(B, T, H, d, generator=g, dtype=torch.float64),
           "k": torch.nn.functional.normalize(torch.randn(B, T, H, m, generator=g, dtype=torch.float64), dim=-1),
           "q": torch.randn(B, T, H, m, generator=g, dtype=torch.float64),
           "beta": torch.nn.functional.softplus(torch.randn(B, T, H, d, generator=g, dtype=torch.float64)) + 0.1,
           "mu": 0.2 + 0.6 * torch.rand(B, T, H, generator=g, dtype=torch.float64)}
    S0 = tuple(0.5 * torch.randn(B, H, d, m, generator=g, dtype=torch.float64) for _ in range(2))
    return {k: v.to(device) for k, v in ins.items()}, tuple(s.to(device) for s in S0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes, no timing (CPU interpreter)")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    obj = ssmcraft.compile("momentum_longhorn")
    obj.prefer = "interpret" if args.tiny else "triton"
    G.POISON = True
    B, T, H, d, m = (1, 9, 2, 12, 8) if args.tiny else (2, 300, 4, 64, 16)
    ins, S0 = inputs(obj, B, T, H, d, m, device)
    # output, both final states (D_T, S_T), every gradient incl. both initial states (dD0, dS0)
    cmp = reference_errors(obj, lambda i, p, s: obj(i, None, s), ins, None, S0, torch.Generator().manual_seed(1))
    print(f"momentum_longhorn on {device_name()} via {obj.backend}, check shape B={B} T={T} H={H} d={d} m={m}")
    for k, v in cmp.errors.items():
        print(f"  {k:6s} rel_rms {v:.2e}")
    print(f"  outputs all written: {cmp.written}")
    ok = cmp.within(TOL[torch.float32])
    if not args.tiny:
        B, T, H = 8, 2048, 24
        ins, S0 = inputs(obj, B, T, H, d, m, device)
        fw = {k: v.float() for k, v in ins.items()}
        with torch.no_grad():
            t_fwd = bench_ms(lambda: obj(fw, None, None, output_final_state=False))
        tr = {k: v.float().requires_grad_() for k, v in ins.items()}

        def fwd_bwd():
            y, _ = obj(tr, None, None, output_final_state=False)
            y.sum().backward()
        t_all = bench_ms(fwd_bwd)
        print(f"  time B={B} T={T} H={H} d={d} m={m} fp32: fwd {t_fwd:.2f} ms, fwd+bwd {t_all:.2f} ms")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
