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
``updates.derive_stages``).
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
from ssmcraft.config_check import ABSENT, Checker, Field
from ssmcraft.errors import SpecError, quote

IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")   # whole text (fullmatch): no trailing newline
# names the generated PyTorch/Triton code uses, Python's keywords and builtins
CODE_NAMES = {"torch", "F", "tl", "triton", "math", "env", "co", "erase"}
RESERVED = {"S_prev"} | set(E.FUNCTIONS) | CODE_NAMES | set(keyword.kwlist) | set(dir(builtins))
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
    # states of several shapes (empty when every state has the shape ``dims``): per state in
    # declaration order its shape, and its initial value (None: zero; a float c: c times the
    # identity, square states only); see ``state_decls``
    shapes: tuple[tuple[str, str], ...] = ()
    inits: tuple = ()
    # ``approximation: {minibatch: C}`` (``approximation`` is then "minibatch"): gradients taken at
    # the state before each chunk of C tokens (``minibatch_approximation``); 0 otherwise
    minibatch: int = 0
    # hidden dimensions (a deep memory's layer width): ((name, factor, base dim or None), ...), the
    # size factor * size(base) (or factor); states of several shapes over (d, m, hidden...)
    hidden: tuple = ()

    def shape_of(self, state: str) -> tuple[str, str]:
        """A state's declared shape (``dims`` unless the spec declares several shapes)."""
        return self.shapes[self.state_names().index(state)] if self.shapes else self.dims

    def init_of(self, state: str):
        """A state's initial value: None (zero) or c (c times the identity)."""
        return self.inits[self.state_names().index(state)] if self.inits else None

    def square_states(self) -> tuple[str, ...]:
        """The states of shape ``[m, m]`` (metrics), in declaration order."""
        return tuple(x for x in self.state_names() if self.shape_of(x)[0] == self.shape_of(x)[1])

    def axes(self) -> tuple[str, ...]:
        """Every dimension: ``dims`` then the hidden ones (the generated code's tensor axes)."""
        return (*self.dims, *(h[0] for h in self.hidden))

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


def _flag(default: bool) -> Field:
    return Field(lambda c, k, v: c.boolean(k, v), default)


# the top level: presence and the two plain values; the rest is read in ``load_spec``'s order
TOP_FIELDS = {
    "name": Field(lambda c, k, v: _ident(c.source, k, v)),
    "summary": Field(lambda c, k, v: _str(c.source, k, v, allow_empty=True), ""),
    **{k: Field() for k in ("state", "inputs", "objective", "update", "output")},
    **{k: Field(default=ABSENT) for k in ("params", "let", "hidden", "approximation", "source")},
}


def _input_fields(src, dims) -> dict[str, Field]:
    """An input's declaration: ``shape`` a vector over a state dimension or a scalar."""
    def shape(c, k, v):
        out = _shape(src, k, v, dims)
        if len(out) == 2:
            raise SpecError(src, k, "inputs are vectors or scalars; matrices come from outer()")
        return out

    def activation(c, k, v):
        if v is not None and (not isinstance(v, str) or v not in ACTIVATIONS):
            raise SpecError(src, k, f"unknown activation {quote(v)}; known: {', '.join(sorted(ACTIVATIONS))}")
        return v
    return {"shape": Field(shape), "activation": Field(activation, None),
            "positive": _flag(False), "bounded": _flag(False), "normalize": _flag(False)}


def _param_fields(src, dims) -> dict[str, Field]:
    """A learned parameter's declaration (a scalar when ``shape`` is left out)."""
    return {"shape": Field(lambda c, k, v: _shape(src, k, v, dims), ()),
            "positive": _flag(False), "negative": _flag(False),
            "init": Field(lambda c, k, v: _init(src, k, v), "zeros"), "trainable": _flag(True)}


def _declared_name(src, key, name, taken: set) -> str:
    """An input's or parameter's name: an identifier not yet used (it is then taken)."""
    name = _ident(src, key, name)
    if name in taken:
        raise SpecError(src, key, f"name {quote(name)} is already used")
    taken.add(name)
    return name


