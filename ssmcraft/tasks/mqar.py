"""MQAR: multi-query associative recall, as in Zoology (Arora et al., 2023).

A sequence of length T starts with ``n`` key-value pairs ``k1 v1 k2 v2 ... kn vn`` (keys
drawn without replacement from ``[1, vocab//2)``, values from ``[vocab//2, vocab)``). The
remaining ``T - 2n`` positions hold filler tokens drawn uniformly from the whole vocabulary
(Zoology's ``random_non_queries``), among which every key is asked once: a key placed at an
even offset ``2*g`` of the query region, ``g`` drawn without replacement with probability
proportional to ``g**(power_a - 1)`` (short gaps more likely). The target at a query's
position is its value; every other target is ``IGNORE``.

Chance accuracy is ``1 / n``: a model that can copy a value from the context but not
associate it with its key. (Guessing among all values would give ``1 / (vocab - vocab//2)``.)
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ssmcraft.tasks.base import IGNORE, Options, Task, token_accuracy

DEFAULTS = {"vocab": 8192, "seq_len": 64, "num_kv_pairs": 4, "test_seq_len": None,
            "test_num_kv_pairs": None, "power_a": 0.01}


def mqar_batch(batch_size: int, seq_len: int, num_kv_pairs: int, vocab: int, power_a: float,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch: ``(inputs [B, T], targets [B, T])`` int64; see the module docstring.

    Built with torch ops on the generator's device (a CUDA generator gives a batch made on
    the GPU, no host work or copy); the same seed gives the same batch on the same device.
    """
    n, B, T = num_kv_pairs, batch_size, seq_len
    key_vocab = vocab // 2
    check_sizes(T, n, vocab)
    g = generator
    dev = device_of(g)
    keys = distinct(B, 1, key_vocab, n, g)                                                 # [B, n]
    values = distinct(B, key_vocab, vocab, n, g)
    inputs = torch.randint(0, vocab, (B, T), generator=g, device=dev)
    inputs[:, 0:2 * n:2] = keys
    inputs[:, 1:2 * n:2] = values
    query_pos = 2 * n + 2 * query_gaps(B, (T - 2 * n) // 2, n, power_a, g)
    inputs.scatter_(1, query_pos, keys)
    targets = torch.full((B, T), IGNORE, dtype=torch.int64, device=dev)
    targets.scatter_(1, query_pos, values)
    return inputs, targets


def device_of(generator: torch.Generator | None) -> torch.device:
    """Where a batch drawn from ``generator`` is built (CPU without one)."""
    return generator.device if generator is not None else torch.device("cpu")


def distinct(batch_size: int, low: int, high: int, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``[B, n]`` int64: per row, ``n`` distinct values drawn uniformly from ``[low, high)``."""
    dev = device_of(generator)
    return torch.rand(batch_size, high - low, generator=generator, device=dev).argsort(dim=1)[:, :n] + low


def query_gaps(batch_size: int, space: int, n: int, power_a: float, generator: torch.Generator | None) -> torch.Tensor:
    """``[B, n]`` distinct slots in ``[0, space)``, slot ``g`` drawn with probability proportional
    to ``(g + 1) ** (power_a - 1)`` (Zoology's power law: short gaps more likely)."""
    dev = device_of(generator)
    p = power_a * torch.arange(1, space + 1, dtype=torch.float64, device=dev) ** (power_a - 1)
    return torch.multinomial(p.expand(batch_size, space), n, replacement=False, generator=generator)


def check_sizes(seq_len: int, num_kv_pairs: int, vocab: int) -> None:
    """Raise ValueError when an MQAR sequence of these sizes cannot be built."""
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"seq_len {seq_len} is too short for {num_kv_pairs} pairs (needs >= 4 * num_kv_pairs)")
    if vocab // 2 - 1 < num_kv_pairs:
        raise ValueError(f"vocab {vocab} has too few keys for {num_kv_pairs} pairs (needs vocab >= 2 * (pairs + 1))")


class MQARTask(Task):
    """Zoology MQAR; ``seq_len``/``num_kv_pairs`` for training, ``test_*`` for validation."""

    name = "mqar"
    options = DEFAULTS          # its config's keys and their defaults (tasks.check_task reads them)

    def __init__(self, vocab: int, seq_len: int, num_kv_pairs: int, test_seq_len: int | None = None,
                 test_num_kv_pairs: int | None = None, power_a: float = 0.01):
        self.vocab_size = int(vocab)
        self.seq_len = int(seq_len)
        self.num_kv_pairs = int(num_kv_pairs)
        self.eval_seq_len = int(test_seq_len or seq_len)
        self.test_num_kv_pairs = int(test_num_kv_pairs or num_kv_pairs)
        self.power_a = float(power_a)
        check_sizes(self.seq_len, self.num_kv_pairs, self.vocab_size)
        check_sizes(self.eval_seq_len, self.test_num_kv_pairs, self.vocab_size)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>") -> "MQARTask":
        o = Options(cfg, DEFAULTS, source)
        test_len = None if o.get("test_seq_len") is None else o.int("test_seq_len", 4)
        test_pairs = None if o.get("test_num_kv_pairs") is None else o.int("test_num_kv_pairs", 1)
        try:
            return cls(o.int("vocab", 4), o.int("seq_len", 4), o.int("num_kv_pairs", 1), test_len, test_pairs,
                       o.float("power_a", 1e-6, 1.0))
        except ValueError as e:
            o.fail("", str(e))

    def pairs_for(self, split: str) -> int:
        return self.num_kv_pairs if split == "train" else self.test_num_kv_pairs

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        return mqar_batch(batch_size, T, self.pairs_for(split), self.vocab_size, self.power_a, generator)

    def score(self, logits, targets):
        correct, scored = token_accuracy(logits, targets)
        return {"accuracy": (correct, scored)}

    def constant_metrics(self):
        return {"chance_accuracy": self.chance_accuracy("val")}

    def chance_accuracy(self, split: str = "val") -> float:
        return 1.0 / self.pairs_for(split)

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len,
                "num_kv_pairs": self.num_kv_pairs, "test_seq_len": self.eval_seq_len,
                "test_num_kv_pairs": self.test_num_kv_pairs, "power_a": self.power_a,
                "chance_accuracy": self.chance_accuracy("val")}
