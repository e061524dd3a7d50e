"""Passkey retrieval: the key is where the depth says, the labels are its digits."""
import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.tasks import IGNORE, build_task
from ssmcraft.tasks.passkey import QUESTION, min_length, passkey_batch, passkey_text, retrieved


def _text(inputs, targets):
    """Input bytes plus the final target byte: the whole example."""
    return bytes(inputs.tolist()) + bytes([targets[-1].item()])


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_labels_are_the_key_digits_at_the_end(depth):
    inputs, targets, keys = passkey_batch(3, 400, depth, 5, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, 400)
    for b in range(3):
        key = "".join(str(d) for d in keys[b].tolist()).encode()
        scored = (targets[b] != IGNORE).nonzero().flatten().tolist()
        assert scored == list(range(395, 400))
        assert bytes(targets[b, 395:].tolist()) == key
        text = _text(inputs[b], targets[b])
        assert text.endswith(QUESTION + key)
        assert text.count(key) == 3                          # twice in the needle, once as the answer


def test_depth_moves_the_needle():
    positions = []
    for depth in (0.0, 0.5, 1.0):
        text, answer_at = passkey_text(600, depth, b"12345")
        assert len(text) == 601 and answer_at == 596
        positions.append(text.index(b"The pass key is 12345"))
    assert positions[0] < positions[1] < positions[2]
    filler_span = positions[2] - positions[0]
    assert abs((positions[1] - positions[0]) / filler_span - 0.5) < 0.1


def test_retrieved_needs_every_digit():
    inputs, targets, _ = passkey_batch(2, 300, 0.5, 5, torch.Generator().manual_seed(1))
    logits = torch.nn.functional.one_hot(targets.clamp_min(0), 256).float()
    assert retrieved(logits, targets).all()
    logits[0, 297] = torch.roll(logits[0, 297], 1)              # one wrong digit in example 0
    assert retrieved(logits, targets).tolist() == [False, True]


def test_trainable_task_and_too_short_context():
    task = build_task({"name": "passkey", "seq_len": 300})
    x, y = task.sample("train", 4, generator=torch.Generator().manual_seed(0))
    assert x.shape == (4, 300) and int((y != IGNORE).sum()) == 20
    assert task.vocab_size == 256
    with pytest.raises(SpecError, match="shorter than the passkey prompt"):
        build_task({"name": "passkey", "seq_len": min_length(5) - 1})
