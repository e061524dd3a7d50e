"""Deep memory: a memory that is a small MLP, two weight states over a hidden dimension
(``hidden: {h: 2*m}``, ``W1: [h, m]``, ``W2: [d, h]``), read out as ``W2 silu(W1 q)`` and updated by
one gradient step of a regression loss (objectives/ttt_mlp.yaml, TTT-MLP / Titans style).

Checked against autograd, without the compiler's machinery: each state's step against the
gradient of its own loss text (the independent float64 evaluator of test_compiler_derivation.py,
which knows named dimensions, so the hidden one too), and the joint step against autograd's gradient
of the one regression loss ``eta/2 |W2 silu(W1 k) - x|^2`` written in torch; five steps from the
declared initial value (the rectangular identity) and from a random one; the fast path equals the
reference; gradients reach every input and both initial weights (``gradcheck``). Tolerances as in
test_compiler_multistate.py (float64, rtol 1e-9, atol 1e-9 * scale).
"""
from __future__ import annotations

import copy

import pytest
import torch
from test_compiler_derivation import Evaluator, Val

import ssmcraft
from ssmcraft.compiler import expr as E
from ssmcraft.errors import SpecError, SsmcraftError

F64 = torch.float64
RTOL, ATOL = 1e-9, 1e-9
B, H, d, m = 2, 2, 3, 4
h = 2 * m                                   # ttt_mlp declares hidden: {h: 2*m}
SIZES = {"d": d, "m": m, "h": h}
silu = torch.nn.functional.silu


def _inputs(obj, T, seed):
    from helpers import random_inputs
    return random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=seed)[0]


def _random_states(seed):
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(B, H, h, m, generator=g, dtype=F64), 0.5 * torch.randn(B, H, d, h, generator=g, dtype=F64))


def joint_step(W1, W2, k, x, eta):
    """One gradient step of eta/2 |W2 silu(W1 k) - x|^2 in (W1, W2) jointly, by autograd."""
    A, Bm = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
    loss = eta * ((Bm @ silu(A @ k)) - x).square().sum() / 2
    gA, gB = torch.autograd.grad(loss, (A, Bm))
    return W1 - gA, W2 - gB


