"""A kernel against the float64 reference recurrence: the output, every final state and every
gradient (inputs, params, initial states), under fixed random cotangents of the output and
the final states. What the kernel tests (``tests/``) and the GPU checks (``benchmarks/``) share.

::

    ref = reference(obj, ins, params, S0, g)         # float64 values as given; g draws dy, dS
    cmp = compare(ref, lambda i, p, s: obj(i, p, s, True), torch.bfloat16)
    cmp.errors        # {"y": ..., "S_T": ..., "dx": ..., "dbeta": ..., "dS0": ...}: relative RMS
    cmp.written       # no NaN in any output or gradient (outputs NaN-poisoned first)

The reference runs on the values as given: a caller comparing a bf16 kernel with the
reference on the bf16-rounded inputs rounds them first. The kernel gets the inputs in
``dtype``, the params and initial states in fp32. Names: ``y``, ``<state>_T`` per final
state, ``d<input>``, ``d<param>``, ``d<state>0`` per initial state (``S_T``, ``dS0`` with one
state ``S``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ssmcraft.ops.common.reference import like, states
from ssmcraft.ops.rank1_chunk.naive import naive_recurrent_rank1


def rel_rms(got, ref) -> float:
    """Relative RMS error ``||got - ref|| / ||ref||``, in float64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _state_names(obj) -> tuple:
    spec = obj.spec
    return tuple(spec.states) if spec.states else (spec.state,)


@dataclass
class Reference:
    """One case's float64 reference: the values, the cotangents and what the reference gives."""
    obj: object
    ins: dict
    params: dict
    S0: object                 # a tensor, a tuple of tensors (several states) or None
    dy: torch.Tensor
    dS: tuple
    y: torch.Tensor
    S: tuple
    grads: dict                # d<leaf> -> gradient

    @property
    def state_names(self) -> tuple:
        return _state_names(self.obj)


def nan_worst(v: float) -> float:
    """A ``max`` key under which NaN (an unwritten output) counts as the largest error."""
    return v if v == v else float("inf")


@dataclass
class Comparison:
    """A kernel against a ``Reference``: relative RMS errors by name, one per output, final state
    and gradient."""
    errors: dict

    @property
    def written(self) -> bool:
        """Every output and gradient written: the reference is finite, so a NaN left in a kernel
        output (allocated NaN-filled) makes its error NaN."""
        return all(v == v for v in self.errors.values())

    @property
    def worst(self) -> tuple[str, float]:
        """(name, error) of the largest error; NaN counts as the largest."""
        name = max(self.errors, key=lambda k: nan_worst(self.errors[k]))
        return name, self.errors[name]

    def over(self, tol: dict | float) -> dict:
        """{name: error} of the errors over ``tol`` (a number, or ``tol[name]`` with ``tol["grad"]``
        for the gradients); NaN is over any tolerance."""
        return over(self.errors, tol)

    def within(self, tol: dict | float) -> bool:
        """Every error within ``tol`` (``over``; an unwritten output's NaN is over any tolerance)."""
        return not self.over(tol)


def over(errors: dict, tol: dict | float) -> dict:
    """{name: error} of ``errors`` over ``tol`` (a number, or ``tol[name]``, ``tol["grad"]`` for
    names not in it); NaN is over any tolerance. The one tolerance rule of tests and checks."""
    limit = (lambda k: tol) if not isinstance(tol, dict) else (lambda k: tol.get(k, tol["grad"]))
    return {k: v for k, v in errors.items() if not v <= limit(k)}


def _leaf_names(ins, params, S0, states) -> list[str]:
    return [*(f"d{n}" for n in ins), *(f"d{n}" for n in params),
            *([] if S0 is None else [f"d{x}0" for x in states])]


def _cotangents(y, S, g: torch.Generator) -> tuple:
    """(dy, (dS, ...)): float64 normals from the CPU generator ``g``, on the outputs' device."""
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device)
    return dy, tuple(torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.device) for s in S)


def _pullback(y, S, dy, dS):
    """The scalar whose gradient is the pullback of the cotangents (float64)."""
    return (y.double() * dy).sum() + sum((s.double() * w).sum() for s, w in zip(S, dS))


