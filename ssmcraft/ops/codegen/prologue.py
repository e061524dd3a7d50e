"""The computed slots of a structured update in one fused Triton kernel (and its backward).

A structured family (``rank1_row``, ``rank1_chunk``, ``keydecay_chunk``) takes its slots from
``ssmcraft.ops.common.slots``: most are the caller's tensors, but a slot whose coefficient is an
expression (Longhorn's ``c = beta / (1 + beta k.k)`` and ``p = c x``, Gated DeltaNet's
``c = alpha beta``, HGRN's ``p = -x``, ``q = f - 1``) is *computed*. This module generates, per
objective, one kernel that writes every computed slot of a call, and one that writes the
gradients of the leaves they read, so the public path runs no PyTorch op per coefficient and
makes no fp32 copy of a leaf:

forward   one program per block of ``R`` (b, t, h) rows: load each leaf the computed slots
          need in its own dtype (fp32/bf16/fp16, upcast in registers; a param by its head, or
          shared), evaluate the input reductions (``k.k``, over ``m`` or ``d``) and the
          coefficients, write each computed slot in fp32 in the families' layout:
          ``[B, T, H, d]`` / ``[B, T, H, m]`` for a vector slot, ``[B, T, H]`` per head,
          ``[B, T, H, d, m]`` for a matrix one.
backward  the same rows: with ``G_s`` the upstream gradient of slot ``s``, the loss
          ``L = sum_s sum G_s s`` is differentiated by reverse mode through the reductions
          (``ssmcraft.compiler.derive.gradient``, as ``ssmcraft.ops.codegen.general`` does for the step), and
          ``dL/d leaf`` is written in the leaf's dtype: one adjoint sum per reduction the slots read,
          whatever number of slots read it (``build``). A param's gradient is written per row
          (``[B, T, H, *shape]`` fp32) and summed over (b, t) -- and over heads when it is
          shared -- on the host: the kernel needs no atomics and no per-head partials.

Values live in a 3D register tile ``[R, BV, BK]`` (``V = d``, ``K = m``, padded to powers of
two): a d-indexed value is ``[R, BV, 1]``, an m-indexed one ``[R, 1, BK]``, a per-head scalar
``[R, 1, 1]``, so one printed element expression (``ssmcraft.ops.codegen.triton_printer``) serves
every shape and a reduction is one ``tl.sum`` over axis 2 (m) or 1 (d).

Shared work (``build``): reductions are hash-consed by body (``Algebra.reduce``), and a per-token sum
of a polynomial in the keys is split into the sums of its monomials (``factor.factor_sums``), so a
two-key Woodbury update reads ``k.k``, ``k.k2`` and ``k2.k2`` once each; a slot whose expression
equals another's is one store (the other slot is a view of it); the common sub-expressions of the
slots, and of the gradients and the adjoints' bodies, are printed once (``general.shared_lines``).

Layout of this module: the symbolic part (``build``), the kernel source generator, the host
wrappers with the autograd Function (``ssmcraft.ops.common.slots.computed_slots`` is the public
entry). The generated source is readable and cached by content hash (``ssmcraft.compiler.cache``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import sympy
import torch

from ssmcraft.compiler import cache, safe_source
from ssmcraft.compiler.derive import gradient
from ssmcraft.compiler.factor import factor_sums
from ssmcraft.compiler.symbolic import Algebra
from ssmcraft.ops.codegen.general import TilePrinter, element_algebra, shared_lines
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import INTERPRET, buffer, cdiv, next_pow2

POISON = False           # tests: allocate outputs with NaN (unwritten -> NaN)


# ----------------------------------------------------------------------------------------
# the computed slots, symbolically
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Leaf:
    name: str
    dims: tuple
    symbol: sympy.Symbol
    param: bool


@dataclass
class Prologue:
    """The computed slots of one IR and the leaves' gradients, as element expressions."""
    alg: Algebra
    dims: tuple                 # (d, m)
    leaves: list                # [Leaf] the computed slots read, declaration order (inputs, then params)
    slots: list                 # [(slot, dims, expr)] in leaves and reductions, one per distinct value
    G: dict                     # slot -> symbol of its upstream gradient, every computed slot (aliases too)
    grads: dict                 # leaf name -> d(sum_s sum G_s s)/d leaf
    kinds: frozenset = frozenset()   # the value kinds ('', 'V', 'K', 'VK') its tiles span (``_tiles``)
    aliases: dict = field(default_factory=dict)     # slot -> the slot of ``slots`` with the same expression

    @property
    def names(self) -> list:
        """Every computed slot, in the bindings' order (the outputs of ``run``)."""
        return list(self.G)


