"""Zoology's MQAR variants, built on the generator's device like ``mqar_batch``.

Vocabulary layout and filler as Zoology's: keys from the lower part of the vocabulary, values
from the upper part, every position that is neither context nor query holds a token drawn
uniformly from the whole vocabulary (``random_non_queries``), queries placed with Zoology's
power-law gaps (``query_gaps``). ``targets`` hold the answer at the position whose next input
would be it (the last token of the query) and ``IGNORE`` elsewhere.

- ``mqar_forgetting`` (``forgetting_mqar``): ``n`` key-value pairs, then ``u`` of those keys again
  with a new value (never the old one); each key is queried once and its answer is the last
  value it was given::

      A 5  B 3  C 7  D 2 | A 9  C 1 | ... A ... D ...      targets: 9 at A, 2 at D

- ``mqar_compositional`` (``compositional_mqar``): ``n = g*g`` triples ``K1 K2 V`` over a ``g x g``
  grid of ``K1`` and ``K2`` tokens (thirds of the vocabulary), so neither key alone gives the value;
  a query is ``K1 K2`` and its target sits at ``K2``.
- ``mqar_stacked`` (Zoology's ``stacked_mqar.py``, continuous MQAR after JRT): ``num_passes``
  passes over the same ``n`` pairs, each pass in a new order, then every key once in a random
  order, its value the target at the key. Zoology feeds each pair as one position holding the
  key and value embeddings side by side; here a pair is the two tokens ``k v`` (the LM reads
  tokens), so a sequence is ``(2 * num_passes + 1) * n`` tokens. Zoology's
  ``per_sequence_mapping: false`` is not offered: there it fixes a permutation of per-sequence
  sampled keys and values, which fixes no key-to-value map across sequences.
- ``mqar_extrapolate`` (``ar_extrapolate``): training rows drawn from several (length, pairs)
  configurations and validation rows from others (longer, more pairs); rows are split evenly
  over the configurations, in blocks, and a shorter configuration is followed by filler without
  targets up to the batch's length (the same task for a causal model). Validation reports the
  accuracy of each test configuration (``accuracy_T{len}_kv{pairs}``); a validation batch shorter
  than the longest test configuration holds the ones that fit.

Sequences longer than a variant's own layout (evaluation at several lengths) end with filler.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.tasks.base import IGNORE, Options, Task, token_accuracy
from ssmcraft.tasks.mqar import check_sizes, device_of, distinct, mqar_batch, query_gaps


class _Recall(Task):
    """What the variants share: accuracy at the answer positions, chance 1 / pairs."""

    vocab_size: int

    def score(self, logits, targets):
        correct, scored = token_accuracy(logits, targets)
        return {"accuracy": (correct, scored)}

    def pairs_for(self, split: str) -> int:
        return self.num_kv_pairs if split == "train" else self.test_num_kv_pairs

    def constant_metrics(self):
        return {"chance_accuracy": 1.0 / self.pairs_for("val")}

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        n = self.pairs_for(split)
        need = self.length_for(n)
        if T < need:
            raise ValueError(f"{self.name}: seq_len {T} is shorter than {need}, the layout of {n} pairs")
        return self.batch(batch_size, T, n, generator)

    def _filler(self, batch_size: int, seq_len: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
        dev = device_of(generator)
        inputs = torch.randint(0, self.vocab_size, (batch_size, seq_len), generator=generator, device=dev)
        return inputs, torch.full((batch_size, seq_len), IGNORE, dtype=torch.int64, device=dev)


def _test_sizes(o: Options, pairs_key: str = "num_kv_pairs") -> tuple[int | None, int | None]:
    test_len = None if o.get("test_seq_len") is None else o.int("test_seq_len", 1)
    test_pairs = None if o.get(f"test_{pairs_key}") is None else o.int(f"test_{pairs_key}", 1)
    return test_len, test_pairs


class ForgettingMQARTask(_Recall):
    """Zoology's forgetting MQAR: ``num_updates`` keys get a second value; queries want the last."""

    name = "mqar_forgetting"
    options = {"vocab": 8192, "seq_len": 64, "num_kv_pairs": 8, "num_updates": 4, "power_a": 0.01,
               "test_seq_len": None, "test_num_kv_pairs": None}

    def __init__(self, vocab=8192, seq_len=64, num_kv_pairs=8, num_updates=4, power_a=0.01,
                 test_seq_len=None, test_num_kv_pairs=None):
        self.vocab_size, self.seq_len, self.num_kv_pairs = int(vocab), int(seq_len), int(num_kv_pairs)
        self.num_updates, self.power_a = int(num_updates), float(power_a)
        self.eval_seq_len = int(test_seq_len or seq_len)
        self.test_num_kv_pairs = int(test_num_kv_pairs or num_kv_pairs)
        for T, n in ((self.seq_len, self.num_kv_pairs), (self.eval_seq_len, self.test_num_kv_pairs)):
            if self.num_updates > n:
                raise ValueError(f"num_updates {self.num_updates} is more than num_kv_pairs {n}")
            if T < self.length_for(n):
                raise ValueError(f"seq_len {T} is too short for {n} pairs and {self.num_updates} updates "
                                 f"(needs >= 2 * (2 * pairs + updates) = {self.length_for(n)})")
            check_sizes(self.length_for(n), n, self.vocab_size)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>"):
        o = Options(cfg, cls.options, source)
        try:
            return cls(o.int("vocab", 4), o.int("seq_len", 4), o.int("num_kv_pairs", 1), o.int("num_updates", 0),
                       o.float("power_a", 1e-6, 1.0), *_test_sizes(o))
        except ValueError as e:
            o.fail("", str(e))

    def length_for(self, n: int) -> int:
        return 2 * (n + self.num_updates) + 2 * n

    def batch(self, B: int, T: int, n: int, g) -> tuple[torch.Tensor, torch.Tensor]:
        u, V, K = self.num_updates, self.vocab_size, self.vocab_size // 2
        keys = distinct(B, 1, K, n, g)
        first = distinct(B, K, V, n, g)
        which = distinct(B, 0, n, u, g)                                  # the updated keys' indices
        old = first.gather(1, which)
        r = torch.randint(0, V - K - 1, (B, u), generator=g, device=device_of(g)) + K
        new = r + (r >= old).long()                                      # uniform over values != old
        final = first.scatter(1, which, new)
        inputs, targets = self._filler(B, T, g)
        inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2] = keys, first
        c = 2 * n
        inputs[:, c:c + 2 * u:2], inputs[:, c + 1:c + 2 * u:2] = keys.gather(1, which), new
        c += 2 * u
        query_pos = c + 2 * query_gaps(B, (self.length_for(n) - c) // 2, n, self.power_a, g)
        inputs.scatter_(1, query_pos, keys)
        targets.scatter_(1, query_pos, final)
        return inputs, targets

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len, "num_kv_pairs": self.num_kv_pairs,
                "num_updates": self.num_updates, "power_a": self.power_a, "test_seq_len": self.eval_seq_len,
                "test_num_kv_pairs": self.test_num_kv_pairs, "chance_accuracy": 1.0 / self.test_num_kv_pairs}


