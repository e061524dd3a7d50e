"""Which generated Triton kernel runs a compiled objective, and how it is called.

``ssmcraft.kernels.dispatch`` asks :func:`select` for a family's ``specialise(obj, lay)``, which
makes the runner for one call signature (the family's ``prepare``); a runner is called as
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
Families are tried in a fixed order -- ``decode`` (one-token calls only: the fused kernel of
the update in element form), ``keydecay_chunk`` (decays that are scalar or vary over
the key dimension only, provably positive: GLA, RetNet, HGRN, linear attention; chunked, on
tensor cores), ``diagonal`` (every scalar/elementwise decay, e.g. Mamba's over ``(d, m)``),
``rank1_row``, ``rankr_row`` (several keys: the general generator, row-tiled) and ``general``,
then ``rank1_chunk`` (moved before ``rank1_row`` for a per-head
step size on the GPU, where the chunked rank-1 kernel is the fast one). A family whose module
does not exist yet, or whose ``supports(ir)`` gives a reason, is skipped; nothing falls back
silently: the name returned says what ran, and :func:`why_not` says why nothing did.
"""
from __future__ import annotations

import importlib

from ssmcraft.errors import SsmcraftError

FAMILIES = ("decode", "keydecay_chunk", "diagonal", "rank1_row", "rankr_row", "general", "rank1_chunk")


def _mode(inputs, prefer) -> tuple[str | None, str]:
    """("triton" | "interpret" | None, why not)."""
    tensors = [t for t in (inputs or {}).values() if hasattr(t, "device")]
    if not tensors:
        return None, "no input tensors"
    try:
        from ssmcraft.kernels.tuning import INTERPRET      # imports triton
    except ImportError as e:
        return None, f"triton is not importable ({e})"
    dev = tensors[0].device.type
    if any(t.device.type != dev for t in tensors):
        return None, "inputs are on different devices"
    if dev == "cuda":
        if prefer in ("auto", "triton"):
            return "triton", ""
        return None, f"prefer={prefer!r} does not select Triton for CUDA tensors"
    if dev == "cpu":
        if not INTERPRET:
            return None, "CPU tensors: Triton runs them only under TRITON_INTERPRET=1 with prefer='interpret'"
        if prefer != "interpret":
            return None, f"CPU tensors under TRITON_INTERPRET=1 run the interpreter only with prefer='interpret' (prefer={prefer!r})"
        return "interpret", ""
    return None, f"no Triton backend for {dev} tensors"


def _order(ir, mode) -> list[str]:
    order = list(FAMILIES)
    if mode == "triton" and ir.kind == "rank1" and ir.is_per_head_step():
        order.remove("rank1_chunk")
        order.insert(order.index("rank1_row"), "rank1_chunk")
    return order


def _load(family: str):
    """(module, None) or (None, why it is unavailable)."""
    name = f"ssmcraft.kernels.{family}"
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as e:
        if e.name == name:
            return None, "not implemented yet"
        return None, f"import failed: {e}"
    except ImportError as e:
        return None, f"import failed: {e}"


def _candidates(obj, mode, inputs=None):
    """[(family, module, reason)] in the order they are tried (reason None = runs it).

    Every family defines ``supports(ir) -> reason or None`` and
    ``prepare(obj, lay) -> fn(inputs, params, initial_state, output_final_state)``: a runner
    specialised to one call signature (``lay`` from ``reference.validate`` carries its sizes and
    dtypes), which ``dispatch`` keeps and calls without further checks. A family may also define
    ``supports_inputs(ir, inputs, mode)`` to refuse shapes it is known to fail on (a reason
    string), so that the next family runs them, by name.
    """
    out = []
    for fam in _order(obj.ir, mode):
        mod, reason = _load(fam)
        if mod is not None:
            try:
                reason = mod.supports(obj.ir) if hasattr(mod, "prepare") else \
                    "no prepare(obj, lay) (the family contract)"
                if reason is None and inputs is not None and hasattr(mod, "supports_inputs"):
                    reason = mod.supports_inputs(obj.ir, inputs, mode)
            except Exception as e:  # a family that cannot even inspect the IR does not run it
                reason = f"supports() failed: {e}"
        out.append((fam, mod, reason))
    return out


