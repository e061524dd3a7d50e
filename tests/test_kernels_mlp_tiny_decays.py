"""The MLP memory's families on decays a sigmoid gate reaches in training (``checking.tiny_decays``:
in (e^-64, e^-14) with exact zeros among them, alone or mixed with ordinary decays in one chunk),
under the Triton interpreter against the float64 reference: output, both final weights and every
gradient (the decay's and both initial weights' included), every buffer poisoned with NaN, on an odd
length, and a packed row against separate calls. The mini-batch form (``mlp_minibatch_chunk``, C of
16, 20 and 32) forms log-decays: unclamped, log 0 = -inf makes every output NaN, a difference of two
rounded sums of hundreds carries ~3e-5 into every factor, and d log c / c is NaN at c = 0 and loses its
digits below c ~ 1e-3; the sequential family (``mlp_memory``) multiplies by the decay directly. The
other inputs are drawn in the stable region, as ``test_kernels_mlp_memory`` draws them. A sibling of
``test_kernels_tiny_decays`` (whose draws have no hidden dimension)."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.bench.classes_commands import COMPOSED  # noqa: E402
from ssmcraft.ops.mlp_memory import recurrent as R  # noqa: E402
from ssmcraft.ops.mlp_minibatch_chunk import chunk as CH  # noqa: E402
from ssmcraft.runtime.checking import tiny_decays  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors  # noqa: E402
from test_kernels_mlp_memory import TOL, _case  # noqa: E402

FAMILIES = {"mlp_minibatch_chunk": CH, "mlp_memory": R}


def _objective(mb, keys):
    """``mlp_huber_minibatch`` (a scalar decay of the running weights) with a mini-batch of ``mb`` (20,
    out of the compose space, set on its spec: tiles of 32 rows, those past 20 masked) and ``keys`` keys."""
    spec = compose_objective(dict(COMPOSED["mlp_huber_minibatch"], minibatch=16 if mb == 20 else mb, keys=keys))
    return dict(spec, name="mlp_huber_mb20", approximation={"minibatch": 20}) if mb == 20 else spec


@pytest.mark.parametrize("mix", [False, True], ids=["tiny", "mixed"])
@pytest.mark.parametrize("family,mb,keys,T", [
    ("mlp_minibatch_chunk", 16, 1, 37), ("mlp_minibatch_chunk", 32, 1, 45), ("mlp_minibatch_chunk", 16, 2, 35),
    ("mlp_minibatch_chunk", 20, 1, 47),
    ("mlp_memory", 16, 1, 37), ("mlp_memory", 0, 1, 37), ("mlp_memory", 0, 2, 35),
])
def test_tiny_and_zero_decays_match_the_reference(family, mb, keys, T, mix, monkeypatch):
    mod = FAMILIES[family]
    obj = ssmcraft.compile(_objective(mb, keys))
    assert mod.supports(obj.ir) is None, f"{family} does not run it"
    monkeypatch.setattr(mod, "POISON", True)
    ins, S0, g = _case(obj, 1, T, 2, 6, 4, seed=2 * T + mix)
    ins, _ = tiny_decays(obj, ins, {}, g, mix)
    assert (ins["alpha"] == 0).any() and (ins["alpha"] < 1e-6).float().mean() > 0.4
    errs = kernel_errors(obj, lambda o, lay: mod.forward(o, lay, None, True), ins, None, S0, g)
    assert set(errs) >= {"y", "W1_T", "W2_T", "dW10", "dW20", *(f"d{n}" for n in ins)}, errs
    assert_within(errs, TOL)


@pytest.mark.parametrize("mix", [False, True], ids=["tiny", "mixed"])
def test_packed_tiny_decays_match_separate_calls(mix, monkeypatch):
    """A packed row (odd lengths, empty ones first and in the middle) on tiny and zero decays against N
    separate float64 reference calls: the second launch's chunks are each sequence's own."""
    from ssmcraft.runtime.checking import compare, packed_reference
    from test_varlen import _interpret
    monkeypatch.setattr(CH, "POISON", True)
    obj = ssmcraft.compile(_objective(16, 1))
    lens = [0, 17, 5, 0, 1, 33]
    ins, _, g = _case(obj, 1, sum(lens), 2, 6, 4, seed=5)
    _, S0, _ = _case(obj, len(lens), 1, 2, 6, 4, seed=6)
    ins, _ = tiny_decays(obj, ins, {}, g, mix)
    assert (ins["alpha"] == 0).any()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    errs = compare(packed_reference(obj, ins, None, S0, cu, g), lambda i, p, s: _interpret(obj, i, p, s, cu)).errors
    assert set(errs) >= {"y", "dW10", "dW20", *(f"d{n}" for n in ins)}, sorted(errs)
    assert_within(errs, TOL)
    assert obj.backend == "triton-interpret:mlp-minibatch-chunk+packed"
