"""Chunked rank-r family (several keys with a per-head step: explicit, decay-explicit and
Woodbury-implicit two-key updates, a three-term composition held out) under the Triton
interpreter, against the float64 reference: output, final state and every gradient (inputs, initial
state; with a gradient on the final state), buffers poisoned with NaN, odd lengths and partial chunks."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.rank1_chunk import chunk as R1  # noqa: E402
from ssmcraft.ops.rankr_chunk import chunk as RC  # noqa: E402
from ssmcraft.ops.rankr_chunk.naive import naive_recurrent_rankr  # noqa: E402
from ssmcraft.runtime.checking import reference_errors  # noqa: E402
from ssmcraft.runtime import select  # noqa: E402
from ssmcraft.runtime.select import validated_call  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_inputs, packed_naive, rel_rms as rel  # noqa: E402

# relative RMS error, fp32 kernels vs float64 reference (the Woodbury factors are quotients of
# O(1) sums: fp32 rounding leaves ~1e-6, as in rankr_row's tests)
TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 5e-5}

TWO = {"data": "regression", "keys": 2, "step": "scalar", "normalize": True}
COMPOSED = {
    "explicit": dict(TWO, proximity="plain", update="explicit"),                 # DeltaNet on two keys
    "decay_explicit": dict(TWO, proximity="scalar_decay", update="decay_explicit"),   # Gated DeltaNet's order
    "explicit_decay": dict(TWO, proximity="scalar_decay", update="explicit"),
    "implicit": dict(TWO, proximity="plain", update="implicit"),                 # Woodbury: full 2 x 2 factors
    "implicit_decay": dict(TWO, proximity="scalar_decay", update="implicit"),    # read keys alpha k
    "wdecay_explicit": dict(TWO, proximity="weight_decay", update="decay_explicit"),   # a computed decay 1/(1+lam)
}
# held out, written by hand: a per-head step that differs per key (c00 != c11: stacked per term), and
# three keys (R = 3, run as four terms with a zero fourth), explicit and implicit (a 3 x 3 Woodbury solve)
TWO_STEPS = {"name": "rc_two_steps", "state": {"S": ["d", "m"]},
             "inputs": {"x": {"shape": ["d"]}, "x2": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True},
                        "k2": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
                        "beta": {"shape": [], "bounded": True}, "gamma": {"shape": [], "bounded": True}},
             "objective": "sq(S - S_prev)/2 + beta*sq(S*k - x)/2 + gamma*sq(S*k2 - x2)/2",
             "update": "explicit", "output": "S*q"}
THREE = {"name": "rc_three", "state": {"S": ["d", "m"]},
         "inputs": {**{x: {"shape": ["d"]} for x in ("x", "x2", "x3")},
                    **{k: {"shape": ["m"], "normalize": True} for k in ("k", "k2", "k3")},
                    "q": {"shape": ["m"]}, "beta": {"shape": [], "bounded": True}},
         "objective": "sq(S - S_prev)/2 + beta*sq(S*k - x)/2 + beta*sq(S*k2 - x2)/2 + beta*sq(S*k3 - x3)/2",
         "update": "explicit", "output": "S*q"}
HANDWRITTEN = {"two_steps": TWO_STEPS, "three_explicit": THREE,
               "three_implicit": dict(THREE, name="rc_three_impl", update="implicit")}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(R1, "POISON", True)
    monkeypatch.setattr(R1, "INTERPRET_BV", None)
    monkeypatch.setattr(RC, "CHUNK", 64)


def _compiled(which):
    return ssmcraft.compile(compose_objective(COMPOSED[which]) if which in COMPOSED else HANDWRITTEN[which])


def test_supports_and_order():
    for which in (*COMPOSED, *HANDWRITTEN):
        ir = _compiled(which).ir
        assert ir.kind == "rankr" and RC.supports(ir) is None and RC.per_head_step(ir), which
    assert "per head" in RC.supports(ssmcraft.compile("longhorn_2key").ir)
    assert "not rankr" in RC.supports(ssmcraft.compile("deltanet").ir)
    ir = _compiled("decay_explicit").ir             # rank1_chunk's kernels: its K limit
    assert RC.supports_sizes(ir, {ir.dims[1]: 128}, "triton") is None
    assert "K = 256 > 128" in RC.supports_sizes(ir, {ir.dims[1]: 256}, "triton")
    ir = _compiled("implicit").ir
    names = [f.name for f in registry.order(ir, "triton")]
    assert names.index("rankr_chunk") < names.index("rankr_row")
    assert [f.name for f in registry.order(ssmcraft.compile("longhorn_2key").ir, "triton")].index("rankr_chunk") > \
        names.index("rankr_row")


@pytest.mark.parametrize("which,T,chunk,B", [
    ("explicit", 1, 64, 2), ("explicit", 37, 32, 1),
    ("decay_explicit", 7, 32, 2), ("decay_explicit", 41, 64, 1),
    ("explicit_decay", 19, 32, 1),
    ("implicit", 23, 32, 1), ("implicit_decay", 37, 32, 1),
    ("wdecay_explicit", 17, 32, 1), ("two_steps", 35, 32, 1),
    ("three_explicit", 21, 64, 1), ("three_implicit", 18, 64, 1),
])
def test_composed_matches_reference(which, T, chunk, B, monkeypatch):
    """Through the family's validated entry (prepare's runner, slots bound and computed as on the
    GPU), fp32, against the objective's float64 reference."""
    monkeypatch.setattr(RC, "CHUNK", chunk)
    obj = _compiled(which)
    ins, params, S0, g = kernel_inputs(obj, B, T, 2, 20, 16, seed=T + chunk)

    def ours(inputs, params, s0):
        y, S = validated_call(RC.prepare, obj, inputs, params, s0, True)
        assert y.dtype == torch.float32 and S.dtype == torch.float32
        return y, S
    assert_within(reference_errors(obj, ours, ins, params, S0, g).errors, TOL)


