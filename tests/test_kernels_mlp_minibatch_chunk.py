"""The MLP memory's mini-batch form on tensor cores (``ssmcraft/ops/mlp_minibatch_chunk``) under the
Triton interpreter, against the objective's float64 reference: output, both final weights and every
gradient (inputs, both initial weights; with a gradient on the final weights), every output buffer
poisoned with NaN, on lengths that are not multiples of the mini-batch. Every data term of the compose
space (regression, linear, pseudo-Huber and Cauchy per output row or of the residual's norm) with
mini-batches of 16 and 32, a scalar decay, weight decay or neither, one key or two; a held-out
hand-written memory; packed rows against separate calls; and dispatch: a mini-batch of 16 to 64 picks
this family and says so, a smaller one the sequential family, with this family's reason."""
import pytest
import torch

pytest.importorskip("triton")

import ssmcraft  # noqa: E402
from ssmcraft.ops import registry  # noqa: E402
from ssmcraft.ops.mlp_memory import recurrent as R  # noqa: E402
from ssmcraft.ops.mlp_minibatch_chunk import chunk as CH  # noqa: E402
from helpers import assert_within, kernel_errors, rel_rms as rel  # noqa: E402
from ssmcraft.search.compose import compose_objective  # noqa: E402
from test_kernels_mlp_memory import HUBER_MB, TOL, _case, _check_packed, _composed  # noqa: E402


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(CH, "POISON", True)


def _space(p, data, step, keys, mb):
    """The compose space's MLP memory with mini-batches of ``mb`` (16, 32 or 64 there)."""
    return compose_objective({"memory": "mlp", "update": "explicit", "proximity": p, "data": data, "step": step,
                              "keys": keys, "minibatch": mb})


def _errors(obj, B, T, d, m, seed):
    ins, S0, g = _case(obj, B, T, 2, d, m, seed=seed)
    if "lam" in ins:
        # weight decay at the anchors scales them by 1 - (the chunk's sum of lam): kept in (0.2, 1), else
        # the weights flip sign and grow every chunk, where a relative error means little
        ins["lam"] = ins["lam"] / obj.ir.minibatch
    errs = kernel_errors(obj, lambda o, lay: CH.forward(o, lay, None, True), ins, None, S0, g)
    assert set(errs) >= {"y", "W1_T", "W2_T", "dW10", "dW20", *(f"d{n}" for n in ins)}, errs
    return errs


# (proximity, data, step, keys, minibatch): a scalar step gives a robust loss of the residual's norm, a
# per-channel one a loss per output row (``test_kernels_mlp_memory.COMPOSED``)
@pytest.mark.parametrize("key,T,B,d,m", [
    (("plain", "regression", "scalar", 1, 16), 37, 1, 6, 4),
    (("scalar_decay", "regression", "per_channel", 2, 32), 45, 2, 5, 4),
    (("weight_decay", "regression", "scalar", 1, 16), 33, 1, 6, 5),
    (("scalar_decay", "linear", "per_channel", 1, 16), 35, 1, 6, 4),
    (("weight_decay", "linear", "scalar", 2, 32), 70, 1, 6, 4),
    (("plain", "huber", "per_channel", 2, 16), 37, 1, 6, 4),
    (("scalar_decay", "huber", "scalar", 1, 32), 41, 2, 5, 4),
    (("weight_decay", "huber", "per_channel", 1, 16), 39, 1, 6, 4),
    (("plain", "cauchy", "scalar", 1, 16), 36, 1, 6, 4),
    (("scalar_decay", "cauchy", "per_channel", 2, 16), 35, 1, 6, 5),
    (("weight_decay", "cauchy", "scalar", 2, 32), 50, 1, 6, 4),
    (("plain", "regression", "scalar", 1, 16), 1, 2, 6, 4),
    (("scalar_decay", "huber", "per_channel", 1, 16), 16, 1, 6, 4),
    # blocks of different sizes over d, m and h (32, 16, 16; 16, 32, 64)
    (("scalar_decay", "cauchy", "scalar", 2, 16), 37, 1, 20, 4),
    (("weight_decay", "huber", "per_channel", 1, 32), 40, 1, 5, 18),
])
def test_composed_matches_the_reference(key, T, B, d, m):
    """Output, both final weights and every gradient (both initial weights included), buffers poisoned."""
    assert_within(_errors(ssmcraft.compile(_space(*key)), B, T, d, m, seed=T + d), TOL)


