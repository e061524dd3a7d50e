"""MAD's recall tasks: in-context recall, noisy in-context recall and fuzzy in-context recall
(multi-query, as MAD's benchmark runs them), built with torch ops on the generator's device.

A sequence is a stream of key-value pairs; a key keeps its value wherever it repeats (within the
sequence), and the last pair repeats an earlier key (the probe). A pair is ``ks`` key tokens then
``vs`` value tokens: one each for (noisy) in-context recall; for fuzzy recall motifs of distinct
tokens with ``ks`` drawn from ``1..k_motif_size`` in training (always ``k_motif_size`` when
evaluating, as MAD prompts at the largest key size) and ``vs`` from ``1..v_motif_size``. A
noisy pair (probability ``frac_noise``) is ``ks + vs`` tokens from the noise vocabulary. Pairs
are added while ``k_motif_size + v_motif_size`` tokens still fit before the probe; the sequence is
left-padded to ``seq_len + 1`` tokens (MAD's pad token for fuzzy recall; for the other two, whose
vocabulary has none, a random key token that starts no pair).

Vocabulary (MAD's): keys ``[0, ns//2)``, values ``[ns//2, ns)``, noise ``[ns, ns + noise)``,
``ns = vocab - noise`` (fuzzy: ``vocab - 1 - noise``, and ``vocab - 1`` is the pad token).

Targets: training targets are the next token everywhere (MAD trains on the shifted sequence);
validation targets are the value tokens of every pair whose key appeared before, else ``IGNORE``.

Differences from MAD's generator, by construction of a batched one: MAD's sequences are
``seq_len - 1`` tokens, these ``seq_len``; the pair that is guaranteed not to be noise is the first
(MAD: a random one); MAD's fuzzy recall inserts the probe pair at a random earlier position, here
the probe repeats a random earlier pair (the same joint law of context and probe).
"""
from __future__ import annotations

import torch

from ssmcraft.tasks.base import IGNORE
from ssmcraft.tasks.mad.base import COMMON, MADTask
from ssmcraft.tasks.mqar import device_of


def _motifs(B: int, S: int, low: int, high: int, width: int, g) -> torch.Tensor:
    """``[B, S, width]``: per slot, ``width`` distinct tokens from ``[low, high)``."""
    return torch.rand(B, S, high - low, generator=g, device=device_of(g)).argsort(-1)[..., :width] + low


