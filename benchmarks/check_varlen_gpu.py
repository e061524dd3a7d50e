"""Packed sequences (``cu_seqlens``) on the GPU: a packed call of N sequences against the same
sequences run separately through the float64 reference loop (output, final states, every
gradient, initial states included), in fp32 and bf16, for the families with packed kernels
(every family but the one-token decode: GLA, RetNet, Mamba, diagonal Longhorn, DeltaNet, Gated
DeltaNet, exact / gated Longhorn, longhorn_2key, the generated nonlinear and two-state kernels, and
``bench --classes``' composed KDA-like, rank-2 per head, mini-batch classes, RLS, the MLP memory and
the metric compositions).
Lengths are odd, shorter and longer than a chunk, and include an empty sequence. Then the time of
one packed call against the padded batch ``[N, max_len]`` holding the same sequences (bf16,
forward and forward+backward); ``packed+read`` is the packed call with its offsets read and checked
on the host every call (``SSMCRAFT_CHECK_OFFSETS=always``), which waits for the GPU.

    PYTHONUNBUFFERED=1 python3 benchmarks/check_varlen_gpu.py [--only gla,rls] [--no-time]

Prints one line per check and a timing table; exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.ops.common import varlen  # noqa: E402
from ssmcraft.runtime.checking import compare, packed_reference  # noqa: E402

from check_library_gpu import STABLE_REGION, initial_states  # noqa: E402
from checks import TOL, TOL_CHUNKED, dtype_name  # noqa: E402
from ssmcraft.bench.classes_commands import class_specs  # noqa: E402
from common import bench_ms  # noqa: E402

LENS = [0, 1, 37, 64, 129, 300, 511]
CASES = [("gla", "keydecay-chunked+packed", TOL_CHUNKED), ("retnet", "keydecay-chunked+packed", TOL_CHUNKED),
         ("deltanet", "rank1-chunk+packed", TOL_CHUNKED), ("gated_deltanet", "rank1-chunk+packed", TOL_CHUNKED),
         ("mamba", "diagonal-chunked+packed", TOL), ("longhorn_diag", "diagonal-chunked+packed", TOL),
         ("longhorn", "rank1-row+prologue+packed", TOL), ("gated_longhorn", "rank1-row+prologue+packed", TOL),
         ("longhorn_2key", "rankr-row+prologue+packed", TOL), ("huber_longhorn", "general+packed", TOL),
         ("cauchy_delta", "general+packed", TOL), ("momentum_longhorn", "general+packed", TOL),
         ("kda_like", "rank1-keydecay-chunk+packed", TOL_CHUNKED), ("rank2_head_gated", "rankr-chunk+packed", TOL_CHUNKED),
         ("minibatch_delta", "minibatch-chunk+packed", TOL_CHUNKED), ("rls", "precision-fp64+rank1-chunk+packed", TOL_CHUNKED),
         ("ttt_mlp", "mlp-memory+packed", TOL), ("mlp_huber_minibatch", "mlp-minibatch-chunk+packed", TOL_CHUNKED),
         ("minibatch_huber", "general+packed", TOL), ("metric_rank2", "precision-fp64+rankr-chunk+packed", TOL_CHUNKED),
         ("metric_huber", "precision-fp64+general+packed", TOL_CHUNKED)]
H, D, M = 4, 64, 16      # M below the chunked per-row families' MIN_KEYS: Longhorn runs on rank1_row here
TIMED = [2048, 1500, 900, 700, 400, 300, 150, 100]     # the padded batch is [8, 2048]


def offsets(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def check(name: str, want: str, tol: dict) -> bool:
    obj = ssmcraft.compile(dict(class_specs((name,)))[name])
    ins, params = random_inputs(obj, 1, sum(LENS), H, D, M, torch.float64, "cuda", seed=1, unit_keys=True)
    ins.update({n: f(ins[n]) for n, f in STABLE_REGION.get(name, {}).items()})
    S0 = initial_states(obj, len(LENS), H, D, M, torch.Generator().manual_seed(2))
    S0 = tuple(s.to("cuda") for s in S0) if isinstance(S0, tuple) else S0.to("cuda")
    cu = offsets(LENS, "cuda")
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        rounded = {k: v.to(dtype).double() for k, v in ins.items()}       # the reference sees what the kernel sees
        ref = packed_reference(obj, rounded, params, S0, cu, torch.Generator().manual_seed(3))
        cmp = compare(ref, lambda i, p, s: obj(i, p, s, True, cu_seqlens=cu), dtype)
        name_ok = obj.backend.startswith(f"triton:{want}")
        passed = cmp.within(tol[dtype]) and name_ok
        worst, err = cmp.worst
        print(f"{'ok  ' if passed else 'FAIL'} {name:14s} {dtype_name(dtype):8s} worst {err:.2e} ({worst}) "
              f"tol {tol[dtype]:g}  backend {obj.backend}", flush=True)
        ok &= passed
    return ok


def timing(name: str) -> list:
    """(path, fwd ms, fwd+bwd ms) of the packed call and of the padded batch, bf16."""
    obj = ssmcraft.compile(name)
    T = max(TIMED)
    ins, params = random_inputs(obj, len(TIMED), T, H, D, M, torch.bfloat16, "cuda", seed=4)
    packed = {k: torch.cat([v[i, :n] for i, n in enumerate(TIMED)])[None].contiguous() for k, v in ins.items()}
    cu = offsets(TIMED, "cuda")
    rows = []
    for label, x, kw in (("packed", packed, {"cu_seqlens": cu}), ("packed+read", packed, {"cu_seqlens": cu}),
                         ("padded", ins, {})):
        varlen.CHECK = "always" if label == "packed+read" else "auto"   # +read: the offsets checked on the host
        leaves = {k: v.detach().requires_grad_() for k, v in x.items()}

        def fwd():
            with torch.no_grad():
                return obj(x, params, None, False, **kw)

        def fwd_bwd():
            y, _ = obj(leaves, params, None, False, **kw)
            y.float().sum().backward()
        rows.append((f"{name} {label}", sum(TIMED) if label.startswith("packed") else len(TIMED) * T,
                     bench_ms(fwd), bench_ms(fwd_bwd), obj.backend))
    varlen.CHECK = "auto"
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated objectives of the checks (default: all)")
    ap.add_argument("--no-time", action="store_true", help="checks only")
    args = ap.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    ok = all([check(*case) for case in CASES if not only or case[0] in only])
    if args.no_time:
        print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
        return 0 if ok else 1
    print(f"\ntiming, bf16, H={H} d={D} m={M}, lengths {TIMED} ({sum(TIMED)} tokens) packed vs padded "
          f"[{len(TIMED)}, {max(TIMED)}]", flush=True)
    print(f"{'call':24s} {'tokens':>7s} {'fwd ms':>8s} {'fwd+bwd ms':>11s}  backend", flush=True)
    for name in ("gla", "mamba", "gated_deltanet"):
        for label, tokens, f, fb, backend in timing(name):
            print(f"{label:24s} {tokens:7d} {f:8.3f} {fb:11.3f}  {backend}", flush=True)
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
