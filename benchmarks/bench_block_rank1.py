"""The block rank-1 family (``ssmcraft/ops/block_rank1_row/``: Longhorn with momentum and its class)
through ``obj()`` at one shape, in one process: fwd and fwd+bwd ms as ``bench_classes.py`` measures
them, for each forced (rows per program, num_warps, checkpoint interval) and each bound of the walk
back (``--bits``: ``recurrent.DIVIDE_BITS``, -1 every chunk rebuilt, inf every chunk walked), beside the
same objective on the generated ``general`` family (the block family switched off) and the references.

Run on a CUDA machine:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_block_rank1.py [--shape 8,2048,16,64,64] [--dtype bf16]
        [--only deltanet,longhorn] [--spec momentum_longhorn] [--sweep 8:1:16,2:1:16,4:1:32,4:1:16:8,8:1:16:8:0]
        [--bits -1,6,8,inf] [--general]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import timing_table  # noqa: E402
from ssmcraft.bench.classes_commands import measure  # noqa: E402
from ssmcraft.ops import block_rank1_row  # noqa: E402
from ssmcraft.ops.block_rank1_row import recurrent as R  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--only", default="deltanet,longhorn", help="references, comma-separated, timed by the rules")
    ap.add_argument("--spec", default="momentum_longhorn", help="the objective of the block family")
    ap.add_argument("--sweep", default="", help="comma-separated ROWS:WARPS:CHUNK[:FWD_ROWS[:KEEP_AHEAD]], each timed "
                    "with that config forced (FWD_ROWS: the forward's rows per program, ROWS otherwise; KEEP_AHEAD 0: "
                    "the backward loads its kept states when it uses them, not a pair ahead)")
    ap.add_argument("--bits", default="", help="comma-separated DIVIDE_BITS, each timed with the rule and every --sweep "
                    "config (default: the module's)")
    ap.add_argument("--general", action="store_true", help="also time the objective on the general family")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_block_rank1.py needs a CUDA device")
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    bits = [float(x) for x in args.bits.split(",") if x] or [R.DIVIDE_BITS]
    runs = [(n, "rule", None, R.DIVIDE_BITS) for n in args.only.split(",") if n]
    for b in bits:
        tag = "" if not args.bits else f" bits {b:g}"
        runs += [(args.spec, "rule" + tag, None, b)]
        runs += [(args.spec, s + tag, tuple(int(x) for x in s.split(":")), b) for s in args.sweep.split(",") if s]
    if args.general:
        runs.append((args.spec, "general", None, R.DIVIDE_BITS))
    rows = []
    supports = block_rank1_row.FAMILY.supports
    default_bits = R.DIVIDE_BITS
    for name, label, cfg, b in runs:
        R.CONFIG.clear()
        R.DIVIDE_BITS = b
        if cfg is not None:
            R.CONFIG.update(zip(("rows", "warps", "chunk", "fwd_rows", "keep_ahead"), cfg))
        if label == "general":
            block_rank1_row.FAMILY.supports = lambda ir: "switched off (bench_block_rank1.py --general)"
        try:
            row = measure(name, name, shape, dtype, False) | {"config": label}
        except Exception as e:  # noqa: BLE001: one failure is a row of the table
            row = {"spec": name, "config": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        finally:
            block_rank1_row.FAMILY.supports = supports
            R.CONFIG.clear()
            R.DIVIDE_BITS = default_bits
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    ref = {r["spec"]: r["fwd_bwd_ms"] for r in rows if r.get("config") == "rule" and "fwd_bwd_ms" in r}
    timing_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B,T,H,d,m = {args.shape}, {args.dtype}",
                 rows, [("objective", "spec"), ("backend", "backend"),
                        ("config (rows:warps:chunk[:fwd rows[:keep ahead]][ bits])", "config"),
                        ("fwd ms", "fwd_ms"), ("fwd+bwd ms", "fwd_bwd_ms")],
                 {"x DeltaNet": ref.get("deltanet"), "x Longhorn": ref.get("longhorn")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
