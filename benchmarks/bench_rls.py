"""The precision family's two forms (``ssmcraft.ops.precision_rank1.chunk.PARALLEL``: one inverse of
the covariance per segment of ``SEGMENT`` tokens, the segments in parallel; or one program walking
every chunk) checked against the float64 reference loop on the GPU, then timed beside DeltaNet, all
in one process:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_rls.py [--shape 8,2048,16,64,64] [--dtype bf16]
        [--check-shape 2,1029,2,64,64] [--segments 32,64] [--only rls,precond_delta] [--profile]
        [--memory fp32,io] [--memory-chunks 64,16]
    python3 benchmarks/bench_rls.py --smoke     # CPU dry run of the fp32 checks under the interpreter, tiny sizes

1. Correctness: each objective in each form (sequential, then parallel at each segment length),
   fp32 and bf16, through ``obj()`` on the check shape (an odd length, many segments): output, both
   final states and every gradient (both initial states included) against one float64 reference per
   objective (``checks.TOL_CHUNKED``); a failed check is printed and the script exits 1 after timing.
2. Timings (``classes_commands.measure``: fwd and fwd+bwd through ``obj()``, median), DeltaNet first,
   then each objective in each form, one table with the ratio to DeltaNet's fwd+bwd, then the config
   the autotuner chose for each precision and covariance kernel; ``--profile`` adds the largest
   kernels of each row. ``--memory fp32,io`` also times each form with the memory's
   chunked step in the I/O dtype (``chunk.MEMORY_FP32 = False``: what the fp32 step costs; the
   checks run the default), ``--memory-chunks 64,32,16`` at each of those chunk sizes (``chunk.CHUNK``:
   in fp32 at 64 the chunked step's kernels spill up to 6 KB a thread, at 16 next to nothing).
"""
from __future__ import annotations

import argparse
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ssmcraft  # noqa: E402
from ssmcraft.bench.classes_commands import REFERENCE, measure  # noqa: E402
from ssmcraft.bench.run import random_inputs  # noqa: E402
from ssmcraft.ops.precision_rank1 import chunk as PR  # noqa: E402
from check_library_gpu import initial_states  # noqa: E402
from checks import TOL_CHUNKED, compare, dtype_name, reference, summary  # noqa: E402


def forms(segments: list[int]):
    """(PARALLEL, SEGMENT) of every form to run, the sequential one first."""
    return [(False, PR.SEGMENT)] + [(True, s) for s in segments]


def set_form(parallel: bool, segment: int) -> str:
    PR.PARALLEL, PR.SEGMENT = parallel, segment
    return PR.form()


def check(names, shape, segments, device: str) -> bool:
    B, T, H, d, m = shape
    ok = True
    for name in names:
        obj = ssmcraft.compile(name)
        if SMOKE:
            obj.prefer = "interpret"
        ins, params = random_inputs(obj, B, T, H, d, m, torch.float64, "cpu", seed=1, unit_keys=True)
        g = torch.Generator().manual_seed(2)
        S0 = initial_states(obj, B, H, d, m, g)
        ins = {k: v.to(device) for k, v in ins.items()}
        params = {k: v.to(device) for k, v in (params or {}).items()}
        S0 = tuple(s.to(device) for s in S0)
        ref = reference(obj, ins, params, S0, g)
        for parallel, segment in forms(segments):
            form = set_form(parallel, segment)
            # the interpreter's bf16 products are not the GPU's: the smoke run checks fp32 only
            for dtype in (torch.float32,) if SMOKE else (torch.float32, torch.bfloat16):
                cmp = compare(ref, lambda i, p, s: obj(i, p, s), dtype)
                good = cmp.within(TOL_CHUNKED[dtype])
                ok &= good
                print(f"check {name:14s} {form:33s} {dtype_name(dtype):9s} {obj.backend}: "
                      f"{summary(cmp, TOL_CHUNKED[dtype])}", flush=True)
    return ok


MEMORY = {"fp32": True, "io": False}       # ``--memory``: chunk.MEMORY_FP32 of each name


