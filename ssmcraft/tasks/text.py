"""Byte-level language modelling on a text corpus (vocabulary 256, one token per byte).

Deterministic train/validation split: the corpus is cut into blocks of ``block_size`` bytes
and every ``round(1 / val_fraction)``-th block (the last of each group) goes to validation.
Interleaving keeps both splits spread over the whole corpus (a sorted stdlib would
otherwise validate on one package only). Batches are windows of ``T + 1`` bytes at uniform
random offsets within a split; ``targets`` are ``inputs`` shifted by one.

Packing (``pack: true``, the default): a window holds several documents (the corpus's files or
rows, ``Corpus.starts``), and the model sees where each begins: an input token that starts a
document carries ``DOC_START`` (``ssmcraft.layers.lm``), so that every layer restarts its state
there (``cu_seqlens``), and the target that would predict a document's first byte from the previous
document is not scored (``IGNORE``). The seams of the split (a training block that follows a
validation block, and every validation block) count as document starts too, since the bytes on
either side were not adjacent in the corpus. ``pack: false`` gives plain windows that run across
documents.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ssmcraft.layers.lm import DOC_START
from ssmcraft.tasks.base import IGNORE, Options, Task
from ssmcraft.tasks.corpus import Corpus, load_corpus

VOCAB = 256
DEFAULTS = {"corpus": "stdlib", "seq_len": 256, "test_seq_len": None, "val_fraction": 0.05,
            "block_size": 65536, "glob": "*", "max_bytes": None, "hf_split": "train",
            "hf_text_field": "text", "cache_dir": None, "pack": True}


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


def document_starts(n: int, starts: list[int], val_fraction: float, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) bool masks, aligned with ``split_blocks``' splits of ``n`` bytes: True where a
    document begins (``starts``), at every seam of a split and at each split's first byte."""
    mark = torch.zeros(n, dtype=torch.bool)
    mark[torch.tensor(starts, dtype=torch.int64)] = True
    every = max(2, int(round(1.0 / val_fraction)))
    for b in range(1, (n + block_size - 1) // block_size):
        if b % every in (every - 1, 0):      # a validation block, or the training block after one
            mark[b * block_size] = True
    train, val = split_blocks(mark, val_fraction, block_size)
    for part in (train, val):
        if part.numel():
            part[0] = True
    return train, val


def windows(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None,
            doc_starts: torch.Tensor | None = None):
    """``(inputs [B, T], targets [B, T])`` int64 from random windows of ``data`` [N] uint8.

    The window offsets are drawn on the generator's device and the batch is sliced where
    ``data`` lives (on the GPU after ``TextTask.to``: no host work per batch). ``doc_starts`` (bool
    [N]): where documents begin; an input token there carries ``DOC_START`` and the target equal to
    it (the previous document's last prediction) is ``IGNORE``.
    """
    if data.numel() < seq_len + 1:
        raise ValueError(f"split has {data.numel()} bytes, fewer than one window of {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator,
                           device=generator.device if generator is not None else None).to(data.device)
    idx = starts[:, None] + torch.arange(seq_len + 1, device=data.device)
    seq = data[idx].to(torch.int64)
    if doc_starts is None:
        return seq[:, :-1], seq[:, 1:]
    first = doc_starts[idx]
    return seq[:, :-1] + DOC_START * first[:, :-1], torch.where(first[:, 1:], IGNORE, seq[:, 1:])


class TextTask(Task):
    """Byte-level LM on a ``Corpus``; ``describe()`` records the corpus's size and sha256."""

    name = "text"
    options = DEFAULTS          # its config's keys and their defaults (tasks.check_task reads them)
    vocab_size = VOCAB

    def __init__(self, corpus: Corpus, seq_len: int = 256, test_seq_len: int | None = None,
                 val_fraction: float = 0.05, block_size: int = 65536, pack: bool = True):
        self.corpus = corpus
        self.seq_len = int(seq_len)
        self.eval_seq_len = int(test_seq_len or seq_len)
        self.val_fraction, self.block_size = float(val_fraction), int(block_size)
        data = torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)
        self.train_data, self.val_data = split_blocks(data, self.val_fraction, self.block_size)
        self.pack = bool(pack)
        self.train_starts = self.val_starts = None
        if self.pack:
            if corpus.starts is None:
                raise ValueError(f"pack: corpus {corpus.source} was cached without its document offsets; delete "
                                 "its cache to read it again, or set pack: false")
            self.train_starts, self.val_starts = document_starts(data.numel(), corpus.starts, self.val_fraction,
                                                                 self.block_size)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>") -> "TextTask":
        o = Options(cfg, DEFAULTS, source)
        max_bytes = None if o.get("max_bytes") is None else o.int("max_bytes", 1)
        corpus = load_corpus(str(o.get("corpus")), glob=str(o.get("glob")), max_bytes=max_bytes,
                             hf_split=str(o.get("hf_split")), hf_text_field=str(o.get("hf_text_field")),
                             cache_dir=o.get("cache_dir"))
        test_len = None if o.get("test_seq_len") is None else o.int("test_seq_len", 1)
        pack = o.get("pack")
        if not isinstance(pack, bool):
            o.fail("pack", f"must be true or false, got {pack!r}")
        try:
            return cls(corpus, o.int("seq_len", 1), test_len, o.float("val_fraction", 1e-4, 0.5),
                       o.int("block_size", 1), pack)
        except ValueError as e:
            o.fail("pack", str(e))

    def to(self, device) -> "TextTask":
        """Move both splits to ``device`` once (batches are then sliced there)."""
        self.train_data, self.val_data = self.train_data.to(device), self.val_data.to(device)
        if self.pack:
            self.train_starts, self.val_starts = self.train_starts.to(device), self.val_starts.to(device)
        return self

    @property
    def documents(self) -> bool:
        """Batches carry document starts (``DOC_START``): the model must restart at them (``LM.documents``)."""
        return self.pack

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        train = split == "train"
        return windows(self.train_data if train else self.val_data, batch_size, T, generator,
                       self.train_starts if train else self.val_starts)

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len,
                "test_seq_len": self.eval_seq_len, "val_fraction": self.val_fraction,
                "block_size": self.block_size, "pack": self.pack, "train_bytes": int(self.train_data.numel()),
                "val_bytes": int(self.val_data.numel()), "corpus": self.corpus.describe()}
