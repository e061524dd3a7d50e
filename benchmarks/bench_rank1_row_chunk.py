"""GPU checks and timings of the chunked per-row rank-1 family (``ssmcraft.ops.rank1_row_chunk``)
beside the per-token one (``rank1_row``) and the chunked per-head one (``rank1_chunk``, DeltaNet), in
one process:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_rank1_row_chunk.py [--shape 8,2048,16,64,64]
        [--configs 16x16x4,16x32x4,32x16x4] [--no-check] [--no-anchor] [--decayed [--profile] [--row-split]]

1. Correctness (``--check``, default on): Longhorn exact's recurrence (u = v = q = k, c and p per row)
   and the general slot form (distinct keys, per-row oc and oh) at B=2, T=1000 (the last chunk cut to
   8 tokens), H=2, K=V=64, fp32 and bf16, the first configs (the general form: the first): output, final state and every gradient (keys, c, p,
   initial state, with a gradient on the final state) against the float64 loop (``rank1_row``'s
   ``naive.py``) on the same (rounded) inputs; rank1_row's own errors beside them.
2. Timings, bf16, at ``--shape`` (B, T, H, K, V), ``triton.testing.do_bench`` medians of the kernels
   alone (c and p given, as the objectives' prologue hands them over): forward, and forward+backward
   (every input's gradient, none of the state's), for rank1_row and each (C, R, num_warps) config of
   the chunked family; FLA-style DeltaNet (per-head step) on rank1_chunk as the anchor.
3. ``--decayed``: the decayed kernels (one key; the decay per row, then per head) against the float64
   loop at B=1 T=320 and ``--shape``'s H, K, V, fp32 and bf16, ordinary and tiny/zero decays; then
   Gated Longhorn (a per-head decay) and wd_longhorn (a per-row one) through ``obj()`` in one process, on
   rank1_row and on this family (``DECAYED``: each one's switch, ``DECAY_AHEAD`` / ``ROW_DECAY_AHEAD``),
   each timed in bf16 at ``--shape`` (``bench.classes_commands.measure``: fwd, fwd+bwd; ``--profile``: its
   kernels' GPU time) beside Longhorn (no decay, this family) for the ratio to Longhorn, and Gated
   Longhorn with its u's factor folded into c on the host (``SCALE_IN_KERNEL`` off). What decides the
   switches. ``--row-split``: in place of those rows, Longhorn, DeltaNet and wd_longhorn on this family
   with its backward split in two kernels and as one (``ROW_DECAY_SPLIT``), and the per-row checks under
   both settings.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ssmcraft.ops.rank1_chunk.chunk import delta_rule  # noqa: E402
from ssmcraft.ops.rank1_row import recurrent as R  # noqa: E402
from ssmcraft.ops.rank1_row.naive import naive_recurrent_rank1_row  # noqa: E402
from ssmcraft.ops.rank1_row_chunk import chunk as RC  # noqa: E402
from ssmcraft.runtime.checking import rel_rms as rel  # noqa: E402

DEV = "cuda"


def longhorn(B, T, H, K, V, dtype, seed=0, general=False):
    """Leaves (u, v, q, oq, c, p, oc, oh, S0 [B, H, K, V]) of Longhorn exact (u = v = q = k, unit-scale
    keys, c = beta / (1 + beta k.k), p = c x), in ``dtype`` (S0 fp32); ``general``: distinct u, v, q and
    per-row oc, oh."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.float32)  # noqa: E731
    k = r(B, T, H, K) / K ** 0.5
    beta = torch.nn.functional.softplus(r(B, T, H, V))
    c = beta / (1 + beta * (k * k).sum(-1, keepdim=True))
    p = c * r(B, T, H, V)
    q = r(B, T, H, K) / K ** 0.5
    S0 = r(B, H, K, V) * 0.5
    cast = lambda x: x.to(dtype)  # noqa: E731
    if general:
        u, v, qq = (cast(r(B, T, H, K) / K ** 0.5) for _ in range(3))
        return u, v, qq, cast(q), cast(c * 0.8), cast(p), cast(r(B, T, H, V)), cast(r(B, T, H, V)), S0
    k = cast(k)
    return k, k, k, cast(q), cast(c), cast(p), 1.0, None, S0