def load_spec(spec: str | Path | Mapping) -> Spec:
    """Read and validate a spec (a path, YAML text or a mapping) into a frozen ``Spec``."""
    raw, src = read_source(spec)
    top = Checker(src).section("", raw, TOP_FIELDS)
    name, summary = top["name"], top["summary"]

    hidden = hidden_dims(src, raw.get("hidden"))
    state_names, dims, shapes, inits = state_decls(src, raw["state"], tuple(h[0] for h in hidden))
    state_name = state_names[-1]
    multi = len(state_names) > 1
    prevs = [f"{x}_prev" for x in state_names] if multi else ["S_prev"]

    inputs_raw = raw["inputs"]
    if not isinstance(inputs_raw, dict) or not inputs_raw:
        raise SpecError(src, "inputs", "expected a non-empty mapping of input declarations")
    c = Checker(src)
    taken = {*state_names, *prevs, *dims}
    inputs: dict[str, InputDecl] = {}
    for iname, decl in inputs_raw.items():
        key = f"inputs.{iname}"
        iname = _declared_name(src, key, iname, taken)
        d = c.section(key, decl, _input_fields(src, dims))
        inputs[iname] = InputDecl(iname, **d)
        if d["normalize"] and len(d["shape"]) != 1:
            raise SpecError(src, f"{key}.normalize", "only a vector input can be normalised")

    params: dict[str, ParamDecl] = {}
    params_raw = raw.get("params", {}) or {}
    if not isinstance(params_raw, dict):
        raise SpecError(src, "params", f"expected a mapping, got {type(params_raw).__name__}")
    for pname, decl in params_raw.items():
        key = f"params.{pname}"
        pname = _declared_name(src, key, pname, taken)
        p = ParamDecl(pname, **c.section(key, decl, _param_fields(src, dims)))
        if p.positive and p.negative:
            raise SpecError(src, key, "cannot be both positive and negative")
        params[pname] = p

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
        spec = _multi_state_spec(src, raw, name, summary, state_names, prevs, dims, inputs, params, lets, declared)
        return _with_shapes(src, raw, spec, shapes, inits, lets, hidden)
    if inits:
        raise SpecError(src, f"state.{state_name}.init", "identity needs a square state")
    objective = _expression(src, "objective", raw["objective"], declared)
    update = raw["update"]
    if update not in ("implicit", "explicit", "newton"):
        raise SpecError(src, "update", f"expected implicit, explicit or newton, got {quote(update)}")
    approximation = raw.get("approximation", "exact")
    minibatch = 0
    if isinstance(approximation, dict):
        approximation, minibatch = minibatch_approximation(src, approximation, update)
    elif approximation not in ("exact", "diagonal"):
        raise SpecError(src, "approximation", f"expected exact, diagonal or {{minibatch: C}}, got {quote(approximation)}")
    output = _output(src, raw, declared, _let_closure(lets), prevs, "the new state S")
    return Spec(name, summary, state_name, dims, inputs, params, tuple(lets), objective,
                update, approximation, output, source=src, raw=raw, minibatch=minibatch)


MINIBATCH_MAX = 4096


def minibatch_approximation(src, value: dict, update: str) -> tuple[str, int]:
    """``approximation: {minibatch: C}`` -> ("minibatch", C): within each chunk of C tokens every
    gradient of the data loss is taken at the state before the chunk (TTT, Titans), so the chunk's
    updates are computed in parallel; for explicit and Newton updates."""
    _keys(src, "approximation", value, {"minibatch"})
    C = value.get("minibatch")
    if isinstance(C, bool) or not isinstance(C, int) or not 1 <= C <= MINIBATCH_MAX:
        raise SpecError(src, "approximation.minibatch", f"expected a chunk size, an integer 1..{MINIBATCH_MAX}, got {C!r}")
    if update not in ("explicit", "newton"):
        raise SpecError(src, "approximation.minibatch", f"a mini-batch takes explicit or Newton steps at the chunk's "
                        f"start; update {update} minimises exactly (use update: explicit or newton)")
    return "minibatch", C


STATE_FIELDS = {"shape": Field(), "init": Field(default="zeros")}


