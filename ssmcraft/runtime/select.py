"""Which kernel family runs a compiled objective, and how it is called.

``ssmcraft.runtime.dispatch`` asks :func:`select` (through ``CompiledObjective.triton_runner``)
for a family's ``specialise(obj, lay)``, which makes the runner for one call signature (the family's ``prepare``); a runner is called as
``runner(obj, inputs, params, initial_state, output_final_state) -> (y, S_T, backend)`` with
the reference API's shapes (``y [B, T, H, d]``, ``S_T [B, H, d, m]``) and ``backend`` naming
what ran, e.g. ``"triton:diagonal-chunked"`` or ``"triton-interpret:rank1-row"``; a family whose
slots include computed ones adds how they were made (``slots.computed_path``), e.g.
``"triton:rank1-row+prologue"`` for exact Longhorn (one fused Triton prologue kernel).

When Triton runs:
  * CUDA tensors and ``obj.prefer`` in ("auto", "triton");
  * CPU tensors when ``TRITON_INTERPRET=1`` is set (read once, when the kernels are imported:
    ``tuning.INTERPRET``, which sizes their tiles and warps too) and ``obj.prefer == "interpret"``
    (how CI tests the kernels).
Families are tried in the order of ``ssmcraft.ops.registry`` (``registry.order``: one-token
``decode`` first; ``rank1_chunk`` declares itself ahead of ``rank1_row`` on CUDA for a per-head
step). A family whose ``supports`` gives a reason is skipped; nothing falls back silently: the
name returned says what ran, and :func:`why_not` says why nothing did.
"""
from __future__ import annotations

from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common.tuning import INTERPRET
from ssmcraft.ops.registry import order
from ssmcraft.runtime.dispatch import backend_name, triton_mode


def _mode(inputs, prefer) -> tuple[str | None, str]:
    """("triton" | "interpret" | None, why not): ``dispatch.triton_mode`` with this process's
    ``TRITON_INTERPRET`` (read when the kernels were imported)."""
    return triton_mode(inputs, prefer, INTERPRET)


def _candidates(obj, mode, inputs=None):
    """[(family, reason)] in the order they are tried (reason None = runs it): ``supports(ir)``
    and, given ``inputs``, ``supports_inputs`` (``KernelFamily.reason``)."""
    return [(fam, fam.reason(obj.ir, inputs, mode)) for fam in order(obj.ir, mode)]


def _runner(fam, mode: str):
    """``specialise(obj, lay) -> runner`` for one family (``lay`` from ``reference.validate``);
    ``specialise.backend`` names the family as it will run."""
    name = backend_name(mode, fam.backend)

    def specialise(obj, lay):
        """A runner for one call signature: ``lay`` (``reference.validate``) has its sizes."""
        fn = fam.prepare(obj, lay)
        slots_path = getattr(fn, "slots_path", None)       # how computed slots are made (slots.computed_path)
        full = f"{name}+{slots_path}" if slots_path else name

        def fast(obj, inputs, params, initial_state, output_final_state, **packed):
            y, S = fn(inputs, params, initial_state, output_final_state, **packed)   # packed: cu_seqlens=
            return y, (S if output_final_state else None), full
        fast.backend = full
        return fast

    specialise.backend = name
    return specialise


def validated_call(prepare, obj, inputs, params, initial_state, output_final_state):
    """One call of a family outside ``dispatch`` (tests, benchmarks): ``reference.validate`` the
    tensors (on meta tensors: no copies), then run ``prepare(obj, lay)``'s runner on them as given.
    Returns what the runner does: (y [B, T, H, d], S_T [B, H, d, m] fp32 or None)."""
    from ssmcraft.ops.common.reference import validate
    lay = validate(obj.ir, obj.spec, inputs, params, initial_state)
    return prepare(obj, lay)(inputs, params, initial_state, output_final_state)


def select(obj, inputs, prefer):
    """``specialise(obj, lay) -> runner`` (``_runner``) of the family that runs ``obj`` on these
    inputs, or None when no Triton kernel can run them."""
    mode, _ = _mode(inputs, prefer)
    if mode is None:
        return None
    for fam, reason in _candidates(obj, mode, inputs):
        if reason is None:
            return _runner(fam, mode)
    return None


def select_packed(obj, inputs, prefer):
    """(``specialise(obj, lay) -> runner`` of the first family that runs ``obj`` on these packed inputs
    natively (``KernelFamily.varlen`` None), or None; why none does). Its runner takes
    ``cu_seqlens=`` (``ssmcraft.runtime.packed``)."""
    mode, why = _mode(inputs, prefer)
    if mode is None:
        return None, why
    runs = []
    for fam, reason in _candidates(obj, mode, inputs):
        if reason is None and not fam.one_token:
            if fam.varlen is None:
                return _runner(fam, mode), ""
            runs.append(f"{fam.name}: {fam.varlen}")
    if not runs:
        return None, why_not(obj, inputs)
    return None, f"{'; '.join(runs)}; no later family runs it"


def why_not(obj, inputs) -> str:
    """Why :func:`select` finds no kernel (for error messages)."""
    mode, reason = _mode(inputs, obj.prefer)
    if mode is None:
        return reason
    parts = [f"{fam.name}: {reason}" for fam, reason in _candidates(obj, mode, inputs) if reason is not None]
    return f"no kernel family runs {obj.ir.kind} objective {obj.name!r} (" + "; ".join(parts) + ")"


def kernel_source(obj) -> tuple[str, list[tuple[str, str]]]:
    """(family, [(what, text)]): the family that runs ``obj`` on CUDA tensors of a sequence
    (one-token decode aside) and the Triton source generated for ``obj``, as the GPU compiles it.
    A family generated per objective (diagonal, general) gives its kernels; a hand-written one
    (specialised by constexpr modes; or one whose ``generated_source`` is None for ``obj``, as
    rankr_row on its own kernels) gives the generated prologue of its computed slots, if any
    (``slots.computed_path``), or, where the eager coefficients compute them, ``("note", why)``.
    ``SsmcraftError`` with every family's reason when none runs it."""
    parts = []
    for fam, reason in _candidates(obj, "triton"):
        if fam.one_token:
            continue
        if reason is not None:
            parts.append(f"{fam.name}: {reason}")
            continue
        source = fam.generated_source(obj.ir) if fam.generated_source is not None else None
        if source is not None:
            return fam.name, [("kernels", source)]
        from ssmcraft.ops.common import slots
        path = slots.computed_path(obj, slots.bindings(obj.ir))
        if path.source is not None:
            return fam.name, [("prologue of the computed slots", path.source)]
        if path.why is not None:
            return fam.name, [("note", f"{path.why}: the generated eager coefficients compute the computed slots")]
        return fam.name, []
    raise SsmcraftError(f"{obj.name}: no Triton kernel family runs it on CUDA tensors (" + "; ".join(parts) + ")")


def families(obj, inputs=None, prefer="auto") -> list[tuple[str, str | None]]:
    """Each family and why it would not run ``obj`` (None if it would), in the order tried."""
    mode, _ = _mode(inputs, prefer) if inputs else ("triton", "")
    return [(fam.name, reason) for fam, reason in _candidates(obj, mode or "triton")]
