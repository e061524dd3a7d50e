"""Candidates per GPU-hour with and without multi-fidelity, on the composed-search study's
space (``ssmcraft.search.fidelity_compare``): two searches of the same spec and the same
wall budget, one training every trial to the full budget, one with successive halving (or
Hyperband) on tokens seen. Prints one row per arm and the ratio; writes OUT/compare.json.

On one H200 (about 4 minutes: two arms of SECONDS each plus Ray's start; trials packed 3
to a GPU)::

    python benchmarks/search_fidelity.py --study specs/studies/composed_search.yaml --scale full \\
        --seconds 100 --tokens-per-trial 3317760 --min-tokens 122880 --eta 3 \\
        --executor ray --gpus 1 --out /tmp/fidelity_full

On a CPU at tiny scale (what CI runs, in-process)::

    python benchmarks/search_fidelity.py --scale smoke --seconds 20 --min-tokens 128 --executor inline
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ssmcraft.search.fidelity import FIDELITY_KINDS  # noqa: E402
from ssmcraft.search.fidelity_compare import compare  # noqa: E402
from ssmcraft.study.report import markdown_table  # noqa: E402
from ssmcraft.study.spec import load_study_spec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", default=str(REPO / "specs/studies/composed_search.yaml"),
                   help="a composed_search study spec: its search at --scale is the space")
    p.add_argument("--scale", default="smoke", help="the study's scale (smoke or full)")
    p.add_argument("--seconds", type=float, required=True, help="wall budget of each arm (budget.total_seconds)")
    p.add_argument("--trials", type=int, default=1000, help="budget.trials cap of each arm (default 1000)")
    p.add_argument("--tokens-per-trial", type=int, default=None, help="override budget.tokens_per_trial")
    p.add_argument("--min-tokens", type=int, required=True, help="fidelity.min_tokens (the first rung)")
    p.add_argument("--eta", type=int, default=3, help="fidelity.eta (default 3)")
    p.add_argument("--kind", choices=FIDELITY_KINDS, default="successive_halving")
    p.add_argument("--executor", choices=("ray", "inline"), default="ray")
    p.add_argument("--gpus", type=float, default=1.0, help="GPUs the search holds (for GPU-hours; default 1)")
    p.add_argument("--gpus-per-trial", type=float, default=None,
                   help="override resources.gpus_per_trial (a fraction packs trials on one GPU)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    study = load_study_spec(args.study)
    raw = study.params(args.scale)["search"]
    raw["budget"] = {**raw["budget"], "trials": args.trials}
    if args.tokens_per_trial is not None:
        raw["budget"]["tokens_per_trial"] = args.tokens_per_trial
    if args.gpus_per_trial is not None:
        raw.setdefault("resources", {})["gpus_per_trial"] = args.gpus_per_trial
    fidelity = {"kind": args.kind, "min_tokens": args.min_tokens, "eta": args.eta}

    if args.executor == "ray":
        from ssmcraft.search.executor_ray import RayExecutor as make
    else:
        from ssmcraft.search.executor import InlineExecutor as make
    result = compare(raw, fidelity, args.out, seconds=args.seconds, executor=make, gpus=args.gpus,
                     base=study.base)
    rows = result["rows"]
    print()
    print(markdown_table(rows, list(rows[0])))
    ratio = result["ratio"]
    print(f"\ncandidates per GPU-hour, {args.kind} / full budget: "
          f"{'n/a' if ratio is None else f'{ratio:.2f}x'} (study {study.name}, scale {args.scale}, "
          f"{args.seconds:g} s per arm, fidelity {fidelity})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(json.dumps(
        {**result, "study": str(args.study), "scale": args.scale, "executor": args.executor,
         "spec": raw}, indent=2) + "\n")
    print(f"wrote {args.out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