def test_hand_written_memory_matches_the_reference():
    """Held out: a sigmoid memory decayed by ``keep`` with a pseudo-Huber loss of the residual's norm,
    under its own names, in mini-batches of 20 (not a power of two: the tiles' rows past 20 masked)."""
    obj = ssmcraft.compile(dict(HUBER_MB, name="mlp_huber_mb20", approximation={"minibatch": 20}))
    found = CH.match(obj.ir)
    assert (found["data"], found["eta"], found["decay"], found["act"], found["minibatch"]) == \
        ("huber_norm", "lr", "keep", "sigmoid", 20)
    assert_within(_errors(obj, 1, 47, 6, 4, seed=4), TOL)


@pytest.mark.parametrize("key", [("scalar_decay", "huber", "per_channel", 1, 16),
                                 ("weight_decay", "cauchy", "scalar", 2, 16), ("plain", "linear", "scalar", 1, 32)])
def test_packed_equals_separate(key):
    """A packed row (odd lengths, empty ones first and in the middle, some under a mini-batch): each
    sequence's chunks from its own start, as N separate float64 reference calls; this family ran it."""
    _check_packed(ssmcraft.compile(_space(*key)), backend="mlp-minibatch-chunk")


def test_dispatch_runs_the_family_and_says_so():
    obj = ssmcraft.compile(_space("scalar_decay", "cauchy", "per_channel", 1, 16))
    obj.prefer = "interpret"
    ins, S0, _ = _case(obj, 1, 21, 2, 6, 4, seed=1)
    y, (W1, W2) = obj({n: t.float() for n, t in ins.items()}, None, tuple(s.float() for s in S0), True)
    assert obj.backend == "triton-interpret:mlp-minibatch-chunk"
    yr, (W1r, W2r) = obj.reference(ins, None, S0, True)
    assert rel(y, yr) < TOL["y"] and rel(W1, W1r) < TOL["W1_T"] and rel(W2, W2r) < TOL["W2_T"]


@pytest.mark.parametrize("mb,why", [(8, "tensor-core products need 16 rows"), (3, "tensor-core products need 16 rows"),
                                    (0, "no mini-batch"), (128, "would not fit in registers")])
def test_other_mini_batches_run_the_sequential_family_and_say_why(mb, why):
    spec = _composed("plain", "regression", "scalar", 1, mb)
    ir = ssmcraft.compile(spec if mb in (0, 3, 8) else dict(spec, name="mlp_c128", approximation={"minibatch": mb})).ir
    reasons = {f.name: f.reason(ir) for f in registry.FAMILIES}
    assert why in reasons["mlp_minibatch_chunk"] and reasons["mlp_memory"] is None
    assert [f.name for f in registry.FAMILIES if f.reason(ir) is None] == ["mlp_memory"]


def test_bad_mini_batch_is_refused_by_name():
    x = torch.zeros(1, 4, 1, 3)
    k = torch.zeros(1, 4, 1, 2)
    S0 = (torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 3, 5))
    with pytest.raises(ValueError, match=r"mlp_minibatch_chunk: minibatch must be in \[16, 64\], got 8"):
        CH.mlp_minibatch_chunk(x, k, k, minibatch=8, initial_state=S0)
    with pytest.raises(ValueError, match="mlp_minibatch_chunk: give decay or weight_decay, not both"):
        CH.mlp_minibatch_chunk(x, k, k, decay=x[..., 0], weight_decay=x[..., 0], minibatch=16, initial_state=S0)


def test_config_rule():
    """The GPU's configs: the chunk's block is the mini-batch's power of two; 8 warps with fp32 I/O only
    where no product has an N of 16 (a chunk of 16 then runs in a block of 32)."""
    from ssmcraft.ops.mlp_minibatch_chunk.kernels import _CHUNK_CONFIGS, _chunk_rule

    def kept(C, prec, BD=64):
        return [(c.kwargs["BC"], c.num_warps) for c in _chunk_rule(_CHUNK_CONFIGS, None, C=C, PREC=prec, BD=BD,
                                                                     BM=64, BH=128)]
    assert kept(16, "tf32") == [(16, 4), (16, 8)]
    assert kept(16, "tf32x3") == [(16, 4), (32, 8)]
    assert kept(16, "tf32x3", BD=16) == [(16, 4)]
    assert kept(20, "tf32") == [(32, 4), (32, 8)]
    assert kept(64, "tf32x3") == [(64, 4), (64, 8)]