def reference(obj, ins: dict, params: dict | None, S0, g: torch.Generator, final_state: bool = True) -> Reference:
    """The float64 reference of ``obj`` on ``ins``/``params``/``S0`` (float64; ``S0`` a tensor, a
    tuple of them for several states, or None) and its gradients under cotangents ``dy`` then
    one ``dS`` per state drawn from ``g`` (a CPU generator; moved to the inputs' device). Without
    ``final_state`` no final state is returned or pulled back (the call under test must return
    ``(y, None)``: its backward then runs with no final-state cotangent)."""
    params = dict(params or {})
    leaves = {k: v.detach().clone().requires_grad_() for k, v in ins.items()}
    pleaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    s0 = None if S0 is None else tuple(s.detach().clone().requires_grad_() for s in states(S0))
    y, S = obj.reference(leaves, pleaves, like(S0, s0 or ()), final_state)
    S = states(S)
    dy, dS = _cotangents(y, S, g)
    wrt = [*leaves.values(), *pleaves.values(), *(s0 or ())]
    grads = torch.autograd.grad(_pullback(y, S, dy, dS), wrt)
    return Reference(obj, dict(ins), params, S0, dy, dS, y.detach(), tuple(s.detach() for s in S),
                     dict(zip(_leaf_names(ins, params, S0, _state_names(obj)), grads)))


class _Packed:
    """An objective whose ``reference`` runs one packed row (``cu_seqlens``) as its N sequences, each
    on its own (``ssmcraft.runtime.packed``): the reference of a packed call."""

    def __init__(self, obj, cu_seqlens):
        self.obj, self.spec, self.cu_seqlens = obj, obj.spec, cu_seqlens
        self.ir = obj.ir        # ``compare`` reads from it which states are symmetric (carried by their inverse)

    def reference(self, ins, params, S0, final_state):
        return self.obj.reference(ins, params, S0, final_state, cu_seqlens=self.cu_seqlens)


def packed_reference(obj, ins: dict, params: dict | None, S0, cu_seqlens, g: torch.Generator) -> Reference:
    """``reference`` of a packed call: inputs ``[1, total_T, H, n]``, ``S0`` ``[N, H, d, m]`` (or None),
    ``cu_seqlens`` the offsets; the sequences run separately. Compare a packed call with
    ``compare(ref, lambda i, p, s: obj(i, p, s, True, cu_seqlens=cu_seqlens), dtype)``."""
    return reference(_Packed(obj, cu_seqlens), ins, params, S0, g)


def compare(ref: Reference, call: Callable, dtype: torch.dtype = torch.float32, *,
            grad_scale: dict | None = None) -> Comparison:
    """``call(inputs, params, S0) -> (y, S_T)`` (``S_T`` a tuple with several states) on the
    reference's values (inputs in ``dtype``, params and initial states fp32, all leaves of the
    autograd graph), against ``ref``. ``grad_scale``: leaf -> factor; that leaf's gradient is
    compared times the factor (the leaf itself: the gradient with respect to its log)."""
    lv = {k: v.detach().to(dtype).requires_grad_() for k, v in ref.ins.items()}
    pv = {k: v.detach().float().requires_grad_() for k, v in ref.params.items()}
    s1 = None if ref.S0 is None else tuple(s.detach().float().requires_grad_() for s in states(ref.S0))
    y, S = call(lv, pv, like(ref.S0, s1 or ()))
    S = states(S)
    if y.shape != ref.y.shape or [s.shape for s in S] != [s.shape for s in ref.S]:
        raise ValueError(f"the kernel returned y {tuple(y.shape)}, states {[tuple(s.shape) for s in S]}; the reference "
                         f"y {tuple(ref.y.shape)}, states {[tuple(s.shape) for s in ref.S]}")
    wrt = [*lv.values(), *pv.values(), *(s1 or ())]
    got = torch.autograd.grad(_pullback(y, S, ref.dy, ref.dS), wrt)
    errors = {"y": rel_rms(y, ref.y)}
    errors.update({f"{x}_T": rel_rms(s, r) for x, s, r in zip(ref.state_names, S, ref.S)})
    scale = {f"d{k}": v for k, v in (grad_scale or {}).items()}
    # a state carried by its inverse (a covariance) is symmetric: only the symmetric part of its initial
    # value's gradient acts on a symmetric perturbation; the antisymmetric part depends on how a
    # formula happens to read the matrix (P k or k^T P), so it is not compared
    square = {f"d{x}0" for x, _, _ in getattr(getattr(ref.obj, "ir", None), "inverses", ())}
    for name, a in zip(ref.grads, got):
        b = ref.grads[name]
        if name in scale:
            a, b = a * scale[name], b * scale[name]
        if name in square:
            a, b = (0.5 * (t + t.transpose(-1, -2)) for t in (a, b))
        errors[name] = rel_rms(a, b)
    return Comparison(errors)


