"""The objective mixer over real compiled objectives: recurrent == parallel, gradients,
input activations, parameter inits and constraints."""
import math
from pathlib import Path

import pytest
import torch

import ssmcraft
from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers import ObjectiveMixer, ObjectiveMixerConfig

OBJECTIVES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "objectives").glob("*.yaml"))

# every activation rule and init form of the contract in one objective
PROBE = {
    "name": "probe", "state": {"S": ["d", "m"]},
    "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True},
               "q": {"shape": ["m"], "activation": "silu"}, "g": {"shape": ["d"], "bounded": True},
               "w": {"shape": [], "positive": True}, "dt": {"shape": ["d"], "positive": True}},
    "params": {"A": {"shape": ["d", "m"], "negative": True, "init": "s4d_real"},
               "r": {"shape": [], "positive": True, "init": "retnet_decay"}},
    "objective": "sq(S - r*had(exp(A), S_prev))/2 - w*dot(S*k, had(had(g, dt), x))",
    "update": "implicit", "output": "S*q",
}


def _mixer(objective, d_model=16, heads=2, m=4, **kw):
    torch.manual_seed(0)
    cfg = ObjectiveMixerConfig(objective=objective, heads=heads, state_size=m, **kw)
    return ObjectiveMixer(cfg, d_model, ssmcraft.compile(objective))


def test_library_is_there():
    assert {"longhorn", "mamba", "deltanet"} <= set(OBJECTIVES)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_recurrent_mode_equals_parallel_mode(name):
    mixer = _mixer(name).double()
    h = torch.randn(2, 11, 16, dtype=torch.float64)
    parallel = mixer(h)
    cache, outs = mixer.init_cache(2), []
    for t in range(h.shape[1]):
        y, cache = mixer.step(h[:, t], cache)
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, 1), parallel, rtol=1e-9, atol=1e-10)
    states = cache.state if mixer.obj.spec.states else (cache.state,)      # several states: a tuple
    assert len(states) == len(mixer.obj.spec.state_names())
    # [B, H, d = 2 * 16 / 2, m] each, [B, H, m, m] for a square state
    assert [s.shape for s in states] == list(mixer.obj.state_shapes(2, 2, 16, 4).values())


@pytest.mark.parametrize("name", OBJECTIVES)
def test_gradients_reach_every_parameter(name):
    mixer = _mixer(name)
    mixer(torch.randn(2, 9, 16)).square().mean().backward()
    missing = [n for n, p in mixer.named_parameters()
               if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0)]
    assert not missing


def test_input_activations_follow_the_declarations():
    mixer = _mixer(PROBE, heads=2, m=4)
    u = torch.randn(3, 7, mixer.D) * 3
    inputs = mixer.project(u)
    assert inputs["x"].shape == (3, 7, 2, 16) and torch.equal(inputs["x"], u.view(3, 7, 2, 16))   # value = conv out
    assert inputs["w"].shape == (3, 7, 2) and (inputs["w"] > 0).all()                            # softplus
    assert ((inputs["g"] > 0) & (inputs["g"] < 1)).all()                                          # sigmoid
    torch.testing.assert_close(inputs["k"].norm(dim=-1), torch.ones(3, 7, 2))                    # L2-normalised
    assert (inputs["q"] >= -0.28).all()                                                           # silu's minimum
    assert mixer.route["dt"].startswith("low-rank") and mixer.route["k"].startswith("linear")
    assert mixer.activation == {"x": "identity", "k": "identity", "q": "silu", "g": "sigmoid", "w": "softplus",
                                "dt": "softplus"}


def test_softplus_inputs_start_in_the_dt_range():
    mixer = _mixer(PROBE, dt_min=1e-3, dt_max=1e-1)
    bias = mixer.proj["dt"][1].bias
    dt = torch.nn.functional.softplus(bias)
    assert (dt >= 1e-3 * 0.999).all() and (dt <= 1e-1 * 1.001).all()
    mixer2 = _mixer(PROBE, input_bias={"g": 2.0})
    g_bias = mixer2.proj["g"][1].bias                            # [d] gate: low-rank projection
    assert torch.allclose(g_bias, torch.full_like(g_bias, 2.0))


def test_param_inits_and_sign_constraints():
    mixer = _mixer(PROBE, heads=3, d_model=12, m=5)
    values = mixer.param_values()
    A = values["A"]
    assert A.shape == (3, 8, 5)                                  # [H, d, m], d = 2 * 12 / 3
    assert torch.allclose(A, -(torch.arange(5.0) + 1).expand(3, 8, 5))
    assert torch.allclose(values["r"], 1 - 2.0 ** (-5 - torch.arange(3.0)))
    assert torch.allclose(mixer.raw_params["A"], torch.log(-A))  # stored as log-magnitude
    with torch.no_grad():
        mixer.raw_params["A"].fill_(10.0)
    assert (mixer.param_values()["A"] < 0).all()                 # stays negative whatever the raw value


def test_init_violating_the_declared_sign_is_refused():
    bad = {**PROBE, "params": {**PROBE["params"], "A": {"shape": ["d", "m"], "positive": True, "init": "s4d_real"}}}
    with pytest.raises(SsmcraftError, match="declared positive"):
        _mixer(bad)


def test_value_input_choice():
    assert _mixer("longhorn").value_name == "x"
    none = _mixer("longhorn", value_input="none")
    assert none.value_name is None and none.route["x"].startswith("linear")
    with pytest.raises(SpecError, match="not a \\[d\\] input"):
        _mixer("longhorn", value_input="k")


def test_heads_must_divide_the_inner_width():
    with pytest.raises(SpecError, match="not divisible"):
        _mixer("longhorn", d_model=10, heads=3)


def test_describe_is_json_ready():
    import json

    info = _mixer("mamba").describe()
    json.dumps(info)
    assert info["objective"] == "mamba" and info["params"]["A"]["constraint"] == "negative"
    assert math.prod(info["params"]["A"]["shape"]) == 2 * 16 * 4
