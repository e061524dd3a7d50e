"""Study specs: reading and validation (every problem is a ``SpecError`` naming the key).

::

    name: mqar_state_size
    kind: mqar_state_size            # one of KINDS
    claim: "..."                     # optional: the paper's claim, quoted in the report
    thresholds: {tol: 0.02}          # optional: override the kind's verdict thresholds
    base: {...}                      # parameters shared by both scales (deep-merged under them)
    smoke: {...}                     # a CPU-minute: what the tests run
    full: {...}                      # the GPU size

Both scales are validated when the spec is loaded, so a typo in ``full`` shows up in a
smoke run. The parameters of each kind are listed in ``KINDS``.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ssmcraft import yamlsafe
from ssmcraft.config_check import ABSENT, REQUIRED, Checker, Field
from ssmcraft.errors import SpecError, SsmcraftError, one_line

SCALES = ("smoke", "full")

# verdict thresholds of each kind (overridable under ``thresholds:``)
THRESHOLDS: dict[str, dict[str, float]] = {
    "mqar_state_size": {"tol": 0.02},
    "exact_vs_diagonal": {"acc_tol": 0.01, "loss_tol": 0.01},
    "extrapolation": {"max_ratio": 1.10, "improve_tol": 0.01},
    "state_capacity": {"min_points": 3, "min_r2": 0.8},
    "composed_search": {},
    "mad": {},
    "equal_state": {"acc_tol": 0.01, "loss_tol": 0.005},
}


def _deep_merge(a: Mapping, b: Mapping) -> dict:
    out = copy.deepcopy(dict(a))
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) \
            else copy.deepcopy(v)
    return out


class _Checker(Checker):
    """A ``Checker`` that also knows the spec's folder (a search section's relative paths)."""

    def __init__(self, source: str, prefix: str = "", base: Path | None = None):
        super().__init__(source, prefix)
        self.base = base or Path.cwd()


def _seeds(c: Checker, key: str, v: Any) -> list[int]:
    out = c.seq(key, v, lambda k, x: x if isinstance(x, int) and not isinstance(x, bool) and x >= 0
                else c.fail(k, f"expected a seed (integer >= 0), got {x!r}"))
    if len(set(out)) != len(out):
        c.fail(key, f"seeds repeat: {out}")
    return out


def _pos_int(c: Checker, key: str, v: Any) -> int:
    return c.positive(key, v, integer=True)


def _pos_float(c: Checker, key: str, v: Any) -> float:
    return c.positive(key, v)


def _mapping(c: Checker, key: str, v: Any) -> dict:
    return c.mapping(key, v)


_EXPERIMENT = {"task": Field(_mapping), "model": Field(_mapping), "train": Field(_mapping, default={})}


def _experiment(c: Checker, key: str, v: Any, task: str | None) -> dict:
    """``{task, model, train}`` of ``ssmcraft train``; ``task.name`` must be ``task``."""
    e = c.section(key, v, _EXPERIMENT)
    if task is not None and e["task"].get("name") != task:
        c.fail(f"{key}.task.name", f"this study needs the {task!r} task, got {e['task'].get('name')!r}")
    _check_as_training(c, key, e)
    return e


def _check_as_training(c: Checker, key: str, e: dict) -> None:
    """The experiment through the checks ``ssmcraft train`` gives a config (``train.config.resolve``:
    the model, train and task keys, the model's and train's values), so that a typo in either scale
    is found when the spec is loaded."""
    from ssmcraft.train.config import resolve

    try:
        resolve({"task": e["task"], "model": e["model"], "train": e["train"]}, c.source)
    except SpecError as err:
        c.fail(f"{key}.{err.key}", err.problem)


def _mitigations(c: Checker, key: str, v: Any) -> list[str]:
    from ssmcraft.layers.mitigation import Mitigation

    out = c.seq(key, v, c.string, min_len=0)
    for i, text in enumerate(out):
        try:
            Mitigation.parse(text)
        except SsmcraftError as e:
            c.fail(f"{key}[{i}]", str(e))
    return out


def _overrides(c: Checker, key: str, v: Any) -> dict:
    """objective -> a partial ``{task, model, train}`` merged over the experiment for that objective."""
    partial = {name: Field(_mapping, default=ABSENT) for name in _EXPERIMENT}
    return {str(obj): c.section(f"{key}.{obj}", part, partial) for obj, part in c.mapping(key, v).items()}


def experiment_for(experiment: dict, overrides: dict, objective: str) -> dict:
    """The experiment one objective trains with: ``overrides[objective]`` merged over it."""
    return _deep_merge(experiment, overrides.get(objective, {}))


# the options of ``ssmcraft eval`` a study may set; the others keep ``EvalOptions``' defaults
_EVAL = {"batches": Field(_pos_int, ABSENT), "batch_size": Field(_pos_int, ABSENT),
         "explosion_factor": Field(_pos_float, ABSENT), "state_points": Field(_pos_int, ABSENT)}


def _objective(c: Checker, key: str, v: Any) -> str:
    """An objective name: "attention", a library objective, or a spec file's path (.yaml / .yml)."""
    from ssmcraft.runtime.lookup import unknown_objective

    name = c.string(key, v)
    why = None if name == "attention" or "/" in name or name.lower().endswith((".yaml", ".yml")) else unknown_objective(name)
    if why is not None:
        c.fail(key, f"{why} (or attention, or a spec file's path)")
    return name


