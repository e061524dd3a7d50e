"""Search specs: YAML -> a frozen, validated ``SearchSpec``.

Everything that can be checked without running a trial is checked here, with a one-line
``SpecError`` naming the file, the key and the problem: unknown keys, bad ranges, unknown
objectives and term values, a pruner on a multi-metric study, a searched key that is also
fixed. (Whether each objective variant *derives* is checked by
``ssmcraft.search.objectives.check_objectives``, which calls the compiler; whether the
``task``/``model``/``train`` sections are what ``ssmcraft.train`` takes, by
``ssmcraft.search.space.check_experiment``, when the trials are ssmcraft's own trainings: a
``--trial-function`` may read other keys there.)

Format (every key; defaults after ``=``)::

    name: quickstart                      # study name
    seed: 0                               # = 0; trial seed = seed + trial number
    task:  {name: mqar, ...}              # the experiment sections of ssmcraft.train
    model: {d_model: 64, n_layers: 2}     #   (ssmcraft/train/config.py), passed as is,
    train: {batch_size: 16, ...}          #   plus the searched values and MANAGED below
    objectives_dir: my_objectives/        # = absent; searched before the library
    budget:
      trials: 8                           # finished trials wanted (failed ones count)
      tokens_per_trial: 1_000_000         # -> train.tokens
      seconds_per_trial: 120              # -> train.max_seconds (training stops itself)
      timeout_grace: 30                   # = 30; killed at seconds_per_trial + this
      total_seconds: null                 # = null; no new trial after this (per run)
    space:
      objective: {choice: [longhorn, ./mine.yaml, {compose: {...}, label: comp}]}
      approximation: {choice: [exact, diagonal]}   # overrides every objective's
      m:  {int: [8, 32], step: 8}         # aliases: m, d_model/width, lr (ALIASES)
      lr: {float: [1.0e-4, 3.0e-3], log: true}
      model.mixer.heads: {choice: [1, 2]} # or a dotted path under model/train/task
      model.layers: {choice: {pure: [], swa: [{every: 2, mixer: {kind: attention, window: 64}}]}}
                                          # labelled choices: Optuna samples the label, the
                                          # trial config gets its value (any YAML value)
    rank: {val_loss: minimize, tokens_per_s: maximize}
    sampler: {name: tpe, ...}             # = tpe for one metric, nsga2 for several
    pruner: {name: median, ...}           # = none; single-metric studies only
    resources: {cpus_per_trial: 1, gpus_per_trial: auto, max_concurrent: auto,
                max_retries: 2, max_trials_per_gpu: 8}
                                          # gpus_per_trial auto: trials packed per GPU from
                                          # their measured memory (ssmcraft.search.packing)
    fidelity: {kind: successive_halving, min_tokens: 100_000, eta: 3,   # = absent: every
               metric: val_loss}      # trial trains to the full budget (ssmcraft.search.fidelity)
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ssmcraft import yamlsafe
from ssmcraft.config_check import Checker, Field
from ssmcraft.errors import SpecError, one_line
from ssmcraft.search import library
from ssmcraft.search.compose import TERMS, check_choices
from ssmcraft.search.fidelity import FIDELITY_KINDS, Fidelity
from ssmcraft.errors import quote as shown

# space key -> config path
ALIASES: dict[str, tuple[str, ...]] = {
    "m": ("model", "mixer", "state_size"),
    "d_model": ("model", "d_model"),
    "width": ("model", "d_model"),
    "lr": ("train", "lr"),
    "approximation": ("objective", "approximation"),
}
PATH_ROOTS = ("model", "train", "task")
# config paths the search sets itself, and from what
MANAGED: dict[tuple[str, ...], str] = {
    ("train", "tokens"): "budget.tokens_per_trial",
    ("train", "max_seconds"): "budget.seconds_per_trial",
    ("train", "device"): "resources.gpus_per_trial",
    ("model", "mixer", "objective"): "space.objective",
}
DIRECTIONS = ("minimize", "maximize")
SEED_MAX = 2 ** 32 - 1      # numpy's seeds, which Optuna's samplers take, are 32-bit


# ---------------------------------------------------------------- dataclasses

@dataclass(frozen=True)
class Param:
    """One searched hyperparameter. ``name`` is the space key and Optuna's param name."""
    name: str
    path: tuple[str, ...]          # where the value goes in the trial config
    kind: str                      # choice | int | float
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    values: tuple = field(default=(), hash=False)   # a labelled choice's values, one per label in ``choices``

    def value_of(self, sampled: Any) -> Any:
        """The value a sampled choice puts in the trial config (a labelled choice's value)."""
        return self.values[self.choices.index(sampled)] if self.values else sampled


