"""The KDA-like composed layer (``diagonal_decay, regression, scalar step, decay_explicit``, normalised
keys) on its chunked family ``rank1_keydecay_chunk``: correctness on the GPU first, then timings.

Run on a CUDA machine (FLA 0.6.0 importable for its row):

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_kda.py [--shape 8,2048,16,64,64] [--no-fla] [--profile]

1. Correctness: the composed KDA-like objective and a held-out one of the class (keys not
   normalised) through ``obj()``, fp32 and bf16, against the float64 reference loop (output,
   final state, every gradient incl. the initial state's; ``checks.compare``) at B=2 T=300 H=2
   d=m=64 (``--check-shape``).
2. Timings at ``--shape`` (bf16, one process): ssmcraft DeltaNet and the KDA-like layer through
   ``obj()`` as ``bench_classes.py`` times them (``timing.obj_calls`` / ``time_calls``), then FLA's
   ``chunk_kda`` fwd and fwd+bwd (``timing.bench_ms``; log-space decay, unit keys, scale 1), each
   with its ratio to DeltaNet's fwd+bwd. FLA runs last: its first call autotunes, bounded by
   ``--fla-configs`` (configs kept per FLA kernel, ``bound_fla_autotune``) to fit a short run.
   ``--profile``: the GPU kernels of one fwd+bwd of the KDA-like layer and of FLA's.

``--leaf 16/16,16/4,4/4`` checks and times the family at each pair of leaf sizes (forward's prep /
backward, ``LEAF_FWD`` / ``LEAF_BWD``) in one process (an A/B of the sub-block halving); an item
``FWD/BWD/CHUNK/SUB/FAST`` also sets the chunk size (``CHUNK``: 16, 32 or 64), the sub-block
(``SUB``) and the products on the diagonal sub-blocks (``FAST_DIAG``, 0 or 1), each left at the
module's value where the item stops early: ``--leaf 16/4/64/16/0,16/4/64/16/1,16/4/32/16/1`` times
the elementwise diagonal sub-blocks against their products, at chunks of 64 and 32, in one process.
Each item compiles kernels of its own: on an H200 machine, seven processes compiling at once, the
checks of the chunk-32 items took 46-48 s and those of the chunk-64 items (255 registers, long
unrolled code) did not finish within 75 s. Warm them in processes of their own first
(``--only-check --check-shape 1,300,16,64,64 --leaf ITEM``: H=16 d=m=64 compiles the timed case's
kernels too) with more time than that, then time all items in one process. FLA's
kernels take minutes to compile (259 s for its forward and backward at one config per kernel on an
H200): compile them in a process of its own beside the checks (``--fla-warmup``; the compiled
kernels stay in Triton's disk cache, and FLA asks Triton to cache its autotune choices there too,
``FLA_CACHE_RESULTS``, not yet seen to work on the device), then time:

    python3 benchmarks/bench_kda.py --fla-warmup --fla-configs 1 &
    python3 benchmarks/bench_kda.py --only-check --leaf 16/16,16/4; wait
    python3 benchmarks/bench_kda.py --no-check --profile --fla-configs 1 --leaf 16/16,16/4
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.runtime import timing  # noqa: E402
from ssmcraft.bench.classes_commands import kernel_profile, measure  # noqa: E402
from checks import TOL_CHUNKED, compare, dtype_name, reference, summary  # noqa: E402
from common import bound_fla_autotune  # noqa: E402

# the composed specs as files (``compose_objective`` needs ``ssmcraft.search``, whose optuna a
# GPU image may lack); the tests check them against ``compose_objective``
SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")
KDA_LIKE = os.path.join(SPECS, "kda_like.yaml")
HELD_OUT = os.path.join(SPECS, "kda_like_unnormalized.yaml")


def check(path: str, shape=(2, 300, 2, 64, 64)) -> bool:
    obj = ssmcraft.compile(path)
    B, T, H, d, m = shape
    ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, torch.device("cuda"), seed=1)
    S0 = 0.5 * torch.randn(B, H, d, m, dtype=torch.float64, device="cuda")
    ref = reference(obj, ins, params, S0, torch.Generator().manual_seed(2))
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        cmp = compare(ref, lambda i, p, s: obj(i, p, s, True), dtype)
        good = cmp.within(TOL_CHUNKED[dtype]) and "rank1-keydecay-chunk" in obj.backend
        ok &= good
        print(f"{obj.spec.name} {dtype_name(dtype)} B{B} T{T} H{H} d{d} m{m} [{obj.backend}]: "
              f"{summary(cmp, TOL_CHUNKED[dtype])}", flush=True)
    return ok


KNOBS = ("LEAF_FWD", "LEAF_BWD", "CHUNK", "SUB", "FAST_DIAG")


def _knobs(item: str, family) -> tuple[int, ...]:
    """``FWD/BWD[/CHUNK[/SUB[/FAST]]]`` as the module constants of ``KNOBS``, the module's own where
    the item leaves them out ("" keeps them all)."""
    given = [int(n) for n in item.split("/")] if item else []
    if item and not 2 <= len(given) <= len(KNOBS):
        raise SystemExit(f"bench_kda.py: --leaf: item {item!r} is not FWD/BWD[/CHUNK[/SUB[/FAST]]]")
    return tuple(given) + tuple(getattr(family, k) for k in KNOBS[len(given):])


def _set(family, knobs) -> None:
    for name, value in zip(KNOBS, knobs):
        setattr(family, name, value)


def _label(knobs) -> str:
    fwd, bwd, chunk, sub, fast = knobs
    return f"chunk {chunk}, sub {sub}, leaves {fwd}/{bwd}, diagonal {'products' if fast else 'elementwise'}"


def fla_calls(shape, keep: int):
    """FLA's chunk_kda at ``shape`` in bf16 (log-space decay, unit keys, scale 1): (fwd, fwd_bwd)
    callables; its autotuners cut to ``keep`` configs first (``bound_fla_autotune``; 0: all)."""
    from fla.ops.kda import chunk_kda
    if keep:
        bound_fla_autotune(keep)
    B, T, H, d, m = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q = torch.nn.functional.normalize(mk(B, T, H, m), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(mk(B, T, H, m), dim=-1).bfloat16()
    v = mk(B, T, H, d).bfloat16()
    gate = torch.nn.functional.logsigmoid(2.0 + mk(B, T, H, m))           # log alpha, fp32
    beta = torch.sigmoid(mk(B, T, H)).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, gate, beta)]
    do = torch.randn(B, T, H, d, generator=g, device="cuda").bfloat16()

    def fwd():
        return chunk_kda(q, k, v, gate, beta, scale=1.0)[0]

    def fwd_bwd():
        return torch.autograd.grad(chunk_kda(*leaves, scale=1.0)[0], leaves, do)
    return fwd, fwd_bwd


def fla_kda(shape, ref_ms, profile: bool, keep: int):
    """FLA's chunk_kda at ``shape`` in bf16: (fwd ms, fwd+bwd ms or None where it failed)."""
    fwd, fwd_bwd = fla_calls(shape, keep)
    with torch.no_grad():
        f = timing.bench_ms(fwd)
    print(f"| FLA chunk_kda | {f:.3f} | ", end="", flush=True)
    try:
        fb = timing.bench_ms(fwd_bwd)
        print(f"{fb:.3f} | {fb / ref_ms:.2f} |", flush=True)
        if profile:
            print("-- FLA chunk_kda: GPU kernels of one fwd+bwd")
            for k, c, us in kernel_profile(fwd_bwd)[:16]:
                print(f"   {us:10.1f} us  x{c:<3d} {k[:110]}")
    except Exception as e:  # noqa: BLE001 - the refusal is the row's content
        print(f"backward failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} | - |", flush=True)
        fb = None
    return f, fb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--fla-configs", type=int, default=4,
                    help="autotune configs kept per FLA kernel (0: all; its first call then takes minutes)")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of one fwd+bwd of the KDA-like layer")
    ap.add_argument("--only-check", action="store_true", help="the correctness checks alone (exit status 1 if one fails)")
    ap.add_argument("--fla-warmup", action="store_true",
                    help="one FLA fwd and fwd+bwd, untimed, then exit: compiles and autotunes FLA's kernels into "
                         "Triton's disk cache in a process of its own, run beside the checks")
    ap.add_argument("--diag-unroll", type=int, default=None,
                    help="in-block offsets per step of the backward's diagonal block sums (chunk.DIAG_UNROLL)")
    ap.add_argument("--leaf", default=None,
                    help="FWD/BWD[/CHUNK[/SUB[/FAST]]]: rows of the diagonal blocks summed elementwise in the "
                         "forward's prep and in the backward, SUB halved down to them (chunk.LEAF_FWD, LEAF_BWD), "
                         "then chunk.CHUNK, SUB and FAST_DIAG; a comma list checks and times the layer at each "
                         "item, in this process")
    ap.add_argument("--check-shape", default="2,300,2,64,64",
                    help="B,T,H,d,m of the correctness checks (H=16 d=m=64 shares the timed case's compiled kernels)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kda.py needs a CUDA device")
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    check_shape = tuple(int(x) for x in args.check_shape.split(","))
    t0 = time.time()
    if args.fla_warmup:
        for fn in fla_calls(shape, args.fla_configs):
            fn()
        torch.cuda.synchronize()
        print(f"FLA chunk_kda compiled and autotuned in {time.time() - t0:.0f} s", flush=True)
        return 0
    from ssmcraft.ops.rank1_keydecay_chunk import chunk as family
    family.DIAG_UNROLL = args.diag_unroll or family.DIAG_UNROLL
    leaves = [_knobs(item, family) for item in args.leaf.split(",")] if args.leaf else [_knobs("", family)]
    kda, held_out = KDA_LIKE, HELD_OUT
    ok = True
    if not args.no_check:
        for knobs in leaves:
            _set(family, knobs)
            print(f"-- {_label(knobs)}", flush=True)
            ok = all([check(kda, check_shape), check(held_out, check_shape)]) and ok
        print(f"[checks {'passed' if ok else 'FAILED'} in {time.time() - t0:.0f} s]", flush=True)
    if args.only_check:
        return 0 if ok else 1
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, B,T,H,d,m = {args.shape}, bf16; "
          "ratio: fwd+bwd / deltanet's fwd+bwd (same process); each row printed once timed (a run cut short "
          "keeps the rows it reached)")
    print("| layer | fwd ms | fwd+bwd ms | x deltanet |\n|---|---|---|---|", flush=True)
    rows = []
    for label, spec, knobs in [("deltanet", "deltanet", None)] + [("KDA-like (composed)", kda, k) for k in leaves]:
        if knobs is not None:
            _set(family, knobs)
            label = f"{label}, {_label(knobs)}"
        r = measure(label, spec, shape, torch.bfloat16, args.profile and knobs is not None)
        rows.append(r)
        print(f"| {r['spec']} [{r['backend']}] | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
              f"{r['fwd_bwd_ms'] / rows[0]['fwd_bwd_ms']:.2f} |", flush=True)
        for k, c, us in r.get("kernels", [])[:16]:
            print(f"   {us:10.1f} us  x{c:<3d} {k[:110]}", flush=True)
    ref = rows[0]["fwd_bwd_ms"]
    print(f"[timed in {time.time() - t0:.0f} s]", flush=True)
    if not args.no_fla:
        try:
            f, fb = fla_kda(shape, ref, args.profile, args.fla_configs)
            for r in rows[1:] if fb else []:
                print(f"{r['spec']} / FLA chunk_kda: fwd {r['fwd_ms'] / f:.2f}x, "
                      f"fwd+bwd {r['fwd_bwd_ms'] / fb:.2f}x", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"FLA chunk_kda failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    print(f"[done in {time.time() - t0:.0f} s]", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
