"""``ssmcraft bench SPEC``: the command line of ``ssmcraft.bench.run`` (what it times and how is
documented there); ``ssmcraft bench --classes``: the structure-class table of
``ssmcraft.bench.classes_commands``."""
from __future__ import annotations

import sys

from ssmcraft.bench.run import LAYER_NOT_GRAPHED, run_bench, run_layer_bench
from ssmcraft.fileio import write_json


def add_arguments(p):
    p.add_argument("spec", nargs="?", help="an objective spec: a path, or a library name such as longhorn_diag")
    p.add_argument("--classes", action="store_true",
                   help="the structure-class table instead: every library objective and one composed objective "
                        "per class the library lacks, fwd and fwd+bwd through obj() and the ratio to DeltaNet's "
                        "fwd+bwd in the same process (CUDA only); --only limits the rows")
    p.add_argument("--only", default="", help="with --classes: comma-separated library names, composed class labels "
                                              "or spec files")
    p.add_argument("--no-composed", action="store_true", help="with --classes: the library's objectives only")
    p.add_argument("--profile", action="store_true", help="with --classes: each row's GPU kernels of one fwd+bwd")
    p.add_argument("--shape", default=None,
                   help="B,T,H,d,m (d = V values per head, m = K keys); default 8,2048,1,1536,16, "
                        "and 8,2048,16,64,64 with --classes")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="input/output dtype (state is fp32)")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--layer", action="store_true",
                   help="time the mixer (ObjectiveMixer: projections, conv, recurrence, gate) fwd+bwd instead; "
                        "d_model = H*d, bf16 autocast")
    p.add_argument("--graphed", action="store_true",
                   help="also time obj.graphed(...) (CUDA graphs captured once on the same tensors, replayed): "
                        "eager, graphed (tensors copied in) and static (the graph's own buffers) side by side, "
                        "with GPU busy and host us per call, and a check of the graphed call against eager; "
                        "needs CUDA (an error otherwise, never an eager run); not with --layer")
    p.add_argument("--out", help="also write the results as JSON to this file")


def _graphs_table(res: dict) -> list[str]:
    """``--graphed``'s lines: eager, 1-thread (fwd+bwd only), graphed and static side by side per kind,
    then the check."""
    from ssmcraft.runtime.timing import HOW_LABELS, HOWS, KINDS
    kinds = [k for k in KINDS if f"eager_{k}_ms" in res]
    lines = ["  CUDA graphs (obj.graphed, captured once on these tensors; static: called on the graph's own "
             "input buffers, no copy-in)",
             "  (1-thread: eager, the backward run by the autograd engine on the calling thread)",
             f"  {'':18s} " + " ".join(f"{HOW_LABELS.get(h, h):>9s}" for h in HOWS)]
    for kind in kinds:
        label = "fwd" if kind == "fwd" else "fwd+bwd"
        for what, key, fmt in (("ms", "{h}_{k}_ms", "{:9.3f}"), ("GPU busy", "{h}_busy_{k}", "{:9.2f}"),
                               ("host us", "{h}_host_us_{k}", "{:9.0f}")):
            vals = [res.get(key.format(h=h, k=kind)) for h in HOWS]
            lines.append(f"  {label + ' ' + what:18s} " + " ".join(
                fmt.format(v) if v is not None else f"{'-':>9s}" for v in vals))
    verdict = "exact" if res["check_exact"] else f"worst {res['check_worst_rel']:.1e} (eager repeat " \
                                                   f"{res['check_eager_repeat_rel']:.1e})"
    missing = f"; missing {', '.join(res['check_missing'])}" if res["check_missing"] else ""
    if res["check_nonfinite"]:
        missing += f"; eager not finite in {', '.join(res['check_nonfinite'])} (these inputs diverge)"
    lines.append(f"  check graphed vs eager ({', '.join(res['check_errors'])}){missing}: {verdict} "
                 f"{'PASS' if res['check_ok'] else 'FAIL'}")
    return lines


