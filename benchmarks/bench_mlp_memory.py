"""The MLP memory family's kernels (``ssmcraft.ops.mlp_memory``) in each of their forms, through ``obj()``
at one shape in one process, beside FLA's ``fused_recurrent_delta_rule`` at the same shape (what a
per-head nonlinear update is held against): fwd and fwd+bwd ms as ``bench_classes.py`` measures them,
and each fwd+bwd's ratio to FLA's. A form is ``recurrent.FUSE`` on or off (the forward kernel's
docstring); ``--profile`` adds each row's kernels (GPU us per fwd+bwd).

Run on a CUDA machine (FLA on ``PYTHONPATH`` for ``--fla``):

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_mlp_memory.py [--shape 8,2048,16,64,64] [--dtype bf16]
        [--only ttt_mlp,mlp_cauchy_2key] [--forms fused,unfused] [--fla] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import timing_table  # noqa: E402
from bench_general import fla_delta_rule  # noqa: E402
from ssmcraft.bench.classes_commands import class_specs, measure  # noqa: E402
from ssmcraft.ops.mlp_memory import kernels as K, recurrent as R  # noqa: E402

FORMS = {"fused": True, "unfused": False}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,2048,16,64,64", help="B,T,H,d,m")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--only", default="ttt_mlp,mlp_cauchy_2key", help="comma-separated library names or bench "
                    "--classes labels")
    ap.add_argument("--forms", default="fused,unfused", help=f"comma-separated, of {', '.join(FORMS)}")
    ap.add_argument("--fla", action="store_true", help="add FLA's fused_recurrent_delta_rule (first)")
    ap.add_argument("--profile", action="store_true", help="each row's kernels, GPU us per fwd+bwd")
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in forms if f not in FORMS]
    if bad:
        print(f"bench_mlp_memory.py: --forms: unknown {', '.join(bad)} (known: {', '.join(FORMS)})")
        return 2
    if not torch.cuda.is_available():
        print("bench_mlp_memory.py needs a CUDA device")
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    labels = [n for n in args.only.split(",") if n]
    specs = dict(class_specs(tuple(labels)))
    rows = [fla_delta_rule(shape, dtype) | {"form": "FLA's"}] if args.fla else []
    if rows:
        print(rows[0], flush=True)
    default = R.FUSE
    for label in labels:
        for form in forms:
            R.FUSE = FORMS[form]
            try:
                row = measure(label, specs.get(label, label), shape, dtype, args.profile) | {"form": form}
                # the autotuner's last choice: this row's (its kernels were the last tuned)
                row["warps"] = "/".join(str(getattr(getattr(k, "best_config", None), "num_warps", "-"))
                                        for k in (K.mlp_memory_fwd_kernel, K.mlp_memory_bwd_kernel))
            except Exception as e:  # noqa: BLE001: one failure is a row of the table
                first = str(e).splitlines()[0] if str(e) else ""
                row = {"spec": label, "form": form, "error": f"{type(e).__name__}: {first}"}
            finally:
                R.FUSE = default
            rows.append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    fla = rows[0]["fwd_bwd_ms"] if args.fla else None
    timing_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B,T,H,d,m = {args.shape}, {args.dtype}",
                 rows, [("objective", "spec"), ("backend", "backend"), ("form", "form"), ("warps fwd/bwd", "warps"),
                        ("fwd ms", "fwd_ms"), ("fwd+bwd ms", "fwd_bwd_ms")],
                 {"x FLA fused_recurrent fwd+bwd": fla},
                 after=lambda r: [f"|   {name[:60]} x{n} | | | | | {us:.1f} us | |" for name, n, us in r.get("kernels", [])[:3]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