def leaves_of(xs):
    seen = []
    for x in xs:
        if isinstance(x, torch.Tensor) and not any(x is s for s in seen):
            seen.append(x)
    return seen


def reference(xs):
    """The float64 loop on ``xs``' values: (output, final state, cotangents dy and dS, the gradients of
    every distinct tensor of ``xs`` under them)."""
    leaves = {id(x): x.detach().double().requires_grad_() for x in leaves_of(xs)}
    u, v, q, oq, c, p, oc, oh, S0 = [leaves[id(x)] if isinstance(x, torch.Tensor) else x for x in xs]
    B, T, H, K = u.shape
    V = S0.shape[-1]
    ones = torch.ones(B, T, H, device=DEV, dtype=torch.float64)
    oc = ones if not isinstance(oc, torch.Tensor) else oc
    oh = torch.zeros(B, T, H, V, device=DEV, dtype=torch.float64) if oh is None else oh
    y, S = naive_recurrent_rank1_row(u, v, q, oq, ones, c, p, oc, oh, S0)
    g = torch.Generator(device=DEV).manual_seed(7)
    dy = torch.randn(y.shape, generator=g, device=DEV, dtype=torch.float64)
    dS = torch.randn(S.shape, generator=g, device=DEV, dtype=torch.float64)
    grads = torch.autograd.grad((y * dy).sum() + (S * dS).sum(), list(leaves.values()))
    return y, S, dy, dS, grads


def errors(run, xs, ref):
    """Relative RMS errors of ``run(*xs) -> (y, S)`` against ``reference(xs)``."""
    y_ref, S_ref, dy, dS, ref_g = ref
    leaves = {id(x): x.detach().clone().requires_grad_() for x in leaves_of(xs)}
    y, S = run(*[leaves[id(x)] if isinstance(x, torch.Tensor) else x for x in xs])
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), list(leaves.values()))
    out = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    out.update({f"d{i}": rel(a, b) for i, (a, b) in enumerate(zip(got, ref_g))})
    return out


def run_row(u, v, q, oq, c, p, oc, oh, S0):
    return R.rank1_row_recurrence(u, v, q, oq, c, p, oc=oc, oh=oh, initial_state=S0, output_final_state=True)


def run_chunk(u, v, q, oq, c, p, oc, oh, S0):
    return RC.rank1_row_chunk(u, v, q, oq, c, p, oc=oc, oh=oh, initial_state=S0, output_final_state=True)