class CompositionalMQARTask(_Recall):
    """Zoology's compositional MQAR: compound keys ``(K1, K2)`` on a grid; ``num_kv_pairs`` a square."""

    name = "mqar_compositional"
    options = {"vocab": 8192, "seq_len": 64, "num_kv_pairs": 4, "power_a": 0.01, "test_seq_len": None,
               "test_num_kv_pairs": None}

    def __init__(self, vocab=8192, seq_len=64, num_kv_pairs=4, power_a=0.01, test_seq_len=None,
                 test_num_kv_pairs=None):
        self.vocab_size, self.seq_len, self.num_kv_pairs = int(vocab), int(seq_len), int(num_kv_pairs)
        self.power_a = float(power_a)
        self.eval_seq_len = int(test_seq_len or seq_len)
        self.test_num_kv_pairs = int(test_num_kv_pairs or num_kv_pairs)
        for T, n in ((self.seq_len, self.num_kv_pairs), (self.eval_seq_len, self.test_num_kv_pairs)):
            g = math.isqrt(n)
            if g * g != n:
                raise ValueError(f"num_kv_pairs must be a perfect square (4, 9, 16, ...) for the K1 x K2 grid, got {n}")
            if T < self.length_for(n):
                raise ValueError(f"seq_len {T} is too short for {n} pairs (needs >= 6 * pairs = {self.length_for(n)})")
            third = self.vocab_size // 3
            if third - 1 < g or self.vocab_size - 2 * third < n:
                raise ValueError(f"vocab {self.vocab_size} is too small for a {g} x {g} grid")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>"):
        o = Options(cfg, cls.options, source)
        try:
            return cls(o.int("vocab", 6), o.int("seq_len", 6), o.int("num_kv_pairs", 1),
                       o.float("power_a", 1e-6, 1.0), *_test_sizes(o))
        except ValueError as e:
            o.fail("", str(e))

    @staticmethod
    def length_for(n: int) -> int:
        return 6 * n

    def batch(self, B: int, T: int, n: int, g) -> tuple[torch.Tensor, torch.Tensor]:
        side, third = math.isqrt(n), self.vocab_size // 3
        k1 = distinct(B, 1, third, side, g).repeat_interleave(side, dim=1)            # A A B B
        k2 = distinct(B, third, 2 * third, side, g).repeat(1, side)                   # X Y X Y
        order = torch.rand(B, n, generator=g, device=device_of(g)).argsort(dim=1)
        k1, k2 = k1.gather(1, order), k2.gather(1, order)
        values = distinct(B, 2 * third, self.vocab_size, n, g)
        inputs, targets = self._filler(B, T, g)
        inputs[:, 0:3 * n:3], inputs[:, 1:3 * n:3], inputs[:, 2:3 * n:3] = k1, k2, values
        query = 3 * n + 3 * query_gaps(B, (self.length_for(n) - 3 * n) // 3, n, self.power_a, g)
        inputs.scatter_(1, query, k1)
        inputs.scatter_(1, query + 1, k2)
        targets.scatter_(1, query + 1, values)
        return inputs, targets

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len, "num_kv_pairs": self.num_kv_pairs,
                "power_a": self.power_a, "test_seq_len": self.eval_seq_len,
                "test_num_kv_pairs": self.test_num_kv_pairs, "chance_accuracy": 1.0 / self.test_num_kv_pairs}


