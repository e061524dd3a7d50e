"""Causal softmax attention with rotary position embeddings: the baseline mixer, full or
over a sliding window.

Shapes: hidden ``[B, T, d_model]``, per head ``[B, H, T, d_head]`` with
``d_head = d_model / H`` (even, for the rotary pairs). Recurrent mode keeps a key/value
cache: full attention's grows with every token (memory O(T), unlike an objective mixer's
constant state); with ``window: w`` it is a ring of ``w`` slots holding the last ``w`` tokens
(O(w), and of constant shape, so graphed decoding can hold it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers.config import AttentionConfig
from ssmcraft.layers.mitigation import Mitigation


@dataclass
class KVCache:
    """Full attention: keys and values so far ``[B, H, t, d_head]`` and the next position (an int).
    Sliding window ``w``: a ring of ``w`` slots ``[B, H, w, d_head]`` (position ``p`` in slot
    ``p % w``) and the next position as a 0-dim int64 tensor on the cache's device."""

    k: torch.Tensor
    v: torch.Tensor
    pos: int | torch.Tensor


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + d/2])`` of x ``[B, H, T, d]`` by ``pos * base**(-2i/d)``;
    ``positions`` ``[T]``, or ``[B, T]`` (each row its own, e.g. restarting at every packed document)."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) * 2 / d)
    angles = positions.to(torch.float32)[..., None] * freqs                      # [T, d/2] or [B, T, d/2]
    if angles.dim() == 3:
        angles = angles[:, None]                                                  # [B, 1, T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class AttentionMixer(nn.Module):
    def __init__(self, cfg: AttentionConfig, d_model: int):
        super().__init__()
        if cfg.heads < 1 or d_model % cfg.heads or (d_model // cfg.heads) % 2:
            raise SpecError("<mixer>", "heads", f"d_model = {d_model} must split into {cfg.heads} heads of even size")
        self.cfg, self.H, self.hd = cfg, cfg.heads, d_model // cfg.heads
        self.window = int(cfg.window)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.last_backend = "sdpa"

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor):
        B, T, _ = h.shape
        q, k, v = self.qkv(h).view(B, T, 3, self.H, self.hd).permute(2, 0, 3, 1, 4)
        return rotary(q, positions, self.cfg.rope_base), rotary(k, positions, self.cfg.rope_base), v

    def _attend(self, h: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        """h ``[B, T, d_model]`` -> (``[B, T, d_model]``, the rotated keys and the values ``[B, H, T, d_head]``)."""
        B, T, C = h.shape
        pos = torch.arange(T, device=h.device)
        near = pos[:, None] - pos[None, :]
        if cu_seqlens is not None:      # positions restart at every document, as each alone would have them
            flat = torch.arange(B * T, device=h.device)
            cu = cu_seqlens.to(device=h.device, dtype=torch.int64)
            doc = torch.searchsorted(cu, flat, right=True) - 1
            q, k, v = self._qkv(h, (flat - cu[doc]).view(B, T))
            seen = (near >= 0) & (near < self.window) if self.window else near >= 0
            doc = doc.view(B, 1, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen & (doc[..., :, None] == doc[..., None, :]))
        elif self.window and self.window < T:
            # query i sees keys j with i - window < j <= i
            q, k, v = self._qkv(h, pos)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=(near >= 0) & (near < self.window))
        else:
            q, k, v = self._qkv(h, pos)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C)), k, v

    def forward(self, h: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """h ``[B, T, d_model]`` -> ``[B, T, d_model]``. ``cu_seqlens``: offsets of documents packed in
        the rows laid end to end (``ObjectiveMixer.forward``): a query sees keys of its own document only."""
        return self._attend(h, cu_seqlens)[0]

    def prefill(self, h: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """A prompt h ``[B, T, d_model]`` from an empty cache -> (``forward(h)``, the cache ``step``
        holds after its last token: every key/value, or with a window the ring of the last
        ``window`` ones, position ``p`` in slot ``p % window``)."""
        if cache is not None:
            raise SsmcraftError("attention prefill starts from an empty cache (cache=None); continue a "
                                "cache token by token with step")
        y, k, v = self._attend(h)
        T = h.shape[1]
        ring = self.init_cache(h.shape[0])      # its dtype (the weights'), as step keeps it under autocast
        k, v = k.to(ring.k.dtype), v.to(ring.v.dtype)
        if not self.window:
            return y, KVCache(k, v, T)
        kept = torch.arange(max(0, T - self.window), T, device=h.device)
        slots = kept % self.window
        return y, KVCache(ring.k.index_copy(2, slots, k[:, :, kept]), ring.v.index_copy(2, slots, v[:, :, kept]),
                          torch.tensor(T, dtype=torch.int64, device=h.device))

    def init_cache(self, batch_size: int) -> KVCache:
        """An empty key/value cache (a ring of ``window`` zero slots with a window) on the module's
        device and in its dtype."""
        w = self.qkv.weight
        empty = torch.zeros(batch_size, self.H, self.window, self.hd, device=w.device, dtype=w.dtype)
        if self.window:
            return KVCache(empty, empty.clone(), torch.zeros((), dtype=torch.int64, device=w.device))
        return KVCache(empty, empty.clone(), 0)

    def step(self, h_t: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """h_t ``[B, d_model]`` -> (``[B, d_model]``, the cache with this token appended; with a
        window, written over the oldest of its slots)."""
        B, C = h_t.shape
        if self.window:
            pos = cache.pos
            q, k, v = self._qkv(h_t[:, None], pos.view(1))
            slot = (pos % self.window).view(1)
            k, v = cache.k.index_copy(2, slot, k), cache.v.index_copy(2, slot, v)
            written = torch.arange(self.window, device=h_t.device) <= pos    # every slot once pos >= window - 1
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=written.view(1, 1, 1, -1))
            return self.out_proj(y.reshape(B, C)), KVCache(k, v, pos + 1)
        q, k, v = self._qkv(h_t[:, None], torch.tensor([cache.pos], device=h_t.device))
        k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(y.reshape(B, C)), KVCache(k, v, cache.pos + 1)

    def state_elements(self) -> int | None:
        """Numbers one sequence's cache holds (keys and values): ``2 * window * d_model`` with a
        window, None for full attention (its cache grows with the context)."""
        return 2 * self.window * self.H * self.hd if self.window else None

    def trace_states(self, h: torch.Tensor, every: int = 1) -> torch.Tensor:
        raise SsmcraftError("the attention mixer has no recurrent state to trace")

    def set_mitigation(self, mitigation: Mitigation | None) -> None:
        if mitigation is not None and not mitigation.is_identity:
            raise SsmcraftError(f"mitigation {mitigation.label()} does not apply to the attention mixer "
                                "(it has no recurrent state)")

    def describe(self) -> dict[str, Any]:
        return {"kind": "attention", "heads": self.H, "d_head": self.hd, "rope_base": self.cfg.rope_base,
                "window": self.window}
