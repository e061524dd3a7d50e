"""How many bits a per-row rank-1 backward loses when it walks a decayed chunk back by dividing by
the decay (``ssmcraft.ops.rank1_row.bwd``), against rebuilding the chunk from its checkpoint: both
forced (``DIVIDE_BITS`` = inf / -1), fp32, against the float64 loop, on Longhorn's step with a
per-head decay of fixed gain per chunk (``-log2 prod a`` over the chunk = the bits the walk may
lose), under the Triton interpreter (CPU) or on a GPU. Prints the worst relative RMS error over
y, S_T and every gradient (inputs, decay, initial state) per gain. ``--block``: the same for the block
rank-1 family (``ssmcraft.ops.block_rank1_row``: Longhorn with momentum, the momentum mu per head at that
gain; its walk also adds the first state's errors into the second, up to log2(chunk) more bits). ``--time SHAPE`` (GPU) instead
times wd/gated Longhorn through ``obj()`` (bf16, the bench's draws) at each of ``--time-configs``
(checkpoint interval ``recurrent.DECAY_CHUNK``, bound ``DIVIDE_BITS``, ``ATOMIC_SUMS`` with and without a
decay; default: the
module's interval and sums with every chunk rebuilt, the default bound, 6 bits and every chunk walked),
with one reverse loop for both ways and with a loop per way (``recurrent.ONE_LOOP``; ``--one-loop-only``:
the first only), beside DeltaNet and Longhorn (at each ``ATOMIC_SUMS`` of the configs), in one process.

    TRITON_INTERPRET=1 python3 benchmarks/exp_divide_bits.py [--T 96] [--chunk 8] [--K 16] [--V 16] [--block]
    python3 benchmarks/exp_divide_bits.py --time 8,2048,16,64,64 [--time-configs 8:6:0,16:10:1] [--one-loop-only]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ssmcraft.ops.block_rank1_row import recurrent as BR  # noqa: E402
from ssmcraft.ops.block_rank1_row.naive import naive_block_rank1  # noqa: E402
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


def block_errors(bits, args, seed):
    """``errors`` for Longhorn with momentum on the block family: mu per head at ``bits`` per chunk."""
    B, T, H, K, V = 2, args.T, 2, args.K, args.V
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    beta = torch.sigmoid(r(B, T, H, V))
    c = beta / (1 + beta)
    leaves = [k, r(B, T, H, K), (2.0 ** (-bits / args.chunk)) * torch.exp(0.02 * r(B, T, H)).clamp(max=1.0), c,
              c * r(B, T, H, V), r(B, H, K, V), r(B, H, K, V)]

    def run(k, q, mu, c, p, D0, S0, naive):
        rows = {"a00": mu, "a01": 0.0, "a10": mu, "a11": 1.0, "e0": mu, "e1": 1.0, "w0": 1.0, "w1": 1.0, "c": c,
                "p": p, "ro0": 0.0, "ro1": 1.0}
        if not naive:
            y, S = BR.block_recurrence(k, k, k, q, rows, initial_state=(D0, S0), output_final_state=True)
            return y, S
        row = lambda x: x[..., None] if x.dim() == 4 else x[..., None, None]  # noqa: E731
        co = {s: row(x) if isinstance(x, torch.Tensor) else x for s, x in rows.items()}
        co.update({"u": k[..., None, :], "v": k[..., None, :], "q": k[..., None, :], "oq": q[..., None, :], "oc": 1.0})
        y, S = naive_block_rank1(co, 2, (D0.transpose(-1, -2), S0.transpose(-1, -2)))
        return y, tuple(s.transpose(-1, -2) for s in S)

    ref = [x.clone().requires_grad_() for x in leaves]
    y_ref, S_ref = run(*ref, True)
    dy, dS = r(*y_ref.shape), [r(*s.shape) for s in S_ref]
    ref_g = torch.autograd.grad((y_ref * dy).sum() + sum((s * d).sum() for s, d in zip(S_ref, dS)), ref)
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    out = []
    for div in (math.inf, -1.0):
        BR.DIVIDE_BITS = div
        ours = [x.detach().float().to(dev).requires_grad_() for x in leaves]
        y, S = run(*ours, False)
        got = torch.autograd.grad((y.double() * dy.to(dev)).sum()
                                  + sum((s.double() * d.to(dev)).sum() for s, d in zip(S, dS)), ours)
        rel = lambda x, y_: float((x.detach().double().cpu() - y_).norm() / y_.norm())  # noqa: E731
        out.append(max([rel(y, y_ref)] + [rel(a, b) for a, b in zip(S, S_ref)] + [rel(a, b) for a, b in zip(got, ref_g)]))
    return out


def timings(shape, configs=None, one_loop_only=False):
    """fwd / fwd+bwd ms per (objective, config, loop form) through ``obj()``, bf16, one process;
    ``configs``: (checkpoint interval, bound, atomic sums) triples (default: the module's interval and
    sums at every chunk rebuilt, the default bound, 6 bits and every chunk walked)."""
    from ssmcraft.bench.classes_commands import measure
    default, one, chunk, atomic = R.DIVIDE_BITS, R.ONE_LOOP, R.DECAY_CHUNK, R.ATOMIC_SUMS
    configs = configs or [(chunk, b, atomic[1]) for b in sorted({-1.0, default, 6.0, math.inf})]
    rows = [("deltanet", (chunk, None, atomic[0]), one)]
    rows += [("longhorn", (chunk, None, x), one) for x in sorted({c[2] for c in configs})]
    rows += [(n, c, o) for c in configs for n in ("wd_longhorn", "gated_longhorn")
             for o in ((True,) if one_loop_only else (True, False))]
    for name, (c, b, x), loop in rows:
        R.DECAY_CHUNK, R.DIVIDE_BITS, R.ATOMIC_SUMS, R.ONE_LOOP = c, (default if b is None else b), (x, x), loop
        r = measure(name, name, shape, torch.bfloat16)
        print(f"{name:16s} chunk {c:3d} bits {'-' if b is None else b!s:5s} atomic {int(x)} "
              f"{'one loop' if loop else 'loop per way':12s} {r['backend']:28s} fwd {r['fwd_ms']:.3f} ms  "
              f"fwd+bwd {r['fwd_bwd_ms']:.3f} ms", flush=True)
    R.DIVIDE_BITS, R.ONE_LOOP, R.DECAY_CHUNK, R.ATOMIC_SUMS = default, one, chunk, atomic


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=96)
    ap.add_argument("--K", type=int, default=16)
    ap.add_argument("--V", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--bits", default="0.5,1,2,4,6,8,10,12,16,24")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--block", action="store_true", help="the block rank-1 family (Longhorn with momentum)")
    ap.add_argument("--time", default="", help="B,T,H,d,m: time instead (GPU)")
    ap.add_argument("--time-configs", default="", help="--time: comma-separated CHUNK:BITS:ATOMIC (checkpoint "
                    "interval, bound (inf: every chunk walked), 1: the K-vector gradients summed by atomics)")
    ap.add_argument("--one-loop-only", action="store_true", help="--time: one reverse loop for both ways only")
    args = ap.parse_args()
    if args.time:
        configs = [(int(c), float(b), bool(int(x))) for c, b, x in (t.split(":") for t in args.time_configs.split(",") if t)]
        return timings(tuple(int(x) for x in args.time.split(",")), configs, args.one_loop_only)
    R.DECAY_CHUNK = args.chunk
    BR.CONFIG["chunk"] = args.chunk
    measure = block_errors if args.block else errors
    print(f"{'block, ' if args.block else ''}T={args.T} K={args.K} V={args.V} chunk={args.chunk}: worst rel RMS over y, S_T, every gradient")
    print("bits/chunk  walk      rebuild   ratio")
    for b in (float(x) for x in args.bits.split(",")):
        w = r = 0.0
        for s in range(args.seeds):
            ew, er = measure(b, args, s)
            w, r = max(w, ew), max(r, er)
        print(f"{b:9.1f}  {w:.2e}  {r:.2e}  {w / r:6.2f}", flush=True)


if __name__ == "__main__":
    main()