def computed_slot_names(binds: dict) -> list[str]:
    return [s for s, b in binds.items() if b.kind == "computed"]


def build(ir, binds: dict) -> Prologue:
    """The computed slots of ``ir`` (``binds`` from ``slots.bindings``) and their adjoints.

    Each distinct slot expression is one value (Woodbury's ``c01`` and ``c10`` are the same
    expression: the second is an alias, ``Prologue.aliases``). The loss of the reverse mode,
    ``L = sum_s sum G_s s``, is one sum over the slots' dims per kind of slot (the upstream
    gradients of aliases added first), so that the adjoint of each reduction the slots read
    (``k.k``) is one sum over the rows, whatever number of slots read it."""
    d, m = ir.dims
    alg, sym = element_algebra(ir, ir.reductions)
    names = computed_slot_names(binds)
    need = {n for s in names for n in binds[s].needs}
    leaves = [Leaf(n, tuple(dims), sym(n, dims), n in ir.params)
              for n, dims in (*ir.inputs.items(), *ir.params.items()) if n in need]
    expanded = ir.expanded_coefficients()
    slots, G, aliases, first, weight = [], {}, {}, {}, {}
    for s in names:
        dims = tuple(binds[s].dims)
        e, _ = factor_sums(alg, expanded[ir.slots[s]], per_token=True)      # k.k, k.k2, ... each one sum
        G[s] = sym(f"_G_{s}", dims)
        if (e, dims) in first:
            aliases[s] = first[(e, dims)]
        else:
            first[(e, dims)] = s
            slots.append((s, dims, e))
        primary = aliases.get(s, s)
        weight[primary] = weight.get(primary, 0) + G[s]
    groups: dict = {}
    for s, dims, e in slots:
        groups[dims] = groups.get(dims, 0) + weight[s] * e
    loss = sympy.Integer(0)
    for dims, term in groups.items():
        for dim in (m, d):
            if dim in dims:
                term = alg.reduce(term, dim)
        loss += term
    grads = {lf.name: gradient(alg, loss, lf.symbol) for lf in leaves}
    kinds = {_key(lf.dims, (d, m)) for lf in leaves} | {_key(dims, (d, m)) for _, dims, _ in slots}
    kinds |= {_key(r.dims | {r.over}, (d, m)) for r in alg.reductions.values()}
    return Prologue(alg, (d, m), leaves, slots, G, grads, frozenset(kinds | {""}), aliases)


# ----------------------------------------------------------------------------------------
# code generation (kernels)
# ----------------------------------------------------------------------------------------

class _Printer(TilePrinter):
    """Element expressions as Triton values over the ``[R, BV, BK]`` tile (see the module
    docstring): ``general``'s printer with a row axis in front."""

    def __init__(self, pro: Prologue):
        d, m = pro.dims
        self._setup(pro.alg, pro.dims, {d: "V_f", m: "K_f", **{lf.symbol.name: f"l_{lf.name}" for lf in pro.leaves},
                                        **{g.name: f"g_{s}" for s, g in pro.G.items()}})

    def reduce(self, r) -> str:
        mask = _MASK[_key(self.alg.dims_of(r.body), self.dims)]
        return f"tl.sum(tl.where({mask}, {self.expr(r.body)}, 0.0), axis={2 if r.over == self.dims[1] else 1}, keep_dims=True)"


def _key(dims, dm) -> str:
    """'', 'V', 'K' or 'VK': which state dimensions a value varies over."""
    return ("V" if dm[0] in dims else "") + ("K" if dm[1] in dims else "")


