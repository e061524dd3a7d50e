"""Stage 1: YAML -> a frozen, schema-checked ``Spec``.

Every problem is a ``SpecError`` naming the source (file path, ``<text>`` or ``<dict>``),
the key (dotted path) and what is wrong. YAML is read with the safe loader; expression
strings are only parsed (``expr.parse``), never evaluated.

Several states (``state: {D: [d, m], S: [d, m]}``, one shared shape): ``objective:`` maps
each state to its loss, ``update:``/``approximation:`` are one value or a mapping per state
(the approximation exact: several states are classified general or nonlinear, which has no
diagonal, so ``diagonal`` is refused here),
``X_prev`` names each state's previous value (``S_prev`` stays the name with one state), and
the states update in declaration order, so a loss may read the new values of the states
declared before its own, never of a later one (``Spec.states`` and friends; see
``derive.derive_stages``).
"""
from __future__ import annotations

import builtins
import keyword
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ssmcraft import yamlsafe
from ssmcraft.compiler import expr as E
from ssmcraft.config_check import Checker
from ssmcraft.errors import SpecError, quote

IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")   # whole text (fullmatch): no trailing newline
# names the generated PyTorch/Triton code uses, Python's keywords and builtins
CODE_NAMES = {"torch", "F", "tl", "triton", "math", "env", "co", "erase"}
RESERVED = {"S_prev"} | set(E.FUNCTIONS) | CODE_NAMES | set(keyword.kwlist) | set(dir(builtins))
TOP_KEYS = {"name", "summary", "state", "inputs", "params", "let", "objective", "update",
            "approximation", "output", "source"}
INPUT_KEYS = {"shape", "positive", "bounded", "normalize", "activation"}
PARAM_KEYS = {"shape", "positive", "negative", "init", "trainable"}
ACTIVATIONS = {"identity", "silu", "sigmoid", "softplus", "exp", "tanh", "relu", "elu1"}
INIT_NAMES = {"zeros", "ones", "s4d_real", "retnet_decay"}
INIT_FORMS = {"constant": 1, "uniform": 2, "normal": 2, "log_uniform": 2}


@dataclass(frozen=True)
class InputDecl:
    """A per-token input produced by the layer's projections."""
    name: str
    shape: tuple[str, ...]          # () per-head scalar, (d,) or (m,)
    positive: bool = False
    bounded: bool = False           # value in (0, 1)
    normalize: bool = False         # L2-normalised over its dimension
    activation: str | None = None   # explicit override of the implied activation


@dataclass(frozen=True)
class ParamDecl:
    """A learned, token-independent tensor (per head when the layer has heads)."""
    name: str
    shape: tuple[str, ...]
    positive: bool = False
    negative: bool = False
    init: Any = "zeros"             # a name in INIT_NAMES or {form: args}
    trainable: bool = True


@dataclass(frozen=True)
class Spec:
    name: str
    summary: str
    state: str                       # the state's name (S)
    dims: tuple[str, str]            # (rows, cols) = (value dim d, key dim m)
    inputs: Mapping[str, InputDecl]
    params: Mapping[str, ParamDecl]
    let: tuple[tuple[str, str], ...]
    objective: str
    update: str                      # implicit | explicit | newton
    approximation: str               # exact | diagonal
    output: str
    source: str = "<dict>"           # where the spec came from (for messages)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # several states (empty with one): names in declaration order (the update order), and per
    # state its loss, update and approximation; `state` is then the last state, `objective`,
    # `update` and `approximation` summaries for display
    states: tuple[str, ...] = ()
    objectives: tuple[str, ...] = ()
    updates: tuple[str, ...] = ()
    approximations: tuple[str, ...] = ()

    @property
    def output_dim(self) -> str:
        return self.dims[0]

    def state_names(self) -> tuple[str, ...]:
        """Every state in declaration order (one name for a single-state spec)."""
        return self.states or (self.state,)

    def prev_name(self, state: str) -> str:
        """The name of a state's previous value: ``S_prev`` with one state, ``X_prev`` with several."""
        return f"{state}_prev" if self.states else "S_prev"

    def declared(self) -> list[str]:
        return [n for s in self.state_names() for n in (s, self.prev_name(s))] + [*self.inputs, *self.params, *self.dims]