@dataclass(frozen=True)
class ObjectiveOption:
    """One entry of ``space.objective.choice``: a library name, a file, or a composition
    whose terms each hold one value (fixed) or several (searched as ``label.term``)."""
    label: str
    kind: str                                  # library | file | compose
    path: Path | None = None                   # library / file
    terms: tuple[tuple[str, tuple], ...] = ()  # compose: (term, values)

    def searched_terms(self) -> list[tuple[str, tuple]]:
        return [(t, v) for t, v in self.terms if len(v) > 1]


@dataclass(frozen=True)
class Budget:
    trials: int
    tokens_per_trial: int
    seconds_per_trial: float
    timeout_grace: float = 30.0
    total_seconds: float | None = None

    @property
    def hard_timeout(self) -> float:
        """Seconds after which a trial that has not returned is killed."""
        return self.seconds_per_trial + self.timeout_grace


@dataclass(frozen=True)
class Resources:
    cpus_per_trial: float = 1.0
    gpus_per_trial: float | None = None        # None: auto (packed from measured memory when the
                                               # cluster has GPUs: ssmcraft.search.packing; else 0)
    max_concurrent: int | None = None          # None: as many as the resources allow
    max_retries: int = 2                       # re-runs of a trial whose worker died
    max_trials_per_gpu: int = 8                # cap of gpus_per_trial auto


@dataclass(frozen=True)
class Component:
    """A sampler or pruner: its name and every option, defaults filled in."""
    name: str
    options: dict


@dataclass(frozen=True)
class SearchSpec:
    name: str
    source: str                    # file path or "<dict>", for messages
    base: Path                     # folder relative paths are taken from
    seed: int
    task: dict
    model: dict
    train: dict
    objectives_dir: Path | None
    budget: Budget
    objectives: tuple[ObjectiveOption, ...]
    params: tuple[Param, ...]      # every other searched key, in spec order
    rank: tuple[tuple[str, str], ...]   # (metric, direction)
    sampler: Component
    pruner: Component
    resources: Resources
    raw: dict = field(repr=False)  # the parsed YAML, for hashing and copying
    fidelity: Fidelity | None = None   # multi-fidelity (rungs on tokens seen); None: off

    @property
    def metrics(self) -> list[str]:
        return [m for m, _ in self.rank]

    @property
    def directions(self) -> list[str]:
        return [d for _, d in self.rank]

    @property
    def single_metric(self) -> bool:
        return len(self.rank) == 1

    def option(self, label: str) -> ObjectiveOption:
        return next(o for o in self.objectives if o.label == label)


def spec_hash(raw: Mapping) -> str:
    """Content hash of a spec, ignoring the keys that may change when a study is resumed
    (``budget.trials``, ``budget.total_seconds``: a study may be extended)."""
    data = json.loads(json.dumps(raw, sort_keys=True, default=str))
    for key in ("trials", "total_seconds"):
        data.get("budget", {}).pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- loading

def load_search_spec(spec: str | Path | Mapping, source: str | None = None,
                     base: Path | None = None) -> SearchSpec:
    """Parse and validate a search spec: a YAML file path or an already-parsed mapping.
    Relative paths in it are taken from ``base``: by default the file's folder (the
    current folder for a mapping)."""
    if isinstance(spec, Mapping):
        return _parse(dict(spec), source or "<dict>", base or Path.cwd())
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(path), "", "search spec not found") from None
    except IsADirectoryError:
        raise SpecError(str(path), "", "a folder, not a search spec file") from None
    except (OSError, ValueError) as e:     # unreadable, not UTF-8, a NUL byte in the name
        raise SpecError(str(path), "", f"cannot read: {getattr(e, 'strerror', None) or one_line(e)}") from None
    return _parse(yamlsafe.load(text, str(path)), source or str(path), base or path.resolve().parent)


