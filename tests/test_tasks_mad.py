"""MAD's six tasks: shapes, answer positions, an oracle reading the input solves each by
construction, reproducible seeds, MAD's finite training sets, its levels and score."""
from __future__ import annotations

import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.tasks import IGNORE, build_task
from ssmcraft.tasks.mad import MAD_TASKS, levels, mad_score, task_score


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _runs(tokens, is_key, is_value):
    """Parse ``k.. v..`` pairs: for each position, (key run of the pair it belongs to, value tokens
    of that pair up to and including it)."""
    out, key, vals, prev = [], (), (), None
    for tok in tokens:
        if is_key(tok):
            key = (key if prev == "k" else ()) + (tok,)
            vals, prev = (), "k"
        elif is_value(tok) and prev in ("k", "v"):
            vals, prev = vals + (tok,), "v"
        else:
            key, vals, prev = (), (), None
        out.append((key, vals))
    return out


def recall_oracle(x, y, K, ns, key_width):
    """Accuracy of reading the answer off an earlier pair with the same key (its last
    ``key_width`` tokens) at every scored position."""
    right = total = 0
    for b in range(x.shape[0]):
        toks = x[b].tolist()
        parsed = _runs(toks, lambda t: t < K, lambda t: K <= t < ns)
        for t in (y[b] != IGNORE).nonzero().flatten().tolist():
            key, vals = parsed[t]
            done = len(vals)                                     # value tokens already read
            answer = None
            for j in range(t - 1, -1, -1):                       # latest earlier pair with this key
                k2, v2 = parsed[j]
                if k2[-key_width:] == key[-key_width:] and len(v2) == done + 1 and v2[:done] == vals:
                    answer = v2[-1]
                    break
            right += int(answer == int(y[b, t]))
            total += 1
    return right / total


@pytest.mark.parametrize("cfg, K, ns, width", [
    ({"name": "in_context_recall", "vocab": 16, "seq_len": 64}, 8, 16, 1),
    ({"name": "noisy_recall", "vocab": 32, "noise_vocab_size": 16, "frac_noise": 0.4, "seq_len": 64}, 8, 16, 1),
    ({"name": "fuzzy_recall", "vocab": 16, "seq_len": 96}, 7, 15, 3),
])
def test_recall_tasks_are_solved_by_reading_the_context(cfg, K, ns, width):
    task = build_task({**cfg, "num_train_examples": None})
    x, y = task.sample("val", 16, generator=_gen())
    assert x.shape == y.shape == (16, cfg["seq_len"]) and x.min() >= 0 and x.max() < cfg["vocab"]
    assert ((y != IGNORE).sum(1) >= 1).all()                          # the probe is always scored
    assert (y[:, -1] != IGNORE).all()                                 # ... and ends the sequence
    scored = y[y != IGNORE]
    assert ((scored >= K) & (scored < ns)).all()                      # answers are value tokens
    assert recall_oracle(x, y, K, ns, width) == 1.0
    xt, yt = task.sample("train", 4, generator=_gen())
    assert torch.equal(xt[:, 1:], yt[:, :-1])                         # training: next token everywhere


def test_noise_takes_its_fraction_of_pairs():
    task = build_task({"name": "noisy_recall", "seq_len": 512, "frac_noise": 0.6, "num_train_examples": None})
    x, _ = task.sample("val", 32, generator=_gen())
    noise = ((x >= 16) & (x < 32)).float().mean()
    assert 0.5 < noise < 0.7                                          # pairs after the first are noise w.p. 0.6


def test_fuzzy_keys_have_every_motif_size_in_training_and_the_largest_in_validation():
    task = build_task({"name": "fuzzy_recall", "vocab": 32, "seq_len": 128, "num_train_examples": None})
    sizes = {}
    for split in ("train", "val"):
        x, _ = task.sample(split, 8, generator=_gen())
        sizes[split] = {len(k) for b in range(8) for k, v in _runs(x[b].tolist(), lambda t: t < 15,
                                                                   lambda t: 15 <= t < 31) if len(v) == 1}
    assert sizes["train"] == {1, 2, 3} and sizes["val"] == {3}


def test_selective_copying_targets_the_scattered_tokens_in_order():
    task = build_task({"name": "selective_copying", "vocab": 16, "seq_len": 64, "num_tokens_to_copy": 8,
                       "num_train_examples": None})
    x, y = task.sample("val", 8, generator=_gen())
    region = 64 - 8 - 1
    assert (x[:, region] == 15).all() and (x[:, region + 1:] == 14).all()
    assert ((y != IGNORE).nonzero()[:, 1] > region).all() and ((y != IGNORE).sum(1) == 8).all()
    for b in range(8):
        kept = [t for t in x[b, :region].tolist() if t != 14]        # the oracle: non-blank tokens in order
        assert kept == y[b, region + 1:].tolist()