def _objectives(c: Checker, key: str, v: Any) -> list[str]:
    return c.seq(key, v, lambda k, x: _objective(c, k, x))


def _search(c: _Checker, key: str, v: Any) -> dict:
    from ssmcraft.search.spec import load_search_spec

    s = c.mapping(key, v)
    try:
        load_search_spec(s, source=f"{c.source} ({c.prefix}.{key})", base=c.base)
    except SpecError as e:
        raise SpecError(c.source, f"{c.prefix}.{key}.{e.key}" if e.key else f"{c.prefix}.{key}", e.problem) from None
    return s


def _leave_out(c: Checker, key: str, v: Any) -> list[str]:
    """Library layers removed from the library for a leave-one-out search (checked against the
    space in ``_check_leave_out`` once the scale's search is known)."""
    from ssmcraft.compiler.library import library_names

    names = c.seq(key, v, c.string, min_len=0)
    if len(set(names)) != len(names):
        c.fail(key, "lists a layer twice")
    library = set(library_names())
    for n in names:
        if n not in library:
            c.fail(key, f"{n!r} is not a library objective; known: {', '.join(sorted(library))}")
    return names


def _check_leave_out(c: Checker, params: dict) -> None:
    """A left-out layer must not be offered to the search by name."""
    choices = (((params.get("search") or {}).get("space") or {}).get("objective") or {}).get("choice") or []
    for n in params.get("leave_out") or []:
        if n in [e for e in choices if isinstance(e, str)]:
            c.fail("search.space.objective", f"{n!r} is left out of the library (leave_out) but listed here by name")


def _mad_tasks(c: Checker, key: str, v: Any) -> list[str]:
    from ssmcraft.tasks.mad import MAD_TASKS

    out = c.seq(key, v, c.string)
    for i, name in enumerate(out):
        if name not in MAD_TASKS:
            c.fail(f"{key}[{i}]", f"{name!r} is not a MAD task; MAD's: {', '.join(MAD_TASKS)}")
    if len(set(out)) != len(out):
        c.fail(key, "lists a task twice")
    return out


def mad_cells(params: dict) -> list[tuple[str, str, dict]]:
    """``(task, level label, task config)`` of every MAD level a ``mad`` study trains on: MAD's
    levels (only ``baseline`` with ``levels: baseline``), each with ``task_overrides[task]`` merged in."""
    from ssmcraft.tasks.mad import levels

    out = []
    for task in params["tasks"]:
        chosen = levels(task)[:1] if params["levels"] == "baseline" else levels(task)
        out += [(task, label, {**cfg, **params["task_overrides"].get(task, {})}) for label, cfg in chosen]
    return out


