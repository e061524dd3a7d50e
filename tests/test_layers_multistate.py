"""Issue 14: an objective with several states (momentum Longhorn) in the mixer, training,
evaluation tools and export, on CPU: a few training steps lower nothing to NaN and move
every parameter; recurrent ``step`` carries a tuple state and equals parallel mode (also in
test_layers_mixer.py, which runs every library objective); ``trace_states`` follows the
state the output reads; the mitigations that need a decay refuse by name; ``ssmcraft export``
writes a standalone module whose outputs and recurrent steps match the trained model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.layers.config import mixer_config
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.layers.mixer import ObjectiveMixer

sys.path.insert(0, str(Path(__file__).parent))
from test_export_standalone import experiment  # noqa: E402


def _mixer():
    torch.manual_seed(0)
    cfg = mixer_config({"kind": "objective", "objective": "momentum_longhorn", "state_size": 4, "heads": 2})
    return ObjectiveMixer(cfg, d_model=16)


def test_mixer_trains_a_few_steps_and_traces_the_read_state():
    mixer = _mixer()
    opt = torch.optim.Adam(mixer.parameters(), lr=1e-2)
    h = torch.randn(2, 9, 16)
    target = torch.randn(2, 9, 16)
    before = {n: p.detach().clone() for n, p in mixer.named_parameters()}
    losses = []
    for _ in range(3):
        loss = (mixer(h) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert mixer.last_backend == "torch-vectorised"
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    moved = [n for n, p in mixer.named_parameters() if not torch.equal(p, before[n])]
    assert set(moved) == set(before), f"not updated: {set(before) - set(moved)}"
    trace = mixer.trace_states(h, every=3)
    assert trace.shape == (2, 3, 2, 16, 4) and mixer.obj.traced_state == "S"
    cache = mixer.init_cache(2)
    for t in range(9):
        _, cache = mixer.step(h[:, t], cache)
    torch.testing.assert_close(trace[:, -1], cache.state[1], rtol=1e-5, atol=1e-6)   # S after 9 tokens


def test_decay_mitigations_refuse_by_name():
    mixer = _mixer()
    with pytest.raises(SsmcraftError, match=r"momentum_longhorn: retention/insertion scaling needs a decay.*general"):
        mixer.set_mitigation(Mitigation(retention=1.5))
    mixer.set_mitigation(Mitigation(window=4))
    with pytest.raises(SsmcraftError, match=r"momentum_longhorn: the state-difference sliding window .* general"):
        mixer(torch.randn(1, 5, 16))


MINIBATCH_DELTANET = {"name": "deltanet_mb", "state": {"S": ["d", "m"]},
                      "inputs": {"x": {"shape": ["d"]}, "k": {"shape": ["m"], "normalize": True},
                                 "q": {"shape": ["m"], "normalize": True}, "beta": {"shape": [], "bounded": True}},
                      "objective": "beta*sq(S*k - x)/2", "update": "explicit", "approximation": {"minibatch": 4},
                      "output": "S*q"}


@pytest.mark.parametrize("objective,structure", [("momentum_longhorn", "general"), ("rls", "nonlinear"),
                                                 ("ttt_mlp", "nonlinear"), (MINIBATCH_DELTANET, "general")],
                         ids=["momentum_longhorn", "rls", "ttt_mlp", "minibatch"])
def test_train_and_export(tmp_path, objective, structure):
    """rls: a square state (R [m, m], carried by its inverse), ttt_mlp: weights over a hidden
    dimension (W1 [h, m], W2 [d, h]), a mini-batch objective (its steps carry the chunk), through
    training, export and the exported module's recurrent steps."""
    from ssmcraft.export import export
    from ssmcraft.train import train_run

    metrics = train_run(experiment(objective, n_layers=1), tmp_path / "run")
    assert metrics["status"] == "ok" and metrics["structure"] == structure
    res = export(tmp_path / "run", tmp_path / "export")
    assert res.structure == structure
    assert res.verified["max_abs_diff"] < 1e-5 and res.verified["step_max_abs_diff"] < 1e-5
    assert res.verified["prefill_max_abs_diff"] < 1e-5


def test_exported_state_size_counts_every_state():
    from ssmcraft.export.runtime_lm import Model
    from ssmcraft.layers.mixer import ChunkCache, RecurrentCache
    conv, S1, S2 = torch.zeros(2, 8, 3), torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 8, 4)
    assert Model.state_size([RecurrentCache(conv, (S1, S2))]) == 48 + 64 + 128
    assert Model.state_size([RecurrentCache(conv, ChunkCache(S2, {"k": torch.zeros(2, 3, 2, 4)}))]) == 48 + 128 + 48
