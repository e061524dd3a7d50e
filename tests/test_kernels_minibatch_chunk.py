"""Chunked mini-batch family (``approximation: {minibatch: C}`` on explicit regression steps) under
the Triton interpreter: its kernels against their float64 loop twin (``naive.py``), and composed
objectives through the family against the objective's float64 reference (output, final state,
every gradient including the initial state's, with a gradient on the final state), on lengths
that are not a multiple of the mini-batch, with every output buffer poisoned with NaN."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.minibatch_chunk import chunk as M  # noqa: E402
from ssmcraft.ops.minibatch_chunk.naive import naive_minibatch  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors, kernel_inputs, rel_rms as rel  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}
F64 = torch.float64


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(M, "POISON", True)
    monkeypatch.setattr(M, "INTERPRET_BV", None)


def _twin_case(B, T, H, K, V, row, decay, seed, anchor=False, predict=True):
    """[u, v, p, c, oq, a, h0, lam] (u None without a prediction, a and lam None when absent)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)       # noqa: E731
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)            # noqa: E731
    c = torch.rand(B, T, H, *((V,) if row else ()), generator=g, dtype=F64)
    a = 0.5 + 0.5 * torch.rand(B, T, H, generator=g, dtype=F64) if decay else None
    lam = 0.05 * torch.rand(B, T, H, generator=g, dtype=F64) if anchor else None
    u = unit(r(B, T, H, K)) if predict else None
    return [u, unit(r(B, T, H, K)), r(B, T, H, V), c, r(B, T, H, K), a, r(B, H, K, V), lam], g


# (T, C, per-row step, decay a, value block, anchor decay lam, prediction u)
TWIN = [
    (1, 16, False, False, None, False, True), (37, 16, False, True, None, False, True),
    (37, 16, True, False, 16, False, True), (70, 32, True, True, None, False, True),
    (65, 64, False, True, 16, False, True),
    (37, 16, False, False, None, True, True), (70, 32, True, True, 16, True, True),
    (9, 16, True, False, None, True, True),
    (37, 16, False, False, 16, False, False), (33, 32, True, True, None, False, False),
    (70, 32, False, True, None, True, False),
]


@pytest.mark.parametrize("T,C,row,decay,bv,anchor,predict", TWIN)
def test_kernels_match_their_loop_twin(T, C, row, decay, bv, anchor, predict, monkeypatch):
    monkeypatch.setattr(M, "INTERPRET_BV", bv)
    xs, g = _twin_case(2, T, 2, 16, 24, row, decay, T + C, anchor, predict)
    xs = [None if x is None else x.requires_grad_() for x in xs]
    o, ht = naive_minibatch(*xs[:7], C, lam=xs[7])
    do, dht = torch.randn(o.shape, generator=g, dtype=F64), torch.randn(ht.shape, generator=g, dtype=F64)
    want = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [x for x in xs if x is not None])
    ys = [None if x is None else x.detach().float().requires_grad_() for x in xs]
    u, v, p, c, oq, a, h0, lam = ys
    o2, ht2 = M.chunk_minibatch(u, v, p, c, oq, a=a, lam=lam, initial_state=h0, output_final_state=True,
                                chunk_size=C)
    got = torch.autograd.grad((o2 * do.float()).sum() + (ht2 * dht.float()).sum(), [x for x in ys if x is not None])
    assert rel(o2, o) < TOL["y"] and rel(ht2, ht) < TOL["S_T"]
    names = [n for n, x in zip("u v p c oq a h0 lam".split(), xs) if x is not None]
    assert len(got) == len(names)
    for name, x, y in zip(names, got, want):
        assert rel(x, y) < TOL["grad"], name


def test_no_initial_state_and_no_final_gradient():
    xs, g = _twin_case(1, 20, 2, 16, 16, False, True, seed=5)
    xs = xs[:7]
    xs[-1] = torch.zeros_like(xs[-1])
    u, v, p, c, oq, a, _ = [None if x is None else x.float().requires_grad_() for x in xs]
    o, ht = M.chunk_minibatch(u, v, p, c, oq, a=a, chunk_size=16)
    assert ht is None
    o.square().sum().backward()
    ref = [None if x is None else x.clone().requires_grad_() for x in xs[:-1]]
    ro, _ = naive_minibatch(*ref, xs[-1], 16)
    ro.square().sum().backward()
    assert rel(o, ro) < TOL["y"]
    for name, x, y in zip("u v p c oq a".split(), (u, v, p, c, oq, a), ref):
        assert rel(x.grad, y.grad) < TOL["grad"], name