def test_compression_reproduces_the_tokens_after_reading_them():
    task = build_task({"name": "compression", "vocab": 16, "seq_len": 20, "num_train_examples": None})
    x, y = task.sample("val", 4, generator=_gen())
    assert torch.equal(y[:, 10:], x[:, :10]) and (x[:, 10:] == 15).all() and (y[:, :10] == IGNORE).all()
    assert x[:, :10].max() < 15


def test_memorization_map_is_fixed_across_batches_and_devices_of_generation():
    task = build_task({"name": "memorization", "vocab": 64, "seq_len": 16, "num_train_examples": None})
    table = {}
    for seed in range(3):
        x, y = task.sample("val", 8, generator=_gen(seed))
        assert (x[:, 1::2] == 63).all() and (y[:, 0::2] == IGNORE).all()
        for k, v in zip(x[:, 0::2].flatten().tolist(), y[:, 1::2].flatten().tolist()):
            assert table.setdefault(k, v) == v                          # one value per key, always
    assert torch.equal(build_task({"name": "memorization", "vocab": 64, "seq_len": 16}).map, task.map)
    assert sorted(task.map.tolist()) == sorted(set(task.map.tolist()))   # a map onto distinct values
    assert all(31 <= v < 63 for v in table.values())


@pytest.mark.parametrize("name", MAD_TASKS)
def test_seeds_reproduce_batches(name):
    cfg = {**levels(name)[0][1], "num_train_examples": None}
    task = build_task(cfg)
    a, b, c = (task.sample("val", 3, generator=_gen(s)) for s in (7, 7, 8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])


def test_a_finite_training_set_is_made_once_from_its_seed():
    cfg = {"name": "in_context_recall", "seq_len": 32, "num_train_examples": 5}
    task = build_task(cfg)
    x, _ = task.sample("train", 64, generator=_gen(1))
    assert len({tuple(r) for r in x.tolist()}) <= 5
    again, _ = build_task(cfg).sample("train", 64, generator=_gen(2))
    assert {tuple(r) for r in again.tolist()} <= {tuple(r) for r in task._pool(torch.device("cpu"))[0].tolist()}
    other = build_task({**cfg, "data_seed": 1})._pool(torch.device("cpu"))[0]
    assert not torch.equal(other, task._pool(torch.device("cpu"))[0])
    fresh, _ = task.sample("val", 64, generator=_gen(1))
    assert len({tuple(r) for r in fresh.tolist()}) == 64              # validation is never the pool


def test_levels_and_score_follow_mad():
    assert [len(levels(t)) for t in MAD_TASKS] == [11, 11, 14, 13, 11, 6]
    label, cfg = levels("noisy_recall")[-1]
    assert label == "frac_noise=0.8" and cfg["vocab"] == 32 and cfg["noise_vocab_size"] == 16
    assert levels("compression")[0][1]["seq_len"] == 62
    for task in MAD_TASKS:
        for _, cfg in levels(task):
            build_task(cfg)                                             # every level is a valid task
    accs = {t: {label: 0.5 for label, _ in levels(t)} for t in MAD_TASKS}
    accs["memorization"]["vocab=8192"] = 0.2
    scores = mad_score(accs)
    assert scores["memorization"] == pytest.approx((5 * 0.5 + 0.2) / 6)
    assert scores["mad_score"] == pytest.approx((5 * 0.5 + scores["memorization"]) / 6)
    with pytest.raises(ValueError, match="no accuracy for level"):
        task_score({"baseline": 1.0}, "compression")


@pytest.mark.parametrize("cfg, key, problem", [
    ({"name": "fuzzy_recall", "vocab": 6}, "task", "fewer than the motif sizes"),
    ({"name": "noisy_recall", "noise_vocab_size": 0}, "task", "needs noise_vocab_size"),
    ({"name": "selective_copying", "seq_len": 32}, "task", "must exceed"),
    ({"name": "compression", "seq_len": 31}, "task", "must be even"),
    ({"name": "memorization", "num_train_examples": 0}, "task.num_train_examples", "at least 1"),
    ({"name": "in_context_recall", "frac_noise": 0.1}, "task.frac_noise", "unknown key"),
])
def test_bad_config_names_the_key(cfg, key, problem):
    with pytest.raises(SpecError) as e:
        build_task(cfg)
    assert e.value.key == key and problem in e.value.problem