_MASK = {"": "MR", "V": "MV", "K": "MK", "VK": "MVK"}
_ZERO = {"": "Z1", "V": "ZV", "K": "ZK", "VK": "ZVK"}
_SIZE = {"": "1", "V": "V", "K": "K", "VK": "V * K"}
_OFFS = {"": "0", "V": "offs_v[None, :, None]", "K": "offs_k[None, None, :]",
         "VK": "offs_v[None, :, None] * K + offs_k[None, None, :]"}


def _row_ptr(base, k) -> str:
    """Pointer tile of a per-row value of kind ``k`` in a [B, T, H, *] tensor."""
    return f"{base} + r64[:, None, None] * {_SIZE[k]} + {_OFFS[k]}"


def _leaf_ptr(lf: Leaf, dm) -> str:
    k = _key(lf.dims, dm)
    if lf.param:        # [heads, *shape] or [*shape]: PS_<name> is the head stride (0 when shared)
        return f"P_{lf.name} + hd[:, None, None] * PS_{lf.name} + {_OFFS[k]}"
    return _row_ptr(f"P_{lf.name}", k)


def _loads(pro: Prologue, indent="    ") -> list[str]:
    return [f"{indent}l_{lf.name} = tl.load({_leaf_ptr(lf, pro.dims)}, mask={_MASK[_key(lf.dims, pro.dims)]}, "
            f"other=0.).to(tl.float32)" for lf in pro.leaves]


PREAMBLE = [
    "    i_r = tl.program_id(0)",
    "    rows = i_r * R + tl.arange(0, R)",
    "    r64 = rows.to(tl.int64)",
    "    hd = r64 % H",
    "    offs_v = tl.arange(0, BV)",
    "    offs_k = tl.arange(0, BK)",
    "    MR = (rows < N)[:, None, None]",
    "    MV = MR & (offs_v < V)[None, :, None]",
    "    MK = MR & (offs_k < K)[None, None, :]",
    "    MVK = MV & MK",
    "    V_f = V * 1.0",
    "    K_f = K * 1.0",
    "    Z1 = tl.zeros([R, 1, 1], dtype=tl.float32)",
    "    ZV = tl.zeros([R, BV, 1], dtype=tl.float32)",
    "    ZK = tl.zeros([R, 1, BK], dtype=tl.float32)",
    "    ZVK = tl.zeros([R, BV, BK], dtype=tl.float32)",
]


def _with_preamble(head: list, body: list) -> list:
    """``head`` + the preamble lines whose names ``body`` uses (zeros and masks only where needed)
    + ``body``."""
    text = "\n".join(body)
    keep = []
    for line in reversed(PREAMBLE):
        name = line.split("=")[0].strip()
        if re.search(rf"\b{name}\b", text):
            keep.insert(0, line)
            text += "\n" + line
    return [*head, *keep, *body]


def _adjoints(pro: Prologue) -> set:
    """The reductions of the backward that the slots do not read (the adjoints of those they read)."""
    alg = pro.alg
    forward = {r.symbol for r in alg.reductions_in(sympy.Add(*(e for _, _, e in pro.slots)))}
    return {r.symbol for r in alg.reductions_in(sympy.Add(*pro.grads.values()))} - forward