def recall_batch(B: int, T: int, vocab: int, noise_vocab: int, frac_noise: float, k_motif: int, v_motif: int,
                 pad_token: int | None, split: str, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [B, T], targets [B, T])`` of a recall task (module docstring). ``pad_token`` None:
    the vocabulary has no pad token (in-context recall); ``split`` picks the targets and key sizes."""
    dev = device_of(g)
    N = T + 1
    ns = vocab - noise_vocab - (0 if pad_token is None else 1)
    K = ns // 2
    S = N // 2 + 1                                                       # slots: at least 2 tokens each
    W = k_motif + v_motif
    ks = (torch.randint(1, k_motif + 1, (B, S), generator=g, device=dev) if split == "train"
          else torch.full((B, S), k_motif, device=dev))
    vs = torch.randint(1, v_motif + 1, (B, S), generator=g, device=dev)
    keys = _motifs(B, S, 0, K, k_motif, g)                               # [B, S, k_motif]
    values = _motifs(B, S, K, ns, v_motif, g)
    noisy = torch.rand(B, S, generator=g, device=dev) < frac_noise
    noisy[:, 0] = False
    # a key is its size and its first ks tokens; the first pair with a key gives every later one its value
    o = torch.arange(k_motif, device=dev)
    ident = torch.where(o < ks[..., None], keys, -1)
    same = (ident[:, :, None, :] == ident[:, None, :, :]).all(-1)        # [B, S, S]
    earlier = torch.ones(S, S, dtype=torch.bool, device=dev).tril(-1)
    same = same & earlier & ~noisy[:, None, :] & ~noisy[:, :, None]
    seen = same.any(-1)
    first = torch.where(seen, same.int().argmax(-1), torch.arange(S, device=dev))
    values = values.gather(1, first[..., None].expand(-1, -1, v_motif))
    vs = vs.gather(1, first)
    length = ks + vs
    kept = length.cumsum(1) <= N - W                                     # room left for any probe
    # the probe: a random earlier kept pair that is not noise
    probe = torch.multinomial((kept & ~noisy).double(), 1, generator=g)  # [B, 1]
    ks = torch.cat([ks, ks.gather(1, probe)], 1)
    vs = torch.cat([vs, vs.gather(1, probe)], 1)
    keys = torch.cat([keys, keys.gather(1, probe[..., None].expand(-1, -1, k_motif))], 1)
    values = torch.cat([values, values.gather(1, probe[..., None].expand(-1, -1, v_motif))], 1)
    noisy = torch.cat([noisy, torch.zeros(B, 1, dtype=torch.bool, device=dev)], 1)
    seen = torch.cat([seen, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)
    length = torch.where(torch.cat([kept, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1), ks + vs, 0)
    pad = N - length.sum(1, keepdim=True)                                # [B, 1]
    starts = pad + length.cumsum(1) - length                             # [B, S + 1]
    pos = torch.arange(N, device=dev).expand(B, N).contiguous()
    slot = (torch.searchsorted(starts, pos, right=True) - 1).clamp_min(0)
    off = pos - starts.gather(1, slot)
    in_key = off < ks.gather(1, slot)
    key_tok = keys.gather(1, slot[..., None].expand(-1, -1, k_motif)).gather(2, off.clamp(0, k_motif - 1)[..., None])[..., 0]
    voff = (off - ks.gather(1, slot)).clamp(0, v_motif - 1)
    val_tok = values.gather(1, slot[..., None].expand(-1, -1, v_motif)).gather(2, voff[..., None])[..., 0]
    seq = torch.where(in_key, key_tok, val_tok)
    is_noise = noisy.gather(1, slot)
    if noise_vocab:
        seq = torch.where(is_noise, torch.randint(ns, ns + noise_vocab, (B, N), generator=g, device=dev), seq)
    before = pos < pad
    filler = (torch.full((B, N), pad_token, device=dev) if pad_token is not None
              else torch.randint(0, K, (B, N), generator=g, device=dev))
    seq = torch.where(before, filler, seq)
    scored = ~before & ~in_key & ~is_noise & seen.gather(1, slot)
    if split == "train":
        return seq[:, :-1], seq[:, 1:]
    return seq[:, :-1], torch.where(scored, seq, IGNORE)[:, 1:]


class _Recall(MADTask):
    k_motif_size = 1
    v_motif_size = 1
    pad = False

    def __init__(self, vocab, seq_len, noise_vocab_size=0, frac_noise=0.0, k_motif_size=1, v_motif_size=1,
                 num_train_examples=None, data_seed=0):
        self.vocab_size, self.seq_len, self.eval_seq_len = int(vocab), int(seq_len), int(seq_len)
        self.noise_vocab_size, self.frac_noise = int(noise_vocab_size), float(frac_noise)
        self.k_motif_size, self.v_motif_size = int(k_motif_size), int(v_motif_size)
        self.num_train_examples, self.data_seed = num_train_examples, int(data_seed)
        ns = self.vocab_size - self.noise_vocab_size - int(self.pad)
        if ns // 2 < self.k_motif_size or ns - ns // 2 < self.v_motif_size:
            raise ValueError(f"vocab {self.vocab_size} leaves {ns // 2} key and {ns - ns // 2} value tokens, fewer than "
                             f"the motif sizes ({self.k_motif_size}, {self.v_motif_size})")
        if self.frac_noise > 0 and self.noise_vocab_size < 1:
            raise ValueError("frac_noise > 0 needs noise_vocab_size >= 1")
        if self.seq_len + 1 < 3 * (self.k_motif_size + self.v_motif_size):
            raise ValueError(f"seq_len {self.seq_len} is too short for pairs of up to "
                             f"{self.k_motif_size + self.v_motif_size} tokens")

    def pool_chunk(self) -> int:
        """Bounded by the ``[B, S, S, k_motif_size]`` key comparison of ``recall_batch``."""
        slots = (self.seq_len + 1) // 2 + 1
        return max(1, min(1024, 2 ** 26 // (slots * slots * self.k_motif_size)))

    def instances(self, batch_size, seq_len, split, generator):
        return recall_batch(batch_size, seq_len, self.vocab_size, self.noise_vocab_size, self.frac_noise,
                            self.k_motif_size, self.v_motif_size, self.vocab_size - 1 if self.pad else None, split,
                            generator)


class InContextRecallTask(_Recall):
    """MAD's in-context recall (multi-query): single-token keys and values."""

    name = "in_context_recall"
    options = {"vocab": 16, "seq_len": 128, **COMMON, "num_train_examples": 12_800}

    @classmethod
    def from_config(cls, cfg, source="<experiment>"):
        return cls.read(cfg, source, checked=lambda o: {"vocab": o.int("vocab", 2), "seq_len": o.int("seq_len", 2)})


class NoisyRecallTask(_Recall):
    """MAD's noisy in-context recall: pairs replaced by noise tokens with probability ``frac_noise``."""

    name = "noisy_recall"
    options = {"vocab": 32, "seq_len": 128, "noise_vocab_size": 16, "frac_noise": 0.2, **COMMON,
               "num_train_examples": 12_800}

    @classmethod
    def from_config(cls, cfg, source="<experiment>"):
        return cls.read(cfg, source, checked=lambda o: {
            "vocab": o.int("vocab", 2), "seq_len": o.int("seq_len", 2), "noise_vocab_size": o.int("noise_vocab_size", 0),
            "frac_noise": o.float("frac_noise", 0.0, 0.99)})


class FuzzyRecallTask(_Recall):
    """MAD's fuzzy in-context recall: keys and values are motifs of several tokens."""

    name = "fuzzy_recall"
    options = {"vocab": 16, "seq_len": 128, "k_motif_size": 3, "v_motif_size": 3, **COMMON,
               "num_train_examples": 12_800}
    pad = True

    @classmethod
    def from_config(cls, cfg, source="<experiment>"):
        return cls.read(cfg, source, checked=lambda o: {
            "vocab": o.int("vocab", 3), "seq_len": o.int("seq_len", 2), "k_motif_size": o.int("k_motif_size", 1),
            "v_motif_size": o.int("v_motif_size", 1)})