def _check_mad(c: Checker, params: dict) -> None:
    """Every level's task config builds, and the model and train sections pass ``ssmcraft train``'s checks."""
    from ssmcraft.tasks import build_task

    if params["state_size"] is not None and params["state_elements"] is not None:
        c.fail("state_elements", "give state_size (the same m everywhere) or state_elements (the same state), not both")
    for task in params["task_overrides"]:
        if task not in params["tasks"]:
            c.fail(f"task_overrides.{task}", f"{task!r} is not among this study's tasks")
    for task, label, cfg in mad_cells(params):
        try:
            build_task(cfg, c.source)
        except SpecError as e:
            c.fail(f"task_overrides.{task}", f"level {label}: {e.key}: {e.problem}")
    _check_as_training(c, "experiment", {"task": mad_cells(params)[0][2], "model": params["model"],
                                         "train": params["train"]})


def _study_objective(c: Checker, key: str, v: Any) -> str | dict:
    """An objective of an ``equal_state`` study: what ``_objective`` takes, or ``{compose: {term:
    choice}}``, a composition of the search's compose space (``search.compose``), kept as its
    completed choices."""
    from ssmcraft.search.compose import check_choices

    if not isinstance(v, Mapping):
        return _objective(c, key, v)
    entry = c.mapping(key, v, ("compose",))
    if "compose" not in entry:
        c.fail(key, "expected an objective name or {compose: {term: choice}}")
    return {"compose": check_choices(entry["compose"], c.source, c.key(f"{key}.compose"))}


def objective_label(entry: str | dict) -> str:
    """The name an ``equal_state`` objective goes by in run folders and tables."""
    from ssmcraft.search.compose import composed_name

    return composed_name(entry["compose"]) if isinstance(entry, Mapping) else Path(entry).stem


def objective_value(entry: str | dict) -> str | dict:
    """What ``train_cell`` trains for an ``equal_state`` objective: the name, or the composed spec."""
    from ssmcraft.search.compose import compose_objective

    return compose_objective(entry["compose"]) if isinstance(entry, Mapping) else entry


def _study_objectives(c: Checker, key: str, v: Any) -> list:
    out = c.seq(key, v, lambda k, x: _study_objective(c, k, x))
    labels = [objective_label(o) for o in out]
    if len(set(labels)) != len(labels):
        c.fail(key, f"lists an objective twice: {labels}")
    return out


def _state_elements(c: Checker, key: str, v: Any) -> dict[str, int]:
    """``{mqar: N, text: N}``: numbers of state per sequence (all layers, every state) each task's
    models may carry."""
    given = c.mapping(key, v, ("mqar", "text"))
    for task in ("mqar", "text"):
        if task not in given:
            c.fail(f"{key}.{task}", "missing (required: the state budget of this task's models)")
    return {t: c.positive(f"{key}.{t}", n, integer=True) for t, n in given.items()}


def _check_equal_state(c: Checker, params: dict) -> None:
    """Challengers and baselines are different objectives, and each fits the state budget at some m."""
    from ssmcraft.study.iso_state import iso_state_size

    labels = [objective_label(o) for o in params["challengers"]]
    for i, o in enumerate(params["baselines"]):
        if objective_label(o) in labels:
            c.fail(f"baselines[{i}]", f"{objective_label(o)!r} is also a challenger")
    for obj in params["overrides"]:
        if obj not in labels + [objective_label(o) for o in params["baselines"]]:
            c.fail(f"overrides.{obj}", "is not one of this study's objectives (a name, or a composition's name)")
    for task in ("mqar", "text"):
        for role in ("challengers", "baselines"):
            for i, o in enumerate(params[role]):
                if o == "attention":
                    c.fail(f"{role}[{i}]", "attention has no fixed state (its cache grows with the context)")
                label = objective_label(o)
                model = experiment_for(params[task], params["overrides"], label)["model"]
                try:
                    iso_state_size(model, objective_value(o), params["state_elements"][task])
                except SpecError as e:          # the mixer refused the model (e.g. an input_bias its objective lacks)
                    where = f"overrides.{label}" if label in params["overrides"] else task
                    c.fail(f"{where}.model.{e.key}", e.problem)
                except SsmcraftError as e:
                    c.fail(f"state_elements.{task}", f"{objective_label(o)}: {e}")