def fmt(errs):
    return " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + f"  max={max(errs.values()):.1e}"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def timings(run, xs):
    """(fwd ms, fwd+bwd ms) of ``run(*xs)`` (bf16): the gradients of every tensor but the last (the
    initial state), one tensor given in several places (u = v = q) staying one."""
    table = {}

    def leaf(x):
        if not isinstance(x, torch.Tensor) or x is xs[-1]:
            return x
        return table.setdefault(id(x), x.detach().requires_grad_())
    args = [leaf(x) for x in xs]
    grads = list(table.values())
    with torch.no_grad():
        f = bench(lambda: run(*args))
    dy = torch.randn_like(run(*args)[0])

    def fb():
        torch.autograd.grad(run(*args)[0], grads, dy)
    return f, bench(fb)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64")
    ap.add_argument("--configs", default="16x16x4,16x32x4,32x16x4,16x64x4,32x32x8")
    ap.add_argument("--check-shape", default="2,1000,2,64,64", help="B,T,H,K,V of the float64 checks")
    ap.add_argument("--check-configs", type=int, default=2, help="how many of the configs Longhorn's check runs "
                    "(the general form runs the first)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-anchor", action="store_true", help="time no DeltaNet anchor")
    ap.add_argument("--decayed", action="store_true", help="the decayed kernels against float64, then Gated "
                    "Longhorn and wd_longhorn through obj() on rank1_row and on this family (DECAYED), timed (only this)")
    ap.add_argument("--profile", action="store_true", help="with --decayed: each row's kernels, GPU time")
    ap.add_argument("--row-split", action="store_true", help="with --decayed: time (and check) wd_longhorn with "
                    "its backward split and not (ROW_DECAY_SPLIT) beside Longhorn and DeltaNet, only those")
    ap.add_argument("--decay-tiles", default="", help="with --decayed: the decayed objectives on this family at "
                    "these tiles too (CxR,...)")
    args = ap.parse_args(argv)
    if args.decayed:
        return decayed(args)
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    print(torch.cuda.get_device_name() if DEV == "cuda" else DEV, "triton", triton.__version__, flush=True)
    if not args.no_check:
        for general in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                xs = longhorn(*(int(x) for x in args.check_shape.split(",")), dtype, seed=1, general=general)
                name = ("general" if general else "longhorn") + (" fp32" if dtype == torch.float32 else " bf16")
                ref = reference(xs)
                print(f"check {name:<13} rank1_row          {fmt(errors(run_row, xs, ref))}", flush=True)
                for C, Rw, W in configs[:args.check_configs] if not general else configs[:1]:
                    RC.CHUNK, RC.ROWS, RC.NUM_WARPS = C, Rw, W
                    try:
                        e = fmt(errors(run_chunk, xs, ref))
                    except Exception as ex:  # noqa: BLE001 - a config that fails says so and the others run
                        e = f"FAILED: {type(ex).__name__}: {str(ex)[:200]}"
                    print(f"check {name:<13} chunk C{C} R{Rw} w{W}  {e}", flush=True)
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    xs = longhorn(B, T, H, K, V, torch.bfloat16)
    print(f"timings bf16 B={B} T={T} H={H} K={K} V={V} (ms, median): fwd  fwd+bwd", flush=True)
    f, fb = timings(run_row, xs)
    print(f"rank1_row (per token)          {f:7.3f} {fb:7.3f}", flush=True)
    for C, Rw, W in configs:
        RC.CHUNK, RC.ROWS, RC.NUM_WARPS = C, Rw, W
        try:
            f, fb = timings(run_chunk, xs)
            print(f"rank1_row_chunk C{C} R{Rw} w{W:<2}       {f:7.3f} {fb:7.3f}", flush=True)
        except Exception as ex:  # noqa: BLE001 - as above
            print(f"rank1_row_chunk C{C} R{Rw} w{W:<2}       FAILED: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
    if args.no_anchor:
        return
    k, _, _, q, _, _, _, _, S0 = xs
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(B, T, H, V, generator=g, device=DEV).to(torch.bfloat16)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, device=DEV)).to(torch.bfloat16)
    f, fb = timings(lambda k_, q_, x_, b_, S: delta_rule(q_, k_, x_, b_, initial_state=S, output_final_state=True),
                    (k, q, x, beta, S0))
    print(f"rank1_chunk DeltaNet (anchor)  {f:7.3f} {fb:7.3f}", flush=True)


# the objectives with a decay and the switch that puts each on this family on CUDA
DECAYED = {"gated_longhorn": "DECAY_AHEAD", "wd_longhorn": "ROW_DECAY_AHEAD"}


def _decay_check(shape, dtype, tiny, per_row):
    """The decayed kernels (one key, c and p per row; the decay per row, else per head) against the
    float64 loop on the same rounded values: errors of the output, final state and every gradient (k, oq,
    a, c, p, S0); ``tiny``: half the decays below 1e-6, 15 % of those exact zeros."""
    B, T, H, K, V = shape
    g = torch.Generator(device=DEV).manual_seed(5)
    k, _, _, q, c, p, _, _, S0 = longhorn(B, T, H, K, V, dtype, seed=5)
    dims = (B, T, H, V) if per_row else (B, T, H)
    a = 0.3 + 0.7 * torch.rand(dims, generator=g, device=DEV)
    if tiny:
        t = torch.exp(-14 - 50 * torch.rand(dims, generator=g, device=DEV))
        t = torch.where(torch.rand(dims, generator=g, device=DEV) < 0.15, torch.zeros_like(t), t)
        a = torch.where(torch.rand(dims, generator=g, device=DEV) < 0.5, t, a)
    a = a.to(dtype)
    leaves = [k, q, a, c, p, S0]
    ref64 = [x.detach().double().requires_grad_() for x in leaves]
    kk, qq, aa, cc, pp, ss = ref64
    ones = torch.ones(B, T, H, device=DEV, dtype=torch.float64)
    y_ref, S_ref = naive_recurrent_rank1_row(kk, kk, kk, qq, aa, cc, pp, ones, torch.zeros_like(cc), ss)
    dy = torch.randn(y_ref.shape, generator=g, device=DEV, dtype=torch.float64)
    dS = torch.randn(S_ref.shape, generator=g, device=DEV, dtype=torch.float64)
    ref_g = torch.autograd.grad((y_ref * dy).sum() + (S_ref * dS).sum(), ref64)
    ours = [x.detach().clone().requires_grad_() for x in leaves]
    ok, oqq, oa, oc_, op, os_ = ours
    y, S = RC.rank1_row_chunk(ok, ok, ok, oqq, oc_, op, initial_state=os_, output_final_state=True, a=oa)
    got = torch.autograd.grad((y.double() * dy).sum() + (S.double() * dS).sum(), ours)
    errs = {"y": rel(y, y_ref), "S_T": rel(S, S_ref)}
    errs.update({f"d{n}": rel(x, r) for n, x, r in zip(("k", "oq", "a", "c", "p", "S0"), got, ref_g)})
    return errs


