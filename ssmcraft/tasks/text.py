"""Byte-level language modelling on a text corpus (vocabulary 256, one token per byte).

Deterministic train/validation split: the corpus is cut into blocks of ``block_size`` bytes
and every ``round(1 / val_fraction)``-th block (the last of each group) goes to validation.
Interleaving keeps both splits spread over the whole corpus (a sorted stdlib would
otherwise validate on one package only). Batches are windows of ``T + 1`` bytes at uniform
random offsets within a split; ``targets`` are ``inputs`` shifted by one.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ssmcraft.tasks.base import Options, Task
from ssmcraft.tasks.corpus import Corpus, load_corpus

VOCAB = 256
DEFAULTS = {"corpus": "stdlib", "seq_len": 256, "test_seq_len": None, "val_fraction": 0.05,
            "block_size": 65536, "glob": "*", "max_bytes": None, "hf_split": "train",
            "hf_text_field": "text", "cache_dir": None}


def split_blocks(data: torch.Tensor, val_fraction: float, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 tensors from ``data`` [N] uint8; see the module docstring."""
    every = max(2, int(round(1.0 / val_fraction)))
    n_blocks = (data.numel() + block_size - 1) // block_size
    if n_blocks < every:
        # fewer blocks than one group: the last val_fraction of the bytes is validation
        cut = int(data.numel() * (1 - val_fraction))
        return data[:cut], data[cut:]
    parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for b in range(n_blocks):
        parts[b % every == every - 1].append(data[b * block_size:(b + 1) * block_size])
    return torch.cat(parts[False]), torch.cat(parts[True])


def windows(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None):
    """``(inputs [B, T], targets [B, T])`` int64 from random windows of ``data`` [N] uint8.

    The window offsets are drawn on the generator's device and the batch is sliced where
    ``data`` lives (on the GPU after ``TextTask.to``: no host work per batch).
    """
    if data.numel() < seq_len + 1:
        raise ValueError(f"split has {data.numel()} bytes, fewer than one window of {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator,
                           device=generator.device if generator is not None else None).to(data.device)
    idx = starts[:, None] + torch.arange(seq_len + 1, device=data.device)
    seq = data[idx].to(torch.int64)
    return seq[:, :-1], seq[:, 1:]


class TextTask(Task):
    """Byte-level LM on a ``Corpus``; ``describe()`` records the corpus's size and sha256."""

    name = "text"
    options = DEFAULTS          # its config's keys and their defaults (tasks.check_task reads them)
    vocab_size = VOCAB

    def __init__(self, corpus: Corpus, seq_len: int = 256, test_seq_len: int | None = None,
                 val_fraction: float = 0.05, block_size: int = 65536):
        self.corpus = corpus
        self.seq_len = int(seq_len)
        self.eval_seq_len = int(test_seq_len or seq_len)
        self.val_fraction, self.block_size = float(val_fraction), int(block_size)
        data = torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)
        self.train_data, self.val_data = split_blocks(data, self.val_fraction, self.block_size)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>") -> "TextTask":
        o = Options(cfg, DEFAULTS, source)
        max_bytes = None if o.get("max_bytes") is None else o.int("max_bytes", 1)
        corpus = load_corpus(str(o.get("corpus")), glob=str(o.get("glob")), max_bytes=max_bytes,
                             hf_split=str(o.get("hf_split")), hf_text_field=str(o.get("hf_text_field")),
                             cache_dir=o.get("cache_dir"))
        test_len = None if o.get("test_seq_len") is None else o.int("test_seq_len", 1)
        return cls(corpus, o.int("seq_len", 1), test_len, o.float("val_fraction", 1e-4, 0.5),
                   o.int("block_size", 1))

    def to(self, device) -> "TextTask":
        """Move both splits to ``device`` once (batches are then sliced there)."""
        self.train_data, self.val_data = self.train_data.to(device), self.val_data.to(device)
        return self

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        return windows(self.train_data if split == "train" else self.val_data, batch_size, T, generator)

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len,
                "test_seq_len": self.eval_seq_len, "val_fraction": self.val_fraction,
                "block_size": self.block_size, "train_bytes": int(self.train_data.numel()),
                "val_bytes": int(self.val_data.numel()), "corpus": self.corpus.describe()}