def timings(names, shape, dtype, segments, profile: bool, memory: list[str], chunks: list[int]) -> list[str]:
    rows = [_measured("-", measure(REFERENCE, REFERENCE, shape, dtype, profile))]
    default = PR.CHUNK
    for name in names:
        for parallel, segment in forms(segments):
            form = set_form(parallel, segment)
            for mem in memory:
                for c in chunks:
                    PR.MEMORY_FP32, PR.CHUNK = MEMORY[mem], c
                    label = form + ("" if len(memory) == 1 else f", memory {mem}") + \
                        ("" if len(chunks) == 1 else f", memory chunk {c}")
                    rows.append(_measured(label, measure(name, name, shape, dtype, profile)))
                    torch.cuda.empty_cache()
            PR.MEMORY_FP32, PR.CHUNK = MEMORY["fp32"], default
    ref = rows[0][1]["fwd_bwd_ms"]
    lines = [f"| objective | precision form | backend | fwd ms | fwd+bwd ms | x {REFERENCE} |", "|---|---|---|---|---|---|"]
    for form, r in rows:
        lines.append(f"| {r['spec']} | {form} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                     f"{r['fwd_bwd_ms'] / ref:.2f} |")
    return lines


def tuned() -> list[str]:
    """The config the autotuner chose for each of the precision family's kernels, per tuning key."""
    from ssmcraft.ops.precision_rank1 import kernels
    out = []
    for name in ("precision_fwd_kernel", "precision_bwd_kernel", "covariance_fwd_kernel", "covariance_bwd_kernel"):
        for key, cfg in getattr(getattr(kernels, name), "cache", {}).items():
            out.append(f"tuned {name} {key}: {cfg}")
    return out


def _measured(form: str, row: dict) -> tuple[str, dict]:
    """``row`` printed as it comes (a run cut short keeps what it measured), its largest kernels with it."""
    print(f"row {row['spec']} [{form}]: fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms", flush=True)
    for k, c, us in row.get("kernels", [])[:8]:
        print(f"   {row['spec']} [{form}]: {us:10.1f} us  x{c:<3d} {k[:100]}", flush=True)
    return form, row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m of the timings")
    ap.add_argument("--check-shape", default="2,1029,2,64,64", help="B,T,H,d,m of the checks")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--segments", default="32,64", help="the parallel form's segment lengths to run")
    ap.add_argument("--only", default="rls,precond_delta", help="the objectives (the precision family's)")
    ap.add_argument("--profile", action="store_true", help="the largest kernels of each timed row")
    ap.add_argument("--memory", default="fp32", help="the memory step's dtypes to time: fp32 (the default), io "
                    "(the I/O dtype), or both")
    ap.add_argument("--memory-chunks", default=str(PR.CHUNK), help="the memory step's chunk sizes to time (16, 32, 64)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, the checks only at 1,37,1,4,8")
    args = ap.parse_args(argv)
    memory = args.memory.split(",")
    if not set(memory) <= set(MEMORY):
        print(f"bench_rls.py: --memory: {args.memory!r} is not a comma-separated list of {', '.join(MEMORY)}",
              file=sys.stderr)
        return 2
    if not all(c in ("16", "32", "64") for c in args.memory_chunks.split(",")):
        print(f"bench_rls.py: --memory-chunks: {args.memory_chunks!r} is not a comma-separated list of 16, 32, 64",
              file=sys.stderr)
        return 2
    chunks = [int(c) for c in args.memory_chunks.split(",")]
    if args.smoke:
        ok = check(args.only.split(","), (1, 37, 1, 4, 8), [int(x) for x in args.segments.split(",")], "cpu")
        print("checks: " + ("all ok" if ok else "FAILED"))
        return 0 if ok else 1
    shape = tuple(int(x) for x in args.shape.split(","))
    names = args.only.split(",")
    segments = [int(x) for x in args.segments.split(",")]
    print(f"# {torch.cuda.get_device_name()}  timings {shape} {args.dtype}  checks {args.check_shape}", flush=True)
    ok = True if args.no_check else check(names, tuple(int(x) for x in args.check_shape.split(",")), segments, "cuda")
    lines = timings(names, shape, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype], segments, args.profile,
                    memory, chunks)
    print("\n".join(lines))
    print("\n".join(tuned()))
    print("checks: " + ("skipped" if args.no_check else "all ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