def decayed(args):
    """``--decayed`` (module docstring, 3.)."""
    from ssmcraft.bench.classes_commands import measure
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    shape = tuple(int(x) for x in args.shape.split(","))
    if not args.no_check:       # at T = 320 and the timed shape's H, K, V (the bf16 kernels compile once)
        split_default = RC.ROW_DECAY_SPLIT
        checks = [(True, split) for split in (True, False)] if args.row_split else [(True, None), (False, None)]
        for per_row, split in checks:
            if split is not None:
                RC.ROW_DECAY_SPLIT = split
            for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                for tiny in (False, True):
                    errs = _decay_check((1, 320, *shape[2:]), dtype, tiny, per_row)
                    print(f"check {'per-row' if per_row else 'per-head'} decay kernels "
                          f"{'' if split is None else f'ROW_DECAY_SPLIT={split} '}{name} "
                          f"{'tiny' if tiny else 'ordinary'} vs float64: {fmt(errs)}", flush=True)
        RC.ROW_DECAY_SPLIT = split_default
    # (label, objective, switches): each decayed objective on both families, then on this family at each of
    # ``--decay-tiles`` (C x R)
    rows = [("longhorn", "longhorn", {})]
    if args.row_split:
        rows += [("deltanet", "deltanet", {})]
        rows += [(f"wd_longhorn ROW_DECAY_SPLIT={split}", "wd_longhorn", {"ROW_DECAY_AHEAD": True,
                                                                         "ROW_DECAY_SPLIT": split})
                 for split in (False, True, False, True)]
    for spec in DECAYED if not args.row_split else ():
        rows += [(f"{spec} {DECAYED[spec]}={ahead}", spec, {DECAYED[spec]: ahead}) for ahead in (False, True)]
    if not args.row_split:
        rows.append(("gated_longhorn SCALE_IN_KERNEL=False", "gated_longhorn", {"SCALE_IN_KERNEL": False}))
    for tiles in filter(None, args.decay_tiles.split(",")):
        C, Rw = (int(x) for x in tiles.split("x"))
        rows += [(f"{spec} C{C} R{Rw}", spec, {DECAYED[spec]: True, "CHUNK": C, "ROWS": Rw}) for spec in DECAYED]
    print(f"obj() bf16 B,T,H,d,m={shape} (ms, median): fwd  fwd+bwd  x Longhorn's fwd+bwd", flush=True)
    base = None
    for label, spec, switches in rows:
        saved = {k: getattr(RC, k) for k in switches}
        for k, v in switches.items():
            setattr(RC, k, v)
        r = measure(label, spec, shape, torch.bfloat16, profile=args.profile and "ROWS" not in switches)
        for k, v in saved.items():
            setattr(RC, k, v)
        base = base or r["fwd_bwd_ms"]
        print(f"{r['spec']:<34} {r['backend']:<34} {r['fwd_ms']:7.3f} {r['fwd_bwd_ms']:7.3f} "
              f"{r['fwd_bwd_ms'] / base:6.2f}", flush=True)
        if "kernels" in r:
            print("  profile (GPU us per fwd+bwd): " + "; ".join(
                f"{name[:48]} x{n} {us:.0f}" for name, n, us in r["kernels"][:10]), flush=True)
    return 0


if __name__ == "__main__":
    main()
