"""The interface every task implements, and config-checking helpers shared by the tasks.

A task is a source of ``(inputs, targets)`` batches of token ids:

- ``inputs``:  ``[B, T]`` int64, token ids in ``[0, vocab_size)``;
- ``targets``: ``[B, T]`` int64, the token to predict at each position, or ``IGNORE``
  (-100, PyTorch's ``cross_entropy`` default ``ignore_index``) where nothing is scored.

Batches are drawn from a ``torch.Generator`` the caller owns, so a run is reproducible from
its seed alone and no task keeps random state of its own. A batch is made on the
generator's device (a CUDA generator: built by torch ops on the GPU, no host work; the
same seed gives the same batch on the same kind of device, not across CPU and GPU).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ssmcraft.config_check import Checker, Field

IGNORE = -100
SPLITS = ("train", "val")


class Task:
    """Base class: subclasses set ``name``, ``vocab_size``, ``seq_len`` and implement ``sample``.

    ``seq_len`` is the training length; ``eval_seq_len`` the default length of validation
    batches (equal unless the task config asks for a different test length).
    """

    name: str = "task"
    options: dict                # the config's keys besides name, with their defaults (set by each task)
    vocab_size: int
    seq_len: int
    eval_seq_len: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>") -> "Task":
        """The task of a config mapping: ``cls(**values)``, each of ``options``' keys taken from
        ``cfg`` or its default. Unknown keys are a ``SpecError``, and so is a ``ValueError``
        the constructor raises (its message names the problem). Tasks that check each value
        themselves override this."""
        o = Options(cfg, cls.options, source)
        try:
            return cls(**{k: o.get(k) for k in cls.options})
        except ValueError as e:
            o.fail("", str(e))

    def sample(self, split: str, batch_size: int, seq_len: int | None = None,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs [B, T], targets [B, T])`` int64 for ``split`` in ``SPLITS``.

        ``seq_len`` defaults to ``self.seq_len`` for ``train`` and ``self.eval_seq_len``
        for ``val``.
        """
        raise NotImplementedError

    def to(self, device) -> "Task":
        """Move the task's data (if it holds any, e.g. a corpus) to ``device``; returns self."""
        return self

    def describe(self) -> dict[str, Any]:
        """A JSON-serialisable description (name, sizes, and data provenance)."""
        raise NotImplementedError

    def score(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, tuple[float, float]]:
        """Task-specific metrics of one batch as ``name -> (numerator, denominator)``.

        Numbers or 0-dim tensors (left on the device: ``evaluate`` sums them there and
        reads them back once).

        logits ``[B, T, V]``, targets ``[B, T]``. Sums over batches divided give the metric
        (so batches of different sizes average correctly). None by default.
        """
        return {}

    def constant_metrics(self) -> dict[str, float]:
        """Metrics that do not depend on the model (e.g. chance accuracy); none by default."""
        return {}

    def default_len(self, split: str, seq_len: int | None) -> int:
        check_split(split)
        if seq_len is not None:
            return int(seq_len)
        return self.seq_len if split == "train" else self.eval_seq_len

    def fixed_batches(self, split: str, n_batches: int, batch_size: int, seq_len: int | None = None,
                      seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` batches drawn from a generator seeded with ``seed``: the same every call."""
        g = torch.Generator().manual_seed(int(seed))
        return [self.sample(split, batch_size, seq_len, g) for _ in range(n_batches)]


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, scored) counts of argmax predictions at positions whose target is not IGNORE,
    as 0-dim int64 tensors on the logits' device (no host sync).

    logits ``[B, T, V]``, targets ``[B, T]``.
    """
    mask = targets != IGNORE
    correct = (logits.argmax(-1) == targets) & mask
    return correct.sum(), mask.sum()


class Options:
    """A task's config section, read with the shared checker (``ssmcraft.config_check``): the keys of
    ``allowed`` (name -> default) and ``name``, unknown keys refused; ``int`` / ``float`` check a
    value where the task reads it. ``source`` names where the mapping came from ("task" in an
    experiment spec) for messages."""

    def __init__(self, cfg: Mapping[str, Any], allowed: Mapping[str, Any], source: str = "<experiment>",
                 key: str = "task"):
        self.checker = Checker(source, key)
        self.values = self.checker.section("", cfg, {k: Field(default=v) for k, v in allowed.items()},
                                           extra=("name",))

    def get(self, name: str):
        return self.values[name]

    def int(self, name: str, minimum: int | None = None) -> int:
        """An integer (a float with no fraction, as YAML may write one, is taken), at least ``minimum``."""
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                self.fail(name, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            self.fail(name, f"must be at least {minimum}, got {value}")
        return value

    def float(self, name: str, low: float | None = None, high: float | None = None) -> float:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(name, f"expected a number, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            self.fail(name, f"must lie in [{low}, {high}], got {value}")
        return float(value)

    def fail(self, name: str, problem: str):
        self.checker.fail(name, problem)
