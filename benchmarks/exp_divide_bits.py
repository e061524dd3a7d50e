"""How many bits a per-row rank-1 backward loses when it walks a decayed chunk back by dividing by
the decay (``ssmcraft.ops.rank1_row.bwd``), against rebuilding the chunk from its checkpoint: both
forced (``DIVIDE_BITS`` = inf / -1), fp32, against the float64 loop, on Longhorn's step with a
per-head decay of fixed gain per chunk (``-log2 prod a`` over the chunk = the bits the walk may
lose), under the Triton interpreter (CPU) or on a GPU. Prints the worst relative RMS error over
y, S_T and every gradient (inputs, decay, initial state) per gain. ``--time SHAPE`` (GPU) instead
times wd/gated Longhorn through ``obj()`` (bf16, the bench's draws) with every chunk rebuilt, the
default bound, 6 bits and every chunk walked, with one reverse loop for both ways and with a loop per way
(``recurrent.ONE_LOOP``), beside DeltaNet and Longhorn, in one process.

    TRITON_INTERPRET=1 python3 benchmarks/exp_divide_bits.py [--T 96] [--chunk 8] [--K 16] [--V 16]
    python3 benchmarks/exp_divide_bits.py --time 8,2048,16,64,64
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.rank1_row.naive import naive_recurrent_rank1_row  # noqa: E402


def errors(bits, args, seed):
    """(walk, rebuild) worst relative RMS error at a decay losing ``bits`` bits per chunk."""
    B, T, H, K, V = 2, args.T, 2, args.K, args.V
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    q = r(B, T, H, K)
    beta = torch.sigmoid(r(B, T, H, V))
    c = beta / (1 + beta)
    p = c * r(B, T, H, V)
    # per step a = 2^(-bits/chunk) times a small jitter
    a = (2.0 ** (-bits / args.chunk)) * torch.exp(0.02 * r(B, T, H)).clamp(max=1.0)
    S0 = r(B, H, K, V)
    leaves = [k, q, a, c, p, S0]
    ref = [x.clone().requires_grad_() for x in leaves]
    kr, qr, ar, cr, pr, Sr = ref
    y_ref, S_ref = naive_recurrent_rank1_row(kr, kr, kr, qr, ar, cr, pr, torch.ones(B, T, H, dtype=torch.float64),
                                             torch.zeros(B, T, H, V, dtype=torch.float64), Sr)
    dy, dS = torch.randn(y_ref.shape, generator=g, dtype=torch.float64), torch.randn(S_ref.shape, generator=g,
                                                                                   dtype=torch.float64)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), ref)
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    out = []
    for div in (math.inf, -1.0):
        R.DIVIDE_BITS = div
        ours = [x.detach().float().to(dev).requires_grad_() for x in leaves]
        ko, qo, ao, co, po, So = ours
        y, S = R.rank1_row_recurrence(ko, ko, ko, qo, co, po, a=ao, initial_state=So, output_final_state=True)
        got = torch.autograd.grad((y.double() * dy.to(dev)).sum() + (S.double() * dS.to(dev)).sum(), ours)
        rel = lambda x, y_: float((x.detach().double().cpu() - y_).norm() / y_.norm())  # noqa: E731
        errs = [rel(y, y_ref), rel(S, S_ref)] + [rel(x, y_) for x, y_ in zip(got, ref_g)]
        out.append(max(errs))
    return out


def timings(shape):
    """fwd / fwd+bwd ms per (objective, bound) through ``obj()``, bf16, one process."""
    from ssmcraft.bench.classes_commands import measure
    default, one = R.DIVIDE_BITS, R.ONE_LOOP
    rows = [("deltanet", None, one), ("longhorn", None, one)] + [
        (n, b, o) for n in ("wd_longhorn", "gated_longhorn") for o in (True, False)
        for b in sorted({-1.0, default, 6.0, math.inf})]
    for name, bits, loop in rows:
        R.DIVIDE_BITS, R.ONE_LOOP = (default if bits is None else bits), loop
        r = measure(name, name, shape, torch.bfloat16)
        print(f"{name:16s} bits {'-' if bits is None else bits!s:5s} {'one loop' if loop else 'loop per way':12s} "
              f"{r['backend']:28s} fwd {r['fwd_ms']:.3f} ms  fwd+bwd {r['fwd_bwd_ms']:.3f} ms", flush=True)
    R.DIVIDE_BITS, R.ONE_LOOP = default, one


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=96)
    ap.add_argument("--K", type=int, default=16)
    ap.add_argument("--V", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--bits", default="0.5,1,2,4,6,8,10,12,16,24")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--time", default="", help="B,T,H,d,m: time instead (GPU)")
    args = ap.parse_args()
    if args.time:
        return timings(tuple(int(x) for x in args.time.split(",")))
    R.DECAY_CHUNK = args.chunk
    print(f"T={args.T} K={args.K} V={args.V} chunk={args.chunk}: worst rel RMS over y, S_T, every gradient")
    print("bits/chunk  walk      rebuild   ratio")
    for b in (float(x) for x in args.bits.split(",")):
        w = r = 0.0
        for s in range(args.seeds):
            ew, er = errors(b, args, s)
            w, r = max(w, ew), max(r, er)
        print(f"{b:9.1f}  {w:.2e}  {r:.2e}  {w / r:6.2f}", flush=True)


if __name__ == "__main__":
    main()