class StackedMQARTask(_Recall):
    """Zoology's stacked (continuous, multi-pass) MQAR in tokens: passes over the pairs, then queries."""

    name = "mqar_stacked"
    options = {"vocab": 8192, "num_kv_pairs": 8, "num_passes": 1, "seq_len": None, "test_num_kv_pairs": None,
               "test_seq_len": None}

    def __init__(self, vocab=8192, num_kv_pairs=8, num_passes=1, seq_len=None, test_num_kv_pairs=None,
                 test_seq_len=None):
        self.vocab_size, self.num_kv_pairs, self.num_passes = int(vocab), int(num_kv_pairs), int(num_passes)
        self.test_num_kv_pairs = int(test_num_kv_pairs or num_kv_pairs)
        self.seq_len = int(seq_len or self.length_for(self.num_kv_pairs))
        self.eval_seq_len = int(test_seq_len or max(self.seq_len, self.length_for(self.test_num_kv_pairs)))
        for T, n in ((self.seq_len, self.num_kv_pairs), (self.eval_seq_len, self.test_num_kv_pairs)):
            if T < self.length_for(n):
                raise ValueError(f"seq_len {T} is shorter than (2 * num_passes + 1) * pairs = {self.length_for(n)}")
            if self.vocab_size // 2 < n:
                raise ValueError(f"vocab {self.vocab_size} has fewer than {n} keys")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>"):
        o = Options(cfg, cls.options, source)
        seq_len = None if o.get("seq_len") is None else o.int("seq_len", 1)
        test_len, test_pairs = _test_sizes(o)
        try:
            return cls(o.int("vocab", 2), o.int("num_kv_pairs", 1), o.int("num_passes", 1), seq_len, test_pairs,
                       test_len)
        except ValueError as e:
            o.fail("", str(e))

    def length_for(self, n: int) -> int:
        return (2 * self.num_passes + 1) * n

    def batch(self, B: int, T: int, n: int, g) -> tuple[torch.Tensor, torch.Tensor]:
        K, dev = self.vocab_size // 2, device_of(g)
        keys = distinct(B, 0, K, n, g)
        values = distinct(B, K, 2 * K, n, g)              # the i-th key's value is values[:, i]
        inputs, targets = self._filler(B, T, g)
        for p in range(self.num_passes):
            order = torch.rand(B, n, generator=g, device=dev).argsort(dim=1)
            inputs[:, 2 * p * n:2 * (p + 1) * n:2] = keys.gather(1, order)
            inputs[:, 2 * p * n + 1:2 * (p + 1) * n:2] = values.gather(1, order)
        order = torch.rand(B, n, generator=g, device=dev).argsort(dim=1)
        q = 2 * self.num_passes * n
        inputs[:, q:q + n] = keys.gather(1, order)
        targets[:, q:q + n] = values.gather(1, order)
        return inputs, targets

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "num_kv_pairs": self.num_kv_pairs,
                "num_passes": self.num_passes, "seq_len": self.seq_len, "test_seq_len": self.eval_seq_len,
                "test_num_kv_pairs": self.test_num_kv_pairs, "chance_accuracy": 1.0 / self.test_num_kv_pairs}


def _configs(o: Options, key: str) -> list[tuple[int, int]]:
    value = o.get(key)
    if not isinstance(value, list) or not value:
        o.fail(key, f"expected a non-empty list of [seq_len, num_kv_pairs], got {value!r}")
    out = []
    for i, c in enumerate(value):
        if not (isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                             for x in c)):
            o.fail(f"{key}[{i}]", f"expected [seq_len, num_kv_pairs] (positive integers), got {c!r}")
        out.append((c[0], c[1]))
    return out


