"""Every kernel family that takes a decay, on decays a sigmoid gate reaches in training: drawn in
(0, 1e-6) with exact zeros among them, and tiny and ordinary decays mixed in one chunk, under the
Triton interpreter against the float64 reference (``ssmcraft.runtime.checking``): output, final
state and every gradient, the decay's and the initial state's included, every buffer poisoned
with NaN. Chunks of 16 tokens over 37 (two terms a token: 32 term rows): three chunks, the last partial, the state carried across.

Library layers (Gated DeltaNet, GLA, HGRN, RetNet, Mamba) and composed objectives, each on every
family that runs it on CUDA (``KernelFamily.reason`` in mode "triton"), the row families beside the
chunked ones. The chunked families form log-decays: log 0 = -inf and a cumulative sum through it
made every output NaN; a decay's gradient formed as d log a / a was NaN at a = 0 and, below a ~ 1e-3,
rounding of d log a blown up by 1 / a."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.registry import BY_NAME, FAMILIES  # noqa: E402
from ssmcraft.runtime.checking import DECAY_NAMES, compare, reference, tiny_decays  # noqa: E402
from ssmcraft.runtime.select import validated_call  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_inputs  # noqa: E402

TOL = {"y": 1e-5, "S_T": 1e-5, "grad": 2e-5}
B, T, H, D, M = 1, 37, 2, 24, 16

SCALAR_DECAY = {"proximity": "scalar_decay", "data": "regression", "step": "scalar", "normalize": True}
OBJECTIVES = {
    "gated_deltanet": "gated_deltanet", "gla": "gla", "hgrn": "hgrn", "retnet": "retnet", "mamba": "mamba",
    # the byte-level search's objective that diverged (implicit, alpha bounded, keys normalised)
    "composed_implicit": compose_objective(dict(SCALAR_DECAY, update="implicit")),
    "composed_decay_explicit": compose_objective(dict(SCALAR_DECAY, update="decay_explicit")),
    "kda_like": compose_objective(dict(SCALAR_DECAY, proximity="diagonal_decay", update="decay_explicit")),
    "two_keys_decay_explicit": compose_objective(dict(SCALAR_DECAY, keys=2, update="decay_explicit")),
    "two_keys_implicit": compose_objective(dict(SCALAR_DECAY, keys=2, update="implicit")),
    "minibatch_regression": compose_objective(dict(SCALAR_DECAY, update="explicit", minibatch=16)),
    "minibatch_linear": compose_objective({"proximity": "scalar_decay", "data": "linear", "update": "explicit",
                                           "minibatch": 16}),
}
# (objective, family): every family that takes a decay, with the objectives it runs
CASES = [
    ("gated_deltanet", "rank1_chunk"), ("gated_deltanet", "rank1_row"),
    ("composed_implicit", "rank1_chunk"), ("composed_implicit", "rank1_row"),
    ("composed_decay_explicit", "rank1_chunk"),
    ("gla", "keydecay_chunk"), ("gla", "diagonal"), ("hgrn", "keydecay_chunk"), ("hgrn", "diagonal"),
    ("retnet", "keydecay_chunk"), ("retnet", "diagonal"), ("mamba", "diagonal"),
    ("kda_like", "rank1_keydecay_chunk"),
    ("two_keys_decay_explicit", "rankr_chunk"), ("two_keys_implicit", "rankr_chunk"),
    ("minibatch_regression", "minibatch_chunk"), ("minibatch_linear", "minibatch_chunk"),
]


def _case(obj, mix, seed):
    """(inputs, params, S0, g): ``kernel_inputs``'s draws (Mamba's A made negative, in (-1.1, -0.5)),
    then the decays redrawn by ``checking.tiny_decays``."""
    ins, params, S0, g = kernel_inputs(obj, B, T, H, D, M, seed)
    if "A" in params:
        params["A"] = -(params["A"] + 0.3)
    ins, params = tiny_decays(obj, ins, params, g, mix)
    return ins, params, S0, g


@pytest.fixture(scope="module")
def objectives():
    return {}


@pytest.mark.parametrize("mix", [False, True], ids=["tiny", "mixed"])
@pytest.mark.parametrize("name,family", CASES)
def test_tiny_and_zero_decays_match_the_reference(name, family, mix, objectives, monkeypatch):
    if name not in objectives:
        objectives[name] = ssmcraft.compile(OBJECTIVES[name])
    obj, fam = objectives[name], BY_NAME[family]
    assert fam.reason(obj.ir, None, "triton") is None, f"{family} does not run {name}"
    for f in FAMILIES:      # rankr_chunk runs rank1_chunk's kernels: every family's buffers poisoned
        if f.poison is not None:
            monkeypatch.setattr(f.module, "POISON", True)
    for attr, value in (("CHUNK", 32 if family == "rankr_chunk" else 16), ("INTERPRET_BV", None)):
        if hasattr(fam.module, attr):
            monkeypatch.setattr(fam.module, attr, value)
    ins, params, S0, g = _case(obj, mix, seed=len(name) + mix)
    ref = reference(obj, ins, params, S0, g)
    assert all(bool(torch.isfinite(v).all()) for v in ref.grads.values())
    cmp = compare(ref, lambda i, p, s: validated_call(fam.prepare, obj, i, p, s, True))
    decay_grads = {f"d{n}" for n in DECAY_NAMES} | {"ddelta", "dA"}
    assert set(cmp.errors) & decay_grads, "no decay gradient compared"
    assert_within(cmp.errors, TOL)