def _runner(fam: str, mod, mode: str):
    """``specialise(obj, lay) -> runner`` for one family (``lay`` from ``reference.validate``);
    ``specialise.backend`` names the family as it will run."""
    kernel = getattr(mod, "BACKEND_NAME", fam.replace("_", "-"))
    name = f"{'triton' if mode == 'triton' else 'triton-interpret'}:{kernel}"

    def specialise(obj, lay):
        """A runner for one call signature: ``lay`` (``reference.validate``) has its sizes."""
        fn = mod.prepare(obj, lay)
        slots_path = getattr(fn, "slots_path", None)       # how computed slots are made (slots.computed_path)
        full = f"{name}+{slots_path}" if slots_path else name

        def fast(obj, inputs, params, initial_state, output_final_state):
            y, S = fn(inputs, params, initial_state, output_final_state)
            return y, (S if output_final_state else None), full
        fast.backend = full
        return fast

    specialise.backend = name
    return specialise


def validated_call(prepare, obj, inputs, params, initial_state, output_final_state):
    """One call of a family outside ``dispatch`` (tests, benchmarks): ``reference.validate`` the
    tensors (on meta tensors: no copies), then run ``prepare(obj, lay)``'s runner on them as given.
    Returns what the runner does: (y [B, T, H, d], S_T [B, H, d, m] fp32 or None)."""
    from ssmcraft.kernels.reference import validate
    lay = validate(obj.ir, obj.spec, inputs, params, initial_state)
    return prepare(obj, lay)(inputs, params, initial_state, output_final_state)


def select(obj, inputs, prefer):
    """``specialise(obj, lay) -> runner`` (``_runner``) of the family that runs ``obj`` on these
    inputs, or None when no Triton kernel can run them."""
    mode, _ = _mode(inputs, prefer)
    if mode is None:
        return None
    for fam, mod, reason in _candidates(obj, mode, inputs):
        if reason is None:
            return _runner(fam, mod, mode)
    return None


def why_not(obj, inputs) -> str:
    """Why :func:`select` finds no kernel (for error messages)."""
    mode, reason = _mode(inputs, obj.prefer)
    if mode is None:
        return reason
    parts = [f"{fam}: {reason}" for fam, _, reason in _candidates(obj, mode, inputs) if reason is not None]
    return f"no kernel family runs {obj.ir.kind} objective {obj.name!r} (" + "; ".join(parts) + ")"


def kernel_source(obj) -> tuple[str, list[tuple[str, str]]]:
    """(family, [(what, text)]): the family that runs ``obj`` on CUDA tensors of a sequence
    (one-token decode aside) and the Triton source generated for ``obj``, as the GPU compiles it.
    A family generated per objective (diagonal, general) gives its kernels; a hand-written one
    (specialised by constexpr modes) gives the generated prologue of its computed slots, if any
    (``slots.computed_path``), or, where the eager coefficients compute them, ``("note", why)``.
    ``SsmcraftError`` with every family's reason when none runs it."""
    parts = []
    for fam, mod, reason in _candidates(obj, "triton"):
        if fam == "decode":
            continue
        if reason is not None:
            parts.append(f"{fam}: {reason}")
            continue
        generated = getattr(mod, "generated_source", None)
        if generated is not None:
            return fam, [("kernels", generated(obj.ir))]
        from ssmcraft.kernels import slots
        path = slots.computed_path(obj, slots.bindings(obj.ir))
        if path.source is not None:
            return fam, [("prologue of the computed slots", path.source)]
        if path.why is not None:
            return fam, [("note", f"{path.why}: the generated eager coefficients compute the computed slots")]
        return fam, []
    raise SsmcraftError(f"{obj.name}: no Triton kernel family runs it on CUDA tensors (" + "; ".join(parts) + ")")


def families(obj, inputs=None, prefer="auto") -> list[tuple[str, str | None]]:
    """Each family and why it would not run ``obj`` (None if it would), in the order tried."""
    mode, _ = _mode(inputs, prefer) if inputs else ("triton", "")
    return [(fam, reason) for fam, _, reason in _candidates(obj, mode or "triton")]