def _print(res: dict) -> None:
    s = res["shape"]
    if res.get("layer"):
        print(f"mixer on {res['spec']} ({res['kind']}) on {res['device']}, backend {res['backend']}, "
              f"B={s['B']} T={s['T']} H={s['H']} d={s['d']} m={s['m']} {res['dtype']}")
        print(f"  fwd {res['fwd_ms']:.3f} ms   fwd+bwd {res['fwd_bwd_ms']:.3f} ms   "
              f"({res['tokens_per_s_fwd_bwd']:.0f} tokens/s fwd+bwd)")
        return
    print(f"{res['spec']} ({res['kind']}) on {res['device']}, backend {res['backend']}, "
          f"B={s['B']} T={s['T']} H={s['H']} d={s['d']} m={s['m']} {res['dtype']}")
    print(f"  copy bandwidth     {res['copy_bandwidth_GBps']:8.0f} GB/s")
    print(f"  fwd                {res['fwd_ms']:8.3f} ms   {res['fwd_GBps']:7.0f} GB/s   "
          f"{res['fwd_x_floor']:5.2f}x the HBM floor ({res['fwd_floor_ms']:.3f} ms)")
    if "fwd_bwd_ms" in res:
        print(f"  fwd+bwd            {res['fwd_bwd_ms']:8.3f} ms   {res['fwd_bwd_GBps']:7.0f} GB/s   "
              f"{res['fwd_bwd_x_floor']:5.2f}x the HBM floor ({res['fwd_bwd_floor_ms']:.3f} ms)")
        if not res.get("graphed"):      # else in the table's 1-thread column
            print(f"  fwd+bwd, 1 thread  {res['onethread_fwd_bwd_ms']:8.3f} ms   (the backward run by the autograd "
                  "engine on this thread: torch.autograd.set_multithreading_enabled(False))")
    if res.get("graphed"):
        print("\n".join(_graphs_table(res)))
    if "kernel_entry_fwd_ms" in res:
        print(f"  diagnostic: kernel entry diagonal_scan fwd {res['kernel_entry_fwd_ms']:.3f} ms "
              f"(obj() overhead {res['fwd_ms'] - res['kernel_entry_fwd_ms']:+.3f} ms)")
    for k, v in res.get("configs", {}).items():
        print(f"  config ({k})  {v}")


def _shape(text: str) -> tuple[int, ...]:
    from ssmcraft.errors import SsmcraftError
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SsmcraftError(f"--shape must be B,T,H,d,m integers, got {text!r}")
    if len(shape) != 5 or min(shape) < 1:
        raise SsmcraftError(f"--shape must be five positive integers B,T,H,d,m, got {text!r}")
    return shape


def _classes(args) -> int:
    import torch

    from ssmcraft.bench.classes_commands import REFERENCE, run_classes, table
    from ssmcraft.errors import SsmcraftError
    if not torch.cuda.is_available():
        raise SsmcraftError("bench --classes times Triton kernels on CUDA; this machine has no CUDA device "
                            "(timings under the interpreter mean nothing)")
    shape = _shape(args.shape or "8,2048,16,64,64")
    rows = run_classes(shape, args.dtype, tuple(n for n in args.only.split(",") if n), not args.no_composed,
                       args.profile)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape B,T,H,d,m = "
          f"{','.join(map(str, shape))}, {args.dtype}; ratio: fwd+bwd / {REFERENCE}'s fwd+bwd (same process)")
    print("\n".join(table(rows)))
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "shape": shape, "dtype": args.dtype,
                              "rows": rows})
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def run(args) -> int:
    from ssmcraft.errors import SsmcraftError
    if args.classes:
        if args.spec or args.layer or args.graphed or args.no_backward:
            raise SsmcraftError("bench --classes times its own list of objectives (--only limits it); "
                                "it takes no SPEC, --layer, --graphed or --no-backward")
        return _classes(args)
    if not args.spec:
        raise SsmcraftError("bench needs an objective SPEC (a path or a library name), or --classes")
    if args.only or args.no_composed or args.profile:
        raise SsmcraftError("--only, --no-composed and --profile go with --classes")
    shape = _shape(args.shape or "8,2048,1,1536,16")
    if args.layer and args.graphed:
        raise SsmcraftError(LAYER_NOT_GRAPHED)
    if args.layer:
        res = run_layer_bench(args.spec, shape)
    else:
        res = run_bench(args.spec, shape, args.dtype, backward=not args.no_backward, graphed=args.graphed)
    _print(res)
    if args.out:
        write_json(args.out, res)
        print(f"wrote {args.out}", file=sys.stderr)
    if res.get("graphed") and not res["check_ok"]:
        print("ssmcraft bench: error: the graphed call differs from eager obj() (check above)", file=sys.stderr)
        return 1
    return 0
