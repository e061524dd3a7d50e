"""Issue 14: objectives with several states, derived block-coordinate in declaration order.

Each state's update is checked against the independent float64 evaluator of
test_compiler_derivation.py (no compiler machinery): with the states declared before it at
their new values and the later ones at their previous values, an implicit state's new value
is the Newton minimiser of its own loss (autograd Hessian, positive definite) and zeroes its
gradient; an explicit state's is one gradient step of its loss from its previous value.
Five steps of ``reference`` equal five iterations of these stages done literally, and the
vectorised path equals the reference. Tolerances as in test_compiler_derivation.py (float64,
rtol 1e-9, atol 1e-9 * scale; gradient <= 1e-10 * its scale).
"""
from __future__ import annotations

import json

import pytest
import torch
from test_compiler_derivation import Evaluator, Val

import ssmcraft
from ssmcraft.compiler import expr as E
from ssmcraft.compiler.updates import derive_stages
from ssmcraft.compiler.spec import load_spec
from ssmcraft.compiler.symbolic import symbolic_objective

F64 = torch.float64
RTOL, ATOL, GRAD_TOL = 1e-9, 1e-9, 1e-10
B, H, d, m = 1, 2, 3, 4

INPUTS = {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True}, "q": {"shape": ["m"]},
          "beta": {"shape": ["d"], "positive": True}, "mu": {"shape": [], "bounded": True}}
EXPLICIT_D = {"name": "momentum_explicit", "state": {"D": ["d", "m"], "S": ["d", "m"]}, "inputs": INPUTS,
              "objective": {"D": "sq(D - mu*D_prev)/2 + wsq((S_prev + D)*k - x, beta)/2", "S": "sq(S - S_prev - D)/2"},
              "update": {"D": "explicit", "S": "implicit"}, "output": "S*q + D*q"}
# an Adam-like second moment V of the step S - S_prev: quadratic in S -> nonlinear recurrence
SECOND_MOMENT = {"name": "second_moment", "state": {"S": ["d", "m"], "V": ["d", "m"]}, "inputs": INPUTS,
                 "params": {"A": {"shape": ["d", "m"], "positive": True, "init": 0.5}},
                 "objective": {"S": "sq(S - S_prev)/2 + wsq(S*k - x, beta)/2",
                               "V": "sq(V - mu*V_prev - had(A, had(S - S_prev, S - S_prev)))/2"},
                 "update": "implicit", "output": "S*q + V*k"}
CASES = {"momentum_longhorn": "momentum_longhorn", "explicit_step": EXPLICIT_D, "second_moment": SECOND_MOMENT}
# a grid of two-state losses: the first state's loss times the second's, with the updates cycling
# through (implicit, implicit), (explicit, implicit), (implicit, explicit)
FIRST = ["sq(D - mu*D_prev)/2 + sq((S_prev + D)*k - x)/2", "sq(D - D_prev)/2 + wsq(D*k - x + S_prev*q, beta)/2"]
SECOND = ["sq(S - S_prev - D)/2", "sq(S - mu*S_prev)/2 + wsq(S*k - x, beta)/2 + dot(S, D)",
          "sq(S - S_prev - had(D, D))/2 + mu*dot(S*k, x)"]
UPDATES = [("implicit", "implicit"), ("explicit", "implicit"), ("implicit", "explicit")]
GRID = {f"grid{i}{j}": {"name": f"grid{i}{j}", "state": {"D": ["d", "m"], "S": ["d", "m"]}, "inputs": INPUTS,
                        "objective": {"D": a, "S": b}, "output": "S*q + D*k" if j else "S*q",
                        "update": dict(zip("DS", UPDATES[(i + j) % 3]))}
        for i, a in enumerate(FIRST) for j, b in enumerate(SECOND)}
ALL = {**CASES, **GRID}


def _stage_loss(ev, text, values, name, X):
    env = dict(ev.base)
    env.update({n: Val(v, "d", "m") for n, v in values.items()})
    env[name] = Val(X, "d", "m")
    v = ev._eval(E.parse(text), env, ())
    assert v.scalar
    return v.t.reshape(())


def _grad(ev, text, values, name, X, create_graph=False):
    X = X.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_stage_loss(ev, text, values, name, X), X, create_graph=create_graph)
    return g