def _lookup(sections: Mapping, path: tuple[str, ...]) -> Any:
    """The value at ``path`` in the sections, or None when any step is missing."""
    node: Any = sections
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _check_path(c: Checker, sections: Mapping, p: Param) -> None:
    """A searched path goes through sections: refuse one through a fixed value (``model.d_model.x``
    with ``d_model: 16``), which a trial's config could not hold."""
    node: Any = sections
    for i, part in enumerate(p.path[:-1]):
        if not isinstance(node, Mapping) or part not in node:
            return
        node = node[part]
        if not isinstance(node, Mapping):
            c.fail(f"space.{p.name}", f"{'.'.join(p.path[:i + 1])} is fixed to {shown(node)}, not a section")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):   # a name too long for the file system, a NUL byte
        return False


def _name(c: Checker, key: str, name: Any) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", name):
        # 128: Optuna's RDB storage keeps study names of up to 512 characters
        c.fail(key, f"expected a name of 1 to 128 letters, digits, '_', '.', '-', got {shown(name)}")
    return name


def _folder(base: Path) -> Field:
    """An optional folder, relative to the spec's own folder."""
    def check(c: Checker, key: str, value: Any) -> Path | None:
        if value is None:
            return None
        if not isinstance(value, str):
            c.fail(key, f"expected a folder path, got {shown(value)}")
        try:
            folder = (base / value).resolve()
        except (OSError, ValueError) as e:  # a NUL byte, a loop of links
            c.fail(key, f"not a usable path ({one_line(e)})")
        if not _is_dir(folder):
            c.fail(key, f"not a folder: {shown(str(folder))}")
        return folder
    return Field(check, None)


def _top_fields(base: Path) -> dict[str, Field]:
    """The top level: presence, and the values that need nothing else; ``budget``, ``rank``,
    ``space``, ``sampler``, ``pruner``, ``resources`` and ``fidelity`` depend on one another and
    are read by their own parsers, in ``_parse``."""
    return {"name": Field(_name), "seed": _seed(0),
            **{k: Field(lambda c, k, v: c.mapping(k, v), {}) for k in PATH_ROOTS},
            "objectives_dir": _folder(base),
            **{k: Field() for k in ("budget", "space", "rank")},
            "sampler": Field(default={}), "pruner": Field(default={"name": "none"}),
            "resources": Field(default={}), "fidelity": Field(default=None)}


def _parse(raw: Any, source: str, base: Path) -> SearchSpec:
    c = Checker(source)
    top = c.section("", raw, _top_fields(base))
    raw = dict(raw)
    name, seed, objectives_dir = top["name"], top["seed"], top["objectives_dir"]
    sections = {k: top[k] for k in PATH_ROOTS}
    for path, origin in MANAGED.items():
        if _lookup(sections, path) is not None:
            c.fail(".".join(path), f"set by the search from {origin}; remove it here")

    rank = _parse_rank(c, raw["rank"])
    budget = _parse_budget(c, raw["budget"])
    pruner = _parse_pruner(c, top["pruner"], len(rank))
    fidelity = None
    if top["fidelity"] is not None:
        fidelity = _parse_fidelity(c, top["fidelity"], dict(rank), budget)
        if pruner.name != "none":
            c.fail("fidelity", f"and pruner {shown(pruner.name)} both stop trials early; keep one")
        if _lookup(sections, ("train", "eval_every")) is not None:
            c.fail("train.eval_every", "set by the search from fidelity.min_tokens (a validation on every "
                                       "rung); remove it here")
    objectives, params = _parse_space(c, raw["space"], base, objectives_dir)
    for p in params:
        if p.path[0] in sections and _lookup(sections, p.path) is not None:
            c.fail(f"space.{p.name}", f"{'.'.join(p.path)} is also fixed in {p.path[0]}:; set it in one place")
        for managed, origin in MANAGED.items():
            if p.path[:len(managed)] == managed:
                c.fail(f"space.{p.name}", f"{'.'.join(p.path)} is set by the search from {origin}")
        if p.path[0] in sections:
            _check_path(c, sections, p)
        for q in params:
            if q is not p and len(q.path) > len(p.path) and q.path[:len(p.path)] == p.path:
                c.fail(f"space.{q.name}", f"{'.'.join(q.path)} lies under {'.'.join(p.path)}, which space.{p.name} "
                                          f"sets to one value; search one of them")
    return SearchSpec(
        name=name, source=source, base=base, seed=seed, objectives_dir=objectives_dir,
        budget=budget, objectives=objectives, params=params, rank=rank,
        sampler=_parse_sampler(c, top["sampler"], len(rank), seed), pruner=pruner,
        resources=_parse_resources(c, top["resources"]), raw=raw, fidelity=fidelity, **sections)


