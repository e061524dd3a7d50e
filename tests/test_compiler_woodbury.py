"""Issue 14: rank-r implicit updates (Woodbury), one Newton step (``update: newton``), the
``rankr`` structure class and the two library objectives that use them.

The library-wide numerical checks (the derived step zeroes autograd's gradient and equals a
Newton solve; newton equals one autograd Newton step; diagonal equals the diagonal of the
exact transition) run in ``test_compiler_derivation.py`` over the library and its EXTRA
cases (rank 2, 3 and 4, cross terms, per head, weighted proximity, newton on two keys). Here:
newton == implicit on quadratics, the classification into ``rankr`` and its slots, the
diagonal approximation, mitigation, the printed forms, refusals, and a few training steps of
the new objectives in the mixer (float64 unless said)."""
import copy
import json

import pytest
import torch
import yaml

import ssmcraft
from ssmcraft.compiler.library import find_objective
from ssmcraft.errors import DerivationError, SsmcraftError
from ssmcraft.layers import ObjectiveMixer, ObjectiveMixerConfig

F64 = torch.float64


def _raw(name):
    return yaml.safe_load(find_objective(name).read_text())


def _run(obj, T=6, seed=0, sizes=(5, 4), H=2):
    from helpers import random_inputs
    d, m = obj.spec.dims
    inputs, params = random_inputs(obj.spec, B=2, T=T, H=H, sizes={d: sizes[0], m: sizes[1]}, seed=seed)
    S0 = torch.randn(2, H, *sizes, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    return obj.reference(inputs, params, initial_state=S0)


@pytest.mark.parametrize("name", ["longhorn", "wd_longhorn", "gated_longhorn", "longhorn_2key"])
def test_newton_equals_implicit_on_quadratics(name):
    """One Newton step on a quadratic is its minimiser: same structure class, same states and
    outputs to float64 rounding over several steps."""
    implicit = ssmcraft.compile(name)
    newton = ssmcraft.compile({**_raw(name), "name": f"{name}_newton", "update": "newton"})
    assert newton.ir.kind == implicit.ir.kind and newton.ir.update == "newton"
    (y1, S1), (y2, S2) = _run(implicit), _run(newton)
    torch.testing.assert_close(y2, y1, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(S2, S1, rtol=1e-11, atol=1e-11)


def test_newton_on_pseudo_huber_is_a_robust_step():
    """huber_longhorn: a nonlinear recurrence whose step is Longhorn's with the residual
    passed through rho'(r) = r / sqrt(1 + r^2) and the step size through rho'': for a huge
    residual the state moves far less than Longhorn's implicit step."""
    obj = ssmcraft.compile("huber_longhorn")
    assert obj.ir.kind == "nonlinear" and obj.ir.update == "newton"
    lh = ssmcraft.compile("longhorn")
    k = torch.tensor([1.0, 0.0, 0.0], dtype=F64).reshape(1, 1, 1, 3)
    ins = {"k": k, "q": k, "beta": torch.full((1, 1, 1, 2), 0.5, dtype=F64),
           "x": torch.tensor([100.0, 0.1], dtype=F64).reshape(1, 1, 1, 2)}
    (_, S_h), (_, S_l) = obj.reference(ins), lh.reference(ins)
    # row 0: residual -100: Huber's step ~ beta*rho'(r) ~ 0.5, Longhorn's ~ 100/3
    assert S_h[0, 0, 0, 0].abs() < 1.0 < 30 < S_l[0, 0, 0, 0].abs()
    # row 1: small residual: the two agree to O(r^2)
    assert (S_h[0, 0, 1, 0] - S_l[0, 0, 1, 0]).abs() < 1e-3


def test_several_keys_land_in_rankr():
    """Implicit (Woodbury) and explicit updates with two keys are ``rankr`` with L = R = 2;
    the explicit one's erase is diagonal (c01 = c10 = 0, absent); a per-head step is per head."""
    implicit = ssmcraft.compile("longhorn_2key").ir
    assert implicit.kind == "rankr" and implicit.ranks() == (2, 2)
    assert implicit.erase_slots() == ["c00", "c01", "c10", "c11"] and not implicit.is_per_head_step()
    raw = {**_raw("longhorn_2key"), "name": "two_key_explicit", "update": "explicit",
           "inputs": {**_raw("longhorn_2key")["inputs"], "beta": {"shape": [], "bounded": True}},
           "objective": "beta*sq(S*k - x)/2 + beta*sq(S*k2 - x2)/2"}
    explicit = ssmcraft.compile(raw).ir
    assert explicit.kind == "rankr" and explicit.erase_slots() == ["c00", "c11"] and explicit.is_per_head_step()
    assert ssmcraft.compile("longhorn").ir.kind == "rank1"          # rank 1 stays in its class


def test_rankr_diagonal_is_a_diagonal_decay():
    """approximation: diagonal of a Woodbury update: the diagonal of its transition (numerically
    against the exact rankr update's Jacobian in test_compiler_derivation's rank2_diagonal)."""
    obj = ssmcraft.compile({**_raw("longhorn_2key"), "name": "two_key_diag", "approximation": "diagonal"})
    assert obj.ir.kind == "diagonal_decay"
    exact = ssmcraft.compile("longhorn_2key")
    d, m = 3, 4
    from helpers import random_inputs
    ins, _ = random_inputs(exact.spec, B=1, T=1, H=1, sizes={"d": d, "m": m}, seed=5)
    step = lambda S: exact.reference(ins, initial_state=S.reshape(1, 1, d, m))[1].reshape(-1)   # noqa: E731
    S0 = torch.randn(d * m, dtype=F64)
    J = torch.autograd.functional.jacobian(step, S0)
    want = J.diagonal() * S0 + step(torch.zeros(d * m, dtype=F64))
    got = obj.reference(ins, initial_state=S0.reshape(1, 1, d, m))[1].reshape(-1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_printing_json_and_code():
    obj = ssmcraft.compile("longhorn_2key")
    text = obj.update
    assert "c01 . (S_prev u1) v0^T" in text and "_c00 [d] =" in text
    data = obj.ir.to_json()
    assert json.loads(json.dumps(data))["kind"] == "rankr" and {"u0", "u1", "v0", "v1", "c11"} <= set(data["slots"])
    assert "phi1 = (S_prev * co['u1']).sum(-1, keepdim=True)" in obj.source


def test_mitigation_on_rankr():
    obj = ssmcraft.compile("longhorn_2key")
    with pytest.raises(SsmcraftError, match="low-rank erase"):
        obj.mitigated(retention=0.9)
    half = obj.mitigated(insertion=0.5)
    assert half.ir.kind == "rankr"
    S0 = torch.zeros(2, 2, 5, 4, dtype=F64)
    from helpers import random_inputs
    ins, _ = random_inputs(obj.spec, B=2, T=1, H=2, sizes={"d": 5, "m": 4}, seed=2)
    torch.testing.assert_close(half.reference(ins, initial_state=S0)[1], 0.5 * obj.reference(ins, initial_state=S0)[1])


@pytest.mark.parametrize("objective,update,pattern", [
    ("sq(S - S_prev)/2 + sq(S*k - x)/2 + sq(S*q - x)/2 + sq(S*exp(k))/2 + sq(S*exp(q))/2 + sq(S*sigmoid(k))/2",
     "implicit", r"rank-5 part; ssmcraft solves diagonal plus rank <= 4"),
    ("sq(S - S_prev)/2 + dot(S*k, S*q)", "implicit", r"principal minor .* rank-2 part, -1, is negative"),
    ("sq(S - S_prev)/2 + dot(S*k, S*q)/4 + sq(S*k)/16 + sq(S*q)/16", "implicit", r"minor .* rank-2 part, -3/64, is negative"),
    ("sq(S - S_prev)/2 + dot(beta, log(1 + had(S*k - x, S*k - x)))", "newton",
     r"Hessian of the objective at S_prev .* rank-1 part, .*\(1 - \(-x\[i\] \+ Sum\(S_prev\[i, j\]\*k\[j\], \(j, 1, m\)\)\)\*\*2\)"),
])
def test_refusals(objective, update, pattern):
    """r > 4, an indefinite rank-2 part (and one with a positive diagonal, G = [[1/8, 1/4], [1/4, 1/8]]),
    Cauchy's rho'' < 0 under newton: one-line refusals naming the objective key."""
    raw = {**_raw("longhorn"), "name": "refused", "objective": objective, "update": update}
    with pytest.raises(DerivationError, match=pattern) as ei:
        ssmcraft.compile(raw)
    assert ei.value.key == "objective" and "\n" not in str(ei.value)


@pytest.mark.parametrize("name", ["longhorn_2key", "huber_longhorn"])
def test_new_objectives_train_in_the_mixer(name):
    """A few Adam steps of the mixer (CPU, vectorised path) fit a random target: the loss falls."""
    torch.manual_seed(0)
    cfg = ObjectiveMixerConfig(objective=name, heads=2, state_size=4)
    mixer = ObjectiveMixer(cfg, 16, ssmcraft.compile(name))
    h, target = torch.randn(4, 12, 16), torch.randn(4, 12, 16)
    opt = torch.optim.Adam(mixer.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = (mixer(h) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0], losses
