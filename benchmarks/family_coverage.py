"""Which kernel family runs each objective of a seeded sample of the compose space on CUDA: the
first family of ``ssmcraft.ops.registry.order(ir, "triton")`` that supports the IR (the one-token
``decode`` family left out: training calls have T > 1), or the PyTorch path where none does. CPU only
(it derives, it runs nothing):

    python3 benchmarks/family_coverage.py [--n 200] [--seed 0] [--out OUT.json]

The sample: every proximity, data term, one or two keys, step, update and memory, with and without
a mini-batch of 16, keys normalised, the exact approximation; compositions the compiler refuses are
skipped and not counted. Prints one line per objective (name, structure class, family), the count per
family, then each objective left on the PyTorch path with every family's reason.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ssmcraft  # noqa: E402
from ssmcraft.errors import SsmcraftError  # noqa: E402
from ssmcraft.ops.registry import order  # noqa: E402
from ssmcraft.search.compose import TERMS, check_choices, compose_objective, composed_name  # noqa: E402


def sample(n: int, seed: int) -> list[dict]:
    combos = [dict(proximity=p, data=d, keys=k, step=s, update=u, minibatch=mb, memory=mem, normalize=True)
              for p, d, k, s, u, mb, mem in itertools.product(TERMS["proximity"], TERMS["data"], (1, 2), TERMS["step"],
                                                              TERMS["update"], (0, 16), TERMS["memory"])]
    random.Random(seed).shuffle(combos)
    return combos[:n] if n else combos


def family_of(ir) -> tuple[str | None, list[str]]:
    """(the family CUDA dispatch picks, or None; the refusals of the others, in order)."""
    why = []
    for fam in order(ir, "triton"):
        if fam.name == "decode":
            continue
        reason = fam.reason(ir)
        if reason is None:
            return fam.name, why
        why.append(f"{fam.name}: {reason}")
    return None, why


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="compositions to derive (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the rows as JSON")
    args = ap.parse_args(argv)
    rows = []
    for choices in sample(0, args.seed):
        if args.n and len(rows) >= args.n:
            break
        try:
            obj = ssmcraft.compile(compose_objective(check_choices(choices)))
        except SsmcraftError:
            continue                      # a composition the compiler refuses is not a layer
        fam, why = family_of(obj.ir)
        rows.append({"name": composed_name(choices), "kind": obj.ir.kind, "family": fam, "choices": choices,
                     "refusals": [] if fam else why})
        print(f"{rows[-1]['name']:48s} {obj.ir.kind:16s} {fam or 'PyTorch path'}", flush=True)
    counts = collections.Counter(r["family"] or "PyTorch path" for r in rows)
    print(f"\n{len(rows)} objectives: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    for r in rows:
        if r["family"] is None:
            print(f"PyTorch path: {r['name']} ({r['kind']})\n    " + "\n    ".join(w[:140] for w in r["refusals"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