def _parse_rank(c: Checker, value: Any) -> tuple[tuple[str, str], ...]:
    rank = c.mapping("rank", value)
    if not rank:
        c.fail("rank", "name at least one metric with minimize or maximize")
    for metric, direction in rank.items():
        c.one_of(f"rank.{metric}", direction, DIRECTIONS, "minimize or maximize")
    return tuple(rank.items())


def _int_from(low: int) -> Field:
    """A required integer >= ``low``."""
    return Field(lambda c, k, v: c.number(k, v, integer=True, min=low))


def _with_default(f: Field, default: Any) -> Field:
    return Field(f.check, default, f.choices)


_POSITIVE = Field(lambda c, k, v: c.number(k, v, above=0))
_OPTIONAL_POSITIVE = Field(lambda c, k, v: None if v is None else c.number(k, v, above=0), None)
_PROB = Field(lambda c, k, v: c.number(k, v, min=0, max=1))
_FLAG = Field(lambda c, k, v: c.boolean(k, v))

BUDGET = {"trials": _int_from(1), "tokens_per_trial": _int_from(1), "seconds_per_trial": _POSITIVE,
          "timeout_grace": Field(lambda c, k, v: c.number(k, v, min=0), 30.0), "total_seconds": _OPTIONAL_POSITIVE}


def _parse_budget(c: Checker, value: Any) -> Budget:
    return Budget(**c.section("budget", value, BUDGET))


def _parse_fidelity(c: Checker, value: Any, rank: dict[str, str], budget: Budget) -> Fidelity:
    def min_tokens(c, key, v):
        v = c.number(key, v, integer=True, min=1)
        if v >= budget.tokens_per_trial:
            c.fail(key, f"{v} leaves no rung below budget.tokens_per_trial ({budget.tokens_per_trial})")
        return v
    f = c.section("fidelity", value, {
        "kind": Field(choices=FIDELITY_KINDS), "min_tokens": Field(min_tokens),
        "eta": Field(lambda c, k, v: c.number(k, v, integer=True, min=2), 3),
        "metric": Field(lambda c, k, v: c.string(k, v), "val_loss"), "direction": Field(default=None)})
    direction = f["direction"] if f["direction"] is not None else rank.get(f["metric"], "minimize")
    c.one_of("fidelity.direction", direction, DIRECTIONS, "minimize or maximize")
    if f["metric"] in rank and rank[f["metric"]] != direction:
        c.fail("fidelity.direction", f"{direction}, but rank says {f['metric']}: {rank[f['metric']]}")
    return Fidelity(f["kind"], f["min_tokens"], f["eta"], f["metric"], direction)


def _parse_resources(c: Checker, value: Any) -> Resources:
    def gpus(key, v):
        if v == "auto":
            return None
        v = c.number(key, v, min=0)
        if v > 1 and v != int(v):
            c.fail(key, f"a trial takes a fraction of one GPU or whole GPUs, got {v}")
        return float(v)

    def concurrent(key, v):
        return None if v == "auto" else c.number(key, v, integer=True, min=1)

    o = c.section("resources", value, {
        "cpus_per_trial": Field(lambda c, k, v: float(c.number(k, v, above=0)), 1.0),
        "gpus_per_trial": Field(lambda c, k, v: gpus(k, v), None),
        "max_concurrent": Field(lambda c, k, v: concurrent(k, v), None),
        "max_retries": _with_default(_int_from(0), 2),
        "max_trials_per_gpu": _with_default(_int_from(1), 8),
    }, extra=("name",))
    return Resources(**o)


def _seed(default: int) -> Field:
    return Field(lambda c, k, v: c.number(k, v, integer=True, min=0, max=SEED_MAX), default)


