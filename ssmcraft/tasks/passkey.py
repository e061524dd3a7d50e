"""Passkey retrieval, byte-level (one token per byte, vocabulary 256).

A sequence is an instruction, filler text repeated to the chosen length, a needle sentence
holding a random key of ``digits`` decimal digits inserted at a chosen depth of the filler
(0 = right after the instruction, 1 = right before the question; snapped to the
nearest sentence start), the question and the key::

    There is an important info hidden ... <filler> The pass key is 71432. Remember it.
    71432 is the pass key. <filler> What is the pass key? The pass key is 71432

``inputs`` are the first T bytes, ``targets`` the next byte at each position but ``IGNORE``
everywhere except the positions that predict the answer's digits (the last ``digits``
positions). A trial counts as retrieved when every digit is predicted (argmax, teacher
forcing; identical to greedy decoding of the answer).

``PasskeyTask`` is the trainable variant (random depth per example); ``passkey_batch``
builds the fixed-length, fixed-depth batches of the evaluation grid.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from ssmcraft.tasks.base import IGNORE, Options, Task, token_accuracy

PREFIX = (b"There is an important info hidden inside a lot of irrelevant text. "
          b"Find it and memorize it. I will quiz you about the important information there.\n")
FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = b"The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = b"What is the pass key? The pass key is "
VOCAB = 256
DEFAULTS = {"seq_len": 256, "digits": 5, "depth": None, "test_seq_len": None}


def needle_length(digits: int) -> int:
    """The needle's length in bytes with its ``digits``-digit key written in (at each ``{key}``)."""
    return len(NEEDLE) + NEEDLE.count(b"{key}") * (digits - len(b"{key}"))


def min_length(digits: int) -> int:
    """Shortest context (in bytes) that holds the prompt, the needle and the answer."""
    return len(PREFIX) + needle_length(digits) + len(QUESTION) + digits


def sentence_start_near(filler: bytes, position: float) -> int:
    """The sentence start in ``filler`` (0, after each ". ", or its end) closest to ``position``."""
    return min(sentence_starts(filler).tolist(), key=lambda s: (abs(s - position), s))


def passkey_text(seq_len: int, depth: float, key: bytes) -> tuple[bytes, int]:
    """The ``seq_len + 1`` bytes of one example and the index where the answer starts."""
    digits = len(key)
    n_fill, filler = _fill(seq_len, digits)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    cut = sentence_start_near(filler, depth * n_fill)
    text = PREFIX + filler[:cut] + NEEDLE.replace(b"{key}", key) + filler[cut:] + QUESTION + key
    assert len(text) == seq_len + 1
    return text, seq_len + 1 - digits


def passkey_batch(batch_size: int, seq_len: int, depth: float | torch.Tensor, digits: int = 5,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs [B, T], targets [B, T], keys [B, digits])`` int64; ``depth`` a float or ``[B]``.

    Only the last ``digits`` targets are scored: they are the key's digits as bytes. Built
    with torch ops on the generator's device (no per-example Python); byte for byte the
    text of ``passkey_text`` (the tests compare the two).
    """
    dev = generator.device if generator is not None else torch.device("cpu")
    key_digits = torch.randint(0, 10, (batch_size, digits), generator=generator, device=dev)
    depths = (depth.to(dev) if isinstance(depth, torch.Tensor)
              else torch.full((batch_size,), float(depth), device=dev))
    if dev.type == "cpu" and bool(((depths < 0) | (depths > 1)).any()):   # (no GPU sync to check)
        raise ValueError(f"depth must lie in [0, 1], got {depths.tolist()}")
    n_fill, starts, const = _layout(seq_len, digits, dev)
    # the sentence start nearest to depth * n_fill (the first, i.e. smallest, on a tie)
    cut = starts[(starts.double()[None, :] - depths.double()[:, None] * n_fill).abs().argmin(1)]
    pos = torch.arange(seq_len + 1, device=dev)[None, :].expand(batch_size, -1)
    lp, ln, cut = len(PREFIX), needle_length(digits), cut[:, None]
    in_needle = (pos >= lp + cut) & (pos < lp + cut + ln)
    after = pos >= lp + cut + ln
    idx = torch.where(in_needle, lp + n_fill + (pos - lp - cut), torch.where(after, pos - ln, pos))
    idx = torch.where(pos >= lp + n_fill + ln, pos, idx)     # QUESTION and the answer: in place
    seq = const[idx]
    slot = torch.cumsum((seq == 0).to(torch.int64), dim=1) - 1   # NULs in order: 2 needle keys, then the answer
    key_bytes = 48 + key_digits
    seq = torch.where(seq == 0, key_bytes.gather(1, (slot % digits).clamp_min(0)), seq)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, : seq_len - digits] = IGNORE
    return inputs, targets, key_digits


@functools.lru_cache(maxsize=16)
def _layout(seq_len: int, digits: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The constants of every batch of one (length, digits, device), made once (a batch then
    does no host work and no host-to-device copy): ``(n_fill, sentence starts [S], const)``,
    ``const`` the bytes PREFIX + filler + needle (NUL where the digits go) + QUESTION + NULs
    for the answer, which a batch indexes (``passkey_text``'s layout)."""
    template = NEEDLE.replace(b"{key}", b"\0" * digits)     # the needle with NUL where the digits go
    n_fill, filler = _fill(seq_len, digits)
    const = _bytes(PREFIX + filler + template + QUESTION + b"\0" * digits, device)
    return n_fill, sentence_starts(filler).to(device), const