def state_decls(src, state, hidden: tuple = ()) -> tuple[tuple[str, ...], tuple[str, str], tuple, tuple]:
    """``state:`` -> (names in declaration order, the shared dims [d, m], shapes, inits).

    An entry is ``X: [d, m]`` or ``X: {shape: [r, c], init: zeros | {identity: c}}``. Every state
    has one shape [d, m] (the first state of two different dimension names gives it), except
    square states ``[m, m]`` over its key dimension: a metric (``wsq(V, X)``) of another state's
    proximity. ``init`` is the initial value: zero by default, ``{identity: c}`` (square states)
    c times the identity. ``shapes`` and ``inits`` are empty when every state is a zero-initialised
    [d, m] (so the specs of one shape compare and hash as they always did)."""
    if not isinstance(state, dict) or not state:
        raise SpecError(src, "state", f"expected one entry like {{S: [d, m]}} per state, got {state!r}")
    shapes_raw, inits = {}, []
    for sname, decl in state.items():
        key = f"state.{sname}"
        init = None
        if isinstance(decl, dict):
            d = Checker(src).section(key, decl, STATE_FIELDS)
            init = _state_init(src, f"{key}.init", d["init"])
            decl = d["shape"]
        shapes_raw[sname] = decl
        inits.append(init)
    if hidden:
        return _hidden_states(src, state, shapes_raw, inits, hidden)
    square = {x for x, dims in shapes_raw.items() if isinstance(dims, list) and len(dims) == 2 and dims[0] == dims[1]}
    plain = {x: dims for x, dims in shapes_raw.items() if x not in square}
    if len(shapes_raw) == 1:
        plain = shapes_raw              # one state: the rules of one [d, m] state
    if not plain:
        raise SpecError(src, "state", "every state is square; at least one must be a [d, m] matrix (two different "
                        "dimension names): a square state is the metric of another state's proximity")
    names, dims = _states(src, plain)
    for x in square:
        _ident(src, "state", x)
        for dname in shapes_raw[x]:
            _ident(src, f"state.{x}", dname)
        if shapes_raw[x][0] != dims[1]:
            raise SpecError(src, f"state.{x}", f"a square state must be over the key dimension, [{dims[1]}, {dims[1]}] "
                            f"(the metric of a [{', '.join(dims)}] state's proximity), got {shapes_raw[x]!r}")
    order = tuple(state)
    if square:
        names, _ = _states(src, {x: list(dims) for x in order})     # the name rules over every state
    for x, init in zip(order, inits):
        if init is not None and x not in square:
            raise SpecError(src, f"state.{x}.init", f"identity needs a square state (or a deep memory's weights, "
                            f"with hidden dimensions); {x} is [{', '.join(dims)}]")
    shapes = tuple(tuple(shapes_raw[x]) for x in order) if square else ()
    return names, dims, shapes, tuple(inits) if any(i is not None for i in inits) else ()


def _hidden_states(src, state, shapes_raw, inits, hidden):
    """States over hidden dimensions (a deep memory, e.g. ``W1: [h, m]``, ``W2: [d, h]``): each of two
    different dimension names, none square; the other two names are (d, m): d the one that is a row
    of some state, m a column. ``init: {identity: c}`` is c times the rectangular identity."""
    if len(shapes_raw) == 1:
        raise SpecError(src, "hidden", "hidden dimensions are the layers of a deep memory: declare its weights as "
                        "several states")
    shapes, seen = {}, set()
    for x, dims in shapes_raw.items():
        _ident(src, "state", x)
        if not isinstance(dims, list) or len(dims) != 2 or dims[0] == dims[1]:
            raise SpecError(src, f"state.{x}", f"with hidden dimensions every state is a matrix of two different "
                            f"dimension names, got {dims!r}")
        for dname in dims:
            _ident(src, f"state.{x}", dname)
        shapes[x] = tuple(dims)
        seen |= set(dims)
    missing = [h for h in hidden if h not in seen]
    if missing:
        raise SpecError(src, f"hidden.{missing[0]}", "no state uses this dimension")
    visible = sorted(seen - set(hidden))
    rows = {sh[0] for sh in shapes.values()} - set(hidden)
    cols = {sh[1] for sh in shapes.values()} - set(hidden)
    if len(visible) != 2 or len(rows) != 1 or len(cols) != 1 or rows == cols:
        raise SpecError(src, "state", f"besides the hidden dimensions ({', '.join(hidden)}) the states must use two "
                        f"dimensions, the value dimension as a row and the key dimension as a column; got "
                        f"{', '.join(f'{x}: [{chr(44).join(sh)}]' for x, sh in shapes.items())}")
    dims = (rows.pop(), cols.pop())
    names, _ = _states(src, {x: list(dims) for x in shapes})     # the name rules
    return names, dims, tuple(shapes[x] for x in shapes), tuple(inits) if any(i is not None for i in inits) else ()


