"""Candidates per GPU-hour with and without ``fidelity:``, on the same search space and the
same wall budget: two searches of one spec, one whose trials all train
to the full budget, one with multi-fidelity rungs; for each, the candidates tried, those
trained to the full budget, the best final value of the first ranking metric, and
candidates per GPU-hour (``gpus`` GPUs held for the arm's wall time).

Both arms get ``budget.total_seconds = seconds`` (no new trial after it; running trials
finish, so an arm's wall time is a little longer, and is what is counted) and the same
``budget.trials`` cap; objectives are compiled once before both (not timed; the
executor's start, e.g. a local Ray instance, is in each arm's wall time). Only
full-budget trials are compared on quality: a stopped trial's loss is a partial one.
``benchmarks/search_fidelity.py`` is the command-line front end.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

from optuna.trial import TrialState

from ssmcraft.search.coordinator import counts_toward_budget, run_search
from ssmcraft.search.executor import Executor
from ssmcraft.search.objectives import check_objectives
from ssmcraft.search.outcome import TrialFn
from ssmcraft.search.spec import load_search_spec
from ssmcraft.search.trial import train_trial

ARMS = ("full_budget", "fidelity")


def arm_spec(raw: dict, fidelity: dict | None, seconds: float) -> dict:
    """The search spec of one arm: ``raw`` with the wall budget, and ``fidelity`` (which
    sets ``train.eval_every`` itself) or none."""
    raw = copy.deepcopy(raw)
    raw.pop("fidelity", None)
    raw.pop("pruner", None)
    raw["budget"] = {**raw["budget"], "total_seconds": seconds}
    if fidelity is not None:
        raw["fidelity"] = dict(fidelity)
        raw.get("train", {}).pop("eval_every", None)
    return raw


def summarize(arm: str, study, wall_s: float, gpus: float, metric: str, direction: str) -> dict:
    trials = [t for t in study.get_trials(deepcopy=False) if counts_toward_budget(t)]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    values = [t.user_attrs["metrics"][metric] for t in complete]
    best = (min if direction == "minimize" else max)(values) if values else None
    return {"arm": arm, "wall_s": round(wall_s, 3), "candidates": len(trials), "full_budget": len(complete),
            "stopped_at_a_rung": sum(t.state == TrialState.PRUNED for t in trials),
            "failed": sum(t.state == TrialState.FAIL for t in trials), f"best_{metric}": best,
            "candidates_per_gpu_hour": round(len(trials) / (wall_s / 3600 * gpus), 1)}


def compare(raw: dict, fidelity: dict, out: Path, *, seconds: float, executor: Callable[[], Executor],
            gpus: float = 1.0, trial_fn: TrialFn = train_trial, base: Path | None = None,
            log: Callable[[str], None] = print) -> dict:
    """Run both arms (``executor()`` makes a fresh executor for each) under ``out/ARM``;
    returns ``{"rows": [...], "ratio": candidates per GPU-hour, fidelity / full budget}``."""
    out = Path(out)
    specs = {arm: load_search_spec(arm_spec(raw, fidelity if arm == "fidelity" else None, seconds),
                                   source=f"{arm} arm", base=base) for arm in ARMS}
    log(f"objectives: {check_objectives(specs['fidelity']).summary()} (not timed)")
    rows = []
    for arm, spec in specs.items():
        log(f"--- arm {arm}: {seconds:g} s of search")
        start = time.perf_counter()
        result = run_search(spec, out / arm, executor=executor(), trial_fn=trial_fn, compile_fn=None,
                            plots=False, log=log)
        metric, direction = spec.rank[0]
        rows.append(summarize(arm, result.study, time.perf_counter() - start, gpus, metric, direction))
    full, multi = rows
    ratio = multi["candidates_per_gpu_hour"] / full["candidates_per_gpu_hour"] if full["candidates"] else None
    return {"rows": rows, "ratio": ratio, "seconds": seconds, "gpus": gpus, "fidelity": fidelity}
