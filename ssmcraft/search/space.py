"""From a search spec to trials: sample a point (define-by-run), resolve its objective,
and build the stateless trial's config.

Param names, as Optuna stores them: ``objective`` (the option's label), ``<label>.<term>``
for the searched terms of a composed objective (only sampled when that option is chosen:
a conditional space), then every other space key as written (``m``, ``lr``,
``model.n_layers``). A labelled choice (``model.layers: {choice: {pure: [], hybrid: [...]}}``)
stores its label; the trial config gets the label's value (``Param.value_of``).
"""
from __future__ import annotations

import copy
import itertools
import json
from typing import Any, Iterator

from ssmcraft.search.compose import compose_objective
from ssmcraft.search.library import load_objective
from ssmcraft.search.spec import Param, SearchSpec

OBJECTIVE_PARAM = "objective"
APPROXIMATION_PATH = ("objective", "approximation")
OBJECTIVE_PATH = ("model", "mixer", "objective")   # where a trial config holds its objective


def suggest(trial: Any, spec: SearchSpec) -> dict[str, Any]:
    """Sample every param of ``spec`` on an Optuna ``trial`` (or anything with the same
    ``suggest_*`` methods); returns {param name: value}. An enqueued trial gets its fixed
    values back, so a re-queued trial re-runs the same point."""
    params: dict[str, Any] = {}
    label = trial.suggest_categorical(OBJECTIVE_PARAM, [o.label for o in spec.objectives])
    params[OBJECTIVE_PARAM] = label
    for term, values in spec.option(label).searched_terms():
        params[f"{label}.{term}"] = trial.suggest_categorical(f"{label}.{term}", list(values))
    for p in spec.params:
        params[p.name] = _suggest_one(trial, p)
    return params


def _suggest_one(trial: Any, p: Param) -> Any:
    if p.kind == "choice":
        return trial.suggest_categorical(p.name, list(p.choices))
    if p.kind == "int":
        return trial.suggest_int(p.name, p.low, p.high, step=p.step or 1, log=p.log)
    return trial.suggest_float(p.name, p.low, p.high, step=p.step, log=p.log)


def resolve_objective(spec: SearchSpec, params: dict[str, Any]) -> dict:
    """The objective spec dict (docs/design.md format) that ``params`` selects."""
    option = spec.option(params[OBJECTIVE_PARAM])
    approximation = next((params[p.name] for p in spec.params if p.path == APPROXIMATION_PATH), None)
    if option.kind == "compose":
        choices = {t: params.get(f"{option.label}.{t}", values[0]) for t, values in option.terms}
        if approximation is not None:
            choices["approximation"] = approximation
        return compose_objective(choices)
    objective = copy.deepcopy(load_objective(option.path))
    if approximation is not None:
        objective["approximation"] = approximation
    return objective


def build_config(spec: SearchSpec, params: dict[str, Any], *, seed: int, device: str) -> dict:
    """The config of one trial: the experiment mapping ``ssmcraft.train.train_run`` takes.

    ``{"name", "seed", "task", "model", "train"}``: the spec's sections as written, the
    searched values at their paths, the objective spec dict at ``model.mixer.objective``,
    and ``train.tokens``, ``train.max_seconds``, ``train.device`` from the budget.
    """
    config: dict[str, Any] = {
        "name": spec.name,
        "seed": seed,
        "task": copy.deepcopy(spec.task),
        "model": copy.deepcopy(spec.model),
        "train": {**copy.deepcopy(spec.train), "tokens": spec.budget.tokens_per_trial,
                  "max_seconds": spec.budget.seconds_per_trial, "device": device},
    }
    values = {p.path: copy.deepcopy(p.value_of(params[p.name])) for p in spec.params if p.path != APPROXIMATION_PATH}
    values[OBJECTIVE_PATH] = resolve_objective(spec, params)
    for path, value in values.items():
        node = config
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return config


class _FirstPoint:
    """``suggest``'s trial at one point of the space: each choice's first value, each range's low end."""

    def suggest_categorical(self, name, choices):
        return choices[0]

    def suggest_int(self, name, low, high, step=1, log=False):
        return low

    def suggest_float(self, name, low, high, step=None, log=False):
        return low


def check_experiment(spec: SearchSpec) -> None:
    """The trial config of one point of the space (``_FirstPoint``) through the checks that
    ``ssmcraft.train`` gives a config (``train.config.resolve``: the model, train and task keys,
    the model's and train's values; the task is built, except a text task, whose corpus is not read): a typo
    in ``task:``, ``model:`` or ``train:`` is a ``SpecError`` naming the search spec when it is
    loaded, not a failure of every trial. Each label of a labelled choice (a layout, say) is
    checked the same way, at the first point of the other params."""
    from ssmcraft.tasks import TextTask, build_task, task_class
    from ssmcraft.train.config import resolve

    first = suggest(_FirstPoint(), spec)
    points = [first] + [{**first, p.name: label} for p in spec.params if p.values for label in p.choices[1:]]
    for params in points:
        config = resolve(build_config(spec, params, seed=spec.seed, device="cpu"), spec.source)
        if task_class(config["task"]["name"], spec.source) is not TextTask:   # a text task would read its corpus
            build_task(config["task"], spec.source)          # the task's values (a seq_len of -1)


def objective_of(config: dict) -> dict:
    """The objective spec dict inside a trial config."""
    node = config
    for part in OBJECTIVE_PATH:
        node = node[part]
    return node


def objective_variants(spec: SearchSpec, distinct: bool = True) -> Iterator[tuple[dict[str, Any], dict]]:
    """Every objective the space can select, as (params that select it, spec dict): each
    option times its searched terms times the approximation override. ``distinct``: each
    objective once (the first params that select it); else every selection, so that the
    chances of the selections that give one objective can be added up."""
    approx = [p for p in spec.params if p.path == APPROXIMATION_PATH]
    seen: set[str] = set()
    for option in spec.objectives:
        axes = [(f"{option.label}.{t}", v) for t, v in option.searched_terms()]
        axes += [(p.name, p.choices) for p in approx]
        for values in itertools.product(*(v for _, v in axes)):
            params = {OBJECTIVE_PARAM: option.label, **dict(zip((n for n, _ in axes), values))}
            objective = resolve_objective(spec, params)
            key = json.dumps(objective, sort_keys=True)
            if not distinct or key not in seen:
                seen.add(key)
                yield params, objective


def param_names(spec: SearchSpec) -> list[str]:
    """Every param the space can sample, in a fixed order (the leaderboard's columns)."""
    names = [OBJECTIVE_PARAM]
    for option in spec.objectives:
        names += [f"{option.label}.{t}" for t, _ in option.searched_terms()]
    return names + [p.name for p in spec.params]