def hidden_dims(src, value) -> tuple:
    """``hidden: {h: 32}`` or ``{h: 2*m}``: ((name, factor, base or None), ...)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not value:
        raise SpecError(src, "hidden", f"expected a mapping of dimension name: size (an integer, or like 2*m), got {value!r}")
    out = []
    for name, size in value.items():
        key = f"hidden.{name}"
        _ident(src, key, name)
        m = re.fullmatch(r"\s*(\d{1,3})\s*\*\s*([A-Za-z]\w*)\s*", size) if isinstance(size, str) else None
        if isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 4096:
            out.append((name, size, None))
        elif m and 1 <= int(m.group(1)) <= 64:
            out.append((name, int(m.group(1)), m.group(2)))
        else:
            raise SpecError(src, key, f"expected a size: an integer 1..4096, or N*dim with N in 1..64 (like 2*m), got {size!r}")
    return tuple(out)


def _state_init(src, key, value):
    """A state's ``init``: ``zeros`` (None) or ``{identity: c}`` (the float c), c finite."""
    if value == "zeros":
        return None
    if isinstance(value, dict) and set(value) == {"identity"}:
        c = value["identity"]
        if isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c):
            return float(c)
        raise SpecError(src, key, f"identity takes a finite number, got {c!r}")
    raise SpecError(src, key, f"expected zeros or {{identity: c}}, got {value!r}")


def _with_shapes(src, raw, spec: Spec, shapes, inits, lets, hidden=()) -> Spec:
    """A spec with square states: the checks they need beyond ``_multi_state_spec``'s (the output
    and the [d, m] states' losses read a square state only as a metric: ``symbolic``), and the
    shapes and inits recorded."""
    from dataclasses import replace
    if not shapes and not inits:
        return spec
    square = [x for x, sh in zip(spec.states, shapes) if sh[0] == sh[1]] if shapes else []
    prevs = [n for x in square for n in (x, f"{x}_prev")]
    _refuse_reads(src, "output", spec.output, _let_closure(lets), prevs,
                  lambda x: f"the output reads the square state {x}; a square state is a metric, read only by "
                            "wsq(V, X) in a loss",
                  lambda x: f"the output reads the square state {x} (through a let); a square state is a metric")
    for x, upd in zip(spec.states, spec.updates):
        if x in square and upd != "implicit":
            raise SpecError(src, f"update.{x}" if isinstance(raw["update"], dict) else "update",
                            f"a square state ({x}) is updated implicitly (its loss is minimised in closed form); got {upd}")
    for h, _, base in hidden:
        if base is not None and base not in spec.dims:
            raise SpecError(src, f"hidden.{h}", f"a size N*dim names {spec.dims[0]} or {spec.dims[1]}, got {base!r}")
    return replace(spec, shapes=shapes, inits=inits, hidden=hidden)


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
    minibatch = 0
    if isinstance(raw.get("approximation"), dict) and "minibatch" in raw["approximation"]:
        implicit = [x for x, u in zip(states, updates) if u == "implicit"]
        _, minibatch = minibatch_approximation(src, raw["approximation"], "implicit" if implicit else "explicit")
    approximations = _per_state(src, "approximation", None if minibatch else raw.get("approximation"), states,
                                ("exact", "diagonal"), "exact")       # a mini-batch: each state's own step exact
    if "diagonal" in approximations:
        key = "approximation" if isinstance(raw.get("approximation"), str) else \
            f"approximation.{states[approximations.index('diagonal')]}"
        raise SpecError(src, key, "the diagonal approximation is not supported with several states (their "
                        "joint update is classified general or nonlinear, which has no diagonal); use exact")
    output = _output(src, raw, declared, through, prevs, "the new states")
    summary_of = lambda values: values[0] if len(set(values)) == 1 else ", ".join(f"{x}: {v}" for x, v in zip(states, values))  # noqa: E731
    return Spec(name, summary, states[-1], dims, inputs, params, tuple(lets),
                "; ".join(f"{x}: {t}" for x, t in zip(states, losses)), summary_of(updates),
                "minibatch" if minibatch else summary_of(approximations), output, source=src, raw=raw,
                states=tuple(states), objectives=tuple(losses), updates=updates, approximations=approximations,
                minibatch=minibatch)