def kernel_source(ir, pro: Prologue, header: str) -> str:
    """The Triton source (forward and backward kernels) of the computed slots of ``ir``."""
    dm = pro.dims
    leaf_ptrs = "".join(f"P_{lf.name}, " for lf in pro.leaves)
    strides = "".join(f"PS_{lf.name}, " for lf in pro.leaves if lf.param)
    slot_ptrs = "".join(f"O_{s}, " for s, _, _ in pro.slots)
    sizes = "N, H, V, K, " + strides
    consts = "R: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr"
    pr = _Printer(pro)
    fwd = _with_preamble([
        "@triton.jit",
        f"def prologue_fwd_kernel({leaf_ptrs}{slot_ptrs}{sizes}{consts}):",
        '    """One program per block of R (b, t, h) rows: every computed slot, fp32."""'], [
        *_loads(pro),
        *pr.reductions([e for _, _, e in pro.slots], "    "),
        # common sub-expressions once: a Woodbury update repeats its denominators in every slot
        *shared_lines(pr, [e for _, _, e in pro.slots], "    "),
        *[f"    tl.store({_row_ptr(f'O_{s}', _key(dims, dm))}, {pr.expr(e)} + {_ZERO[_key(dims, dm)]}, "
          f"mask={_MASK[_key(dims, dm)]})" for s, dims, e in pro.slots],
    ])
    pr = _Printer(pro)
    grad_ptrs = "".join(f"D_{lf.name}, " for lf in pro.leaves)
    gin = "".join(f"GO_{s}, " for s in pro.names)
    bwd = _with_preamble([
        "@triton.jit",
        f"def prologue_bwd_kernel({leaf_ptrs}{gin}{grad_ptrs}{sizes}{consts}):",
        '    """The same rows: d(sum_s sum G_s s)/d leaf, in the leaf\'s dtype (a param\'s per row, fp32)."""'], [
        *_loads(pro),
        *[f"    g_{s} = tl.load({_row_ptr(f'GO_{s}', _key(pro.alg.symbol_dims[g], dm))}, "
          f"mask={_MASK[_key(pro.alg.symbol_dims[g], dm)]}, other=0.).to(tl.float32)" for s, g in pro.G.items()],
        # the leaves' sums, the common sub-expressions of the gradients and of the adjoints' bodies
        # (which read no adjoint), then the adjoints: one sum over the rows per reduction of the slots
        *shared_lines(pr, list(pro.grads.values()), "    ", ignore=_adjoints(pro)),
        *pr.reductions(list(pro.grads.values()), "    "),
        *[f"    tl.store({_row_ptr(f'D_{lf.name}', _key(lf.dims, dm))}, "
          f"({pr.expr(pro.grads[lf.name])} + {_ZERO[_key(lf.dims, dm)]}).to(D_{lf.name}.dtype.element_ty), "
          f"mask={_MASK[_key(lf.dims, dm)]})" for lf in pro.leaves],
    ])
    alg = pro.alg
    doc = [safe_source.comment(header), "# Generated by ssmcraft (ssmcraft/ops/codegen/prologue.py): edit the spec, not this file.",
           safe_source.docstring("\n".join([f"Computed slots of {ir.spec_name!r} ({ir.kind}) and their leaves' gradients.", "",
           *(f"    {s} {list(dims)} = {sympy.sstr(e)}" for s, dims, e in pro.slots),
           *(f"    {s} = {t} (the same expression: one value)" for s, t in pro.aliases.items()),
           *(f"    {r.symbol.name} = sum_{r.over} {sympy.sstr(r.body)}"
             for r in alg.reductions_in(sympy.Add(*(e for _, _, e in pro.slots), *pro.grads.values()))),
           *(f"    d{n} = {sympy.sstr(g)}" for n, g in pro.grads.items()), ""]))]
    return "\n".join([*doc, "import triton", "import triton.language as tl", "", "", *fwd, "", "", *bwd]) + "\n"


_MODULES: dict = {}


def module(ir, binds: dict):
    """(Prologue, generated module, source) of ``ir``, cached by the IR's content hash (the
    caller keeps the result per call signature: ``slots.computed_path``)."""
    key = ir.content_hash()
    if key not in _MODULES:
        pro = build(ir, binds)
        header = f"spec: {ir.spec_name} ({ir.source}); IR {key}"
        source = kernel_source(ir, pro, header)
        mod = cache.load_generated(f"prologue_{ir.spec_name}", cache.key_for("prologue", source), source)
        _MODULES[key] = (pro, mod, source)
    return _MODULES[key]


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


# fp32 elements of the widest value tile per program on the GPU: forward, backward. The backward
# holds several times more live values per element (the leaves, the upstream gradients, the
# adjoints of every reduction): a rank-2 Woodbury coefficient's backward ran 16x slower at the
# forward's budget, and slower again at 256 (``benchmarks/sweep_prologue.py``)
BUDGET = {False: 4096, True: 1024}