def _newton(ev, text, values, name):
    X0 = torch.zeros(d, m, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(_stage_loss(ev, text, values, name, X0), X0, create_graph=True)
    g = g.reshape(-1)
    rows = []
    for i in range(d * m):
        (hi,) = torch.autograd.grad(g[i], X0, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros(d * m, dtype=F64) if hi is None else hi.reshape(-1))
    Hm = torch.stack(rows)
    assert torch.linalg.eigvalsh((Hm + Hm.T) / 2).min() > 1e-8, "stage loss not strictly convex"
    return (-torch.linalg.solve(Hm, g.detach())).reshape(d, m)


def literal_step(spec, ev, prev: dict) -> dict:
    """One step done literally, state by state: {name: new value}."""
    values = {f"{x}_prev": prev[x] for x in spec.states}
    new = {}
    for name, text, update in zip(spec.states, spec.objectives, spec.updates):
        if update == "implicit":
            new[name] = _newton(ev, text, values, name)
        else:
            new[name] = prev[name] - _grad(ev, text, values, name, prev[name])
        values[name] = new[name]
    return new


def _output(spec, ev, new):
    env = dict(ev.base)
    env.update({n: Val(v, "d", "m") for n, v in new.items()})
    return ev._eval(E.parse(spec.output), env, ()).t.reshape(-1)


def _setup(case, T, seed):
    from helpers import random_inputs
    obj = ssmcraft.compile(ALL[case])
    inputs, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes={"d": d, "m": m}, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    S0 = tuple(torch.randn(B, H, d, m, generator=g, dtype=F64) for _ in obj.spec.states)
    return obj, inputs, params, S0


def _ev(spec, inputs, params, b, t, h):
    vals = {n: inputs[n][b, t, h] for n in spec.inputs}
    vals.update({n: p[h] for n, p in params.items()})
    return Evaluator(spec, {"d": d, "m": m}, vals)


@pytest.mark.parametrize("case", ALL)
def test_each_state_minimises_or_steps_its_own_loss(case):
    obj, inputs, params, S0 = _setup(case, T=1, seed=5)
    spec = obj.spec
    y, S_T = obj.reference(inputs, params, initial_state=S0)
    assert isinstance(S_T, tuple) and len(S_T) == len(spec.states)
    for b in range(B):
        for h in range(H):
            ev = _ev(spec, inputs, params, b, 0, h)
            prev = {x: S0[i][b, h] for i, x in enumerate(spec.states)}
            new = {x: S_T[i][b, h] for i, x in enumerate(spec.states)}
            values = {f"{x}_prev": prev[x] for x in spec.states}
            for i, (name, text, update) in enumerate(zip(spec.states, spec.objectives, spec.updates)):
                scale = 1 + prev[name].abs().max().item()
                if update == "implicit":
                    g_scale = _grad(ev, text, values, name, prev[name]).norm() + _grad(ev, text, values, name, 0 * prev[name]).norm()
                    g = _grad(ev, text, values, name, new[name])
                    assert g.norm() <= GRAD_TOL * g_scale, f"{name}: gradient at the derived value {g.norm():.3e}"
                    want = _newton(ev, text, values, name)
                else:
                    want = prev[name] - _grad(ev, text, values, name, prev[name])
                torch.testing.assert_close(new[name], want, rtol=RTOL, atol=ATOL * scale)
                values[name] = new[name]       # later states see this state's new value
            torch.testing.assert_close(y[b, 0, h], _output(spec, ev, new).detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ALL)
def test_five_steps_equal_the_literal_stages(case):
    T = 5
    obj, inputs, params, S0 = _setup(case, T=T, seed=9)
    spec = obj.spec
    y, S_T = obj.reference(inputs, params, initial_state=S0)
    y_v, S_v = obj(inputs, params, initial_state=S0)
    assert obj.backend == "torch-vectorised"
    torch.testing.assert_close(y_v, y, rtol=RTOL, atol=ATOL)
    for a, b_ in zip(S_v, S_T):
        torch.testing.assert_close(a, b_, rtol=RTOL, atol=ATOL)
    for b in range(B):
        for h in range(H):
            state = {x: S0[i][b, h] for i, x in enumerate(spec.states)}
            for t in range(T):
                ev = _ev(spec, inputs, params, b, t, h)
                state = {k: v.detach() for k, v in literal_step(spec, ev, state).items()}
                scale = 1 + max(v.abs().max().item() for v in state.values())
                torch.testing.assert_close(y[b, t, h], _output(spec, ev, state), rtol=RTOL, atol=ATOL * scale)
            for i, x in enumerate(spec.states):
                torch.testing.assert_close(S_T[i][b, h], state[x], rtol=RTOL, atol=ATOL * scale)


def test_kinds_stages_and_ir():
    kinds = {c: ssmcraft.compile(v).ir.kind for c, v in CASES.items()}
    assert kinds == {"momentum_longhorn": "general", "explicit_step": "general", "second_moment": "nonlinear"}
    grid = {c: ssmcraft.compile(v).ir.kind for c, v in GRID.items()}
    assert grid == {f"grid{i}{j}": "nonlinear" if j == 2 else "general" for i in range(2) for j in range(3)}
    so = symbolic_objective(load_spec("momentum_longhorn"))
    stages = dict(derive_stages(so))
    S, S_prev, D = (so.lowering.env[n].expr for n in ("S", "S_prev", "D"))
    assert (stages["S"] - (S_prev + D)).expand() == 0        # S's own stage: S = S_prev + D
    ir = ssmcraft.compile("momentum_longhorn").ir
    js = ir.to_json()
    assert js["states"] == ["D", "S"] and set(js["state_updates"]) == {"D", "S"}
    assert "states" not in ssmcraft.compile("longhorn").ir.to_json()     # single-state IR unchanged
    json.dumps(js)


def test_tuple_state_contract_and_errors():
    obj, inputs, params, S0 = _setup("momentum_longhorn", T=3, seed=3)
    y, S = obj.reference(inputs, params, initial_state=S0, output_final_state=False)
    assert S is None and y.shape == (B, 3, H, d)
    with pytest.raises(ssmcraft.SsmcraftError if hasattr(ssmcraft, "SsmcraftError") else Exception,
                       match=r"tuple of 2 tensors, one per state \(D, S\)"):
        obj.reference(inputs, params, initial_state=S0[0])
    with pytest.raises(Exception, match=r"initial_state\[1\] \(S\) must be"):
        obj.reference(inputs, params, initial_state=(S0[0], S0[1][:, :1]))
    assert obj.traced_state == "S"
    assert obj.trace(inputs, params, initial_state=S0).shape == (B, 3, H, d, m)
    tr_d = obj.trace(inputs, params, initial_state=S0, state="D")
    _, S_1 = obj.reference({k: v[:, :1] for k, v in inputs.items()}, params, initial_state=S0)
    torch.testing.assert_close(tr_d[:, 0], S_1[0])
    with pytest.raises(Exception, match=r"no state 'Z'"):
        obj.trace(inputs, params, state="Z")


def test_gradients_reach_every_initial_state():
    obj, inputs, params, S0 = _setup("momentum_longhorn", T=4, seed=4)
    S0 = tuple(s.requires_grad_(True) for s in S0)
    y, S = obj(inputs, params, initial_state=S0)
    (y.sum() + S[0].square().sum() + S[1].sum()).backward()
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in S0)


