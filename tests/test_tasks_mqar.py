"""MQAR generator: layout, answer positions and labels, lengths, errors."""
import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.tasks import IGNORE, build_task
from ssmcraft.tasks.mqar import mqar_batch


def _batch(B=16, T=64, n=6, vocab=100, seed=0):
    return mqar_batch(B, T, n, vocab, 0.01, torch.Generator().manual_seed(seed))


def test_context_holds_distinct_keys_then_values():
    inputs, _ = _batch()
    n, half = 6, 50
    keys, values = inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2]
    assert ((keys >= 1) & (keys < half)).all()
    assert ((values >= half) & (values < 100)).all()
    for row in keys:
        assert len(set(row.tolist())) == n


def test_every_key_is_queried_once_and_labelled_with_its_value():
    inputs, targets = _batch()
    n = 6
    for b in range(inputs.shape[0]):
        pairs = dict(zip(inputs[b, 0:2 * n:2].tolist(), inputs[b, 1:2 * n:2].tolist()))
        answer_pos = (targets[b] != IGNORE).nonzero().flatten().tolist()
        assert len(answer_pos) == n
        assert all(p >= 2 * n and (p - 2 * n) % 2 == 0 for p in answer_pos)
        asked = [inputs[b, p].item() for p in answer_pos]
        assert sorted(asked) == sorted(pairs)                       # each key asked exactly once
        for p in answer_pos:
            assert targets[b, p].item() == pairs[inputs[b, p].item()]


def test_targets_only_at_query_positions_and_shapes():
    inputs, targets = _batch(B=4, T=40, n=3)
    assert inputs.shape == targets.shape == (4, 40)
    assert inputs.dtype == targets.dtype == torch.int64
    assert int((targets != IGNORE).sum()) == 4 * 3


def test_deterministic_given_generator():
    a, b = _batch(seed=3), _batch(seed=3)
    c = _batch(seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_train_and_test_lengths_and_pairs_differ():
    task = build_task({"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4,
                       "test_seq_len": 128, "test_num_kv_pairs": 8})
    g = torch.Generator().manual_seed(0)
    x, y = task.sample("train", 2, generator=g)
    assert x.shape == (2, 32) and int((y != IGNORE).sum()) == 8
    x, y = task.sample("val", 2, generator=g)
    assert x.shape == (2, 128) and int((y != IGNORE).sum()) == 16
    x, _ = task.sample("val", 2, seq_len=256, generator=g)
    assert x.shape == (2, 256)
    assert task.chance_accuracy("train") == 0.25 and task.constant_metrics()["chance_accuracy"] == 1 / 8


def test_accuracy_score_counts_answer_positions_only():
    task = build_task({"name": "mqar", "vocab": 64, "seq_len": 32, "num_kv_pairs": 4})
    x, y = task.sample("val", 3, generator=torch.Generator().manual_seed(1))
    perfect = torch.nn.functional.one_hot(y.clamp_min(0), 64).float()     # right answer everywhere
    assert task.score(perfect, y)["accuracy"] == (12, 12)
    wrong = torch.roll(perfect, 1, dims=-1)
    assert task.score(wrong, y)["accuracy"] == (0, 12)


@pytest.mark.parametrize("cfg, key", [
    ({"seq_len": 12, "num_kv_pairs": 4}, "task"),             # too short for 4 pairs
    ({"vocab": 8, "num_kv_pairs": 4}, "task"),                 # too few keys
    ({"num_kv_pair": 4}, "task.num_kv_pair"),                  # typo
    ({"seq_len": "long"}, "task.seq_len"),
])
def test_bad_config_is_a_spec_error(cfg, key):
    with pytest.raises(SpecError) as e:
        build_task({"name": "mqar", "vocab": 64, "seq_len": 32, **cfg})
    assert e.value.key == key


def test_unknown_task_name():
    with pytest.raises(SpecError, match="unknown task 'mqr'"):
        build_task({"name": "mqr"})