def _exact_and_diagonal(c: Checker, key: str, v: Any) -> list[str]:
    if not isinstance(v, list) or len(v) != 2:
        c.fail(key, f"expected [exact, diagonal], got {v!r}")
    return _objectives(c, key, v)


def _bench_shape(c: Checker, key: str, v: Any) -> list[int]:
    if not isinstance(v, list) or len(v) != 5:
        c.fail(key, f"expected [B, T, H, d, m], got {v!r}")
    return c.seq(key, v, lambda k, x: c.positive(k, x, integer=True), min_len=5)


def _task_overrides(c: Checker, key: str, v: Any) -> dict:
    return {t: c.mapping(f"{key}.{t}", o) for t, o in c.mapping(key, v).items()}


def _ints(c: Checker, key: str, v: Any) -> list[int]:
    return c.seq(key, v, lambda k, x: c.positive(k, x, integer=True))


def _floats(c: Checker, key: str, v: Any) -> list[float]:
    return c.seq(key, v, c.positive)


def _experiment_of(task: str | None) -> Field:
    """A required ``{task, model, train}`` section whose task is ``task`` (None: any)."""
    return Field(lambda c, k, v: _experiment(c, k, v, task))


def _field(check: Callable, default: Any = REQUIRED, **kw) -> Field:
    """A field whose check is ``check(c, key, value)`` of this module."""
    return Field(check, default, **kw)


_SEEDS = _field(_seeds, [0])
_OBJECTIVES = _field(_objectives)
_EVAL_FIELD = _field(lambda c, k, v: c.section(k, v, _EVAL), {})

# kind -> its parameters (the same in both scales)
KINDS: dict[str, dict[str, Field]] = {
    "mqar_state_size": {
        "experiment": _experiment_of("mqar"), "objectives": _OBJECTIVES, "state_sizes": _field(_ints),
        "lrs": _field(_floats), "seeds": _SEEDS, "overrides": _field(_overrides, {})},
    "exact_vs_diagonal": {
        "mqar": _experiment_of("mqar"), "text": _experiment_of("text"),
        "objectives": _field(_exact_and_diagonal, ["longhorn", "longhorn_diag"]),
        "seeds": _field(_seeds, [0, 1, 2]), "bench_shape": _field(_bench_shape, None)},
    "extrapolation": {
        "experiment": _experiment_of("text"), "objectives": _field(_objectives, ["longhorn", "mamba", "gla"]),
        "extrapolate": _field(_pos_int, 16), "mitigations": _field(_mitigations, []), "eval": _EVAL_FIELD,
        "seeds": _SEEDS},
    "state_capacity": {
        "experiment": _experiment_of("text"), "objective": _field(_objective, "mamba"),
        "state_sizes": _field(_ints), "train_lengths": _field(_ints),
        "extrapolate": _field(_pos_int, 16), "eval": _EVAL_FIELD, "seeds": _SEEDS,
        "tokens_per_batch": _field(_pos_int, None)},
    "composed_search": {
        "search": _field(_search), "executor": Field(default="inline", choices=("inline", "ray")),
        "confirm": Field(lambda c, k, v: _experiment(c, k, v, None), None), "confirm_seeds": _SEEDS,
        "leave_out": _field(_leave_out, [])},
    "mad": {
        "objectives": _OBJECTIVES, "model": _field(_mapping), "train": _field(_mapping, {}),
        "tasks": _field(_mad_tasks, ["in_context_recall", "fuzzy_recall", "noisy_recall", "selective_copying",
                                     "compression", "memorization"]),
        "levels": Field(default="all", choices=("all", "baseline")),
        "task_overrides": _field(_task_overrides, {}),
        "lrs": _field(_floats, [1e-4, 5e-4, 1e-3]), "seeds": _SEEDS,
        "state_size": _field(_pos_int, None), "state_elements": _field(_pos_int, None)},
    "equal_state": {
        "mqar": _experiment_of("mqar"), "text": _experiment_of("text"),
        "challengers": _field(_study_objectives), "baselines": _field(_study_objectives),
        "state_elements": _field(_state_elements), "seeds": _field(_seeds, [0, 1, 2]),
        "resamples": _field(_pos_int, 2000), "overrides": _field(_overrides, {})},
}