def _tiles(pro: Prologue, V: int, K: int, N: int, backward: bool = False) -> tuple[int, int, int, int]:
    """(R, BV, BK, num_warps): rows per program so that the widest value tile holds ``BUDGET``
    fp32 (16384 under the interpreter, where fewer programs run faster)."""
    BV, BK = next_pow2(V), next_pow2(K)
    width = max({"": 1, "V": BV, "K": BK, "VK": BV * BK}[k] for k in pro.kinds)
    budget = 16384 if INTERPRET else BUDGET[backward]
    R = max(1, min(budget // width, next_pow2(N), 1024))
    R = 1 << (R.bit_length() - 1)
    warps = 1 if INTERPRET else (4 if R * width <= 2048 else 8)
    return R, BV, BK, warps


def _size(dims, pro, V, K) -> list[int]:
    return [V if x == pro.dims[0] else K for x in dims]


def _head_stride(lf: Leaf, t: torch.Tensor, pro, V, K) -> int:
    """A param's stride between heads in its compact tensor (0 when shared by the heads)."""
    return math.prod(_size(lf.dims, pro, V, K)) if t.dim() == len(lf.dims) + 1 and t.shape[0] > 1 else 0


class _PrologueFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, shape, dev, *leaves):
        """shape: (B, T, H, V, K); dev: the device (a slot may read no leaf); leaves: the Prologue's, inputs ``[B, T, H, *]`` contiguous, params
        compact (``[*shape]`` or ``[heads, *shape]``). Returns every computed slot (``pro.names``), fp32; an
        alias is a view of its slot's tensor (one store; its upstream gradient comes back apart)."""
        pro, mod, _ = entry
        B, T, H, V, K = shape
        N = B * T * H
        R, BV, BK, warps = _tiles(pro, V, K, N)
        outs = [_new((B, T, H, *_size(dims, pro, V, K)), dev) for _, dims, _ in pro.slots]
        strides = [_head_stride(lf, t, pro, V, K) for lf, t in zip(pro.leaves, leaves) if lf.param]
        if N > 0:
            launch(mod.prologue_fwd_kernel, (cdiv(N, R),), *leaves, *outs, N, H, V, K, *strides, R=R, BV=BV, BK=BK,
                   num_warps=warps)
        ctx.save_for_backward(*leaves)
        ctx.entry, ctx.shape, ctx.dev, ctx.strides = entry, shape, dev, strides
        value = {s: o for (s, _, _), o in zip(pro.slots, outs)}
        return tuple(value[s] if s in value else value[pro.aliases[s]].view_as(value[pro.aliases[s]])
                     for s in pro.names)

    @staticmethod
    def backward(ctx, *gouts):
        leaves = ctx.saved_tensors
        pro, mod, _ = ctx.entry
        B, T, H, V, K = ctx.shape
        N = B * T * H
        dev, strides = ctx.dev, ctx.strides
        R, BV, BK, warps = _tiles(pro, V, K, N, backward=True)
        grads = [_new((B, T, H, *_size(lf.dims, pro, V, K)), dev) if lf.param else _new(t.shape, dev, t.dtype)
                 for lf, t in zip(pro.leaves, leaves)]
        gouts = [g.contiguous() for g in gouts]
        if N > 0:
            launch(mod.prologue_bwd_kernel, (cdiv(N, R),), *leaves, *gouts, *grads, N, H, V, K, *strides, R=R,
                   BV=BV, BK=BK, num_warps=warps)
        out = []
        for lf, t, g in zip(pro.leaves, leaves, grads):
            if lf.param:        # per row -> the param's own shape: sum over (b, t), and heads when shared
                g = g.reshape(B * T, H, *g.shape[3:]).sum(0)
                g = g.reshape(t.shape) if t.shape[:1] == (H,) and t.dim() == len(lf.dims) + 1 \
                    else g.sum(0).reshape(t.shape)
                g = g.to(t.dtype)
            out.append(g)
        return (None, None, None, *out)


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

def run(entry, cs) -> dict:
    """The computed slots of one call (``cs``: a ``slots.CallSlots``), slot -> fp32 tensor in FLA
    layout: ``[B, T, H, n]`` vector, ``[B, T, H]`` per head, ``[B, T, H, d, m]`` matrix."""
    pro = entry[0]
    leaves = [cs.param(lf.name).contiguous() if lf.param else cs.inputs[lf.name].contiguous() for lf in pro.leaves]
    outs = _PrologueFunction.apply(entry, (cs.B, cs.T, cs.H, cs.d, cs.m), cs.device, *leaves)
    return dict(zip(pro.names, outs))