def test_decay_explicit_at_128_keys_and_values(monkeypatch):
    """rank2_head_gated's composition at d = m = 128 in fp32 with the GPU's tiles there: key block
    128, value blocks of 32 (``chunked._value_block``: fp32 tiles within ``TILE_BYTES`` for sm_90's
    shared memory), odd T over a partial chunk of 64 term rows."""
    monkeypatch.setattr(R1, "INTERPRET_BV", 32)
    obj = _compiled("decay_explicit")
    ins, params, S0, g = kernel_inputs(obj, 1, 37, 1, 128, 128, seed=128)
    assert_within(reference_errors(obj, lambda i, p, s: validated_call(RC.prepare, obj, i, p, s, True),
                                   ins, params, S0, g).errors, TOL)


@pytest.mark.parametrize("which,computed", [("decay_explicit", False), ("implicit", True)])
def test_dispatch_in_the_gpu_order(which, computed, monkeypatch):
    """With the families in their CUDA order, ``obj()`` runs a per-head rank-r objective on this family
    (the Woodbury factors by the fused prologue), bf16 in and out as a layer calls it."""
    monkeypatch.setattr(select, "order", lambda ir, mode: registry.order(ir, "triton"))
    obj = _compiled(which)
    obj.prefer = "interpret"
    ins, _, S0, _ = kernel_inputs(obj, 1, 21, 2, 16, 16, seed=3)
    with torch.no_grad():
        y, S = obj({k: v.half() for k, v in ins.items()}, initial_state=S0.float(), output_final_state=True)
    assert obj.backend == "triton-interpret:rankr-chunk" + ("+prologue" if computed else "")
    y_ref, S_ref = obj.reference({k: v.half().double() for k, v in ins.items()}, initial_state=S0)
    assert y.dtype == torch.float16 and rel(y.double(), y_ref) < 1e-2 and rel(S.double(), S_ref) < 1e-2


@pytest.mark.parametrize("T,R,K,V,chunk,sep_u,decay,scale,per_term,bv", [
    (21, 2, 16, 24, 32, False, True, True, False, None),   # delta-rule form: u = v, one step per token
    (33, 2, 20, 40, 32, True, True, False, True, 16),      # odd K and V, 3 value blocks, a step per term
    (50, 4, 16, 16, 64, True, False, True, True, None),    # four terms per token
    (9, 1, 16, 16, 16, False, True, False, False, None),   # R = 1 through the rank-r entry
    (19, 3, 16, 24, 64, True, True, True, True, None),     # three terms, run as four (a zero fourth)
    (23, 3, 16, 16, 64, False, False, True, False, None),  # three terms, u = v, one step per token
])
def test_kernel_slots(T, R, K, V, chunk, sep_u, decay, scale, per_term, bv, monkeypatch):
    monkeypatch.setattr(R1, "INTERPRET_BV", bv)
    g = torch.Generator().manual_seed(T + K)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    B, H = 1, 2
    ins = {"v": nk(r(B, T, H, R, K)), "u": nk(r(B, T, H, R, K)) if sep_u else None, "p": r(B, T, H, R, V),
           "oq": r(B, T, H, K), "c": rand(B, T, H, R) if per_term else rand(B, T, H),
           "a": 0.3 + 0.7 * rand(B, T, H) if decay else None, "h0": r(B, H, K, V),
           "ps": r(B, T, H) if scale else None}
    names = [n for n, t in ins.items() if t is not None]
    ref_in = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o_ref, h_ref = naive_recurrent_rankr(*ref_in.values())
    do, dh = r(*o_ref.shape), r(*h_ref.shape)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), [ref_in[n] for n in names])
    x = {n: (t.float().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o, ht = RC.chunk_rankr(x["v"], x["p"], x["c"], x["oq"], u=x["u"], a=x["a"], ps=x["ps"], initial_state=x["h0"],
                           output_final_state=True, chunk_size=chunk)
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), [x[n] for n in names])
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
    errs.update({f"d{n}": rel(a_, b_) for n, a_, b_ in zip(names, got, ref_g)})
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})