# composed objectives the family runs (none is in the library): (choices, T)
COMPOSED = [
    ({"update": "explicit", "minibatch": 16}, 37),                                   # per-row step
    ({"update": "explicit", "minibatch": 32, "step": "scalar", "normalize": True}, 70),
    ({"update": "explicit", "minibatch": 16, "proximity": "scalar_decay", "step": "scalar"}, 33),
    ({"update": "explicit", "minibatch": 64, "proximity": "scalar_decay", "normalize": True}, 67),
    # a linear data term (no prediction: S_t = S_c + sum beta x k^T)
    ({"update": "explicit", "minibatch": 16, "data": "linear", "step": "scalar", "normalize": True}, 37),
    ({"update": "explicit", "minibatch": 32, "data": "linear", "proximity": "scalar_decay"}, 21),   # held out, T < C
    # a Newton step on a linear loss (no curvature: the explicit step), held out
    ({"update": "newton", "minibatch": 64, "data": "linear", "proximity": "scalar_decay", "step": "scalar"}, 70),
    # weight decay, its gradient lam S_c taken at the chunk's start as the data term's
    ({"update": "explicit", "minibatch": 16, "proximity": "weight_decay", "step": "scalar"}, 33),
    ({"update": "explicit", "minibatch": 32, "proximity": "weight_decay", "normalize": True}, 45),  # held out
    ({"update": "explicit", "minibatch": 16, "proximity": "weight_decay", "data": "linear"}, 9),    # both, T < C
]

# a library-free composed objective of each class these kernels run, through ``obj()`` packed
PACKED = [
    {"update": "explicit", "minibatch": 16, "data": "linear", "step": "scalar"},
    {"update": "explicit", "minibatch": 16, "proximity": "weight_decay"},
]


@pytest.mark.parametrize("choices,T", COMPOSED)
def test_composed_objectives_match_the_reference(choices, T):
    obj = ssmcraft.compile(compose_objective(choices))
    assert M.supports(obj.ir) is None
    ins, params, S0, g = kernel_inputs(obj, 2, T, 2, 24, 16, seed=T)
    errs = kernel_errors(obj, lambda o, lay: M.forward(o, lay, None, True), ins, params, S0, g)
    assert_within(errs, TOL)


def test_dispatch_runs_the_family_and_says_so():
    obj = ssmcraft.compile(compose_objective({"update": "explicit", "minibatch": 16, "proximity": "scalar_decay"}))
    obj.prefer = "interpret"
    ins, params, S0, _ = kernel_inputs(obj, 1, 21, 2, 8, 16, seed=1)
    ins = {k: v.float() for k, v in ins.items()}
    y, S = obj(ins, None, S0.float(), True)
    assert obj.backend == "triton-interpret:minibatch-chunk"
    yr, Sr = obj.reference(ins, None, S0.float(), True)
    assert rel(y, yr) < 1e-5 and rel(S, Sr) < 1e-5
    assert registry.family("minibatch_chunk").reason(obj.ir) is None


@pytest.mark.parametrize("choices", PACKED)
def test_packed_equals_separate(choices):
    """A packed row through ``obj()`` (odd lengths, empty ones, some under a mini-batch of 16 and some
    over) against each sequence's own float64 reference: output, final states, every gradient."""
    from test_varlen import _interpret, packed_errors
    obj = ssmcraft.compile(compose_objective(choices))
    errs = packed_errors(obj, [0, 17, 5, 0, 1, 33], _interpret, dtype=torch.float32, d=6, m=16)
    assert obj.backend == "triton-interpret:minibatch-chunk+packed"
    assert_within(errs, TOL)


@pytest.mark.parametrize("choices,why", [
    ({"update": "explicit", "minibatch": 8}, "mini-batch of 8"),
    ({"update": "explicit", "minibatch": 16, "data": "huber"}, "not a one-state mini-batch update"),
    ({"update": "explicit", "minibatch": 16, "proximity": "channel_decay"}, "decay alpha has dims ('d',)"),
    ({"update": "explicit", "minibatch": 16, "proximity": "diagonal_decay"}, "decay alpha has dims ('m',)"),
    ({"update": "explicit"}, "not a one-state mini-batch update"),
])
def test_refusals_say_why(choices, why):
    assert why in M.supports(ssmcraft.compile(compose_objective(choices)).ir)