def _parse_sampler(c: Checker, value: Any, n_metrics: int, seed: int) -> Component:
    given = c.mapping("sampler", value)
    name = given.get("name", "tpe" if n_metrics == 1 else "nsga2")
    schemas = {
        # TPE for one metric: multivariate + group handle the conditional (define-by-run)
        # space of composed objectives; constant liar keeps parallel trials apart.
        "tpe": {"seed": _seed(seed), "n_startup_trials": _with_default(_int_from(1), 10),
                "n_ei_candidates": _with_default(_int_from(1), 24),
                "multivariate": _with_default(_FLAG, True), "group": _with_default(_FLAG, True),
                "constant_liar": _with_default(_FLAG, True)},
        "nsga2": {"seed": _seed(seed), "population_size": _with_default(_int_from(2), 50),
                  "mutation_prob": Field(lambda c, k, v: None if v is None else _PROB.check(c, k, v), None),
                  "crossover_prob": _with_default(_PROB, 0.9), "swapping_prob": _with_default(_PROB, 0.5)},
        "random": {"seed": _seed(seed)},
    }
    c.one_of("sampler.name", name, tuple(schemas))
    return Component(name, c.section("sampler", given, schemas[name], extra=("name",)))


def _parse_pruner(c: Checker, value: Any, n_metrics: int) -> Component:
    given = {"name": value} if isinstance(value, str) else c.mapping("pruner", value)
    name = given.get("name", "none")
    schemas = {
        "none": {},
        # steps are tokens seen: warmup and resources are in tokens
        "median": {"n_startup_trials": _with_default(_int_from(0), 5), "n_warmup_steps": _with_default(_int_from(0), 0),
                   "interval_steps": _with_default(_int_from(1), 1), "n_min_trials": _with_default(_int_from(1), 1)},
        "successive_halving": {
            "min_resource": Field(lambda c, k, v: v if v == "auto" else c.number(k, v, integer=True, min=1), "auto"),
            "reduction_factor": _with_default(_int_from(2), 4),
            "min_early_stopping_rate": _with_default(_int_from(0), 0),
            "bootstrap_count": _with_default(_int_from(0), 0)},
    }
    c.one_of("pruner.name", name, tuple(schemas))
    if name != "none" and n_metrics > 1:
        c.fail("pruner", f"pruning needs a single ranking metric (Optuna cannot prune "
                         f"multi-objective trials); rank has {n_metrics}")
    return Component(name, c.section("pruner", given, schemas[name], extra=("name",)))


# ---------------------------------------------------------------- the space

def _parse_space(c: Checker, value: Any, base: Path, objectives_dir: Path | None
                 ) -> tuple[tuple[ObjectiveOption, ...], tuple[Param, ...]]:
    space = c.mapping("space", value)
    if "objective" not in space:
        c.fail("space.objective", "missing (required): {choice: [library names, files or {compose: ...}]}")
    objective = space.pop("objective")
    objectives = _parse_objectives(c, objective, base, objectives_dir)
    params, seen = [], {}
    for key, dist in space.items():
        path = ALIASES.get(key) or _dotted(c, key)
        if path in seen:
            c.fail(f"space.{key}", f"same setting as space.{seen[path]} ({'.'.join(path)})")
        seen[path] = key
        params.append(_parse_param(c, f"space.{key}", key, path, dist))
    approx = next((p for p in params if p.path == ("objective", "approximation")), None)
    if approx is not None:
        if approx.kind != "choice" or approx.values:
            c.fail("space.approximation", "expected {choice: [exact, diagonal]}")
        for v in approx.choices:
            check_choices({"approximation": v}, c.source, "space.approximation")
        if any(isinstance(e, Mapping) and "approximation" in e["compose"] for e in objective["choice"]):
            c.fail("space.approximation", "also set in a compose entry; set it in one place")
    return objectives, tuple(params)


def _dotted(c: Checker, key: str) -> tuple[str, ...]:
    path = tuple(str(key).split("."))
    if len(path) < 2 or path[0] not in PATH_ROOTS or not all(path):
        c.fail(f"space.{key}", f"unknown key; use one of {', '.join(ALIASES)} or a dotted "
                               f"path under {', '.join(PATH_ROOTS)} (e.g. model.n_layers)")
    return path