def read_source(spec: str | Path | Mapping) -> tuple[dict, str]:
    """Return (raw mapping, source label) for a path, YAML text or a mapping."""
    if isinstance(spec, Mapping):
        return dict(spec), str(spec.get("source", "<dict>")) if isinstance(spec.get("source"), str) else "<dict>"
    if isinstance(spec, Path) or _names_a_file(spec):
        path = Path(spec.strip()) if isinstance(spec, str) else spec
        if _is_dir(path):
            raise SpecError(str(path), "", "a folder, not a spec file")
        if not _is_file(path):
            # a bare file name may be the library's (``deltanet.yaml``); a path with folders is the
            # user's file, never silently replaced by the library one of the same name
            from ssmcraft.compiler.library import find_objective
            found = find_objective(str(path)) if path.parent == Path(".") else None
            if found is None:
                raise SpecError(str(path), "", "no such file")
            path = found
        try:
            text, source = path.read_text(encoding="utf-8", errors="replace"), str(path)
        except OSError as e:
            raise SpecError(str(spec), "", f"cannot read: {e.strerror}") from None
    elif isinstance(spec, str):
        text, source = spec, "<text>"
        if "\n" not in spec and ":" not in spec:
            from ssmcraft.compiler.library import find_objective, library_names
            found = find_objective(spec)
            if found is not None:
                text, source = found.read_text(encoding="utf-8"), str(found)
            elif re.match(r"^[A-Za-z][A-Za-z0-9_]*$", spec.strip()):
                raise SpecError(spec.strip(), "", "no such objective in the library; known: " + ", ".join(library_names()))
            elif re.match(r"^[\w.-]+\.\w+$", spec.strip()):
                raise SpecError(spec.strip(), "", "no such file, and not a library objective")
    else:
        raise SpecError("<spec>", "", f"expected a path, YAML text or a mapping, got {type(spec).__name__}")
    data = yamlsafe.load(text, source)
    if not isinstance(data, dict):
        raise SpecError(source, "", f"expected a mapping at the top level, got {type(data).__name__}")
    return data, source


def _names_a_file(spec) -> bool:
    """Whether a string is a path rather than YAML text or a library name: one line that ends in
    .yaml / .yml (any case), has a folder in it, or is a file here and not a library name."""
    if not isinstance(spec, str) or "\n" in spec:
        return False
    s = spec.strip()
    if s.startswith(("{", "[")) or ": " in s or s.endswith(":"):
        return False                 # one-line YAML text (an objective may hold '/')
    if s.lower().endswith((".yaml", ".yml")) or "/" in s:
        return True
    from ssmcraft.compiler.library import find_objective
    return _is_file(Path(s)) and find_objective(s) is None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):   # a name too long for the file system, a NUL byte
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _bool(src, key, value) -> bool:
    return Checker(src).boolean(key, value)


