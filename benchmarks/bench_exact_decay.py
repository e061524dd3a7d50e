"""What the chunked kernels' exact decay gradient costs where no decay is tiny: each objective timed
through ``obj()`` with it (``EXACT_DECAY_GRAD``: the family's ``*_bwd_da_kernel`` after the gradient
kernels, rewriting d a term by term in the chunks holding a decay below e^LOG_EXACT_DA, and in
``rank1_chunk`` the coefficients its gradient kernel stores in those chunks) and without it, beside
DeltaNet, in one process:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_exact_decay.py [--shape 8,2048,16,64,64]
        [--only gated_deltanet,kda_like,rank2_head_gated] [--tiny] [--check] [--profile]

Without it a tiny or zero decay gives wrong gradients: the switch exists for this measurement only.
The draws are the benchmark's own (no tiny decays: both rows compute the same); ``--tiny`` adds rows
timed on decays a sigmoid gate reaches (``checking.tiny_decays``, mixed with ordinary ones: nearly
every chunk holds a tiny one, so the exact kernel runs everywhere). ``--check`` first compares each
objective's output and gradients on such decays (fp32, B=1 T=200 H=2) with the float64 reference, with
the exact decay gradient and without: the relative RMS error of the decay's gradient and the worst of
the others.
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
from ssmcraft.runtime.checking import DECAY_NAMES, compare, reference, tiny_decays  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--only", default="gated_deltanet,kda_like,rank2_head_gated")
    ap.add_argument("--tiny", action="store_true", help="also time on tiny decays (the exact kernel's work)")
    ap.add_argument("--check", action="store_true", help="first, the gradients on tiny decays against float64")
    ap.add_argument("--profile", action="store_true", help="each row's largest kernels")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    dt = torch.bfloat16
    specs = class_specs(tuple(args.only.split(",")))[1:]      # [0]: the reference, timed below
    if args.check:
        for name, spec in specs:
            check(name, spec, shape[3], shape[4])
    rows = [("-", measure(REFERENCE, REFERENCE, shape, dt, args.profile))]
    for name, spec in specs:
        for tiny in (False, True)[:1 + args.tiny]:
            for exact in (True, False):
                R1.EXACT_DECAY_GRAD = RK.EXACT_DECAY_GRAD = exact
                how = ("da kernel" if exact else "none") + (", tiny decays" if tiny else "")
                rows.append((how, measure(name, spec, shape, dt, args.profile, _tiny if tiny else None)))
                print(f"row {name} [{how}]: fwd {rows[-1][1]['fwd_ms']:.3f} ms, "
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


def _tiny(obj, inputs, params):
    """``measure``'s inputs with the decays redrawn by ``checking.tiny_decays`` (mixed with ordinary ones)."""
    ins, ps = tiny_decays(obj, inputs, params, torch.Generator().manual_seed(1), True)
    leaf = (lambda t, like: t.to(like.dtype).detach().requires_grad_(like.requires_grad))
    return {k: leaf(t, inputs[k]) for k, t in ins.items()}, {k: leaf(t, params[k]) for k, t in ps.items()}


def check(name: str, spec, d: int, m: int) -> None:
    """``name``'s output and gradients on tiny and zero decays (fp32 on CUDA, B=1 T=200 H=2) against the
    float64 reference, with the exact decay gradient and without; prints the decay's gradient's relative
    RMS error and the worst other one."""
    import ssmcraft
    from ssmcraft.bench.run import random_inputs
    obj = ssmcraft.compile(spec)
    g = torch.Generator().manual_seed(0)
    ins, params = random_inputs(obj, 1, 200, 2, d, m, torch.float64, torch.device("cuda"))
    ins, params = tiny_decays(obj, ins, params, g, True)
    S0 = 0.5 * torch.randn(1, 2, d, m, generator=g, dtype=torch.float64).cuda()
    ref = reference(obj, ins, params, S0, g)
    for exact in (True, False):
        R1.EXACT_DECAY_GRAD = RK.EXACT_DECAY_GRAD = exact
        errs = compare(ref, lambda i, p, s: obj(i, p, s, True)).errors
        decay = {k: v for k, v in errs.items() if k[1:] in DECAY_NAMES}
        other = max((v, k) for k, v in errs.items() if k not in decay)
        print(f"check {name} [{'da kernel' if exact else 'none'}] ({obj.backend}): "
              + ", ".join(f"{k} {v:.2e}" for k, v in decay.items()) + f"; worst other {other[1]} {other[0]:.2e}",
              flush=True)
    R1.EXACT_DECAY_GRAD = RK.EXACT_DECAY_GRAD = True


if __name__ == "__main__":
    sys.exit(main())
