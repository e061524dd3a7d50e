"""A task of your own, for ``task: {name: examples.tasks:PreviousTokenTask, ...}`` (docs/tasks.md).
Run from the repository root with ``PYTHONPATH=.``::

    PYTHONPATH=. ssmcraft train specs/train_quick.yaml --out runs/mine \
        --set 'task={name: examples.tasks:PreviousTokenTask, vocab: 16, seq_len: 64, lag: 2}'
"""
from __future__ import annotations

import torch

from ssmcraft.tasks import IGNORE, Task
from ssmcraft.tasks.base import token_accuracy


class PreviousTokenTask(Task):
    """Random tokens; the target at position t is the input at position t - ``lag``."""

    name = "previous_token"
    options = {"vocab": 16, "seq_len": 32, "lag": 1}

    def __init__(self, vocab=16, seq_len=32, lag=1):
        if not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be a positive integer, got {lag!r}")
        self.vocab_size, self.seq_len, self.eval_seq_len, self.lag = vocab, seq_len, seq_len, lag

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        dev = generator.device if generator is not None else None
        x = torch.randint(0, self.vocab_size, (batch_size, T), generator=generator, device=dev)
        y = torch.full_like(x, IGNORE)
        y[:, self.lag:] = x[:, :-self.lag]
        return x, y

    def score(self, logits, targets):
        return {"accuracy": token_accuracy(logits, targets)}

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len, "lag": self.lag}
