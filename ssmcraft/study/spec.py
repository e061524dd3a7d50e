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
}


def _deep_merge(a: Mapping, b: Mapping) -> dict:
    out = copy.deepcopy(dict(a))
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) \
            else copy.deepcopy(v)
    return out


class _C:
    def __init__(self, source: str, prefix: str):
        self.source, self.prefix = source, prefix

    def fail(self, key: str, problem: str):
        raise SpecError(self.source, f"{self.prefix}.{key}" if self.prefix else key, problem)

    def mapping(self, key, v):
        if not isinstance(v, Mapping):
            self.fail(key, f"expected a mapping, got {type(v).__name__}")
        return dict(v)

    def string(self, key, v):
        if not isinstance(v, str) or not v:
            self.fail(key, f"expected a non-empty string, got {v!r}")
        return v

    def pos_int(self, key, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            self.fail(key, f"expected a positive integer, got {v!r}")
        return v

    def pos_float(self, key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            self.fail(key, f"expected a positive number, got {v!r}")
        return float(v)

    def seq(self, key, v, item: Callable, min_len: int = 1):
        if not isinstance(v, list) or len(v) < min_len:
            self.fail(key, f"expected a list of at least {min_len} item(s), got {v!r}")
        return [item(f"{key}[{i}]", x) for i, x in enumerate(v)]

    def seeds(self, key, v):
        out = self.seq(key, v, lambda k, x: x if isinstance(x, int) and not isinstance(x, bool) and x >= 0
                       else self.fail(k, f"expected a seed (integer >= 0), got {x!r}"))
        if len(set(out)) != len(out):
            self.fail(key, f"seeds repeat: {out}")
        return out


def _experiment(c: _C, key: str, v: Any, task: str | None) -> dict:
    """``{task, model, train}`` of ``ssmcraft train``; ``task.name`` must be ``task``."""
    e = c.mapping(key, v)
    unknown = set(e) - {"task", "model", "train"}
    if unknown:
        c.fail(f"{key}.{sorted(unknown)[0]}", "unknown key; expected task, model, train")
    for part in ("task", "model"):
        if part not in e:
            c.fail(f"{key}.{part}", "missing (required)")
        c.mapping(f"{key}.{part}", e[part])
    e.setdefault("train", {})
    c.mapping(f"{key}.train", e["train"])
    if task is not None and e["task"].get("name") != task:
        c.fail(f"{key}.task.name", f"this study needs the {task!r} task, got {e['task'].get('name')!r}")
    _check_as_training(c, key, e)
    return e


def _check_as_training(c: _C, key: str, e: dict) -> None:
    """The experiment through the checks ``ssmcraft train`` gives a config (``train.config.resolve``:
    the model, train and task keys, the model's and train's values), so that a typo in either scale
    is found when the spec is loaded."""
    from ssmcraft.train.config import resolve

    try:
        resolve({"task": e["task"], "model": e["model"], "train": e["train"]}, c.source)
    except SpecError as err:
        c.fail(f"{key}.{err.key}", err.problem)


def _mitigations(c: _C, key: str, v: Any) -> list[str]:
    from ssmcraft.layers.mitigation import Mitigation

    out = c.seq(key, v, c.string, min_len=0)
    for i, text in enumerate(out):
        try:
            Mitigation.parse(text)
        except SsmcraftError as e:
            c.fail(f"{key}[{i}]", str(e))
    return out


def _overrides(c: _C, key: str, v: Any) -> dict:
    """objective -> a partial ``{task, model, train}`` merged over the experiment for that objective."""
    out = {}
    for obj, part in c.mapping(key, v).items():
        part = c.mapping(f"{key}.{obj}", part)
        unknown = set(part) - {"task", "model", "train"}
        if unknown:
            c.fail(f"{key}.{obj}.{sorted(unknown)[0]}", "unknown key; expected task, model, train")
        for name, sub in part.items():
            c.mapping(f"{key}.{obj}.{name}", sub)
        out[str(obj)] = part
    return out


def experiment_for(experiment: dict, overrides: dict, objective: str) -> dict:
    """The experiment one objective trains with: ``overrides[objective]`` merged over it."""
    return _deep_merge(experiment, overrides.get(objective, {}))


def _eval(c: _C, key: str, v: Any) -> dict:
    e = c.mapping(key, v)
    schema = {"batches": c.pos_int, "batch_size": c.pos_int, "explosion_factor": c.pos_float,
              "state_points": c.pos_int}
    for k, val in e.items():
        if k not in schema:
            c.fail(f"{key}.{k}", f"unknown key; expected one of {', '.join(schema)}")
        schema[k](f"{key}.{k}", val)
    return e


def _objective(c: _C, key: str, v: Any) -> str:
    """An objective name: "attention", a library objective, or a spec file's path (.yaml / .yml)."""
    from ssmcraft.runtime.lookup import unknown_objective

    name = c.string(key, v)
    why = None if name == "attention" or "/" in name or name.lower().endswith((".yaml", ".yml")) else unknown_objective(name)
    if why is not None:
        c.fail(key, f"{why} (or attention, or a spec file's path)")
    return name


def _objectives(c: _C, key: str, v: Any) -> list[str]:
    return c.seq(key, v, lambda k, x: _objective(c, k, x))


def _search(c: _C, key: str, v: Any, source: str, base: Path) -> dict:
    from ssmcraft.search.spec import load_search_spec

    s = c.mapping(key, v)
    try:
        load_search_spec(s, source=f"{source} ({c.prefix}.{key})", base=base)
    except SpecError as e:
        raise SpecError(source, f"{c.prefix}.{key}.{e.key}" if e.key else f"{c.prefix}.{key}", e.problem) from None
    return s


def _leave_out(c: _C, key: str, v: Any) -> list[str]:
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


def _check_leave_out(c: _C, params: dict) -> None:
    """A left-out layer must not be offered to the search by name."""
    choices = (((params.get("search") or {}).get("space") or {}).get("objective") or {}).get("choice") or []
    for n in params.get("leave_out") or []:
        if n in [e for e in choices if isinstance(e, str)]:
            c.fail("search.space.objective", f"{n!r} is left out of the library (leave_out) but listed here by name")


def _executor(c: _C, key: str, v: Any) -> str:
    if v not in ("inline", "ray"):
        c.fail(key, f"expected inline or ray, got {v!r}")
    return v


def _mad_tasks(c: _C, key: str, v: Any) -> list[str]:
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


def _check_mad(c: _C, params: dict) -> None:
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


# kind -> key -> (required, default, validator(c, key, value, ctx))
_E = lambda task: (lambda c, k, v, ctx: _experiment(c, k, v, task))  # noqa: E731
_S = lambda c, k, v, ctx: c.seeds(k, v)  # noqa: E731
_O = lambda c, k, v, ctx: _objectives(c, k, v)  # noqa: E731
_INTS = lambda c, k, v, ctx: c.seq(k, v, c.pos_int)  # noqa: E731
_FLOATS = lambda c, k, v, ctx: c.seq(k, v, c.pos_float)  # noqa: E731
_INT = lambda c, k, v, ctx: c.pos_int(k, v)  # noqa: E731
_EV = lambda c, k, v, ctx: _eval(c, k, v)  # noqa: E731
_M = lambda c, k, v, ctx: _mitigations(c, k, v)  # noqa: E731

KINDS: dict[str, dict[str, tuple[bool, Any, Callable]]] = {
    "mqar_state_size": {
        "experiment": (True, None, _E("mqar")), "objectives": (True, None, _O),
        "state_sizes": (True, None, _INTS), "lrs": (True, None, _FLOATS), "seeds": (False, [0], _S),
        "overrides": (False, {}, lambda c, k, v, ctx: _overrides(c, k, v))},
    "exact_vs_diagonal": {
        "mqar": (True, None, _E("mqar")), "text": (True, None, _E("text")),
        "objectives": (False, ["longhorn", "longhorn_diag"],
                       lambda c, k, v, ctx: (_objectives(c, k, v) if len(v) == 2 else
                                             c.fail(k, f"expected [exact, diagonal], got {v!r}")) if isinstance(v, list)
                       else c.fail(k, f"expected [exact, diagonal], got {v!r}")),
        "seeds": (False, [0, 1, 2], _S),
        "bench_shape": (False, None, lambda c, k, v, ctx: c.seq(k, v, c.pos_int, min_len=5)
                        if isinstance(v, list) and len(v) == 5 else c.fail(k, f"expected [B, T, H, d, m], got {v!r}"))},
    "extrapolation": {
        "experiment": (True, None, _E("text")), "objectives": (False, ["longhorn", "mamba", "gla"], _O),
        "extrapolate": (False, 16, _INT), "mitigations": (False, [], _M), "eval": (False, {}, _EV),
        "seeds": (False, [0], _S)},
    "state_capacity": {
        "experiment": (True, None, _E("text")), "objective": (False, "mamba", lambda c, k, v, ctx: _objective(c, k, v)),
        "state_sizes": (True, None, _INTS), "train_lengths": (True, None, _INTS),
        "extrapolate": (False, 16, _INT), "eval": (False, {}, _EV), "seeds": (False, [0], _S),
        "tokens_per_batch": (False, None, _INT)},
    "composed_search": {
        "search": (True, None, lambda c, k, v, ctx: _search(c, k, v, ctx["source"], ctx["base"])),
        "executor": (False, "inline", lambda c, k, v, ctx: _executor(c, k, v)),
        "confirm": (False, None, _E(None)), "confirm_seeds": (False, [0], _S),
        "leave_out": (False, [], lambda c, k, v, ctx: _leave_out(c, k, v))},
    "mad": {
        "objectives": (True, None, _O), "model": (True, None, lambda c, k, v, ctx: c.mapping(k, v)),
        "train": (False, {}, lambda c, k, v, ctx: c.mapping(k, v)),
        "tasks": (False, ["in_context_recall", "fuzzy_recall", "noisy_recall", "selective_copying", "compression",
                          "memorization"], lambda c, k, v, ctx: _mad_tasks(c, k, v)),
        "levels": (False, "all", lambda c, k, v, ctx: v if v in ("all", "baseline")
                   else c.fail(k, f"expected all or baseline, got {v!r}")),
        "task_overrides": (False, {}, lambda c, k, v, ctx: {t: c.mapping(f"{k}.{t}", o)
                                                            for t, o in c.mapping(k, v).items()}),
        "lrs": (False, [1e-4, 5e-4, 1e-3], _FLOATS), "seeds": (False, [0], _S),
        "state_size": (False, None, _INT), "state_elements": (False, None, _INT)},
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
    c = _C(source, "")
    if not isinstance(raw, dict):
        c.fail("", "expected a mapping at the top level")
    allowed = {"name", "kind", "claim", "thresholds", "base", *SCALES}
    for k in raw:
        if k not in allowed:
            c.fail(str(k), f"unknown key; expected one of {', '.join(sorted(allowed))}")
    for k in ("name", "kind", *SCALES):
        if k not in raw:
            c.fail(k, "missing (required)")
    name = raw["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        c.fail("name", f"expected letters, digits, '_', '.', '-', got {name!r}")
    kind = raw["kind"]
    if kind not in KINDS:
        c.fail("kind", f"unknown study kind {kind!r}; known: {', '.join(KINDS)}")
    claim = raw.get("claim")
    if claim is not None:
        c.string("claim", claim)
    thresholds = dict(THRESHOLDS[kind])
    for k, v in c.mapping("thresholds", raw.get("thresholds", {})).items():
        if k not in thresholds:
            c.fail(f"thresholds.{k}", f"unknown threshold; {kind} has: {', '.join(thresholds) or 'none'}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            c.fail(f"thresholds.{k}", f"expected a number, got {v!r}")
        thresholds[k] = float(v)
    shared = c.mapping("base", raw.get("base", {}))
    scales = {}
    ctx = {"source": source, "base": base}
    for scale in SCALES:
        merged = _deep_merge(shared, c.mapping(scale, raw[scale] or {}))
        sc = _C(source, scale)
        schema = KINDS[kind]
        for k in merged:
            if k not in schema:
                sc.fail(k, f"unknown key for a {kind} study; expected one of {', '.join(schema)}")
        params = {}
        for k, (required, default, check) in schema.items():
            if k not in merged:
                if required:
                    sc.fail(k, "missing (required; in base: or in this scale)")
                params[k] = copy.deepcopy(default)
                continue
            params[k] = check(sc, k, merged[k], ctx)
            if params[k] is None:
                params[k] = merged[k]
        if kind == "composed_search":
            _check_leave_out(sc, params)
        if kind == "mad":
            _check_mad(sc, params)
        for obj, part in (params.get("overrides") or {}).items():      # each objective's own experiment
            _check_as_training(sc, f"overrides.{obj}", experiment_for(params["experiment"], params["overrides"], obj))
        scales[scale] = params
    return StudySpec(name, kind, source, base, claim, thresholds, scales, raw)
