"""Leave-one-out rediscovery: with some library layers removed, does a search over composed
objectives find them again from the pieces, and after how many trials?

Identity is by derived update (``update_fingerprint``: the IR without the spec's name, file and
``update:`` label), so a composition counts as, say, Gated DeltaNet exactly when the compiler
derives Gated DeltaNet's recurrence from it, whatever its terms are called and whether the spec
asked for it as a minimiser or as a gradient step (DeltaNet's explicit step and the minimiser of
its linearised objective are one recurrence).

- ``space_census``: every objective the search space can select, derived and fingerprinted;
  for each left-out layer, how many of them derive it and the chance that one trial of a
  uniform random search over the (conditional) space draws one -- the baseline that the
  sampler's trial count is compared with.
- ``rediscoveries``: in a finished search's table, the trials that derived each left-out layer,
  the first of them (in trial order), their best rank and whether one is on the Pareto front.
"""
from __future__ import annotations

import hashlib
import json
from fractions import Fraction
from typing import Callable, Iterable

from ssmcraft.errors import SsmcraftError


def update_fingerprint(compiled) -> str:
    """A name-free hash of a compiled objective's derived update: its IR (structure kind,
    coefficient expressions, slots) without the spec's name and file and without the
    ``update`` label, which says how the spec asked for the recurrence, not what it is. Two
    specs that derive the same recurrence share it."""
    ir = compiled.ir.to_json()
    for provenance in ("spec", "source", "update"):
        ir.pop(provenance, None)
    return hashlib.sha256(json.dumps(ir, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_of(objective, compile_fn: Callable, cache: dict | None = None) -> str | None:
    """The fingerprint of a library name or objective spec dict; None if it does not derive."""
    key = objective if isinstance(objective, str) else json.dumps(objective, sort_keys=True)
    if cache is not None and key in cache:
        return cache[key]
    try:
        fp = update_fingerprint(compile_fn(objective))
    except SsmcraftError:
        fp = None
    if cache is not None:
        cache[key] = fp
    return fp


def row_fingerprint(row: dict, compile_fn: Callable, cache: dict | None = None) -> str | None:
    """The fingerprint of a leaderboard row's objective (its recorded spec, else its name)."""
    spec = row.get("objective_spec")
    return fingerprint_of(json.loads(spec) if spec else row.get("objective"), compile_fn, cache)


def _variant_probability(spec, params: dict) -> Fraction:
    """Chance that a uniform draw of the conditional space selects ``params``' objective:
    1/(options) x 1/(values) for each searched term of that option and the approximation axis."""
    from ssmcraft.search.space import APPROXIMATION_PATH, OBJECTIVE_PARAM

    option = spec.option(params[OBJECTIVE_PARAM])
    p = Fraction(1, len(spec.objectives))
    for _, values in option.searched_terms():
        p /= len(values)
    for prm in spec.params:
        if prm.path == APPROXIMATION_PATH:
            p /= len(prm.choices)
    return p


def space_census(spec, targets: dict[str, str], compile_fn: Callable, cache: dict | None = None) -> dict:
    """``targets``: left-out layer -> fingerprint. Returns {"variants": n, "underivable": n,
    "targets": {name: {"variants": n, "p_per_trial": float, "expected_trials": float | None,
    "examples": [objective names]}}} for a uniform random search over ``spec``'s space.

    ``variants`` counts distinct objective specs; a layer's chance adds up every selection of
    the conditional space that derives it (two options of the space may select one objective).
    An objective that does not derive (today's compiler) counts in ``underivable``: a trial that
    draws it fails with the compiler's reason, so it still takes its share of the draws."""
    from ssmcraft.search.space import objective_variants

    out = {name: {"variants": set(), "p": Fraction(0), "examples": []} for name in targets}
    by_fp = {fp: name for name, fp in targets.items()}
    seen: set[str] = set()
    bad: set[str] = set()
    for params, objective in objective_variants(spec, distinct=False):
        key = json.dumps(objective, sort_keys=True)
        seen.add(key)
        fp = fingerprint_of(objective, compile_fn, cache)
        if fp is None:
            bad.add(key)
            continue
        name = by_fp.get(fp)
        if name is not None:
            t = out[name]
            t["p"] += _variant_probability(spec, params)
            if key not in t["variants"] and len(t["examples"]) < 3:
                t["examples"].append(objective.get("name"))
            t["variants"].add(key)
    result = {}
    for name, t in out.items():
        p = float(t["p"])
        result[name] = {"variants": len(t["variants"]), "p_per_trial": p,
                        "expected_trials": (1.0 / p) if p > 0 else None, "examples": t["examples"]}
    return {"variants": len(seen), "underivable": len(bad), "targets": result}


def rediscoveries(table: Iterable[dict], targets: dict[str, str], compile_fn: Callable,
                  cache: dict | None = None) -> dict[str, dict]:
    """Per left-out layer, over the rows of ``reports.rows`` (every trial, failed ones too):
    {"trials": [trial numbers that derived it, in order], "first_trial" (the first of them),
    "trials_until_first" (1-based count of trials up to and including the first draw),
    "trials_until_trained" (the same, up to the first such trial that finished and was
    ranked), "complete", "best_rank", "on_front"}. A draw that failed (timeout, divergence)
    is a draw, not a rediscovery: nothing was learnt about the layer."""
    rows = sorted(table, key=lambda r: r["trial"])
    order = {r["trial"]: i + 1 for i, r in enumerate(rows)}
    out = {}
    for name, fp in targets.items():
        hits = [r for r in rows if row_fingerprint(r, compile_fn, cache) == fp]
        done = [r for r in hits if r.get("rank") is not None]
        out[name] = {"trials": [r["trial"] for r in hits], "first_trial": hits[0]["trial"] if hits else None,
                     "trials_until_first": order[hits[0]["trial"]] if hits else None,
                     "trials_until_trained": order[done[0]["trial"]] if done else None, "complete": len(done),
                     "best_rank": min((r["rank"] for r in done), default=None),
                     "on_front": any(r.get("pareto") for r in done)}
    return out


def census_rows(census: dict, found: dict[str, dict], n_trials: int, n_ranked: int) -> list[dict]:
    """One report row per left-out layer: the space's odds next to what the search did.
    ``rediscovered``: some trial derived the layer and trained to a ranked result;
    ``first_drawn`` / ``first_trained``: trials run up to and including the first such draw /
    the first such ranked trial; ``uniform_expected_trials``: 1/p, the mean of the first draw
    under uniform sampling (geometric)."""
    rows = []
    for name, c in census["targets"].items():
        f = found.get(name, {})
        exp, p = c["expected_trials"], c["p_per_trial"]
        rows.append({"left_out": name, "variants_in_space": c["variants"],
                     "p_per_uniform_trial": round(p, 4),
                     "uniform_expected_trials": None if exp is None else round(exp, 1),
                     "p_uniform_within_budget": None if not p else round(1 - (1 - p) ** n_trials, 3),
                     "rediscovered": bool(f.get("complete")), "first_drawn": f.get("trials_until_first"),
                     "first_trained": f.get("trials_until_trained"), "times_drawn": len(f.get("trials", [])),
                     "times_trained": f.get("complete", 0), "best_rank": f.get("best_rank"),
                     "of_ranked": n_ranked, "on_front": f.get("on_front", False)})
    return rows
