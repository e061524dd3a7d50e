"""The kernel-family interface: what a family runs, how it runs it, how it is exported.

A kernel family is one folder ``ssmcraft/ops/<name>/``: its Triton kernels, the host code that
launches them, and its readable reference twin (``naive.py``). Its ``__init__.py`` declares one
:class:`KernelFamily`; ``ssmcraft.ops.registry.FAMILIES`` lists every family in the order
the runtime tries them (``ssmcraft.runtime.select``), and the exporter, ``ssmcraft bench`` and the
tests read the same list.

The contract, with ``ir`` an ``UpdateIR`` (``ssmcraft.compiler.ir``), ``lay`` the checked call
layout (``ssmcraft.ops.common.reference.validate``) and ``mode`` ``"triton"`` (CUDA) or
``"interpret"`` (CPU tensors under ``TRITON_INTERPRET=1``):

- what it supports: ``supports(ir) -> reason | None`` (structure: decided once per IR);
  ``supports_inputs(ir, inputs, mode)`` and ``supports_sizes(ir, {dim: size}, mode)`` refuse
  shapes the family is known to fail on, so the next family runs them, by name;
- how it runs: ``prepare(obj, lay) -> runner(inputs, params, initial_state, output_final_state)
  -> (y [B, T, H, d], S_T [B, H, d, m] fp32 or None)``, a runner specialised to one call
  signature; a runner may carry ``slots_path`` (how its computed slots are made,
  ``ssmcraft.ops.common.slots.computed_path``), which the backend name reports;
- how it is exported: ``forward(obj, lay, co, output_final_state)``, what the exported module
  calls on a reference layout (None: the family cannot be exported). The exporter bundles
  ``module`` less ``export_exclude`` with the ssmcraft modules it imports; a family that
  generates its kernels per objective gives ``generated_source(ir) -> str`` (what ``ssmcraft
  derive --kernel`` prints; None where hand-written kernels run ``ir``) and ``export_tail(obj, sizes) -> (title, text)``, the generated
  kernels and what stands in for the excluded definitions, pasted after the module;
  a family whose ``forward`` reads the roles of the inputs off the IR's sympy expressions (a ``match(ir)``
  of plain data) records them at export instead (``recorded_match``);
- its name in ``obj.backend``: ``"triton:<backend>"`` (``"triton-interpret:<backend>"`` under
  the interpreter);
- ``module``: the module holding its kernels, whose ``POISON`` flag (where it has one) makes
  every output buffer start as NaN, so the tests see a value the kernels never wrote;
- ``varlen``: why the family does not run packed calls (``cu_seqlens``, ``ssmcraft.ops.common.varlen``),
  or None where its runner takes ``cu_seqlens=`` (inputs ``[1, total_T, H, n]``, states ``[N, H, d, m]``)
  and runs every sequence natively; ``ssmcraft.runtime.packed`` picks the first family that does;
- ``one_token``: the family runs one-token calls only (decode), never a sequence;
- ``ahead_on_gpu``: ``(family name, when(ir))``: on CUDA, this family is tried before the named
  one for the IRs where ``when`` holds (the chunked rank-1 kernel is the fast one for a per-head
  step size), else in its place in the list.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

Reason = Optional[str]


@dataclass
class KernelFamily:
    name: str
    backend: str
    module: ModuleType
    supports: Callable[..., Reason]
    prepare: Callable
    forward: Callable | None = None
    supports_inputs: Callable[..., Reason] | None = None
    supports_sizes: Callable[..., Reason] | None = None
    generated_source: Callable[..., str | None] | None = None
    export_exclude: frozenset = frozenset({"prepare"})
    export_tail: Callable[..., tuple[str, str]] | None = None
    one_token: bool = False
    varlen: Reason = "no packed-sequence (cu_seqlens) kernels"
    ahead_on_gpu: tuple[str, Callable[..., bool]] | None = None

    @property
    def poison(self) -> bool | None:
        """The module's ``POISON`` flag (None where the family has none)."""
        return getattr(self.module, "POISON", None)

    @property
    def path(self) -> str:
        """Where it lives, for messages: ``ssmcraft/ops/<name>/``."""
        return f"ssmcraft/ops/{self.name}/"

    def reason(self, ir, inputs=None, mode: str = "triton") -> Reason:
        """Why this family does not run ``ir`` (on ``inputs`` in ``mode`` when given), or None.
        A family that cannot even inspect the IR does not run it."""
        try:
            why = self.supports(ir)
            if why is None and inputs is not None and self.supports_inputs is not None:
                why = self.supports_inputs(ir, inputs, mode)
        except Exception as e:  # noqa: BLE001 - its message becomes the reason, by family name
            why = f"supports() failed: {e}"
        return why

    def size_reason(self, ir, sizes: dict, mode: str = "triton") -> Reason:
        """Why this family does not run ``ir`` at per-head sizes ``{dim: size}``, or None."""
        if self.supports_sizes is None:
            return None
        try:
            return self.supports_sizes(ir, sizes, mode)
        except Exception as e:  # noqa: BLE001 - as reason()
            return f"supports_sizes() failed: {e}"


def match_reason(ir, match: Callable[..., dict]) -> Reason:
    """A family's ``supports`` where ``match(ir)`` reads its roles off the IR: None where it does, else
    the ValueError's reason, named by the objective."""
    try:
        match(ir)
    except ValueError as e:
        return f"{ir.spec_name}: {e}"
    return None


def probed_match(ir, key: str, structure: Callable[..., dict], probe: Callable[..., dict | str]) -> dict:
    """A family's ``match``: ``structure(ir)`` (the roles read off the IR, ValueError saying what does not
    fit), then ``probe(ir, roles)`` (the roles its numerical check confirms, or why none does), once per
    IR (``ir.memo(key)``). Returns the roles; ValueError says why the family does not run ``ir``."""
    def check():
        try:
            return probe(ir, structure(ir))
        except ValueError as e:
            return str(e)
    out = ir.memo(key, check)
    if isinstance(out, str):
        raise ValueError(out)
    return dict(out)


def recorded_match(match: Callable[..., dict], what: str) -> Callable[..., tuple[str, str]]:
    """An ``export_tail`` for a family whose ``forward`` calls ``match(ir) -> dict`` (plain data: which
    input fills which role, read off the IR with sympy, which an exported module does not carry):
    the tail defines ``match`` returning what ``match`` gave for the exported objective's IR,
    recorded with that IR's content hash; an IR of another hash is refused (ValueError, as
    ``match`` refuses an IR it does not fit). The family's ``export_exclude`` leaves out ``match``
    and everything that reads sympy."""
    def export_tail(obj, sizes: dict) -> tuple[str, str]:
        found, digest = match(obj.ir), obj.ir.content_hash()
        text = repr(found)
        if ast.literal_eval(text) != found:
            raise ValueError(f"{obj.ir.spec_name}: {what}: match() gave {text}, not plain data")
        tail = f'''_MATCHED = {text}
_MATCHED_IR = {digest!r}


def match(ir) -> dict:
    if ir.content_hash() != _MATCHED_IR:
        raise ValueError(f"{what} were exported for IR {{_MATCHED_IR}}, not {{ir.content_hash()}}")
    return dict(_MATCHED)
'''
        return f"the roles {what} read off the IR of {obj.ir.spec_name!r} (IR {digest}), recorded at export", tail
    return export_tail
