"""The derived update's intermediate representation (IR): what code generation reads.

An ``UpdateIR`` is plain data: per-token reductions and coefficients as sympy
expressions over the spec's symbols, the structure class, and which coefficients fill
the slots of that class's recurrence:

- ``scalar_decay`` / ``diagonal_decay``:  ``S_t = a . S_prev + B``
- ``rank1``: ``S_t = a . S_prev - c . (S_prev u) v^T + B``  (c per row, or per head)
- ``rankr``: ``S_t = a . S_prev - sum_{r,l} c_rl . (S_prev u_l) v_r^T + B`` with L, R <= 4
  column vectors (slots ``u0..u{L-1}``, ``v0..v{R-1}``) and row factors ``c{r}{l}`` (per row
  or per head; a slot absent where the factor is 0): several keys or regression terms,
  Woodbury updates; its diagonal approximation is a ``diagonal_decay``. Its input term is
  ``B = sum_r p_r v_r^T`` (slots ``p{r}``, row factors over the same ``v_r``) when it lies in
  their span (it does for regressions on the keys), else a ``B`` slot
- ``general``: linear in S_prev but none of the above; ``S_t`` given element-wise
- ``nonlinear``: an explicit step on a non-quadratic loss; ``S_t`` given element-wise
- several states (``states``, ``state_updates``): one element expression per state in the
  previous states, kind ``general`` (jointly linear) or ``nonlinear``; readout element-wise
and in every class the readout ``y = oc . (S_t oq) + oh`` (or element-wise for general).
``B = p q^T`` when it factorises (it does for every library objective).
Element layouts: a coefficient's ``dims`` are the state dimensions it varies over.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import sympy

from ssmcraft.compiler.slot_names import SlotNames

KINDS = ("scalar_decay", "diagonal_decay", "rank1", "rankr", "general", "nonlinear")


@dataclass(frozen=True)
class Coefficient:
    name: str
    expr: sympy.Expr
    dims: tuple[str, ...]


@dataclass(frozen=True)
class ReductionIR:
    name: str
    body: sympy.Expr
    over: str
    dims: tuple[str, ...]
    metric: str | None = None                   # a row vector times this square matrix (its name)


@dataclass(frozen=True)
class UpdateIR(SlotNames):
    spec_name: str
    source: str
    dims: tuple[str, str]
    state: str                                  # name of the state symbol (new state in readout)
    inputs: dict                                # name -> dims
    params: dict                                # name -> dims
    kind: str
    update: str                                 # implicit | explicit | newton
    approximation: str                          # exact | diagonal
    reductions: tuple = ()                      # ReductionIR, input-only, dependency order
    coefficients: tuple = ()                    # Coefficient, dependency order (CSE temps first)
    slots: dict = field(default_factory=dict)   # slot -> coefficient name (or None)
    state_reductions: tuple = ()                # general/nonlinear: reductions over S_prev / S
    state_update: sympy.Expr | None = None      # general/nonlinear: element of S_t (symbol S_prev)
    readout: sympy.Expr | None = None           # general: element of y (symbol state)
    readout_reductions: tuple = ()
    states: tuple = ()                          # several states: names, in update order (else empty)
    state_updates: tuple = ()                   # several states: element of each X_t (symbols X_prev)
    # square states (metrics, ``ssmcraft.compiler.metric``), empty without: name -> (r, c) of every
    # state, name -> c of an identity init, and per square state (name, alpha, ((c, u, v), ...)) of
    # ``X_t = alpha X_prev + sum c u v^T``, carried by its inverse ``_inv_X`` (its entry in
    # ``state_updates`` is that symbol)
    state_shapes: dict = field(default_factory=dict)
    inits: dict = field(default_factory=dict)
    inverses: tuple = ()
    # ``approximation: {minibatch: C}`` (``ssmcraft.compiler.minibatch``): C, and the elementwise decay
    # ``a`` of ``state_update = a . S_prev + G(_S_c)`` when it has that form (None: it does not)
    minibatch: int = 0
    minibatch_decay: sympy.Expr | None = None
    # hidden dimensions (a deep memory's widths): name -> (factor, base dim or None), size factor *
    # size(base); the generated code lays tensors out over ``axes()``
    hidden: dict = field(default_factory=dict)
    # reductions the structure stage split into smaller ones (``ssmcraft.compiler.factor.Factoring``:
    # ``sum_over body = expr``), for display; the coefficients read only the smaller ones
    factored: tuple = ()
    # several states whose joint update is one rank-1 step of an extrapolated state
    # (``ssmcraft.compiler.blockrank1``): ``coefficients`` and ``slots`` hold the form's
    block: bool = False

    @property
    def state_names(self) -> tuple:
        return self.states or (self.state,)

    # -- views ---------------------------------------------------------------------------
    def coefficient(self, slot: str) -> Coefficient | None:
        name = self.slots.get(slot)
        return next((c for c in self.coefficients if c.name == name), None)

    def is_per_head_step(self) -> bool:
        c = self.coefficient("c")
        if self.kind == "rankr":
            cs = [self.coefficient(slot) for slot in self.erase_slots()]
            return bool(cs) and all(not c.dims for c in cs)
        return c is not None and not c.dims

    def to_json(self) -> dict:
        """A JSON-serialisable form of the IR (``ssmcraft derive --json``)."""
        s = sympy.sstr
        return self.to_json_states({
            "spec": self.spec_name, "source": self.source, "dims": list(self.dims), "state": self.state,
            "kind": self.kind, "update": self.update, "approximation": self.approximation,
            "inputs": {k: list(v) for k, v in self.inputs.items()},
            "params": {k: list(v) for k, v in self.params.items()},
            "reductions": [{"name": r.name, "over": r.over, "dims": list(r.dims), "body": s(r.body)} for r in self.reductions],
            "coefficients": [{"name": c.name, "dims": list(c.dims), "expr": s(c.expr)} for c in self.coefficients],
            "slots": dict(self.slots),
            "state_reductions": [{"name": r.name, "over": r.over, "dims": list(r.dims), "body": s(r.body)} for r in self.state_reductions],
            "state_update": None if self.state_update is None else s(self.state_update),
            "readout_reductions": [{"name": r.name, "over": r.over, "dims": list(r.dims), "body": s(r.body)} for r in self.readout_reductions],
            "readout": None if self.readout is None else s(self.readout),
        })

    def to_json_states(self, out: dict) -> dict:
        """Add the several-state fields and the factored reductions (absent when empty, so the
        hashes of IRs without them stay)."""
        if self.states:
            out["states"] = list(self.states)
            out["state_updates"] = {x: sympy.sstr(e) for x, e in zip(self.states, self.state_updates)}
        if self.block:
            out["block_rank1"] = True
        if self.factored:
            out["factored"] = [{"over": f.over, "body": sympy.sstr(f.body), "as": sympy.sstr(f.expr)}
                               for f in self.factored]
        if self.minibatch:
            out["minibatch"] = self.minibatch
            out["minibatch_decay"] = None if self.minibatch_decay is None else sympy.sstr(self.minibatch_decay)
            if self.states:      # several states: their anchors' names, in order
                out["minibatch_anchors"] = [f"_{x}_c" for x in self.states]
        if self.state_shapes:
            s = sympy.sstr
            out["state_shapes"] = {x: list(v) for x, v in self.state_shapes.items()}
            if self.hidden:
                out["hidden"] = {h: list(v) for h, v in self.hidden.items()}
            out["inits"] = {x: {"identity": c} for x, c in self.inits.items()}
            out["inverses"] = [{"state": x, "alpha": s(a), "terms": [[s(c), s(u), s(v)] for c, u, v in terms]}
                               for x, a, terms in self.inverses]
            for group in ("state_reductions", "readout_reductions", "reductions"):
                for r, j in zip(getattr(self, group), out[group]):
                    if r.metric is not None:
                        j["metric"] = r.metric
        return out

    def axes(self) -> tuple[str, ...]:
        """Every dimension, in the generated code's axis order: ``dims`` then the hidden ones."""
        return (*self.dims, *self.hidden)

    def shape_of(self, state: str) -> tuple[str, str]:
        """A state's shape (dimension names)."""
        return tuple(self.state_shapes.get(state, self.dims))

    def content_hash(self) -> str:
        """A hash of the IR's content (``to_json``), computed once per IR object (``memo``):
        printing the sympy expressions is far too slow to repeat per call, and the kernel
        caches are keyed by it."""
        return self.memo("content_hash", lambda: hashlib.sha256(
            json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16])

    def expanded_coefficients(self) -> dict:
        """Coefficient name -> its expression in leaves and reductions only (the earlier
        coefficients it uses substituted), in the IR's order; a fresh dict of the values
        computed once per IR object."""
        def expand():
            out: dict = {}
            for c in self.coefficients:
                out[c.name] = sympy.sympify(c.expr).xreplace({sympy.Symbol(n, real=True): e for n, e in out.items()})
            return out
        return dict(self.memo("expanded_coefficients", expand))

    def memo(self, key: str, make):
        """``make()``, computed once per IR object and kept on it (an IR is immutable), so that
        what is derived from an IR lives exactly as long as the IR: no cache keyed by ``id``
        keeps IRs alive. Not part of the IR's fields (equality, ``repr``, pickles)."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}