def _parse_param(c: Checker, key: str, name: str, path: tuple[str, ...], dist: Any) -> Param:
    d = c.mapping(key, dist, ("choice", "int", "float", "step", "log"))
    kinds = [k for k in ("choice", "int", "float") if k in d]
    if len(kinds) != 1:
        c.fail(key, "give exactly one of choice: [...], int: [low, high], float: [low, high]")
    kind = kinds[0]
    if kind == "choice":
        if set(d) != {"choice"}:
            c.fail(key, "step and log apply to int and float ranges only")
        choices = d["choice"]
        if isinstance(choices, Mapping) and choices:
            labels = list(choices)
            bad = next((x for x in labels if not isinstance(x, str)), None)
            if bad is not None:
                c.fail(f"{key}.choice", f"labels of a labelled choice must be strings, got {bad!r}")
            return Param(name, path, "choice", choices=tuple(labels), values=tuple(choices.values()))
        if not isinstance(choices, list) or not choices:
            c.fail(f"{key}.choice", "expected a non-empty list, or a mapping label -> value")
        for v in choices:
            if not isinstance(v, (str, int, float, bool)) or v is None:
                c.fail(f"{key}.choice", f"choices must be strings, numbers or booleans, got {shown(v)}")
        if len(set(map(repr, choices))) != len(choices):
            c.fail(f"{key}.choice", "duplicate choices")
        return Param(name, path, "choice", choices=tuple(choices))
    bounds = d[kind]
    integer = kind == "int"
    if not isinstance(bounds, list) or len(bounds) != 2:
        c.fail(f"{key}.{kind}", "expected [low, high]")
    low, high = (c.number(f"{key}.{kind}", b, integer=integer) for b in bounds)
    if low > high:
        c.fail(f"{key}.{kind}", f"low {low} is above high {high}")
    log = c.boolean(f"{key}.log", d.get("log", False))
    step = d.get("step")
    if step is not None:
        step = c.number(f"{key}.step", step, integer=integer, above=0)
        if log:
            c.fail(key, "step and log: true cannot be combined")
    if log and low <= 0:
        c.fail(f"{key}.{kind}", f"log: true needs low > 0, got {low}")
    return Param(name, path, kind, low=low, high=high, step=step, log=log)


def _parse_objectives(c: Checker, value: Any, base: Path, objectives_dir: Path | None
                      ) -> tuple[ObjectiveOption, ...]:
    key = "space.objective"
    choices = c.mapping(key, value, ("choice",)).get("choice")
    if not isinstance(choices, list) or not choices:
        c.fail(f"{key}.choice", "expected a non-empty list of library names, files or {compose: ...}")
    n_compose = sum(isinstance(e, Mapping) for e in choices)
    options, compose_i = [], 0
    for i, entry in enumerate(choices):
        ekey = f"{key}.choice[{i}]"
        if isinstance(entry, str):
            path = library.resolve_objective(entry, base, objectives_dir, c.source, ekey)
            kind = "file" if library.is_path(entry) else "library"
            options.append(ObjectiveOption(entry, kind, path=path))
            continue
        e = c.mapping(ekey, entry, ("compose", "label"))
        if "compose" not in e:
            c.fail(ekey, "expected a library name, a .yaml path or {compose: {term: value or [values]}}")
        compose_i += 1
        label = e.get("label", "composed" if n_compose == 1 else f"composed_{compose_i}")
        if not isinstance(label, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", label):
            c.fail(f"{ekey}.label", f"expected an identifier, got {shown(label)}")
        terms = c.mapping(f"{ekey}.compose", e["compose"], tuple(TERMS))
        resolved = []
        for term in TERMS:
            values = terms.get(term, [TERMS[term][0]])
            values = values if isinstance(values, list) else [values]
            if not values or len(set(map(repr, values))) != len(values):
                c.fail(f"{ekey}.compose.{term}", "expected a value or a non-empty list without duplicates")
            for v in values:
                check_choices({term: v}, c.source, f"{ekey}.compose")
            resolved.append((term, tuple(values)))
        options.append(ObjectiveOption(label, "compose", terms=tuple(resolved)))
    labels = [o.label for o in options]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup is not None:
        c.fail(f"{key}.choice", f"{shown(dup)} appears twice")
    return tuple(options)
