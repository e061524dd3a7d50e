"""Zoology's MQAR variants: shapes, answer positions, an oracle that reads the context solves
each by construction, reproducible seeds, and config errors that name the key."""
from __future__ import annotations

import pytest
import torch

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.tasks import IGNORE, build_task


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _lookup(inputs, targets, context, answer_of):
    """Oracle accuracy: for each scored position, ``answer_of(row, context tokens, position)``."""
    right = total = 0
    for b in range(inputs.shape[0]):
        ctx = inputs[b, :context].tolist()
        for t in (targets[b] != IGNORE).nonzero().flatten().tolist():
            right += int(answer_of(b, ctx, t) == int(targets[b, t]))
            total += 1
    return right / total


def _last_value(ctx, key):
    """The value after the last occurrence of ``key`` at an even position of a ``k v k v`` context."""
    pairs = list(zip(ctx[0::2], ctx[1::2]))
    return [v for k, v in pairs if k == key][-1]


def test_forgetting_answers_with_the_last_value():
    task = build_task({"name": "mqar_forgetting", "vocab": 64, "seq_len": 48, "num_kv_pairs": 6, "num_updates": 3})
    x, y = task.sample("train", 32, generator=_gen())
    assert x.shape == y.shape == (32, 48)
    assert ((y != IGNORE).sum(1) == 6).all()
    C = 2 * (6 + 3)
    assert ((y != IGNORE)[:, :C] == 0).all()                     # answers only in the query region
    assert _lookup(x, y, C, lambda b, ctx, t: _last_value(ctx, int(x[b, t]))) == 1.0
    first = lambda b, ctx, t: _last_value(ctx[:12], int(x[b, t]))  # noqa: E731 - a model that never forgets
    stale = _lookup(x, y, C, first)
    assert abs(stale - 0.5) < 1e-9                                 # 3 of 6 keys were given a new value
    updated = x[:, 12:C:2]
    old = torch.stack([torch.tensor([_last_value(x[b, :12].tolist(), int(k)) for k in updated[b]]) for b in range(32)])
    assert (old != x[:, 13:C:2]).all()                             # a new value is never the old one


def test_compositional_needs_both_keys():
    task = build_task({"name": "mqar_compositional", "vocab": 99, "seq_len": 60, "num_kv_pairs": 9})
    x, y = task.sample("train", 16, generator=_gen(1))
    assert x.shape == (16, 60) and ((y != IGNORE).sum(1) == 9).all()
    C = 27

    def answer(b, ctx, t):
        triples = list(zip(ctx[0::3], ctx[1::3], ctx[2::3]))
        return next(v for k1, k2, v in triples if (k1, k2) == (int(x[b, t - 1]), int(x[b, t])))

    assert _lookup(x, y, C, answer) == 1.0
    triples = torch.stack([x[:, 0:C:3], x[:, 1:C:3]], -1)
    for b in range(16):                                           # a g x g grid: each K1 with every K2
        k1s, k2s = set(triples[b, :, 0].tolist()), set(triples[b, :, 1].tolist())
        assert len(k1s) == len(k2s) == 3 and {tuple(p) for p in triples[b].tolist()} == {(a, c) for a in k1s for c in k2s}


def test_stacked_passes_then_queries():
    task = build_task({"name": "mqar_stacked", "vocab": 40, "num_kv_pairs": 5, "num_passes": 2})
    assert task.seq_len == 25
    x, y = task.sample("train", 8, generator=_gen(2))
    assert x.shape == (8, 25) and ((y != IGNORE)[:, :20] == 0).all() and ((y != IGNORE)[:, 20:]).all()
    assert _lookup(x, y, 10, lambda b, ctx, t: _last_value(ctx, int(x[b, t]))) == 1.0
    for b in range(8):                                              # both passes hold the same pairs, reordered
        assert sorted(zip(x[b, 0:10:2].tolist(), x[b, 1:10:2].tolist())) == \
            sorted(zip(x[b, 10:20:2].tolist(), x[b, 11:20:2].tolist()))
    longer, _ = task.sample("val", 2, seq_len=40, generator=_gen())
    assert longer.shape == (2, 40)


def test_extrapolate_trains_and_tests_on_other_configurations():
    task = build_task({"name": "mqar_extrapolate", "vocab": 128, "train": [[16, 2], [32, 4]],
                       "test": [[32, 4], [64, 8]]})
    assert (task.seq_len, task.eval_seq_len) == (32, 64)
    x, y = task.sample("train", 6, generator=_gen())
    assert x.shape == (6, 32)
    assert (y[:3] != IGNORE).sum(1).tolist() == [2, 2, 2] and (y[3:] != IGNORE).sum(1).tolist() == [4, 4, 4]
    assert ((y[:3, 16:] != IGNORE) == 0).all()                       # the short rows' tails carry no answers
    xv, yv = task.sample("val", 4, generator=_gen())
    assert xv.shape == (4, 64) and (yv != IGNORE).sum(1).tolist() == [4, 4, 8, 8]
    n_of = lambda b: 4 if b < 2 else 8                               # noqa: E731
    assert _lookup(xv, yv, 64, lambda b, ctx, t: _last_value(ctx[:2 * n_of(b)], int(xv[b, t]))) == 1.0
    logits = torch.nn.functional.one_hot(yv.clamp_min(0), 128).float()
    logits[2:] = 0                                                   # rows of the second config all wrong
    scores = task.score(logits, yv)
    assert [int(v) for v in scores["accuracy_T32_kv4"]] == [8, 8]
    assert int(scores["accuracy_T64_kv8"][0]) == 0 and int(scores["accuracy_T64_kv8"][1]) == 16
    short_x, short_y = task.sample("val", 2, seq_len=32, generator=_gen())   # the test configs that fit
    assert (short_y != IGNORE).sum(1).tolist() == [4, 4] and set(task.score(logits[:2, :32], short_y)) == \
        {"accuracy", "accuracy_T32_kv4"}
    with pytest.raises(SsmcraftError, match="hold no test configuration"):
        task.sample("val", 2, seq_len=16)
    with pytest.raises(SsmcraftError, match="cannot hold the training"):
        task.sample("train", 2, seq_len=16)


@pytest.mark.parametrize("name", ["mqar_forgetting", "mqar_compositional", "mqar_stacked", "mqar_extrapolate"])
def test_seeds_reproduce_batches(name):
    task = build_task({"name": name, "vocab": 256})
    a = task.sample("train", 4, generator=_gen(5))
    b = task.sample("train", 4, generator=_gen(5))
    c = task.sample("train", 4, generator=_gen(6))
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and not torch.equal(a[0], c[0])


@pytest.mark.parametrize("cfg, key, problem", [
    ({"name": "mqar_forgetting", "num_kv_pairs": 2, "num_updates": 3}, "task", "num_updates 3"),
    ({"name": "mqar_forgetting", "seq_len": 20}, "task", "too short"),
    ({"name": "mqar_compositional", "num_kv_pairs": 5}, "task", "perfect square"),
    ({"name": "mqar_stacked", "num_passes": 0}, "task.num_passes", "at least 1"),
    ({"name": "mqar_extrapolate", "train": [[16, 2, 1]]}, "task.train[0]", "[seq_len, num_kv_pairs]"),
    ({"name": "mqar_extrapolate", "test": [[64, 4], [64, 8]]}, "task", "distinct lengths"),
    ({"name": "mqar_forgetting", "updates": 1}, "task.updates", "unknown key"),
])
def test_bad_config_names_the_key(cfg, key, problem):
    with pytest.raises(SpecError) as e:
        build_task(cfg)
    assert e.value.key == key and problem in e.value.problem
