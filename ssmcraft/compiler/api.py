"""``ssmcraft.compile``: spec -> compiled objective (the Python API of DESIGN.md).

The stages are pure functions (``load_spec``, ``symbolic_objective``, ``build_ir``,
``reference_source``); ``compile`` chains them, loads the generated reference module
from the content-addressed cache and wraps it with the calls researchers use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import sympy

from ssmcraft.compiler import cache
from ssmcraft.compiler.codegen import coefficient_lines, reference_source, update_formula
from ssmcraft.compiler.ir import Coefficient, UpdateIR
from ssmcraft.compiler.spec import Spec, load_spec
from ssmcraft.compiler.structure import build_ir
from ssmcraft.compiler.symbolic import SymbolicObjective, symbolic_objective
from ssmcraft.errors import SsmcraftError


def generate_reference(ir: UpdateIR):
    """Write (or find) and import the reference module of ``ir``."""
    header = f"spec: {ir.spec_name} ({ir.source}); IR {ir.content_hash()}"
    source = reference_source(ir, header)
    key = cache.key_for("reference", source)
    return cache.load_generated(f"ref_{ir.spec_name}", key, source), source


@dataclass
class CompiledObjective:
    """A derived recurrence with its reference loop and fastest available path."""
    spec: Spec
    ir: UpdateIR
    symbolic: SymbolicObjective | None
    module: object = field(repr=False)
    source: str = field(repr=False)
    backend: str | None = None          # which path the last __call__ ran
    prefer: str = "auto"                # auto | reference | torch | triton | interpret
    _paths: dict = field(default_factory=dict, repr=False, compare=False)   # call signature -> runner

    # -- description --------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def structure_kind(self) -> str:
        return self.ir.kind

    @property
    def update(self) -> str:
        """The derived update in math notation, with its coefficients."""
        return "\n".join([update_formula(self.ir), "where", *("  " + line for line in coefficient_lines(self.ir))])

    def state_shape(self, B: int, H: int, d: int, m: int) -> tuple[int, int, int, int]:
        """The shape of the (last declared) state, ``[B, H, d, m]``; every state: ``state_shapes``."""
        return (B, H, d, m)

    def state_shapes(self, B: int, H: int, d: int, m: int) -> dict:
        """Every state's shape, in declaration order: ``[B, H, d, m]``, or ``[B, H, m, m]`` for a
        square state (``state: {R: {shape: [m, m], ...}}``)."""
        from ssmcraft.kernels.reference import state_shapes
        return state_shapes(self.ir, B, H, d, m)

    def state_elements(self, H: int, d: int, m: int) -> int:
        """Elements of recurrent state one sequence carries, every state counted."""
        return sum(math.prod(shape) for shape in self.state_shapes(1, H, d, m).values())

    def initial_states(self, B: int, H: int, d: int, m: int, device=None, dtype=None):
        """The initial state(s) a call with no ``initial_state`` starts from: zero, or c times the
        identity where the spec declares ``init: {identity: c}``; a tuple with several states."""
        from ssmcraft.kernels.reference import initial_states
        return initial_states(self.ir, B, H, d, m, device, dtype)

    def __repr__(self):
        return f"CompiledObjective({self.spec.name!r}, kind={self.ir.kind!r}, backend={self.backend!r})"

    # -- running ----------------------------------------------------------------------
    def _layout(self, inputs, params, initial_state):
        from ssmcraft.kernels.reference import layout
        return layout(self.ir, self.spec, inputs, params, initial_state)

    def _finish(self, lay, y, S, output_final_state):
        return y.to(lay.out_dtype), (S if output_final_state else None)

    def reference(self, inputs: Mapping, params: Mapping | None = None, initial_state=None,
                  output_final_state: bool = True):
        """The plain per-step loop. inputs [B,T,H,n] / [B,T,H]; returns (y [B,T,H,d], S_T [B,H,d,m]).
        With several states ``initial_state`` and ``S_T`` are tuples of [B,H,d,m], in declaration order."""
        from ssmcraft.kernels.reference import reference_loop
        lay = self._layout(inputs, params, initial_state)
        y, S, _ = reference_loop(self.module, lay)
        return self._finish(lay, y, S, output_final_state)

    def __call__(self, inputs: Mapping, params: Mapping | None = None, initial_state=None,
                 output_final_state: bool = True):
        """The fastest available path (``self.backend`` says which ran); same contract as ``reference``."""
        from ssmcraft.kernels.dispatch import run_fast
        y, S, backend = run_fast(self, inputs, params, initial_state, output_final_state)
        self.backend = backend
        return y, S

    def graphed(self, inputs: Mapping, params: Mapping | None = None, initial_state=None,
                output_final_state: bool = False, warmup: int = 3):
        """This call captured in CUDA graphs (``ssmcraft.kernels.graphs.GraphedCall``): a callable with
        ``obj``'s signature, ``g(inputs, params, initial_state, output_final_state) -> (y, S_T)``, that
        replays one graph for the forward and one for the backward.

        Fixed to these tensors' signature: names, shapes (inputs ``[B, T, H, n]`` / ``[B, T, H]``,
        params declared shape or ``[H, *shape]``, ``initial_state`` ``[B, H, d, m]`` or a tuple of them),
        dtypes, devices and ``requires_grad``, and ``output_final_state``; a call with another one
        raises ``SsmcraftError`` saying what differs. ``warmup`` eager iterations (forward and backward)
        run first, outside the capture, so that path choice, kernel compilation and autotuning happen
        there. Outputs and gradients equal ``obj()``'s; they live in static buffers that the next call
        overwrites. CPU tensors or no CUDA: ``SsmcraftError`` ("CUDA graphs need a CUDA device")."""
        from ssmcraft.kernels.graphs import GraphedCall
        return GraphedCall(self, inputs, params, initial_state, output_final_state, warmup=warmup)

    @property
    def traced_state(self) -> str:
        """The state ``trace`` follows (``kernels.reference.traced_state``); ``trace(state=...)`` picks another."""
        from ssmcraft.kernels.reference import traced_state
        return traced_state(self.ir)

    def trace(self, inputs: Mapping, params: Mapping | None = None, initial_state=None, every: int = 1,
              state: str | None = None):
        """States over time, [B, T // every, H, d, m] (every ``every``-th step), reference loop;
        with several states, of ``state`` (default ``traced_state``, the state the output reads)."""
        from ssmcraft.kernels.reference import empty_trace, reference_loop
        names = self.ir.state_names
        state = self.traced_state if state is None else state
        if state not in names:
            raise SsmcraftError(f"{self.name}: no state {state!r} to trace; states: {', '.join(names)}")
        lay = self._layout(inputs, params, initial_state)
        _, S, states = reference_loop(self.module, lay, every=max(1, int(every)), traced=names.index(state))
        if states is None:
            states = empty_trace(S, lay)
        return states

    def sliding_window(self, inputs: Mapping, params: Mapping | None = None, window: int = 256,
                       initial_state=None):
        """Outputs [B,T,H,d] read from the state of the last ``window`` tokens (decay classes only)."""
        from ssmcraft.kernels.reference import sliding_window
        lay = self._layout(inputs, params, initial_state)
        return sliding_window(self.module, self.ir, lay, int(window)).to(lay.out_dtype)

    def mitigated(self, retention: float = 1.0, insertion: float = 1.0) -> "CompiledObjective":
        """A copy whose decay is raised to ``retention`` (a -> a**retention; > 1 forgets faster)
        and whose input term is scaled by ``insertion`` (Stuffed Mamba's training-free fixes)."""
        return from_ir(self.spec, mitigate(self.ir, retention, insertion), self.symbolic)


def mitigate(ir: UpdateIR, retention: float, insertion: float) -> UpdateIR:
    """The IR with the decay coefficient raised to ``retention`` and the input term scaled."""
    if ir.kind not in ("scalar_decay", "diagonal_decay", "rank1", "rankr"):
        raise SsmcraftError(f"{ir.spec_name}: retention/insertion scaling needs a decay and an additive "
                            f"input term; this objective's update is {ir.kind}")
    coefs = {c.name: c for c in ir.coefficients}
    if retention != 1.0:
        a = coefs[ir.slots["a"]]
        if a.expr == 1:
            what = ("identity minus a rank-1 erase" if ir.kind == "rank1" else
                    "identity minus a low-rank erase" if ir.kind == "rankr" else
                    "the identity: the state sums every write and forgets nothing")
            raise SsmcraftError(f"{ir.spec_name}: this objective has no decay to scale (its transition is "
                                f"{what}); retention scaling applies to decays")
        r = sympy.Float(retention)
        scaled = a.expr ** r if a.expr.is_positive else sympy.sign(a.expr) * sympy.Abs(a.expr) ** r
        coefs[a.name] = Coefficient(a.name, scaled, a.dims)
    if insertion != 1.0:
        for slot in [ir.slots[s] for s in ir.input_slots()] or [ir.slots.get("p") or ir.slots["B"]]:
            c = coefs[slot]
            coefs[slot] = Coefficient(c.name, sympy.Float(insertion) * c.expr, c.dims)
    tag = f"_ret{retention:g}_ins{insertion:g}".replace(".", "p").replace("-", "m")
    return replace(ir, coefficients=tuple(coefs[c.name] for c in ir.coefficients), spec_name=ir.spec_name + tag)


def from_ir(spec: Spec, ir: UpdateIR, symbolic: SymbolicObjective | None = None) -> CompiledObjective:
    module, source = generate_reference(ir)
    return CompiledObjective(spec, ir, symbolic, module, source)


def compile(spec: str | Path | Mapping | Spec) -> CompiledObjective:  # noqa: A001 - the public name
    """Compile an objective spec (a path, a library name, YAML text, a mapping or a ``Spec``)."""
    s = spec if isinstance(spec, Spec) else load_spec(spec)
    so = symbolic_objective(s)
    ir = build_ir(so)
    return from_ir(s, ir, so)