def _str(src, key, value, *, allow_empty=False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise SpecError(src, key, f"expected a non-empty string, got {quote(value)}")
    return value


def _ident(src, key, value) -> str:
    if not isinstance(value, str) or not IDENT.fullmatch(value):
        raise SpecError(src, key, f"{quote(value)} is not a valid name (letters, digits, '_', starting with a letter, at most 32)")
    if value in RESERVED:
        why = "a name the generated code uses" if value in CODE_NAMES else \
            "a Python keyword or builtin" if value not in E.FUNCTIONS and value != "S_prev" else "a function or S_prev"
        raise SpecError(src, key, f"{quote(value)} is reserved ({why})")
    return value


def _shape(src, key, value, dims) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > 2:
        raise SpecError(src, key, f"expected a list of at most 2 dimension names, got {quote(value)}")
    for v in value:
        if v not in dims:
            raise SpecError(src, key, f"unknown dimension {quote(v)}; the state declares {', '.join(dims)}")
    if len(value) == 2 and tuple(value) != tuple(dims):
        raise SpecError(src, key, f"a matrix must have the state's shape [{', '.join(dims)}], got {quote(value)}")
    return tuple(value)


def _keys(src, key, value, allowed):
    Checker(src).mapping(key, value, tuple(sorted(allowed)))


def _init(src, key, value):
    if isinstance(value, bool):
        raise SpecError(src, key, f"expected an initialiser, got {quote(value)}")
    if isinstance(value, (int, float)):
        return {"constant": _init_number(src, key, value, value)}
    if isinstance(value, str):
        if value not in INIT_NAMES:
            raise SpecError(src, key, f"unknown initialiser {quote(value)}; known: {', '.join(sorted(INIT_NAMES | set(INIT_FORMS)))}")
        return value
    if isinstance(value, dict) and len(value) == 1:
        (form, args), = value.items()
        if form not in INIT_FORMS:
            raise SpecError(src, key, f"unknown initialiser {quote(form)}; known: {', '.join(sorted(INIT_NAMES | set(INIT_FORMS)))}")
        args = args if isinstance(args, list) else [args]
        if len(args) != INIT_FORMS[form] or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
            raise SpecError(src, key, f"{form} takes {INIT_FORMS[form]} number(s), got {quote(value[form])}")
        args = [_init_number(src, key, a, value[form], form) for a in args]
        if form == "normal" and args[1] < 0:
            raise SpecError(src, key, f"normal takes [mean, std] with std >= 0, got {args}")
        if form in ("uniform", "log_uniform") and not args[0] < args[1]:
            raise SpecError(src, key, f"{form} needs low < high, got {args}")
        if form == "log_uniform" and args[0] <= 0:
            raise SpecError(src, key, "log_uniform needs positive bounds")
        return {form: args}
    raise SpecError(src, key, f"expected an initialiser name or {{form: args}}, got {quote(value)}")


def _init_number(src, key, number, given, form: str | None = None) -> float:
    """An initialiser's number as a float, held to the magnitudes expression literals are
    (``expr.CONSTANT_RANGE``: an int of any size, or inf, is refused, not an OverflowError)."""
    limit = E.CONSTANT_RANGE[1]
    try:
        x = float(number)
    except OverflowError:
        x = math.inf
    if not (math.isfinite(x) and abs(x) <= limit):
        what = f"{form} takes" if form else "expected"
        raise SpecError(src, key, f"{what} finite numbers of magnitude at most {limit:g}, got {quote(given)}")
    return x


def _expression(src, key, value, declared: set[str]) -> str:
    text = _str(src, key, value)
    try:
        tree = E.parse(text)
    except E.ParseError as e:
        raise SpecError(src, key, f"syntax error: {e}") from None
    unknown = sorted(E.names(tree) - declared)
    if unknown:
        raise SpecError(src, key, f"unknown name {quote(unknown[0])}; declared: {', '.join(sorted(declared, key=_order))}")
    return text


def _order(name: str):
    return (name != "S", name != "S_prev", name)


def load_spec(spec: str | Path | Mapping) -> Spec:
    """Read and validate a spec (a path, YAML text or a mapping) into a frozen ``Spec``."""
    raw, src = read_source(spec)
    _keys(src, "", raw, TOP_KEYS)
    for required in ("name", "state", "inputs", "objective", "update", "output"):
        if required not in raw:
            raise SpecError(src, required, "missing (required)")
    name = _ident(src, "name", raw["name"])
    summary = _str(src, "summary", raw.get("summary", ""), allow_empty=True)

    state_names, dims = _states(src, raw["state"])
    state_name = state_names[-1]
    multi = len(state_names) > 1
    prevs = [f"{x}_prev" for x in state_names] if multi else ["S_prev"]

    inputs_raw = raw["inputs"]
    if not isinstance(inputs_raw, dict) or not inputs_raw:
        raise SpecError(src, "inputs", "expected a non-empty mapping of input declarations")
    taken = {*state_names, *prevs, *dims}
    inputs: dict[str, InputDecl] = {}
    for iname, decl in inputs_raw.items():
        key = f"inputs.{iname}"
        iname = _ident(src, key, iname)
        if iname in taken:
            raise SpecError(src, key, f"name {quote(iname)} is already used")
        _keys(src, key, decl, INPUT_KEYS)
        if "shape" not in decl:
            raise SpecError(src, f"{key}.shape", "missing (required)")
        shape = _shape(src, f"{key}.shape", decl["shape"], dims)
        if len(shape) == 2:
            raise SpecError(src, f"{key}.shape", "inputs are vectors or scalars; matrices come from outer()")
        act = decl.get("activation")
        if act is not None and (not isinstance(act, str) or act not in ACTIVATIONS):
            raise SpecError(src, f"{key}.activation", f"unknown activation {quote(act)}; known: {', '.join(sorted(ACTIVATIONS))}")
        inputs[iname] = InputDecl(
            iname, shape,
            positive=_bool(src, f"{key}.positive", decl.get("positive", False)),
            bounded=_bool(src, f"{key}.bounded", decl.get("bounded", False)),
            normalize=_bool(src, f"{key}.normalize", decl.get("normalize", False)),
            activation=act,
        )
        if inputs[iname].normalize and len(shape) != 1:
            raise SpecError(src, f"{key}.normalize", "only a vector input can be normalised")
        taken.add(iname)

    params: dict[str, ParamDecl] = {}
    params_raw = raw.get("params", {}) or {}
    if not isinstance(params_raw, dict):
        raise SpecError(src, "params", f"expected a mapping, got {type(params_raw).__name__}")
    for pname, decl in params_raw.items():
        key = f"params.{pname}"
        pname = _ident(src, key, pname)
        if pname in taken:
            raise SpecError(src, key, f"name {quote(pname)} is already used")
        _keys(src, key, decl, PARAM_KEYS)
        shape = _shape(src, f"{key}.shape", decl.get("shape", []), dims)
        p = ParamDecl(
            pname, shape,
            positive=_bool(src, f"{key}.positive", decl.get("positive", False)),
            negative=_bool(src, f"{key}.negative", decl.get("negative", False)),
            init=_init(src, f"{key}.init", decl.get("init", "zeros")),
            trainable=_bool(src, f"{key}.trainable", decl.get("trainable", True)),
        )
        if p.positive and p.negative:
            raise SpecError(src, key, "cannot be both positive and negative")
        params[pname] = p
        taken.add(pname)

    declared = {*state_names, *prevs, *inputs, *params, *dims}
    lets: list[tuple[str, str]] = []
    let_raw = raw.get("let", {}) or {}
    if not isinstance(let_raw, dict):
        raise SpecError(src, "let", f"expected a mapping of name: expression, got {type(let_raw).__name__}")
    for lname, text in let_raw.items():
        key = f"let.{lname}"
        lname = _ident(src, key, lname)
        if lname in declared:
            raise SpecError(src, key, f"name {quote(lname)} is already used")
        lets.append((lname, _expression(src, key, text, declared)))
        declared.add(lname)   # a let may use the lets before it

    if multi:
        return _multi_state_spec(src, raw, name, summary, state_names, prevs, dims, inputs, params, lets, declared)
    objective = _expression(src, "objective", raw["objective"], declared)
    update = raw["update"]
    if update not in ("implicit", "explicit", "newton"):
        raise SpecError(src, "update", f"expected implicit, explicit or newton, got {quote(update)}")
    approximation = raw.get("approximation", "exact")
    if approximation not in ("exact", "diagonal"):
        raise SpecError(src, "approximation", f"expected exact or diagonal, got {quote(approximation)}")
    output = _output(src, raw, declared, _let_closure(lets), prevs, "the new state S")
    return Spec(name, summary, state_name, dims, inputs, params, tuple(lets), objective,
                update, approximation, output, source=src, raw=raw)


def _states(src, state) -> tuple[tuple[str, ...], tuple[str, str]]:
    """``state:`` -> (names in declaration order, the shared dims). Several states must share
    one shape [d, m] (the kernels keep one [K, V] tile per state)."""
    if not isinstance(state, dict) or not state:
        raise SpecError(src, "state", f"expected one entry like {{S: [d, m]}} per state, got {quote(state)}")
    names, shapes = [], []
    for sname, dims in state.items():
        sname = _ident(src, "state", sname)
        if not isinstance(dims, list) or len(dims) != 2:
            raise SpecError(src, f"state.{sname}", f"expected two dimension names like [d, m], got {quote(dims)}")
        for dname in dims:
            _ident(src, f"state.{sname}", dname)
        if dims[0] == dims[1]:
            raise SpecError(src, f"state.{sname}", "the two dimensions must have different names")
        if shapes and tuple(dims) != shapes[0]:
            raise SpecError(src, f"state.{sname}", f"every state must have the first state's shape "
                            f"[{', '.join(shapes[0])}], got {quote(dims)}")
        names.append(sname)
        shapes.append(tuple(dims))
    dims = shapes[0]
    for sname in names:
        if sname in dims:
            raise SpecError(src, f"state.{sname}", "a dimension cannot have a state's name")
        if len(names) > 1:
            if sname.endswith("_prev") and sname[:-5] in names:
                raise SpecError(src, f"state.{sname}", f"{quote(sname)} names the previous value of state {quote(sname[:-5])}")
            if len(sname) > 27:
                raise SpecError(src, f"state.{sname}", "with several states a state's name has at most 27 "
                                f"characters (its previous value is {sname}_prev)")
    return tuple(names), dims


def _let_closure(lets) -> dict[str, set[str]]:
    """let name -> every name it reads, through the lets before it too (``lets``: (name,
    expression) in order)."""
    through: dict[str, set[str]] = {}
    for lname, body in lets:
        names = E.names(E.parse(body))
        through[lname] = names.union(*(through[n] for n in names if n in through))
    return through


def _refuse_reads(src, key: str, text: str, through: dict, bad, direct, via) -> None:
    """Refuse ``text`` reading a name of ``bad`` (in order): ``direct(name)`` is the problem when it
    reads it itself, ``via(name)`` plus the let when it reads it through one (``through``:
    ``_let_closure``)."""
    names = E.names(E.parse(text))
    hit = next((x for x in bad if x in names), None)
    if hit is not None:
        raise SpecError(src, key, direct(hit))
    for x in bad:
        lname = next((n for n in sorted(names & set(through)) if x in through[n]), None)
        if lname is not None:
            raise SpecError(src, key, f"{via(x)} (let.{lname})")


def _per_state(src, key, value, states, allowed, default=None) -> tuple[str, ...]:
    """A setting given once for every state (a string) or as a mapping state -> value."""
    if value is None:
        value = default
    if isinstance(value, str):
        if value not in allowed:
            raise SpecError(src, key, f"expected {' or '.join(allowed)} (or a mapping state -> value), got {quote(value)}")
        return tuple(value for _ in states)
    if not isinstance(value, dict):
        raise SpecError(src, key, f"expected {' or '.join(allowed)}, or a mapping state -> value, got {quote(value)}")
    _keys(src, key, value, set(states))
    out = []
    for sname in states:
        if sname not in value:
            if default is None:
                raise SpecError(src, f"{key}.{sname}", "missing (every state needs one)")
            out.append(default)
            continue
        if value[sname] not in allowed:
            raise SpecError(src, f"{key}.{sname}", f"expected {' or '.join(allowed)}, got {quote(value[sname])}")
        out.append(value[sname])
    return tuple(out)


def _output(src, raw, declared, through: dict, prevs, new: str) -> str:
    """The spec's ``output`` expression, refused where it reads a previous state (``prevs``, also
    through a let: ``_let_closure``) rather than ``new``, the new state(s) as the message names them."""
    output = _expression(src, "output", raw["output"], declared)
    _refuse_reads(src, "output", output, through, prevs,
                  lambda x: f"the output reads {new}, not {x}",
                  lambda x: f"the output reads {x} (through a let); it must read {new}")
    return output


def _multi_state_spec(src, raw, name, summary, states, prevs, dims, inputs, params, lets, declared) -> Spec:
    """The rest of a spec with several states: ``objective:`` maps each state to its loss; the
    states update in declaration order, so a state's loss may read the states declared before
    it (new values) and every ``X_prev``, never a later state's new value."""
    objective = raw["objective"]
    if not isinstance(objective, dict):
        raise SpecError(src, "objective", f"with several states ({', '.join(states)}) the objective is a "
                        f"mapping state -> loss, got {type(objective).__name__}")
    through = _let_closure(lets)
    _keys(src, "objective", objective, set(states))
    losses = []
    for i, sname in enumerate(states):
        key = f"objective.{sname}"
        if sname not in objective:
            raise SpecError(src, key, "missing (every state needs its loss)")
        text = _expression(src, key, objective[sname], declared)
        _refuse_reads(src, key, text, through, states[i + 1:],
                      lambda x: f"{quote(x)} is the new value of a state updated after {sname} "
                                f"(states update in declaration order: {', '.join(states)}); use {x}_prev",
                      lambda x: f"the loss reads {quote(x)} (through a let), the new value of a state "
                                f"updated after {sname}; use {x}_prev")
        losses.append(text)
    updates = _per_state(src, "update", raw["update"], states, ("implicit", "explicit"))
    approximations = _per_state(src, "approximation", raw.get("approximation"), states, ("exact", "diagonal"), "exact")
    if "diagonal" in approximations:
        key = "approximation" if isinstance(raw.get("approximation"), str) else \
            f"approximation.{states[approximations.index('diagonal')]}"
        raise SpecError(src, key, "the diagonal approximation is not supported with several states (their "
                        "joint update is classified general or nonlinear, which has no diagonal); use exact")
    output = _output(src, raw, declared, through, prevs, "the new states")
    summary_of = lambda values: values[0] if len(set(values)) == 1 else ", ".join(f"{x}: {v}" for x, v in zip(states, values))  # noqa: E731
    return Spec(name, summary, states[-1], dims, inputs, params, tuple(lets),
                "; ".join(f"{x}: {t}" for x, t in zip(states, losses)), summary_of(updates),
                summary_of(approximations), output, source=src, raw=raw, states=tuple(states),
                objectives=tuple(losses), updates=updates, approximations=approximations)
