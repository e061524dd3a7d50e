"""MAD's memorization: a fixed key-to-value map, the same for every sequence, learned in the
weights.

Vocabulary (MAD's): keys ``[0, ns//2)``, values ``[ns//2, ns)`` with ``ns = vocab - 1``, and the
insert token ``vocab - 1``. The map pairs a random permutation of the keys with one of the
values (made once from ``map_seed`` on the CPU, so it is the same on every device). A sequence is
``seq_len / 2`` pairs ``key insert``, keys drawn uniformly; the target at each insert token is its
key's value.
"""
from __future__ import annotations

import torch

from ssmcraft.tasks.base import IGNORE
from ssmcraft.tasks.mad.base import COMMON, MADTask
from ssmcraft.tasks.mqar import device_of


def kv_map(vocab: int, seed: int) -> torch.Tensor:
    """``[ns//2]`` int64: the value of each key (module docstring)."""
    ns = vocab - 1
    g = torch.Generator().manual_seed(int(seed))
    keys = torch.randperm(ns // 2, generator=g)
    values = torch.randperm(ns - ns // 2, generator=g)[: ns // 2] + ns // 2
    return torch.empty_like(keys).scatter_(0, keys, values)


class MemorizationTask(MADTask):
    """MAD's memorization: a fixed key-to-value map, learned in the weights."""

    name = "memorization"
    options = {"vocab": 256, "seq_len": 32, "map_seed": 12_345, **COMMON, "num_train_examples": 256}

    def __init__(self, vocab=256, seq_len=32, map_seed=12_345, num_train_examples=None, data_seed=0):
        self.vocab_size, self.seq_len, self.eval_seq_len = int(vocab), int(seq_len), int(seq_len)
        self.map_seed = int(map_seed)
        self.num_train_examples, self.data_seed = num_train_examples, int(data_seed)
        if self.vocab_size < 3:
            raise ValueError(f"vocab {self.vocab_size} leaves no key (needs >= 3: a key, a value, the insert token)")
        if self.seq_len % 2:
            raise ValueError(f"seq_len {self.seq_len} must be even (pairs of a key and the insert token)")
        self.map = kv_map(self.vocab_size, self.map_seed)

    @classmethod
    def from_config(cls, cfg, source="<experiment>"):
        return cls.read(cfg, source, checked=lambda o: {"vocab": o.int("vocab", 3), "seq_len": o.int("seq_len", 2),
                                                        "map_seed": o.int("map_seed", 0)})

    def instances(self, batch_size, seq_len, split, generator):
        dev = device_of(generator)
        if seq_len % 2:
            raise ValueError(f"memorization batches need an even length, got {seq_len}")
        table = self.map.to(dev)
        keys = torch.randint(0, table.numel(), (batch_size, seq_len // 2), generator=generator, device=dev)
        inputs = torch.full((batch_size, seq_len), self.vocab_size - 1, dtype=torch.int64, device=dev)
        inputs[:, 0::2] = keys
        targets = torch.full((batch_size, seq_len), IGNORE, dtype=torch.int64, device=dev)
        targets[:, 1::2] = table[keys]
        return inputs, targets