def reference_errors(obj, call: Callable, ins: dict, params: dict | None, S0, g: torch.Generator,
                     dtype: torch.dtype = torch.float32, final_state: bool = True, **kw) -> Comparison:
    """``compare(reference(obj, ins, params, S0, g, final_state), call, dtype, **kw)``: one case, one dtype."""
    return compare(reference(obj, ins, params, S0, g, final_state), call, dtype, **kw)


def rel_max(got, ref) -> float:
    """``max |got - ref| / max |ref|`` in float64 (0.0 when both are equal, exact zeros included)."""
    got, ref = got.double(), ref.double()
    diff = (got - ref).abs().max().item()
    return 0.0 if diff == 0 else diff / max(ref.abs().max().item(), 1e-30)


def graphed_against_eager(obj, ins: dict, params: dict | None, S0, seed: int = 3, tol: float = 1e-6) -> dict:
    """``obj.graphed(ins, params, S0, True)`` against eager ``obj(ins, params, S0, True)`` on the same
    tensors: ``y``, every final state and the gradient of every tensor that requires grad (initial
    states included) under fixed random cotangents (CPU generator ``seed``, moved to the outputs'
    device), relative max error (``rel_max``). Eager is also run against itself
    (``check_eager_repeat_rel``: cuBLAS or atomics may not repeat bitwise).

    Returns ``check_errors`` (name -> error; names as ``compare``'s: ``y``, ``S_T``, ``dx``, ``dS0``),
    ``check_worst_rel``, ``check_exact``, ``check_missing`` (names one side has and the other not),
    ``check_nonfinite`` (names whose eager values are not all finite: inputs on which the recurrence
    diverges, where a relative error means nothing) and ``check_ok``: every error within
    ``max(tol, eager's repeat error)``, nothing missing and everything finite."""
    params = params or {}
    names = _leaf_names(ins, params, S0, _state_names(obj))
    flat = [*ins.values(), *params.values(), *states(S0)]
    wrt = [(n, t) for n, t in zip(names, flat) if t.requires_grad]

    def run(call) -> dict:
        y, S = call(ins, params, S0, True)
        S = states(S)
        wy, wS = _cotangents(y, S, torch.Generator().manual_seed(seed))
        out = {"y": y.detach().clone(), **{f"{x}_T": s.detach().clone() for x, s in zip(_state_names(obj), S)}}
        if wrt:
            grads = torch.autograd.grad(_pullback(y, S, wy, wS), [t for _, t in wrt], allow_unused=True)
            out.update({n: gr.clone() for (n, _), gr in zip(wrt, grads) if gr is not None})
        return out
    eager = run(obj)
    floor = max(rel_max(v, eager[k]) for k, v in run(obj).items())
    graphed = run(obj.graphed(ins, params, S0, True))
    errs = {k: rel_max(graphed[k], eager[k]) for k in eager if k in graphed}
    missing = sorted(set(eager) ^ set(graphed))
    nonfinite = sorted(k for k, v in eager.items() if not bool(torch.isfinite(v).all()))
    worst = max(errs.values(), key=nan_worst)
    return {"check_worst_rel": worst, "check_exact": worst == 0.0 and not missing, "check_eager_repeat_rel": floor,
            "check_ok": not over(errs, max(tol, floor)) and not missing and not nonfinite,
            "check_nonfinite": nonfinite,
            "check_errors": {k: float(f"{v:.3g}") for k, v in errs.items()}, "check_missing": missing}


# (initial state: "none" / "nograd" / "grad", final state in the loss, gated): the chunked rank-1
# kernels' state flags (HAS_H0, STORE_DH0, HAS_DHT, STORE_HT) and step modes (C_IS_PS, C_IS_A_PS)
DELTA_RULE_CASES = (("none", False, False), ("nograd", True, False), ("grad", False, False),
                    ("none", False, True), ("grad", True, True))


