"""The compose space: the spec text each new term writes, that the space expresses the
library's layers exactly (same derived update), and that what derives today is the update its
terms promise, checked numerically in float64 with the independent evaluator of
test_compiler_derivation (autograd, no compiler machinery).

Only compositions that derive with today's compiler are derived here; the others (a closed form
for a non-quadratic loss, two keys implicit, ``update: newton``) are checked as spec text only.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import ssmcraft
from ssmcraft.search.compose import TERMS, compose_objective, compose_terms, composed_name
from ssmcraft.study.rediscovery import update_fingerprint
from test_compiler_derivation import (  # the independent float64 model of the spec language
    F64, STEP_ATOL, STEP_RTOL, Evaluator, _slice_values, exact_step, loss_grad)

# ------------------------------------------------------------------ spec text


@pytest.mark.parametrize("choices, objective", [
    ({"data": "huber", "step": "scalar"}, "sq(S - S_prev)/2 + beta*(sqrt(1 + sq(S*k - x)) - 1)"),
    ({"data": "huber"}, "sq(S - S_prev)/2 + dot(beta, sqrt(ones(d) + had(S*k - x, S*k - x)) - ones(d))"),
    ({"data": "cauchy", "step": "scalar"}, "sq(S - S_prev)/2 + beta*log(1 + sq(S*k - x))/2"),
    ({"data": "cauchy"}, "sq(S - S_prev)/2 + dot(beta, log(ones(d) + had(S*k - x, S*k - x)))/2"),
    ({"proximity": "channel_decay"}, "sq(S - diag(alpha)*S_prev)/2 + wsq(S*k - x, beta)/2"),
    ({"proximity": "weight_decay", "step": "scalar"}, "sq(S - S_prev)/2 + lam*sq(S)/2 + beta*sq(S*k - x)/2"),
    ({"keys": 2}, "sq(S - S_prev)/2 + wsq(S*k - x, beta)/2 + wsq(S*k2 - x2, beta)/2"),
    ({"keys": 2, "data": "linear", "step": "scalar"}, "sq(S - S_prev)/2 - beta*dot(S*k, x) - beta*dot(S*k2, x2)"),
])
def test_new_terms_write_their_objective(choices, objective):
    spec = compose_objective(choices)
    assert spec["objective"] == objective and "let" not in spec
    assert spec["update"] == "implicit"
    assert ("alpha" in spec["inputs"]) == (choices.get("proximity") in ("channel_decay",))


def test_new_inputs_are_declared_with_their_shape_and_range():
    spec = compose_objective({"proximity": "channel_decay", "keys": 2, "normalize": True})
    assert spec["inputs"]["alpha"] == {"shape": ["d"], "bounded": True}
    assert spec["inputs"]["k2"] == {"shape": ["m"], "normalize": True} and spec["inputs"]["x2"] == {"shape": ["d"]}
    spec = compose_objective({"proximity": "weight_decay"})
    assert spec["inputs"]["lam"] == {"shape": [], "positive": True, "bounded": True} and "alpha" not in spec["inputs"]


def test_newton_and_decay_explicit_write_the_update_they_name():
    newton = compose_objective({"data": "huber", "update": "newton"})
    assert newton["update"] == "newton" and newton["name"] == "c_plain_hubr_cstep_newt_exact"
    assert newton["objective"] == compose_objective({"data": "huber"})["objective"]
    gd = compose_objective({"proximity": "scalar_decay", "step": "scalar", "update": "decay_explicit", "keys": 2})
    assert gd["update"] == "implicit"
    assert gd["let"] == {"anchor": "alpha*S_prev", "residual": "anchor*k - x", "residual2": "anchor*k2 - x2"}
    assert gd["objective"] == "sq(S - anchor)/2 + beta*dot(S*k, residual) + beta*dot(S*k2, residual2)"
    wd = compose_objective({"proximity": "weight_decay", "data": "cauchy", "update": "decay_explicit"})
    assert wd["let"]["anchor"] == "S_prev/(1 + lam)"
    assert wd["objective"] == ("sq(S - anchor)/2 + dot(S*k, had(beta, residual)/(ones(d) + "
                               "had(residual, residual)))")


def test_names_are_unique_short_and_stable():
    combos = [c for c in (dict(zip(TERMS, v)) for v in itertools.product(*TERMS.values()))
              if not (c["minibatch"] and c["approximation"] != "exact")]     # refused: a mini-batch is exact
    names = {composed_name(c) for c in combos}
    assert len(names) == len(combos) and max(map(len, names)) <= 32
    # names stored by earlier studies (terms that existed then, the new ones at their defaults)
    assert composed_name({"proximity": "scalar_decay", "normalize": True}) == "c_sdec_regr_cstep_impl_exact_n"
    assert composed_name({"data": "linear", "step": "scalar", "update": "explicit",
                          "approximation": "diagonal"}) == "c_plain_lin_sstep_expl_diag"
    assert composed_name({"proximity": "weight_decay", "keys": 2, "update": "decay_explicit",
                          "normalize": True}) == "c_wdec_regr2_cstep_dexp_exact_n"


# ------------------------------------------------------------------ the library, by derived update

LIBRARY_TWINS = [
    ("gated_deltanet", {"proximity": "scalar_decay", "step": "scalar", "update": "decay_explicit", "normalize": True}),
    ("longhorn", {"proximity": "plain", "data": "regression", "step": "per_channel", "update": "implicit"}),
    ("longhorn_diag", {"approximation": "diagonal"}),
    ("gated_longhorn", {"proximity": "scalar_decay"}),
    ("deltanet", {"step": "scalar", "update": "explicit", "normalize": True}),
    ("deltanet", {"step": "scalar", "update": "decay_explicit"}),      # no decay: the same step
    ("cauchy_delta", {"data": "cauchy", "step": "scalar", "update": "explicit"}),
]


@pytest.mark.parametrize("name, choices", LIBRARY_TWINS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LIBRARY_TWINS)])
def test_the_space_expresses_library_layers_exactly(name, choices, compiled):
    assert update_fingerprint(ssmcraft.compile(compose_objective(choices))) == update_fingerprint(compiled(name))


def test_an_explicit_step_on_a_decayed_proximity_is_not_gated_deltanet(compiled):
    """The reason for decay_explicit: one gradient step of the whole objective from S_prev
    gives alpha S_prev - beta (S_prev k - x) k^T, not alpha S_prev (I - beta k k^T) + beta x k^T."""
    choices = {"proximity": "scalar_decay", "step": "scalar", "update": "explicit", "normalize": True}
    assert update_fingerprint(ssmcraft.compile(compose_objective(choices))) != update_fingerprint(compiled("gated_deltanet"))


# ------------------------------------------------------------------ numerics (float64)

def _one_step(choices, random_inputs, seed=5):
    """Compile ``choices``, run one reference step from a random state; yields per (b, h):
    (evaluator, S_prev, S_t)."""
    obj = ssmcraft.compile(compose_objective(choices))
    spec = obj.spec
    sizes = {"d": 3, "m": 4}
    inputs, params = random_inputs(spec, B=1, T=1, H=2, sizes=sizes, seed=seed)
    S0 = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    _, S_T = obj.reference(inputs, params, initial_state=S0)
    for h in range(2):
        yield Evaluator(spec, sizes, _slice_values(spec, inputs, params, 0, 0, h)), S0[0, h], S_T[0, h]


DECAY_EXPLICIT = [{"proximity": p, "data": d, "step": s, "update": "decay_explicit"}
                  for p in ("scalar_decay", "diagonal_decay", "channel_decay", "weight_decay")
                  for d in ("regression", "huber", "cauchy") for s in ("scalar", "per_channel")]


@pytest.mark.parametrize("choices", DECAY_EXPLICIT, ids=[composed_name(c) for c in DECAY_EXPLICIT])
def test_decay_explicit_is_a_data_step_from_the_decayed_state(choices, random_inputs):
    """S_t = A - grad l(A), A the proximity's minimiser, l the data term of the same choices
    (the one the implicit and explicit compositions use), by autograd."""
    terms = compose_terms(choices)
    for ev, S_prev, S_t in _one_step(choices, random_inputs):
        A = ev.evaluate(terms["anchor"], S_prev.clone(), S_prev).t
        S = A.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(ev.evaluate(terms["data"], S, S_prev).t.sum(), S)
        want = A - g
        assert torch.isfinite(S_t).all() and (g.norm() > 1e-3)
        torch.testing.assert_close(S_t, want, rtol=STEP_RTOL, atol=STEP_ATOL * (1 + S_prev.abs().max().item()))


NEW_DERIVING = [
    {"proximity": "channel_decay"},
    {"proximity": "channel_decay", "update": "explicit", "step": "scalar"},
    {"proximity": "weight_decay"},
    {"proximity": "weight_decay", "update": "explicit"},
    {"data": "huber", "update": "explicit"},
    {"data": "cauchy", "update": "explicit", "proximity": "diagonal_decay"},
    {"keys": 2, "update": "explicit", "normalize": True},
    {"keys": 2, "data": "linear", "proximity": "scalar_decay"},
    {"keys": 2, "data": "huber", "update": "decay_explicit", "proximity": "scalar_decay", "step": "scalar"},
]


@pytest.mark.parametrize("choices", NEW_DERIVING, ids=[composed_name(c) for c in NEW_DERIVING])
def test_new_compositions_derive_the_update_of_their_objective(choices, random_inputs):
    """implicit: the gradient of the objective vanishes at S_t; explicit: S_t = S_prev - grad L(S_prev)."""
    for ev, S_prev, S_t in _one_step(choices, random_inputs):
        scale = 1 + S_prev.abs().max().item()
        if ev.spec.update == "implicit":
            g_scale = loss_grad(ev, S_prev, S_prev).norm() + loss_grad(ev, torch.zeros_like(S_prev), S_prev).norm()
            assert loss_grad(ev, S_t, S_prev).norm() <= 1e-10 * g_scale
        else:
            torch.testing.assert_close(S_t, exact_step(ev, S_prev, "explicit").detach(),
                                       rtol=STEP_RTOL, atol=STEP_ATOL * scale)