def loop_momentum_longhorn(inp, S0):
    """Hand loop: per row i, d_i = argmin ||d - mu d_prev_i||^2/2 + beta_i ((s_prev_i + d) k - x_i)^2/2,
    by torch.linalg.solve of (I + beta_i k k^T) d_i = mu d_prev_i + beta_i (x_i - s_prev_i k) k; then s_i += d_i."""
    D, S = (s.clone() for s in S0)
    ys = []
    for t in range(inp["x"].shape[1]):
        k, x, beta, mu, q = (inp[n][:, t] for n in ("k", "x", "beta", "mu", "q"))
        A = torch.eye(k.shape[-1], dtype=F64) + beta[..., :, None, None] * (k[..., :, None] * k[..., None, :])[..., None, :, :]
        r = x - (S @ k[..., None])[..., 0]
        rhs = mu[..., None, None] * D + (beta * r)[..., None] * k[..., None, :]
        D = torch.linalg.solve(A, rhs[..., None])[..., 0]
        S = S + D
        ys.append((S @ q[..., None])[..., 0])
    return torch.stack(ys, 1), (D, S)


def test_reference_equals_hand_loop():
    obj, inputs, params, S0 = _setup("momentum_longhorn", T=6, seed=13)
    y, S = obj.reference(inputs, params, initial_state=S0)
    y_h, S_h = loop_momentum_longhorn(inputs, S0)
    torch.testing.assert_close(y, y_h, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(S, S_h, rtol=RTOL, atol=ATOL)
    y0, S0_T = obj.reference(inputs, params)            # no initial state: zeros
    torch.testing.assert_close((y0, S0_T), loop_momentum_longhorn(inputs, tuple(torch.zeros_like(s) for s in S0)),
                               rtol=RTOL, atol=ATOL)