def _fill(seq_len: int, digits: int) -> tuple[int, bytes]:
    """``(n_fill, filler)``: how many filler bytes a ``seq_len`` context with a ``digits``-digit
    key holds, and those bytes (FILLER repeated and cut); raises when the prompt does not fit."""
    n_fill = seq_len + 1 - min_length(digits)
    if n_fill < 0:
        raise ValueError(f"passkey context {seq_len} is shorter than the prompt ({min_length(digits)} bytes)")
    return n_fill, (FILLER * (n_fill // len(FILLER) + 1))[:n_fill]


def sentence_starts(filler: bytes) -> torch.Tensor:
    """Every sentence start of ``filler`` (0, after each ". ", and its end), ascending, int64."""
    return torch.tensor([0] + [i + 2 for i in range(len(filler) - 1) if filler[i:i + 2] == b". "] + [len(filler)])


def _bytes(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.int64)


def retrieved(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: every scored position predicted (logits ``[B, T, V]``, targets ``[B, T]``)."""
    mask = targets != IGNORE
    ok = (logits.argmax(-1) == targets) | ~mask
    return ok.all(dim=1)


class PasskeyTask(Task):
    """Trainable passkey retrieval: depth uniform in [0, 1] per example unless ``depth`` is fixed."""

    name = "passkey"
    options = DEFAULTS          # its config's keys and their defaults (tasks.check_task reads them)
    vocab_size = VOCAB

    def __init__(self, seq_len: int = 256, digits: int = 5, depth: float | None = None,
                 test_seq_len: int | None = None):
        self.seq_len, self.digits, self.depth = int(seq_len), int(digits), depth
        self.eval_seq_len = int(test_seq_len or seq_len)
        for T in (self.seq_len, self.eval_seq_len):
            if T < min_length(self.digits):
                raise ValueError(f"seq_len {T} is shorter than the passkey prompt ({min_length(self.digits)} bytes)")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "<experiment>") -> "PasskeyTask":
        o = Options(cfg, DEFAULTS, source)
        depth = None if o.get("depth") is None else o.float("depth", 0.0, 1.0)
        test_len = None if o.get("test_seq_len") is None else o.int("test_seq_len", 1)
        try:
            return cls(o.int("seq_len", 1), o.int("digits", 1), depth, test_len)
        except ValueError as e:
            o.fail("", str(e))

    def sample(self, split, batch_size, seq_len=None, generator=None):
        T = self.default_len(split, seq_len)
        if self.depth is None:
            depth = torch.rand(batch_size, generator=generator,
                               device=generator.device if generator is not None else None)
        else:
            depth = float(self.depth)
        inputs, targets, _ = passkey_batch(batch_size, T, depth, self.digits, generator)
        return inputs, targets

    def score(self, logits, targets):
        correct, scored = token_accuracy(logits, targets)
        hits = retrieved(logits, targets)
        return {"digit_accuracy": (correct, scored), "accuracy": (hits.sum(), hits.numel())}

    def constant_metrics(self):
        return {"chance_accuracy": 0.1 ** self.digits}

    def describe(self):
        return {"name": self.name, "vocab": self.vocab_size, "seq_len": self.seq_len,
                "test_seq_len": self.eval_seq_len, "digits": self.digits, "depth": self.depth}
