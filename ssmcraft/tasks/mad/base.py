"""What MAD's synthetic tasks share: accuracy at the scored positions, and MAD's finite training
sets (``num_train_examples``).

MAD trains each task on a fixed set of examples (12 800 at its baseline, fewer at harder
levels); ``num_train_examples: N`` draws training batches from a pool of N examples made once
(on the generator's device, from ``data_seed``) so that this difficulty axis means the same here;
``null`` makes fresh examples for every batch. Validation batches are always fresh (the caller's
fixed validation seed), as MAD's separate test set.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ssmcraft.tasks.base import Options, Task, token_accuracy
from ssmcraft.tasks.mqar import device_of

COMMON = {"num_train_examples": None, "data_seed": 0}


class MADTask(Task):
    """Subclasses set ``name``, ``options`` (including ``COMMON``), the sizes, and ``instances``."""

    num_train_examples: int | None
    data_seed: int

    def instances(self, batch_size: int, seq_len: int, split: str, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` fresh examples ``(inputs [B, T], targets [B, T])`` for ``split``."""
        raise NotImplementedError

    @classmethod
    def read(cls, cfg: Mapping[str, Any], source: str, checked) -> "MADTask":
        """``cls(**values)``: ``checked(options)`` gives the values the subclass reads through ``Options``; the
        common options are read here; a ``ValueError`` of the constructor becomes a ``SpecError``."""
        o = Options(cfg, cls.options, source)
        n = None if o.get("num_train_examples") is None else o.int("num_train_examples", 1)
        try:
            return cls(**checked(o), num_train_examples=n, data_seed=o.int("data_seed", 0))
        except ValueError as e:
            o.fail("", str(e))

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        if split != "train" or self.num_train_examples is None or T != self.seq_len:
            return self.instances(batch_size, T, split, generator)
        pool_in, pool_tg = self._pool(device_of(generator))
        idx = torch.randint(0, pool_in.shape[0], (batch_size,), generator=generator, device=pool_in.device)
        return pool_in[idx].long(), pool_tg[idx].long()

    def _pool(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The training set, made once per device from ``data_seed`` (int32 to halve its memory)."""
        cache = self.__dict__.setdefault("_pools", {})
        if str(device) not in cache:
            g = torch.Generator(device=device).manual_seed(int(self.data_seed))
            step = self.pool_chunk()
            parts = [self.instances(min(step, self.num_train_examples - i), self.seq_len, "train", g)
                     for i in range(0, self.num_train_examples, step)]
            cache[str(device)] = (torch.cat([p[0] for p in parts]).int(), torch.cat([p[1] for p in parts]).int())
        return cache[str(device)]

    def pool_chunk(self) -> int:
        """Examples made at once while building the training set."""
        return 1024

    def score(self, logits, targets):
        correct, scored = token_accuracy(logits, targets)
        return {"accuracy": (correct, scored)}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len,
                "num_train_examples": self.num_train_examples, "data_seed": self.data_seed,
                **{k: getattr(self, k) for k in self.options if k not in ("vocab", "seq_len") and k not in COMMON}}