class ExtrapolateMQARTask(Task):
    """Zoology's MQAR extrapolation: train on some (length, pairs) configurations, test on others."""

    name = "mqar_extrapolate"
    options = {"vocab": 8192, "train": [[64, 4], [128, 8], [256, 16]], "test": [[512, 32], [1024, 64]],
               "power_a": 0.01, "seq_len": None}

    def __init__(self, vocab=8192, train=((64, 4),), test=((128, 8),), power_a=0.01, seq_len=None):
        self.vocab_size, self.power_a = int(vocab), float(power_a)
        self.train_configs = [tuple(map(int, c)) for c in train]
        self.test_configs = [tuple(map(int, c)) for c in test]
        for T, n in self.train_configs + self.test_configs:
            check_sizes(T, n, self.vocab_size)
        if len({T for T, _ in self.test_configs}) != len(self.test_configs):
            raise ValueError("test configurations need distinct lengths (each is reported on its own)")
        self.seq_len = int(seq_len or max(T for T, _ in self.train_configs))
        if self.seq_len < max(T for T, _ in self.train_configs):
            raise ValueError(f"seq_len {self.seq_len} is shorter than the longest training configuration")
        self.eval_seq_len = max(T for T, _ in self.test_configs)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>"):
        o = Options(cfg, cls.options, source)
        seq_len = None if o.get("seq_len") is None else o.int("seq_len", 1)
        try:
            return cls(o.int("vocab", 4), _configs(o, "train"), _configs(o, "test"), o.float("power_a", 1e-6, 1.0),
                       seq_len)
        except ValueError as e:
            o.fail("", str(e))

    @staticmethod
    def blocks(batch_size: int, n_configs: int) -> torch.Tensor:
        """``[B]``: the configuration of each row (contiguous, as even as ``B`` allows)."""
        return torch.arange(batch_size) * n_configs // batch_size

    def configs_for(self, split: str, seq_len: int) -> list[tuple[int, int]]:
        """The configurations of ``split`` that batches of ``seq_len`` tokens hold: every training
        one (``SsmcraftError`` if one is longer); the test ones that fit (an evaluation at a shorter
        length reports those), ``SsmcraftError`` if none does."""
        if split == "train":
            if seq_len < max(c[0] for c in self.train_configs):
                raise SsmcraftError(f"{self.name}: training batches of length {seq_len} cannot hold the training "
                                    f"configurations (the longest is {max(c[0] for c in self.train_configs)} tokens)")
            return self.train_configs
        fit = [c for c in self.test_configs if c[0] <= seq_len]
        if not fit:
            raise SsmcraftError(f"{self.name}: validation batches of length {seq_len} hold no test configuration "
                                f"(the shortest is {min(c[0] for c in self.test_configs)} tokens)")
        return fit

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        configs = self.configs_for(split, T)
        counts = torch.bincount(self.blocks(batch_size, len(configs)), minlength=len(configs)).tolist()
        dev = device_of(generator)
        parts_in, parts_tg = [], []
        for (L, n), count in zip(configs, counts):
            if count == 0:
                continue
            x, y = mqar_batch(count, L, n, self.vocab_size, self.power_a, generator)
            pad = torch.randint(0, self.vocab_size, (count, T - L), generator=generator, device=dev)
            parts_in.append(torch.cat([x, pad], 1))
            parts_tg.append(torch.cat([y, torch.full_like(pad, IGNORE)], 1))
        return torch.cat(parts_in), torch.cat(parts_tg)

    def score(self, logits, targets):
        """Accuracy, and per test configuration in the batch (validation batches hold the test
        configurations that fit their length, in row blocks: ``configs_for``)."""
        correct, scored = token_accuracy(logits, targets)
        out = {"accuracy": (correct, scored)}
        configs = self.configs_for("val", logits.shape[1])
        rows = self.blocks(logits.shape[0], len(configs)).to(logits.device)
        hit = (logits.argmax(-1) == targets) & (targets != IGNORE)
        for i, (L, n) in enumerate(configs):
            mine = rows == i
            out[f"accuracy_T{L}_kv{n}"] = (hit[mine].sum(), (targets[mine] != IGNORE).sum())
        return out

    def constant_metrics(self):
        return {"chance_accuracy": sum(1.0 / n for _, n in self.test_configs) / len(self.test_configs)}

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "train": [list(c) for c in self.train_configs],
                "test": [list(c) for c in self.test_configs], "power_a": self.power_a, "seq_len": self.seq_len,
                "test_seq_len": self.eval_seq_len, **self.constant_metrics()}


VARIANTS = (ForgettingMQARTask, CompositionalMQARTask, StackedMQARTask, ExtrapolateMQARTask)
