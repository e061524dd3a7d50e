"""The slots of a structured update (the glossary below), and how they come from one call's tensors,
decided once per objective.

Slot glossary. A structured IR (``ssmcraft.compiler.ir``) names the coefficients that fill its
class's recurrence; the kernels speak these names. With the state ``S [d, m]`` (``d`` rows =
values, ``V``; ``m`` columns = keys, ``K``; the kernels keep FLA's transpose ``[K, V]``)::

    S_t = a . S_{t-1}  -  c . (S_{t-1} u) v^T  +  p q^T        y_t = oc . (S_t oq) + oh

=======  =========================================================================================
``a``    the decay (transition's diagonal): a number, per head, over ``d``, ``m`` or ``(d, m)``
``c``    the erase (rank-1) step size: per head or per row (``d``); DeltaNet's ``beta``
``u``    the key the state is read with before erasing (``S_{t-1} u``: the prediction), over ``m``
``v``    the key the erase writes along, over ``m`` (``u = v = k`` for the delta rule)
``p``    the inserted value, over ``d`` (DeltaNet's ``beta x``, Longhorn's ``c x``)
``q``    the insert key, over ``m``: ``B = p q^T`` is the input term
``B``    the input term as a whole, where it does not factorise as ``p q^T`` (``[d, m]``)
``oq``   the readout key (the query), over ``m``
``oc``   the readout's row scale, over ``d`` (1 when absent)
``oh``   the readout's additive term, over ``d`` (0 when absent)
``u{l}`` ``v{r}`` ``c{r}{l}`` ``p{r}``: the ``rankr`` kind's several keys, row factors and inputs:
         ``S_t = a . S_{t-1} - sum_{r,l} c_rl . (S_{t-1} u_l) v_r^T + sum_r p_r v_r^T``
=======  =========================================================================================

The kernels of the structured families take their slots in FLA's layout: ``[B, T, H, n]`` for a vector slot, ``[B, T, H]`` for a
per-head one, or a number. Most library objectives' slots are plain inputs (DeltaNet's
``u = v = q = k``, ``c = beta``; GLA's ``a = alpha``, ``p = x``), so the fast path passes the
caller's tensors straight to the kernel, in their own dtype: no copy, no cast, no PyTorch op. The
slots whose coefficients are expressions are computed together, in fp32, by one of two paths
chosen once per call signature (``computed_path``, in the families' ``prepare``) and named in the
backend (``obj.backend``, e.g. ``triton:rank1-row+prologue``):

- ``prologue``: one fused Triton kernel (``ssmcraft.ops.codegen.prologue``) reads the leaves they
  need (``Binding.needs``) in their own dtype and writes every computed slot; its backward kernel
  writes the leaves' gradients in their dtypes. The families run only on CUDA tensors or under
  ``TRITON_INTERPRET=1``, where it can run, so this is their path;
- ``eager-coefficients``: the objective's generated PyTorch ``coefficients`` on fp32 copies of
  the leaves they need, autograd through them; only where the prologue cannot be printed (a
  function the Triton printer lacks; the reason is logged). The CPU path
  (``torch-vectorised``) calls the generated coefficients itself and never comes here.

``bindings(ir)`` classifies every slot once:

- ``const``:    a number (``a = 1``);
- ``leaf``:     an input or param as it is;
- ``scaled``:   ``s * x`` with ``s`` a per-head scalar leaf and ``x`` a vector leaf (DeltaNet's
                ``p = beta x``: the kernels fuse the per-head scale);
- ``product``:  ``s * x`` with both per-head scalar leaves (Gated DeltaNet's ``c = alpha beta``: the
                chunked rank-1 kernels take it from the decay and the insert scale; elsewhere
                one PyTorch product in fp32);
- ``computed``: anything else.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import sympy
import torch

from ssmcraft.compiler.codegen import slot_leaves


@dataclass(frozen=True)
class Binding:
    kind: str                 # const | leaf | scaled | product | computed
    dims: tuple = ()          # the slot's dims (() per head, (d,) or (m,) a vector)
    value: float = 0.0        # const
    leaf: str = ""            # leaf / scaled / product: the vector (or only, or second) leaf
    scale: str = ""           # scaled / product: the (first) per-head scalar leaf
    needs: tuple = ()         # computed: the leaves its coefficient reads


def bindings(ir) -> dict[str, Binding]:
    """slot -> Binding for every slot of ``ir`` (see the module docstring); classified once per IR
    (``UpdateIR.memo``: each new call signature's ``prepare`` asks again)."""
    return dict(ir.memo("slot_bindings", lambda: _bindings(ir)))


def _bindings(ir) -> dict[str, Binding]:
    exprs = ir.expanded_coefficients()
    dims_of = {c.name: tuple(c.dims) for c in ir.coefficients}
    leaves = {**{n: tuple(d) for n, d in ir.inputs.items()}, **{n: tuple(d) for n, d in ir.params.items()}}
    out = {}
    for slot, name in ir.slots.items():
        e = exprs[name]
        dims = dims_of[name]
        if e.is_number:
            out[slot] = Binding("const", dims, value=float(e))
        elif e.is_Symbol and e.name in leaves and leaves[e.name] == dims:
            out[slot] = Binding("leaf", dims, leaf=e.name)
        elif isinstance(e, sympy.Mul) and len(e.args) == 2 and all(a.is_Symbol and a.name in leaves for a in e.args):
            a, b = (x.name for x in e.args)
            if leaves[a] == () and leaves[b] == dims and dims:
                out[slot] = Binding("scaled", dims, leaf=b, scale=a)
            elif leaves[b] == () and leaves[a] == dims and dims:
                out[slot] = Binding("scaled", dims, leaf=a, scale=b)
            elif leaves[a] == leaves[b] == dims == ():
                out[slot] = Binding("product", dims, leaf=b, scale=a)
            else:
                out[slot] = Binding("computed", dims, needs=tuple(slot_leaves(ir, name)))
        else:
            out[slot] = Binding("computed", dims, needs=tuple(slot_leaves(ir, name)))
    return out


@dataclass(frozen=True)
class ComputedPath:
    """How a call's computed slots are produced (chosen once per call signature):
    ``name`` ``"prologue"`` / ``"eager-coefficients"`` (None: the objective has no computed
    slot, and ``run`` is None), ``run(cs) -> {slot: fp32 tensor in FLA layout}``; ``source``: the
    prologue's generated Triton source, ``why``: why the eager coefficients run them instead."""
    name: str | None
    run: object = None
    source: str | None = None
    why: str | None = None


NO_COMPUTED = ComputedPath(None)      # the path of an objective without computed slots (or a runner not using them)


def eager_coefficients(cs: "CallSlots") -> dict:
    """The generated ``coefficients`` once for every computed slot together (they share their
    sub-expressions, e.g. Longhorn's ``c`` inside ``p = c x``), on fp32 copies of the leaves they
    read, laid out as ``CallSlots.computed`` returns them."""
    need = {n for b in cs.binds.values() for n in b.needs}
    values = cs.obj.module.coefficients(cs._env(need), cs.d, cs.m)
    out = {}
    for slot, b in cs.binds.items():
        if b.kind != "computed":
            continue
        value = values[slot]
        if isinstance(value, torch.Tensor):
            value = value.expand(cs.B, cs.T, cs.H, value.shape[3], value.shape[4])
            value = value.reshape(cs.B, cs.T, cs.H, *cs._size(b.dims))
        out[slot] = value
    return out


def computed_path(obj, binds: dict) -> ComputedPath:
    """The path of ``obj``'s computed slots in a Triton family (see the module docstring); the
    families call it in ``prepare``, once per call signature, and tag their runner with its name."""
    if not any(b.kind == "computed" for b in binds.values()):
        return NO_COMPUTED
    from ssmcraft.ops.codegen import prologue
    try:
        entry = prologue.module(obj.ir, binds)
    except NotImplementedError as e:
        why = f"no Triton prologue ({e})"
        logging.getLogger(__name__).info("%s: computed slots by the eager coefficients (%s)", obj.spec.name, why)
        return ComputedPath("eager-coefficients", eager_coefficients, why=why)
    return ComputedPath("prologue", lambda cs: prologue.run(entry, cs), source=entry[2])


def slot_runner(obj, lay, run, in_kernel: tuple = ()):
    """A structured family's ``prepare`` result for one call signature (``lay`` from
    ``reference.validate``): the slots bound (``bindings``, kept on the IR), the computed slots' path chosen once (``computed_path``), and per call
    ``run(cs, initial_state, output_final_state) -> (y, S_T)`` with ``cs`` the call's
    ``CallSlots``. Returns ``fn(inputs, params, initial_state, output_final_state)``; its
    ``slots_path`` is the computed slots' path, which the backend name carries
    (``ssmcraft.runtime.select``). ``in_kernel``: slots the family forms in its kernels from other
    slots (never read through ``cs``), so they choose no computed path."""
    binds = {s: b for s, b in bindings(obj.ir).items() if s not in in_kernel}
    path = computed_path(obj, binds)
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m

    def fn(inputs, params, initial_state, output_final_state, **packed):
        """``packed``: ``cu_seqlens=`` for a family whose ``run`` takes it (``KernelFamily.varlen``)."""
        return run(CallSlots(obj, binds, inputs, params, B, T, H, d, m, path), initial_state, output_final_state,
                   **packed)
    fn.slots_path = path.name
    return fn


class CallSlots:
    """One call's slot values in FLA layout, from the caller's tensors (see ``bindings``).

    ``inputs``: name -> ``[B, T, H, n]`` / ``[B, T, H]``; ``params``: name -> declared shape or
    ``[H, *shape]`` (missing ones take their constant init). ``B, T, H, d, m``: the call's sizes.
    ``path``: how the computed slots are produced (``computed_path``; ``ComputedPath(None)`` when
    the caller reads no computed slot through it).
    """

    def __init__(self, obj, binds: dict, inputs: dict, params: dict | None, B, T, H, d, m,
                 path: ComputedPath):
        self.obj, self.binds, self.inputs = obj, binds, inputs
        self.params = dict(params or {})
        self.B, self.T, self.H, self.d, self.m = B, T, H, d, m
        self.device = next(iter(inputs.values())).device
        self.path = path
        self._computed = None

    def _size(self, dims):
        return [self.d if x == self.obj.ir.dims[0] else self.m for x in dims]

    def param(self, name: str) -> torch.Tensor:
        """A param as given (declared shape or ``[heads, *shape]``), or its constant init."""
        t = self.params.get(name)
        if t is None:
            from ssmcraft.ops.common.reference import constant_param
            t = constant_param(self.obj.spec.params[name], self._size(self.obj.ir.params[name]), self.device,
                               f"{self.obj.spec.name}: param {name!r}")
        return torch.as_tensor(t, device=self.device)

    def leaf(self, name: str) -> torch.Tensor:
        """An input as given, or a param broadcast to the FLA layout of its dims."""
        if name in self.inputs:
            return self.inputs[name]
        dims = tuple(self.obj.ir.params[name])
        t = self.param(name)
        heads = t.shape[0] if t.dim() == len(dims) + 1 else 1
        return t.reshape(1, 1, heads, *self._size(dims)).expand(self.B, self.T, self.H, *self._size(dims))

    def _env(self, fp32) -> dict:
        """Every leaf laid out for the generated code ([B|1, T|1, H|1, r, c]); those in ``fp32`` are
        converted (they feed a computed slot), the others are views of the caller's tensors."""
        ir = self.obj.ir
        env = {}
        for n in (*ir.inputs, *ir.params):
            dims = tuple(ir.inputs.get(n, ir.params.get(n, ())))
            t = self.leaf(n)
            t = t.float() if n in fp32 else t
            r = self.d if ir.dims[0] in dims else 1
            c = self.m if ir.dims[1] in dims else 1
            env[n] = t.reshape(*t.shape[:3], r, c)
        return env

    def _all_computed(self) -> dict:
        """Every computed slot, once per call, by the call signature's path (``computed_path``)."""
        if self._computed is None:
            self._computed = self.path.run(self)
        return self._computed

    def computed(self, slot: str):
        """The computed slot, fp32, in FLA layout (or a number)."""
        value = self._all_computed()[slot]
        return value if isinstance(value, torch.Tensor) else float(value)

    def get(self, slot: str, default=None):
        """The slot's value: a tensor in FLA layout (a leaf in its own dtype) or a number; a
        ``scaled`` slot is returned whole (``s * x``; use ``split`` to keep it fused)."""
        b = self.binds.get(slot)
        if b is None:
            return default
        if b.kind == "const":
            return b.value
        if b.kind == "leaf":
            return self.leaf(b.leaf)
        if b.kind == "scaled":
            return self.leaf(b.scale).unsqueeze(-1) * self.leaf(b.leaf)
        if b.kind == "product":       # fp32, as a computed slot would be
            return self.leaf(b.scale).float() * self.leaf(b.leaf).float()
        return self.computed(slot)

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        """The readout's scale and offset on a kernel output ``o [B, T, H, d]``: ``oc * o + oh``
        (per-head slots broadcast over d; the kernels compute ``S oq`` only)."""
        oc, oh = self.get("oc", 1.0), self.get("oh")
        if isinstance(oc, torch.Tensor) or oc != 1.0:
            o = o * (oc.unsqueeze(-1) if isinstance(oc, torch.Tensor) and oc.dim() == 3 else oc)
        if oh is not None:
            o = o + (oh.unsqueeze(-1) if isinstance(oh, torch.Tensor) and oh.dim() == 3 else oh)
        return o

    def split(self, slot: str):
        """(per-head scale or None, vector) of a slot: ``scaled`` slots stay factored."""
        b = self.binds[slot]
        if b.kind == "scaled":
            return self.leaf(b.scale), self.leaf(b.leaf)
        return None, self.get(slot)


def computed_slots(objective, inputs: dict, params: dict | None = None) -> dict:
    """Every computed slot of ``objective`` (CompiledObjective or library name) from one call's
    tensors, with the fused kernel (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``).

    inputs: the spec's inputs, ``[B, T, H, d]`` / ``[B, T, H, m]`` / ``[B, T, H]`` (``[B, T, H, d, m]``
      for a matrix input), fp32, bf16 or fp16; params: declared shape or ``[H, *shape]`` (missing
      ones take their constant init).
    Returns slot -> fp32 ``[B, T, H, d]`` / ``[B, T, H, m]`` / ``[B, T, H]`` / ``[B, T, H, d, m]``,
    differentiable with respect to the inputs and params (gradients in their dtypes).
    """
    from ssmcraft.ops.codegen.prologue import module, run
    obj = objective
    if isinstance(objective, str):
        from ssmcraft.compiler.api import derive
        obj = derive(objective)
    ir = obj.ir
    d, m = ir.dims
    sizes = {}
    for n, dims in ir.inputs.items():
        sizes.update(zip(dims, inputs[n].shape[3:]))
    B, T, H = next(iter(inputs.values())).shape[:3]
    binds = bindings(ir)
    cs = CallSlots(obj, binds, inputs, params, B, T, H, sizes.get(d, 1), sizes.get(m, 1), NO_COMPUTED)
    return run(module(ir, binds), cs)


def scaled_u(cs, keys):
    """(u, s): where ``u = s k`` with k another key slot in ``keys`` and s per head (Gated Longhorn's
    u = alpha k), (k itself, s), as c (s_{t-1} . s k) = (s c)(s_{t-1} . k); else (cs's u, None)."""
    scale, u = cs.split("u")
    if scale is None or not any(u is x for x in keys):
        return cs.get("u"), None
    return u, scale


def fold_scaled_u(cs, keys, c):
    """(u, c) for the per-row kernels: ``scaled_u``'s k and c times its s, so the kernel reads k once
    and sums one gradient less over the rows. Else (cs's u, c)."""
    u, scale = scaled_u(cs, keys)
    if scale is None:
        return u, c
    return u, c * (scale.float().unsqueeze(-1) if isinstance(c, torch.Tensor) and c.dim() == 4 else scale.float())


def row_mode(x):
    """(mode, const, tensor) of a per-row kernel's row coefficient (``a``, ``c``, ``p``, ``oc``, ``oh``):
    0 a constant (None: 0), 1 per head [B, T, H], 2 per row [B, T, H, d] (the kernels' ``MODES``)."""
    if x is None:
        return 0, 0.0, None
    if not isinstance(x, torch.Tensor):
        return 0, float(x), None
    return (2 if x.dim() == 4 else 1), 0.0, x
