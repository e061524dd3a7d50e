"""The training options beside the loop: the WSD schedule's shape, activation checkpointing (the
gradients of the plain step; CUDA graphs turned off with it), and the new keys' checks."""
from __future__ import annotations

import json

import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.layers import LM, LMConfig
from ssmcraft.train import train_run
from ssmcraft.train.config import resolve
from ssmcraft.train.graphed import graphs_decision
from ssmcraft.train.recompute import recompute_blocks
from ssmcraft.train.schedule import lr_at, warmup_steps
from ssmcraft.train.validate import step_loss


def test_wsd_warms_up_holds_then_decays_linearly():
    total, lr, ratio = 100, 2.0, 0.1
    warm = warmup_steps(10, total)
    lrs = [lr_at(s, total, lr, warm, ratio, "wsd", 0.2) for s in range(total)]
    assert lrs[:10] == pytest.approx([lr * (s + 1) / 11 for s in range(10)])       # linear warmup
    assert lrs[10:80] == [lr] * 70                                                 # stable: the peak, exactly
    steps = [a - b for a, b in zip(lrs[79:], lrs[80:])]
    assert steps == pytest.approx([lr * (1 - ratio) / 20] * 20)                    # linear decay over the last 20
    assert lrs[-1] == pytest.approx(lr * ratio)
    # the decay as a number of steps; cosine keeps its shape
    assert [lr_at(s, total, lr, warm, ratio, "wsd", 5) for s in (94, 95, 99)] == pytest.approx([lr, 1.64, 0.2])
    assert lr_at(50, total, lr, warm, ratio) < lr and lr_at(50, total, lr, warm, ratio, "cosine") < lr


def test_a_wsd_run_records_its_schedule(tmp_path):
    m = train_run(_mqar(schedule="wsd", decay=2, warmup=1, tokens=4 * 32 * 6), tmp_path)
    lrs = [r["lr"] for r in json.loads((tmp_path / "history.json").read_text())["train"]]
    assert m["schedule"] == "wsd" and lrs == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3, 1.65e-3, 3e-4])


def _lm():
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=30, d_model=16, n_layers=3, mixer={"kind": "objective", "objective": "longhorn",
                                                                    "state_size": 4}))


def test_activation_checkpointing_gives_the_plain_gradients():
    plain, recomputed = _lm(), _lm()
    assert recompute_blocks(recomputed) == 3
    assert list(recomputed.state_dict()) == list(plain.state_dict())            # the weights' names are unchanged
    x, y = torch.randint(0, 30, (2, 12)), torch.randint(0, 30, (2, 12))
    losses, grads = [], []
    for model in (plain, recomputed):
        loss = step_loss(model, x, y, torch.enable_grad)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_activation_checkpointing_recomputes_in_the_backward(monkeypatch):
    """The blocks' forwards run again during the backward (twice in all), not only once."""
    model = _lm()
    recompute_blocks(model)
    calls = []
    real = type(model.blocks[0]).forward

    def counted(self, h):
        calls.append(torch.is_grad_enabled())
        return real(self, h)
    monkeypatch.setattr(type(model.blocks[0]), "forward", counted)
    recompute_blocks(model)                      # rebinds to the counted forward
    step_loss(model, torch.randint(0, 30, (2, 8)), torch.randint(0, 30, (2, 8)), torch.enable_grad).backward()
    assert len(calls) == 6


def _mqar(**train):
    return {"name": "tiny", "seed": 0, "task": {"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4},
            "model": {"d_model": 32, "n_layers": 2, "mixer": {"kind": "objective", "objective": "longhorn",
                                                              "state_size": 8}},
            "train": {"batch_size": 4, "tokens": 4 * 32 * 3, "eval_every": 0, "eval_batches": 1, "eval_batch_size": 4,
                      "save_model": False, "threads": 1, "device": "cpu", **train}}


def test_a_run_with_activation_checkpointing_trains_as_without(tmp_path):
    plain = train_run(_mqar(), tmp_path / "plain")
    recomputed = train_run(_mqar(activation_checkpointing=True), tmp_path / "recomputed")
    assert recomputed["train_loss_last"] == plain["train_loss_last"] and recomputed["val_loss"] == plain["val_loss"]
    assert "activation checkpointing: 2 block(s)" in (tmp_path / "recomputed" / "train.log").read_text()


def test_cuda_graphs_give_way_to_activation_checkpointing():
    cuda = torch.device("cuda")
    assert graphs_decision("auto", cuda, False, "x.yaml", True) == (
        False, "train.cuda_graphs auto: off while train.activation_checkpointing is true")
    assert graphs_decision("auto", cuda, False, "x.yaml", False)[0]
    with pytest.raises(SpecError, match="x.yaml: train.cuda_graphs: true together with train.activation_checkpointing"):
        resolve(_mqar(cuda_graphs=True, activation_checkpointing=True), "x.yaml")


@pytest.mark.parametrize("key, value, message", [
    ("grad_accum", 0, "train.grad_accum: expected a positive integer, got 0"),
    ("grad_accum", 3, "train.grad_accum: 3 does not divide train.batch_size 4 (the global batch) into equal "
                      "micro-batches"),
    ("schedule", "linear", "train.schedule: expected cosine or wsd, got 'linear'"),
    ("decay", -1, "train.decay: expected a non-negative number, got -1"),
    ("checkpoint_every", 1.5, "train.checkpoint_every: expected a non-negative integer, got 1.5"),
    ("activation_checkpointing", "yes", "train.activation_checkpointing: expected true or false, got 'yes'"),
])
def test_bad_values_of_the_new_keys_are_named(key, value, message):
    with pytest.raises(SpecError) as e:
        resolve(_mqar(**{key: value}), "x.yaml")
    assert str(e.value) == f"x.yaml: {message}"