def test_each_weight_steps_its_own_loss_and_the_pair_is_the_joint_step():
    obj = ssmcraft.compile("ttt_mlp")
    spec = obj.spec
    inputs = _inputs(obj, 1, seed=3)
    S0 = _random_states(4)
    y, (W1, W2) = obj.reference(inputs, initial_state=S0)
    for b in range(B):
        for hd in range(H):
            ev = Evaluator(spec, SIZES, {n: inputs[n][b, 0, hd] for n in spec.inputs})
            prev = {"W1_prev": Val(S0[0][b, hd], "h", "m"), "W2_prev": Val(S0[1][b, hd], "d", "h")}
            for name, text, new in zip(spec.states, spec.objectives, (W1[b, hd], W2[b, hd])):
                X = prev[f"{name}_prev"].t.clone().requires_grad_(True)
                env = {**ev.base, **prev, name: Val(X, *spec.shape_of(name))}
                (g,) = torch.autograd.grad(ev._eval(E.parse(text), env, ()).t.reshape(()), X)
                torch.testing.assert_close(new, X.detach() - g, rtol=RTOL, atol=ATOL)
            k, x, eta = (inputs[n][b, 0, hd] for n in ("k", "x", "eta"))
            J1, J2 = joint_step(S0[0][b, hd], S0[1][b, hd], k, x, eta)
            torch.testing.assert_close((W1[b, hd], W2[b, hd]), (J1, J2), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(y[b, 0, hd], J2 @ silu(J1 @ inputs["q"][b, 0, hd]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("start", ["declared", "random"])
def test_five_steps_equal_the_joint_gradient_loop(start):
    obj = ssmcraft.compile("ttt_mlp")
    T = 5
    inputs = _inputs(obj, T, seed=7)
    S0 = _random_states(8) if start == "random" else None
    y, (W1, W2) = obj.reference(inputs, initial_state=S0)
    y_v, S_v = obj(inputs, initial_state=S0)
    assert obj.backend == "torch-vectorised"
    torch.testing.assert_close((y_v, S_v), (y, (W1, W2)), rtol=RTOL, atol=ATOL)
    if S0 is None:      # the declared start: the rectangular identity, 1.0 * I
        S0 = (torch.eye(h, m, dtype=F64).expand(B, H, h, m), torch.eye(d, h, dtype=F64).expand(B, H, d, h))
        torch.testing.assert_close(obj.initial_states(B, H, d, m, dtype=F64), S0, rtol=0, atol=0)
    for b in range(B):
        for hd in range(H):
            A, Bm = S0[0][b, hd], S0[1][b, hd]
            for t in range(T):
                A, Bm = joint_step(A, Bm, *(inputs[n][b, t, hd] for n in ("k", "x", "eta")))
                torch.testing.assert_close(y[b, t, hd], Bm @ silu(A @ inputs["q"][b, t, hd]), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close((W1[b, hd], W2[b, hd]), (A, Bm), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("C", [1, 3])
def test_minibatch_steps_take_both_weights_gradient_at_the_chunk_start(C):
    """TTT's mini-batch: within a chunk of C tokens each token's gradient is taken at the weights
    before the chunk, (W1_c, W2_c); the steps add up. T = 7: a short last chunk."""
    spec = _spec(approximation={"minibatch": C})
    obj = ssmcraft.compile(spec)
    T = 7
    inputs = _inputs(obj, T, seed=11)
    S0 = _random_states(12)
    y, (W1, W2) = obj.reference(inputs, initial_state=S0)
    y_v, S_v = obj(inputs, initial_state=S0)
    torch.testing.assert_close((y_v, S_v), (y, (W1, W2)), rtol=RTOL, atol=ATOL)
    assert obj.ir.minibatch == C and obj.ir.minibatch_decay == (1, 1)    # chunk-parallel: cumulative sums
    for b in range(B):
        for hd in range(H):
            A, Bm = S0[0][b, hd], S0[1][b, hd]
            for t in range(T):
                if t % C == 0:
                    A_c, B_c = A, Bm
                k, x, eta = (inputs[n][b, t, hd] for n in ("k", "x", "eta"))
                J1, J2 = joint_step(A_c, B_c, k, x, eta)
                A, Bm = A + (J1 - A_c), Bm + (J2 - B_c)         # the gradient at the chunk's start
                torch.testing.assert_close(y[b, t, hd], Bm @ silu(A @ inputs["q"][b, t, hd]), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close((W1[b, hd], W2[b, hd]), (A, Bm), rtol=RTOL, atol=ATOL)
    gradcheck(obj, inputs, S0)


def gradcheck(obj, inputs, S0):
    """Finite differences against the fast path's gradients: every input and both initial weights
    (one sequence, one head, float64)."""
    leaves = {k: v[:1, :, :1].clone().requires_grad_(True) for k, v in inputs.items()}
    W = tuple(s[:1, :1].clone().requires_grad_(True) for s in S0)

    def f(W1, W2, *xs):
        y, (W1_T, W2_T) = obj(dict(zip(leaves, xs)), initial_state=(W1, W2))
        return y, W1_T, W2_T
    assert torch.autograd.gradcheck(f, (*W, *leaves.values()), eps=1e-6, atol=1e-7)


def test_gradients_reach_the_inputs_and_both_initial_weights():
    obj = ssmcraft.compile("ttt_mlp")
    gradcheck(obj, _inputs(obj, 3, seed=5), _random_states(6))


def test_shapes_contract_and_refusals():
    obj = ssmcraft.compile("ttt_mlp")
    assert obj.state_shapes(B, H, d, m) == {"W1": (B, H, h, m), "W2": (B, H, d, h)}
    assert obj.state_elements(H, d, m) == H * (h * m + d * h)
    js = obj.ir.to_json()
    assert js["hidden"] == {"h": [2, "m"]} and js["state_shapes"] == {"W1": ["h", "m"], "W2": ["d", "h"]}
    inputs = _inputs(obj, 2, seed=1)
    W1, W2 = _random_states(2)
    with pytest.raises(SsmcraftError, match=r"hidden dimension h \(its rule\) has h = 8, but another tensor has h = 5"):
        obj.reference(inputs, initial_state=(W1[..., :5, :], W2[..., :5]))
    from ssmcraft.ops.general import recurrent as general
    assert "states of several shapes (W1: [h,m], W2: [d,h])" in general.supports(obj.ir)


def _spec(**kw):
    from ssmcraft.compiler.library import find_objective
    import yaml
    spec = yaml.safe_load(find_objective("ttt_mlp").read_text())
    spec = copy.deepcopy(spec)
    spec.update(kw)
    return spec


@pytest.mark.parametrize("spec,key,problem", [
    (_spec(hidden={"h": "2*z"}), "hidden.h", "a size N*dim names d or m, got 'z'"),
    (_spec(hidden={"h": 0}), "hidden.h", "an integer 1..4096, or N*dim"),
    (_spec(hidden={"h": 8, "g": 4}), "hidden.g", "no state uses this dimension"),
    (_spec(state={"W1": ["h", "m"], "W2": ["h", "d"]}), "state", "the value dimension as a row and the key dimension "
     "as a column"),
    (_spec(state={"W": ["d", "h"]}, objective="sq(W*silu(k) - x)/2"), "hidden",
     "declare its weights as several states"),
    (_spec(inputs={"x": {"shape": ["d"]}, "k": {"shape": ["h"]}, "q": {"shape": ["m"]}, "eta": {"shape": []}}),
     "inputs.k.shape", "unknown dimension 'h'"),
])
def test_hidden_refusals(spec, key, problem):
    with pytest.raises(SpecError) as info:
        ssmcraft.compile(spec)
    assert info.value.key == key and problem in info.value.problem, info.value