@pytest.mark.parametrize("R,sep_u,decay,per_term", [
    (3, True, True, True),      # three terms run as four (a zero fourth), a read key and a step per term
    (2, False, False, False),   # delta-rule form: u = v, one step per token, no decay
])
def test_packed_kernel_slots(R, sep_u, decay, per_term, monkeypatch):
    """``chunk_rankr(..., cu_seqlens=)``: a packed row equals the float64 reference on each sequence
    from its own initial state (output, final states [N, H, K, V], every gradient); chunks of 16
    tokens (``R`` term rows each), sequences empty, of 1 token, under, equal to and over a chunk."""
    lens = [0, 17, 16, 5, 0, 1, 33]
    N, T, H, K, V = len(lens), sum(lens), 2, 16, 24
    g = torch.Generator().manual_seed(R)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    nk = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = {"v": nk(r(1, T, H, R, K)), "u": nk(r(1, T, H, R, K)) if sep_u else None, "p": r(1, T, H, R, V),
           "oq": r(1, T, H, K), "c": rand(1, T, H, R) if per_term else rand(1, T, H),
           "a": 0.3 + 0.7 * rand(1, T, H) if decay else None, "h0": r(N, H, K, V), "ps": r(1, T, H)}
    names = [n for n, t in ins.items() if t is not None]
    ref_in = {n: (t.clone().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o_ref, h_ref, cu = packed_naive(naive_recurrent_rankr, ref_in, lens)
    do, dh = r(*o_ref.shape), r(*h_ref.shape)
    ref_g = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(), [ref_in[n] for n in names])
    x = {n: (t.float().requires_grad_() if t is not None else None) for n, t in ins.items()}
    o, ht = RC.chunk_rankr(x["v"], x["p"], x["c"], x["oq"], u=x["u"], a=x["a"], ps=x["ps"], initial_state=x["h0"],
                           output_final_state=True, chunk_size=16 * RC._group(R), cu_seqlens=cu)
    assert ht.shape == (N, H, K, V)
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dh).sum(), [x[n] for n in names])
    errs = {"y": rel(o, o_ref), "S_T": rel(ht, h_ref)}
    errs.update({f"d{n}": rel(a_, b_) for n, a_, b_ in zip(names, got, ref_g)})
    assert_within(errs, {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5})


def test_terms_do_not_see_each_other():
    """Token-strict masks: with two identical unit keys and c = 1 per term, the explicit sum
    erases twice what one term does (H - 2 k k^T H + ...), not the product (I - kk^T)^2 H = (I - kk^T) H
    a sequential (DeltaProduct-like) order would give. One token, checked against the closed form."""
    g = torch.Generator().manual_seed(5)
    K = V = 16
    k = torch.nn.functional.normalize(torch.randn(1, 1, 1, 1, K, generator=g), dim=-1)
    v = k.expand(1, 1, 1, 2, K)
    h0 = torch.randn(1, 1, K, V, generator=g)
    p = torch.zeros(1, 1, 1, 2, V)
    _, ht = RC.chunk_rankr(v, p, torch.ones(1, 1, 1), k[:, :, :, 0], initial_state=h0, output_final_state=True,
                           chunk_size=32)
    kk = k[0, 0, 0, 0]
    want = h0[0, 0] - 2 * torch.outer(kk, kk @ h0[0, 0])
    assert rel(ht[0, 0], want) < 1e-5 and rel(ht[0, 0], h0[0, 0] - torch.outer(kk, kk @ h0[0, 0])) > 0.1


def test_refusals_and_empty():
    v, p = torch.randn(1, 4, 1, 4, 16), torch.randn(1, 4, 1, 4, 8)
    with pytest.raises(ValueError, match="at least 16 tokens"):
        RC.chunk_rankr(v, p, torch.rand(1, 4, 1), v[:, :, :, 0], chunk_size=32)
    with pytest.raises(ValueError, match="at least 16 tokens"):     # R = 3 runs as 4 terms
        RC.chunk_rankr(torch.randn(1, 4, 1, 3, 16), torch.randn(1, 4, 1, 3, 8), torch.rand(1, 4, 1),
                       v[:, :, :, 0], chunk_size=32)
    o, S = RC.chunk_rankr(v[:, :0], p[:, :0], torch.rand(1, 0, 1), v[:, :0, :, 0], output_final_state=True)
    assert o.shape == (1, 0, 1, 8) and float(S.abs().sum()) == 0.0