def delta_rule_case(delta_rule, B, T, H, K, V, h0_kind: str, final: bool, gated: bool, dtype,
                    device="cpu", seed: int = 0, **kw) -> tuple[dict, dict, bool]:
    """``delta_rule(q, k, x, beta, alpha, initial_state=..., output_final_state=final, **kw)`` (FLA
    layout; ``ssmcraft.ops.rank1_chunk.chunk.delta_rule``) on random inputs in ``dtype`` against
    ``naive_recurrent_rank1`` in float64 on the same values (c = alpha beta, ps = beta): no initial state, one that wants no gradient
    or one that does (``h0_kind``), the final state in the loss or not returned at all (``final``).
    Returns ({"y", "S_T"?, "d<leaf>": relative RMS error}, {leaf: its gradient's dtype == its
    own}, whether the final state came back exactly when asked for)."""
    g = torch.Generator().manual_seed(seed + T)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    ins = {"q": nk(r(B, T, H, K)), "k": nk(r(B, T, H, K)), "x": r(B, T, H, V), "beta": torch.sigmoid(r(B, T, H))}
    if gated:
        ins["alpha"] = torch.sigmoid(3.0 + r(B, T, H))
    x = {n: t.to(device=device, dtype=dtype).requires_grad_() for n, t in ins.items()}
    ref = {n: t.detach().double().cpu().requires_grad_() for n, t in x.items()}
    h0 = None if h0_kind == "none" else r(B, H, K, V)
    hx = None if h0 is None else h0.to(device=device, dtype=torch.float32).requires_grad_(h0_kind == "grad")
    rh = torch.zeros(B, H, K, V, dtype=torch.float64) if h0 is None else \
        hx.detach().double().cpu().requires_grad_(h0_kind == "grad")
    o, ht = delta_rule(x["q"], x["k"], x["x"], x["beta"], x.get("alpha"), initial_state=hx, output_final_state=final, **kw)
    a = ref.get("alpha")
    o_ref, h_ref = naive_recurrent_rank1(ref["k"], None, None, ref["x"], ref["q"], ref["beta"] * (1.0 if a is None else a),
                                    a, rh, ps=ref["beta"])
    dy, dh = r(*o_ref.shape), r(*h_ref.shape)
    names = [*ins, *(["h0"] if h0_kind == "grad" else [])]
    got = torch.autograd.grad(_pullback(o, (ht,) if final else (), dy.to(device), (dh.to(device),)),
                              [*x.values(), *([hx] if h0_kind == "grad" else [])])
    want = torch.autograd.grad(_pullback(o_ref, (h_ref,) if final else (), dy, (dh,)),
                               [*ref.values(), *([rh] if h0_kind == "grad" else [])])
    errors = {"y": rel_rms(o.cpu(), o_ref), **({"S_T": rel_rms(ht.cpu(), h_ref)} if final else {})}
    errors.update({f"d{n}": rel_rms(a.cpu(), b) for n, a, b in zip(names, got, want)})
    dtypes = {n: a.dtype == t.dtype for n, a, t in zip(names, got, [*x.values(), hx])}
    return errors, dtypes, (ht is not None) == final


# the decays of the library's and the composer's objectives, by input or param name
DECAY_NAMES = ("alpha", "f", "gamma")


def tiny_decays(obj, ins: dict, params: dict, g: torch.Generator, mix: bool) -> tuple[dict, dict]:
    """``(ins, params)`` with every decay redrawn where a sigmoid gate reaches in training: in (e^-64,
    e^-14) (below 1e-6), 15 % exact zeros, and with ``mix`` half of them ordinary (0.3 to 1) at random
    among them, in each chunk (a param, constant in time: every other entry ordinary, from the first
    tiny); Mamba's ``delta`` in (20, 220), so that exp(delta A) with A < -0.5 is as
    small (and underflows to 0 in fp32), with ``mix`` half of it in (0, 0.1). Float64, on each tensor's
    device; draws from the CPU generator ``g``; everything else as given."""
    def decay(t, param=False):
        s = t.shape
        a = torch.exp(-14 - 50 * torch.rand(s, generator=g, dtype=torch.float64))
        a = torch.where(torch.rand(s, generator=g) < 0.15, torch.zeros_like(a), a)
        if mix:
            ordinary = (torch.arange(t.numel()).reshape(s) % 2 == 1) if param else torch.rand(s, generator=g) < 0.5
            a = torch.where(ordinary, 0.3 + 0.7 * torch.rand(s, generator=g, dtype=torch.float64), a)
        return a.to(t.device)

    def delta(t):
        s = t.shape
        x = 20 + 200 * torch.rand(s, generator=g, dtype=torch.float64)
        if mix:
            x = torch.where(torch.rand(s, generator=g) < 0.5, 0.1 * torch.rand(s, generator=g, dtype=torch.float64), x)
        return x.to(t.device)
    ins = {n: decay(t) if n in DECAY_NAMES else delta(t) if n == "delta" and "A" in obj.spec.params else t
           for n, t in ins.items()}
    return ins, {n: decay(t, True) if n in DECAY_NAMES else t for n, t in params.items()}
