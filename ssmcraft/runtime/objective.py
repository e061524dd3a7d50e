"""``ssmcraft.compile``: spec -> a compiled objective, the object researchers call.

The compiler (``ssmcraft.compiler.api.derive``) makes a :class:`~ssmcraft.compiler.api.Derivation`
(spec, symbolic objective, IR, reference module); :class:`CompiledObjective` adds the calls: the
fastest available path (``ssmcraft.runtime.dispatch``), the reference loop, traces, CUDA graphs and
the mitigated copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ssmcraft.compiler.api import Derivation, derive, generate_reference, mitigate
from ssmcraft.compiler.codegen import coefficient_lines, update_formula
from ssmcraft.compiler.ir import UpdateIR
from ssmcraft.compiler.spec import Spec
from ssmcraft.compiler.symbolic import SymbolicObjective
from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common.reference import (empty_trace, initial_states, layout, reference_loop, sliding_window,
                                           state_shapes, traced_state)
from ssmcraft.runtime import dispatch, packed
from ssmcraft.runtime.graphs import GraphedCall


@dataclass
class CompiledObjective(Derivation):
    """A derived recurrence with its reference loop and fastest available path."""
    backend: str | None = None          # which path the last __call__ ran
    prefer: str = "auto"                # auto | reference | torch | triton | interpret
    _paths: dict = field(default_factory=dict, repr=False, compare=False)   # call signature -> runner

    # -- description --------------------------------------------------------------
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
        return state_shapes(self.ir, B, H, d, m)

    def state_elements(self, H: int, d: int, m: int) -> int:
        """Elements of recurrent state one sequence carries, every state counted."""
        return sum(math.prod(shape) for shape in self.state_shapes(1, H, d, m).values())

    def initial_states(self, B: int, H: int, d: int, m: int, device=None, dtype=None):
        """The initial state(s) a call with no ``initial_state`` starts from: zero, or c times the
        identity where the spec declares ``init: {identity: c}``; a tuple with several states."""
        return initial_states(self.ir, B, H, d, m, device, dtype)

    def __repr__(self):
        return f"CompiledObjective({self.spec.name!r}, kind={self.ir.kind!r}, backend={self.backend!r})"

    # -- running ----------------------------------------------------------------------
    def _layout(self, inputs, params, initial_state):
        return layout(self.ir, self.spec, inputs, params, initial_state)

    def _finish(self, lay, y, S, output_final_state):
        return y.to(lay.out_dtype), (S if output_final_state else None)

    def reference(self, inputs: Mapping, params: Mapping | None = None, initial_state=None,
                  output_final_state: bool = True, cu_seqlens=None):
        """The plain per-step loop. inputs [B,T,H,n] / [B,T,H]; returns (y [B,T,H,d], S_T [B,H,d,m]).
        With several states ``initial_state`` and ``S_T`` are tuples of [B,H,d,m], in declaration order.
        ``cu_seqlens`` (int32/int64 ``[N + 1]``): a packed call, inputs ``[1, total_T, H, n]`` holding N
        sequences end to end, states ``[N, H, d, m]`` (``ssmcraft.ops.common.varlen``)."""
        if cu_seqlens is not None:
            return packed.reference(self, inputs, params, initial_state, output_final_state, cu_seqlens)
        lay = self._layout(inputs, params, initial_state)
        y, S, _ = reference_loop(self.module, lay)
        return self._finish(lay, y, S, output_final_state)

    def __call__(self, inputs: Mapping, params: Mapping | None = None, initial_state=None,
                 output_final_state: bool = True, cu_seqlens=None):
        """The fastest available path (``self.backend`` says which ran); same contract as ``reference``,
        packed calls (``cu_seqlens``) included (``ssmcraft.runtime.packed`` says which path runs them)."""
        if cu_seqlens is not None:
            y, S, backend = packed.run_packed(self, inputs, params, initial_state, output_final_state, cu_seqlens)
        else:
            y, S, backend = dispatch.run_fast(self, inputs, params, initial_state, output_final_state)
        self.backend = backend
        return y, S

    def triton_runner(self, inputs: Mapping, params: Mapping | None = None, initial_state=None):
        """``specialise(obj, lay) -> runner`` of the kernel family that runs these inputs, or None
        (``ssmcraft.runtime.select``; None too where triton does not import)."""
        try:
            from ssmcraft.runtime import select
        except ImportError:
            return None
        return select.select(self, inputs, self.prefer)

    def why_not_triton(self, inputs: Mapping, params: Mapping | None = None, initial_state=None) -> str:
        """Why no kernel family runs these inputs (for error messages)."""
        try:
            from ssmcraft.runtime import select
        except ImportError as e:
            return f"triton backend unavailable: {e}"
        return select.why_not(self, inputs)

    def graphed(self, inputs: Mapping, params: Mapping | None = None, initial_state=None,
                output_final_state: bool = False, warmup: int = 3):
        """This call captured in CUDA graphs (``ssmcraft.runtime.graphs.GraphedCall``): a callable with
        ``obj``'s signature, ``g(inputs, params, initial_state, output_final_state) -> (y, S_T)``, that
        replays one graph for the forward and one for the backward.

        Fixed to these tensors' signature: names, shapes (inputs ``[B, T, H, n]`` / ``[B, T, H]``,
        params declared shape or ``[H, *shape]``, ``initial_state`` ``[B, H, d, m]`` or a tuple of them),
        dtypes, devices and ``requires_grad``, and ``output_final_state``; a call with another one
        raises ``SsmcraftError`` saying what differs. ``warmup`` eager iterations (forward and backward)
        run first, outside the capture, so that path choice, kernel compilation and autotuning happen
        there. Outputs and gradients equal ``obj()``'s; they live in static buffers that the next call
        overwrites. CPU tensors or no CUDA: ``SsmcraftError`` ("CUDA graphs need a CUDA device")."""
        return GraphedCall(self, inputs, params, initial_state, output_final_state, warmup=warmup)

    @property
    def traced_state(self) -> str:
        """The state ``trace`` follows (``kernels.reference.traced_state``); ``trace(state=...)`` picks another."""
        return traced_state(self.ir)

    def trace(self, inputs: Mapping, params: Mapping | None = None, initial_state=None, every: int = 1,
              state: str | None = None):
        """States over time, [B, T // every, H, d, m] (every ``every``-th step), reference loop;
        with several states, of ``state`` (default ``traced_state``, the state the output reads)."""
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
        lay = self._layout(inputs, params, initial_state)
        return sliding_window(self.module, self.ir, lay, int(window)).to(lay.out_dtype)

    def mitigated(self, retention: float = 1.0, insertion: float = 1.0) -> "CompiledObjective":
        """A copy whose decay is raised to ``retention`` (a -> a**retention; > 1 forgets faster)
        and whose input term is scaled by ``insertion`` (Stuffed Mamba's training-free fixes)."""
        return from_ir(self.spec, mitigate(self.ir, retention, insertion), self.symbolic)


def from_ir(spec: Spec, ir: UpdateIR, symbolic: SymbolicObjective | None = None) -> CompiledObjective:
    module, source = generate_reference(ir)
    return CompiledObjective(spec, ir, symbolic, module, source)


def compile(spec: str | Path | Mapping | Spec) -> CompiledObjective:  # noqa: A001 - the public name
    """Compile an objective spec (a path, a library name, YAML text, a mapping or a ``Spec``)."""
    d = derive(spec)
    return CompiledObjective(d.spec, d.ir, d.symbolic, d.module, d.source)