@dataclass
class StudySpec:
    name: str
    kind: str
    source: str
    base: Path
    claim: str | None
    thresholds: dict[str, float]
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)   # scale -> validated params
    raw: dict = field(default_factory=dict)

    def params(self, scale: str) -> dict[str, Any]:
        if scale not in self.scales:
            raise SsmcraftError(f"--scale must be one of {', '.join(SCALES)}, got {scale!r}")
        return copy.deepcopy(self.scales[scale])


def load_study_spec(spec: str | Path | Mapping, source: str | None = None) -> StudySpec:
    """Parse and validate a study spec (a YAML path or a mapping)."""
    if isinstance(spec, Mapping):
        raw, source, base = dict(spec), source or "<dict>", Path.cwd()
    else:
        path = Path(spec)
        if not path.is_file():
            raise SpecError(str(path), "", "study spec not found")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(str(path), "", f"cannot read: {one_line(e)}") from None
        raw = yamlsafe.load(text, str(path))
        source, base = source or str(path), path.resolve().parent
    c = _Checker(source, "", base)
    if not isinstance(raw, dict):
        c.fail("", "expected a mapping at the top level")
    top = c.section("", raw, {"name": Field(), "kind": Field(), "claim": Field(lambda c, k, v: c.string(k, v), None),
                              "thresholds": Field(_mapping, {}), "base": Field(_mapping, {}),
                              **{s: Field() for s in SCALES}})
    name, kind, claim = top["name"], top["kind"], top["claim"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        c.fail("name", f"expected letters, digits, '_', '.', '-', got {name!r}")
    if kind not in KINDS:
        c.fail("kind", f"unknown study kind {kind!r}; known: {', '.join(KINDS)}")
    thresholds = dict(THRESHOLDS[kind])
    for k, v in top["thresholds"].items():
        if k not in thresholds:
            c.fail(f"thresholds.{k}", f"unknown threshold; {kind} has: {', '.join(thresholds) or 'none'}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            c.fail(f"thresholds.{k}", f"expected a number, got {v!r}")
        thresholds[k] = float(v)
    scales = {}
    for scale in SCALES:
        merged = _deep_merge(top["base"], c.mapping(scale, raw[scale] or {}))
        sc = _Checker(source, scale, base)
        params = sc.section("", merged, KINDS[kind], unknown=f"unknown key for a {kind} study",
                            missing="missing (required; in base: or in this scale)")
        if kind == "composed_search":
            _check_leave_out(sc, params)
        if kind == "mad":
            _check_mad(sc, params)
        if kind == "equal_state":
            _check_equal_state(sc, params)
        for obj, part in (params.get("overrides") or {}).items():      # each objective's own experiment
            for section in [k for k in ("experiment", "mqar", "text") if k in params]:
                _check_as_training(sc, f"overrides.{obj}", experiment_for(params[section], params["overrides"], obj))
        scales[scale] = params
    return StudySpec(name, kind, source, base, claim, thresholds, scales, raw)
