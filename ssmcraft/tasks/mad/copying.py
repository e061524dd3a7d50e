"""MAD's selective copying and compression, built with torch ops on the generator's device.

Selective copying (MAD's): ``num_tokens_to_copy`` tokens from ``[0, vocab - 2)`` scattered in
order among blank tokens (``vocab - 2``) over the first ``seq_len - num_tokens_to_copy - 1``
positions, then the copy token (``vocab - 1``), then ``num_tokens_to_copy`` blanks; the target at
each of those blanks is the next token to copy, in order. (MAD inserts the blanks at random
indices one by one; here the token positions are a uniform random subset, kept in order.)

Compression, in causal form: MAD's compression encodes ``L - 1`` random tokens and a
compression token with the model, keeps only the last position's vector, and decodes every token
from it with an MLP (an encoder-decoder head this LM does not have). Here the LM reads the
``n = seq_len / 2`` tokens from ``[0, vocab - 1)``, then the compression token (``vocab - 1``)
``n`` times, and the target at the ``i``-th compression token is the ``i``-th token: everything
the reconstruction needs has to pass through the model's state at the end of the tokens, as in
MAD, but attention layers can also read the tokens back directly (MAD's bottleneck is one vector
for every architecture). MAD's level ``L`` corresponds to ``seq_len = 2 (L - 1)``.
"""
from __future__ import annotations

import torch

from ssmcraft.tasks.base import IGNORE
from ssmcraft.tasks.mad.base import COMMON, MADTask
from ssmcraft.tasks.mqar import device_of


def selective_copy_batch(B: int, T: int, vocab: int, n: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [B, T], targets [B, T])`` of selective copying (module docstring)."""
    dev = device_of(g)
    blank, copy = vocab - 2, vocab - 1
    region = T - n - 1
    tokens = torch.randint(0, vocab - 2, (B, n), generator=g, device=dev)
    where = torch.rand(B, region, generator=g, device=dev).argsort(1)[:, :n].sort(1).values
    inputs = torch.full((B, T), blank, dtype=torch.int64, device=dev)
    inputs.scatter_(1, where, tokens)
    inputs[:, region] = copy
    targets = torch.full((B, T), IGNORE, dtype=torch.int64, device=dev)
    targets[:, region + 1:] = tokens
    return inputs, targets


def compression_batch(B: int, T: int, vocab: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [B, T], targets [B, T])`` of causal compression (module docstring); T even."""
    dev = device_of(g)
    n = T // 2
    tokens = torch.randint(0, vocab - 1, (B, n), generator=g, device=dev)
    inputs = torch.cat([tokens, torch.full((B, n), vocab - 1, dtype=torch.int64, device=dev)], 1)
    targets = torch.cat([torch.full((B, n), IGNORE, dtype=torch.int64, device=dev), tokens], 1)
    return inputs, targets


class SelectiveCopyingTask(MADTask):
    """MAD's selective copying: copy the tokens scattered among blanks, in order, after a copy token."""

    name = "selective_copying"
    options = {"vocab": 16, "seq_len": 256, "num_tokens_to_copy": 16, **COMMON, "num_train_examples": 12_800}

    def __init__(self, vocab=16, seq_len=256, num_tokens_to_copy=16, num_train_examples=None, data_seed=0):
        self.vocab_size, self.seq_len, self.eval_seq_len = int(vocab), int(seq_len), int(seq_len)
        self.num_tokens_to_copy = int(num_tokens_to_copy)
        self.num_train_examples, self.data_seed = num_train_examples, int(data_seed)
        if self.vocab_size < 3:
            raise ValueError(f"vocab {self.vocab_size} leaves no token to copy (2 are the blank and the copy token)")
        if self.seq_len <= 2 * self.num_tokens_to_copy + 1:
            raise ValueError(f"seq_len {self.seq_len} must exceed 2 * num_tokens_to_copy + 1 = "
                             f"{2 * self.num_tokens_to_copy + 1}")

    @classmethod
    def from_config(cls, cfg, source="<experiment>"):
        return cls.read(cfg, source, checked=lambda o: {"vocab": o.int("vocab", 3), "seq_len": o.int("seq_len", 4),
                                                        "num_tokens_to_copy": o.int("num_tokens_to_copy", 1)})

    def instances(self, batch_size, seq_len, split, generator):
        return selective_copy_batch(batch_size, seq_len, self.vocab_size, self.num_tokens_to_copy, generator)


class CompressionTask(MADTask):
    """MAD's compression in causal form: reproduce ``seq_len / 2`` tokens after reading them."""

    name = "compression"
    options = {"vocab": 16, "seq_len": 62, **COMMON, "num_train_examples": 12_800}

    def __init__(self, vocab=16, seq_len=62, num_train_examples=None, data_seed=0):
        self.vocab_size, self.seq_len, self.eval_seq_len = int(vocab), int(seq_len), int(seq_len)
        self.num_train_examples, self.data_seed = num_train_examples, int(data_seed)
        if self.vocab_size < 2:
            raise ValueError(f"vocab {self.vocab_size} leaves no token besides the compression token")
        if self.seq_len % 2:
            raise ValueError(f"seq_len {self.seq_len} must be even (the tokens, then as many compression tokens)")

    @classmethod
    def from_config(cls, cfg, source="<experiment>"):
        return cls.read(cfg, source, checked=lambda o: {"vocab": o.int("vocab", 2), "seq_len": o.int("seq_len", 2)})

    def instances(self, batch_size, seq_len, split, generator):
        if seq_len % 2:
            raise ValueError(f"compression batches need an even length, got {seq_len}")
        return compression_batch(batch_size, seq_len, self.vocab_size, generator)
