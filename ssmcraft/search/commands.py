"""``ssmcraft search SPEC --out DIR``: run or resume a search, then print its leaderboard.

Started again with the same command after it was killed, it resumes: finished trials are
kept, trials that were running are re-queued. ``--resume`` continues the study in DIR
with the spec stored there (SPEC left out); with ``--trials N`` it extends a finished
study to N trials.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
from pathlib import Path

from ssmcraft.errors import SsmcraftError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="search spec (YAML); optional with --resume")
    p.add_argument("--out", required=True, type=Path, help="run folder (created; an existing one is resumed)")
    p.add_argument("--executor", choices=("ray", "inline"), default="ray",
                   help="ray (default): trials as Ray tasks; inline: one at a time in this process")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray instance on loopback)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="RDB URL for the study (e.g. postgresql://...); default: DIR/journal.log")
    p.add_argument("--resume", action="store_true",
                   help="continue the study in --out with its stored spec (DIR/search.yaml)")
    p.add_argument("--trials", type=int, default=None,
                   help="override budget.trials (e.g. to extend a finished study with --resume)")
    p.add_argument("--check", action="store_true",
                   help="validate the spec and compile every objective variant, then exit")
    p.add_argument("--no-objective-check", action="store_true",
                   help="skip compiling every objective variant before the first trial")
    p.add_argument("--trial-function", default=None, metavar="MODULE:NAME",
                   help="run this trial function instead of training (e.g. ssmcraft.search.testing:quadratic)")
    p.add_argument("--no-plots", action="store_true", help="write the leaderboard CSV but no PNG plots")


def _import(ref: str):
    module, _, name = ref.partition(":")
    if not module or not name:
        raise SsmcraftError(f"--trial-function: expected MODULE:NAME, got {ref!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SsmcraftError(f"--trial-function {ref}: {e}") from None


def _load_spec(args):
    """The spec to run: SPEC, or with --resume the copy the study keeps in DIR (its
    relative paths still taken from the original spec's folder)."""
    from ssmcraft.search.rundir import SPEC_COPY, open_study
    from ssmcraft.search.spec import load_search_spec

    if not args.resume:
        if args.spec is None:
            raise SsmcraftError("give a search spec, or --resume to continue the one in --out")
        return load_search_spec(args.spec)
    if args.spec is not None:
        raise SsmcraftError("--resume continues the stored spec; leave SPEC out")
    stored = args.out / SPEC_COPY
    if not stored.is_file():
        raise SsmcraftError(f"--resume: {args.out} holds no search to resume (no {SPEC_COPY})")
    base = open_study(args.out, args.storage).user_attrs.get("spec_base")
    return load_search_spec(stored, base=Path(base) if base else None)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import optuna

    from ssmcraft.runtime.lookup import compile_objective
    from ssmcraft.search import reports
    from ssmcraft.search.coordinator import run_search
    from ssmcraft.search.executor import InlineExecutor
    from ssmcraft.search.objectives import check_objectives
    from ssmcraft.search.space import check_experiment
    from ssmcraft.search.trial import train_trial

    spec = _load_spec(args)
    if args.trials is not None:
        if args.trials < 1:
            raise SsmcraftError(f"--trials must be >= 1, got {args.trials}")
        spec = dataclasses.replace(spec, budget=dataclasses.replace(spec.budget, trials=args.trials))
    if args.check:
        if not args.trial_function:
            check_experiment(spec)
        check = check_objectives(spec)
        print(f"{spec.source}: valid; {check.summary()}")
        for line in check.underivable:
            print(f"  does not derive: {line}")
        return 0
    if args.executor == "inline":
        if args.address is not None:
            raise SsmcraftError("--address applies to the ray executor only")
        executor = InlineExecutor()
    else:
        if importlib.util.find_spec("ray") is None:
            raise SsmcraftError("the ray executor needs Ray (pip install 'ssmcraft[ray]'); "
                                "or run with --executor inline")
        from ssmcraft.search.executor_ray import RayExecutor

        address = args.address or os.environ.get("RAY_ADDRESS") or "local"
        executor = RayExecutor(address)
    trial_fn = _import(args.trial_function) if args.trial_function else train_trial
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the coordinator logs each trial itself
    result = run_search(spec, args.out, executor=executor, trial_fn=trial_fn, storage_url=args.storage,
                        compile_fn=None if args.no_objective_check else compile_objective,
                        plots=not args.no_plots)
    c = result.counts
    print(f"\nsearch {spec.name!r}: {result.stopped}; {c['complete']} complete, {c['pruned']} pruned, "
          f"{c['failed']} failed (executor: {result.executor}; storage: {result.storage})\n")
    print(reports.format_table(result.study))
    print()
    for line in result.reports:
        print(f"report: {line}")
    if result.storage.startswith("journal"):
        print(f"dashboard: optuna-dashboard {args.out / 'journal.log'}")
    return 0
