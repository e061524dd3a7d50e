"""``ssmcraft study SPEC --out DIR [--device auto|cpu|cuda] [--scale smoke|full]``.

Runs the study a spec under ``specs/studies/`` describes and writes ``DIR/report.md`` (date,
device, command, tables, PNG plots beside it, and whether the numbers agree with the paper)
and ``DIR/results.json``. Started again with the same command, finished cells are read back.

``--shard I/N`` trains only every N-th cell (from the I-th) and writes no report: start N such
processes on one GPU or several (small models leave a GPU mostly idle), then the plain command
once more to read every cell back and write the report.
"""
from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from ssmcraft.errors import SsmcraftError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec (YAML), e.g. specs/studies/mqar_state_size.yaml")
    p.add_argument("--out", required=True, type=Path, help="output folder (created; finished cells are reused)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to train and evaluate (default auto: the GPU when there is one)")
    p.add_argument("--scale", default="full", choices=("smoke", "full"),
                   help="smoke: tiny models and few steps (a CPU-minute); full (default): the GPU size")
    p.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                   help="train only cells I, I+N, I+2N, ... and write no report (run N of these side by side, "
                        "then the command without --shard to write the report)")
    p.add_argument("--check", action="store_true", help="validate the spec (both scales) and exit")
    p.add_argument("--quiet", action="store_true", help="warnings only")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N (two integers), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text}: needs N >= 1 and 0 <= I < N")
    return i, n


def run_study(spec_path, out: Path, device: str = "auto", scale: str = "full", command: str | None = None,
              say=print, shard: tuple[int, int] | None = None) -> dict:
    """Run a study; returns {"report", "results", "verdicts"} (report and results None for a shard)."""
    from ssmcraft.study.report import write_report
    from ssmcraft.study.runners import RUNNERS, Context
    from ssmcraft.study.spec import load_study_spec

    spec = spec_path if not isinstance(spec_path, (str, Path)) else load_study_spec(spec_path)
    params = spec.params(scale)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if shard is not None and spec.kind == "composed_search":
        raise SsmcraftError(f"{spec.source}: a composed_search study is one search; it spreads its trials itself "
                            "(search.resources), so --shard does not apply")
    ctx = Context(out=out, device=device, say=say, shard=shard)
    t0 = time.perf_counter()
    runner = RUNNERS[spec.kind]
    if spec.kind == "composed_search":
        result = runner(params, spec.thresholds, ctx, spec.base)
    else:
        result = runner(params, spec.thresholds, ctx)
    if shard is not None:
        say(f"study: shard {shard[0]}/{shard[1]} trained its cells in {time.perf_counter() - t0:.0f} s "
            "(no report: run the command without --shard to write it)")
        return {"report": None, "results": None, "verdicts": []}
    dev = _describe_device(result.get("device"), device)
    command = command or f"ssmcraft study {spec.source} --out {out} --device {device} --scale {scale}"
    report, results = write_report(out, spec=spec, scale=scale, device=dev, command=command, result=result,
                                   wall_s=time.perf_counter() - t0)
    return {"report": report, "results": results, "verdicts": result.get("verdicts", [])}


def plan(spec, scale: str) -> tuple[int, float | None]:
    """(number of training runs, upper bound on training seconds from max_seconds, or None)."""
    p = spec.params(scale)
    k = spec.kind
    if k == "mqar_state_size":
        per = [(len(p["state_sizes"]) if o != "attention" else 1) for o in p["objectives"]]
        runs = [(p["experiment"], sum(per) * len(p["lrs"]) * len(p["seeds"]))]
    elif k == "exact_vs_diagonal":
        runs = [(p["mqar"], 2 * len(p["seeds"])), (p["text"], 2 * len(p["seeds"]))]
    elif k == "extrapolation":
        runs = [(p["experiment"], len(p["objectives"]) * len(p["seeds"]))]
    elif k == "state_capacity":
        runs = [(p["experiment"], len(p["state_sizes"]) * len(p["train_lengths"]) * len(p["seeds"]))]
    elif k == "equal_state":
        n = (len(p["challengers"]) + len(p["baselines"])) * len(p["seeds"])
        runs = [(p["mqar"], n), (p["text"], n)]
    elif k == "mad":
        from ssmcraft.study.spec import mad_cells

        runs = [({"train": p["train"]}, len(p["objectives"]) * len(mad_cells(p)) * len(p["lrs"]) * len(p["seeds"]))]
    else:
        b = p["search"]["budget"]
        return b["trials"], b.get("total_seconds")
    n = sum(c for _, c in runs)
    limits = [e.get("train", {}).get("max_seconds") for e, _ in runs]
    bound = None if any(x is None for x in limits) else sum(x * c for x, (_, c) in zip(limits, runs))
    return n, bound


def _describe_device(used: str | None, asked: str) -> str:
    import platform

    import torch

    used = used or asked
    if str(used).startswith("cuda") and torch.cuda.is_available():
        return f"{used} ({torch.cuda.get_device_name(0)})"
    return f"{used} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def run(args: argparse.Namespace) -> int:
    from ssmcraft.study.spec import load_study_spec
    from ssmcraft.train.commands import setup_logging

    setup_logging(args.quiet)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SsmcraftError("--device cuda: no CUDA device is available here")
    spec = load_study_spec(args.spec)
    if args.check:
        print(f"{spec.source}: valid {spec.kind} study (scales: smoke, full)")
        for scale in ("smoke", "full"):
            n, bound = plan(spec, scale)
            print(f"  {scale}: {n} training runs" + (f", at most {bound / 60:.0f} min of training (max_seconds)"
                                                     if bound is not None else ", no max_seconds bound"))
        return 0
    command = " ".join(["ssmcraft", "study", shlex.quote(str(args.spec)), "--out", shlex.quote(str(args.out)),
                        "--device", args.device, "--scale", args.scale])
    done = run_study(spec, args.out, args.device, args.scale, command=command,
                     say=(lambda s: None) if args.quiet else print, shard=args.shard)
    if done["report"] is None:
        return 0
    for v in done["verdicts"]:
        print(f"{v['verdict'].upper():13s} {v['claim']} (confidence {v['confidence']})")
    print(f"wrote {done['report']} and {done['results']}")
    return 0
