"""The MLP memory's decayed backward (``ssmcraft.ops.mlp_memory``) walks a chunk back dividing by its
decays where they amplify rounding by at most ``2^DIVIDE_BITS``, and replays the others from their
start: on decays mild in most chunks and tiny in one run of tokens (so one chunk is replayed and the
others are walked), a scalar decay, weight decay (a per-channel step), two keys with a decay and a
Cauchy loss of the residual's norm, each against the objective's float64 reference: output, both final
weights and every gradient (inputs, the decays, both initial weights), on odd lengths, with every buffer
poisoned with NaN, and on a packed row. A decay of exactly 0 is replayed: walking every chunk instead
(``DIVIDE_BITS`` inf) divides by it, and the gradients are not finite; replaying every chunk
(``DIVIDE_BITS`` -1) agrees with the selection."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops.mlp_memory import recurrent as R  # noqa: E402
from ssmcraft.runtime.checking import compare, packed_reference  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from helpers import assert_within, kernel_errors  # noqa: E402
from test_kernels_mlp_memory import OBJECTIVES, TOL, _case  # noqa: E402

CHUNK = 8
# the composed cauchy memory of the class benchmarks' mlp_cauchy_2key (a scalar decay, two keys, a
# Cauchy loss of the residual's norm), beside the memory tests' decayed ones; (name, decay input)
CAUCHY_2KEY = compose_objective({"memory": "mlp", "proximity": "scalar_decay", "data": "cauchy", "keys": 2,
                                 "step": "scalar", "update": "explicit", "normalize": True})
CASES = {"scalar_decay_scalar": (OBJECTIVES["scalar_decay_scalar"], "alpha"),
         "weight_decay_per_channel": (OBJECTIVES["weight_decay_per_channel"], "lam"),
         "two_scalar_decay_per_channel": (OBJECTIVES["two_scalar_decay_per_channel"], "alpha"),
         "cauchy_2key": (CAUCHY_2KEY, "alpha")}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(R, "POISON", True)
    monkeypatch.setattr(R, "DECAY_CHUNK", CHUNK)


def _mixed(obj, name, B, T, seed, tiny_at):
    """``_case``'s draws with the decay c mild (in (0.93, 0.99): ~0.05 bits a token, every chunk
    walked) but for tokens ``tiny_at`` of every row and head (c = 0.05: 4.3 bits each, so a chunk
    holding two of them is replayed); ``name`` is the decay's input (alpha: c; lam: c = 1 - lam)."""
    ins, S0, g = _case(obj, B, T, 2, 6, 4, seed=seed)
    c = 0.93 + 0.06 * torch.rand(ins[name].shape, generator=g, dtype=torch.float64)
    c[:, tiny_at] = 0.05
    ins[name] = c if name == "alpha" else 1 - c
    return ins, S0, g


def _errors(obj, ins, S0, g):
    return kernel_errors(obj, lambda o, lay: R.forward(o, lay, None, True), ins, None, S0, g)


@pytest.mark.parametrize("which,T", [("scalar_decay_scalar", 37), ("weight_decay_per_channel", 29),
                                     ("two_scalar_decay_per_channel", 31), ("cauchy_2key", 35)])
def test_walked_and_replayed_chunks_match_the_reference(which, T):
    spec, name = CASES[which]
    obj = ssmcraft.compile(spec)
    # tokens 9 and 12: chunk 1 (tokens 8..15) loses 8.6 bits and is replayed; the rest are walked
    ins, S0, g = _mixed(obj, name, 2, T, seed=T, tiny_at=[9, 12])
    errs = _errors(obj, ins, S0, g)
    assert set(errs) >= {"y", "W1_T", "W2_T", "dW10", "dW20", *(f"d{n}" for n in ins)}, errs
    assert_within(errs, TOL)


def test_a_zero_decay_is_replayed_not_divided_by(monkeypatch):
    """A decay of exactly 0 (the weights reset) cannot be walked back: dividing by it gives no number,
    and walking every chunk (``DIVIDE_BITS`` inf) leaves gradients that are not finite; the selection
    replays that chunk (its lost bits are inf), and replaying every chunk (-1) agrees with it."""
    spec, name = CASES["scalar_decay_scalar"]
    obj = ssmcraft.compile(spec)
    ins, S0, _ = _mixed(obj, name, 1, 27, seed=3, tiny_at=[11])
    ins[name][:, 11] = 0.
    grads = lambda e: max(v for k, v in e.items() if k.startswith("d"))     # noqa: E731
    errs = {}
    for bits in (R.DIVIDE_BITS, float("inf"), -1.):
        monkeypatch.setattr(R, "DIVIDE_BITS", bits)
        errs[bits] = _errors(obj, ins, S0, torch.Generator().manual_seed(4))
    assert_within(errs[R.DIVIDE_BITS], TOL)
    assert_within(errs[-1.], TOL)
    assert not grads(errs[float("inf")]) <= 100 * TOL["grad"], errs[float("inf")]


@pytest.mark.parametrize("which", ["scalar_decay_scalar", "cauchy_2key"])
def test_packed_walked_and_replayed_equals_separate(which):
    """A packed row (odd lengths, empty ones first and in the middle) whose chunks, counted from each
    sequence's start, are walked or replayed: against N separate float64 reference calls."""
    from test_varlen import _interpret
    spec, name = CASES[which]
    obj = ssmcraft.compile(spec)
    lens = [0, 17, 5, 0, 1, 23]
    # the first sequence's tokens 9 and 12 (its chunk 1 is replayed), and the last one's (packed: 32, 35)
    ins, _, g = _mixed(obj, name, 1, sum(lens), seed=7, tiny_at=[9, 12, 32, 35])
    _, S0, _ = _case(obj, len(lens), 1, 2, 6, 4, seed=8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    errs = compare(packed_reference(obj, ins, None, S0, cu, g), lambda i, p, s: _interpret(obj, i, p, s, cu)).errors
    assert set(errs) >= {"y", "dW10", "dW20", *(f"d{n}" for n in ins)}, sorted(errs)
    assert_within(errs, TOL)
    assert obj.backend == "triton-interpret:mlp-memory+packed"
