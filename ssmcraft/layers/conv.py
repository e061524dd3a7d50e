"""Depthwise causal 1-D convolution with a one-token step (the short conv of Mamba blocks)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalConv1d(nn.Module):
    """Depthwise conv over time, left-padded so output ``t`` sees inputs ``t-k+1 .. t``.

    ``kernel_size <= 1`` makes it the identity (no conv). The recurrent step keeps the last
    ``k - 1`` inputs as its state ``[B, C, k - 1]``.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.channels, self.kernel_size = channels, kernel_size
        if kernel_size > 1:
            self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[B, T, C]`` -> ``[B, T, C]``. With ``cu_seqlens`` (offsets ``[N + 1]`` of sequences packed
        in ``x`` ``[1, total_T, C]``, ``ssmcraft.ops.common.varlen``) every sequence is convolved on its
        own: an output never sees an input of an earlier sequence (as N separate calls)."""
        if self.kernel_size <= 1:
            return x
        if cu_seqlens is not None:
            return self._packed(x, cu_seqlens)
        T = x.shape[1]
        return self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)

    def _packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The taps summed one by one, tap ``j`` (input ``t - j``) kept only where ``t - j`` lies in
        ``t``'s sequence (``t`` at least ``j`` tokens after the sequence's start)."""
        T = x.shape[1]
        t = torch.arange(T, device=x.device)
        starts = cu_seqlens.to(device=x.device, dtype=torch.int64)[:-1]
        start = starts[torch.searchsorted(starts, t, right=True) - 1]       # each token's sequence start
        since = (t - start)[None, :, None]
        w = self.conv.weight[:, 0, :]                                        # [C, k], tap k-1 reads t
        y = x * w[:, -1]
        for j in range(1, self.kernel_size):
            shifted = torch.cat([x.new_zeros(1, j, x.shape[2]), x[:, :T - j]], dim=1)
            y = y + torch.where(since >= j, shifted, 0.0) * w[:, -1 - j]
        return y + self.conv.bias if self.conv.bias is not None else y

    def init_state(self, batch_size: int, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(batch_size, self.channels, max(self.kernel_size - 1, 0), device=device, dtype=dtype)

    def prefill(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, T, C]`` after the window ``state`` ``[B, C, k-1]`` -> (``[B, T, C]``, the window
        after the last token): ``step`` T times in one call (``forward`` when ``state`` is zero)."""
        if self.kernel_size <= 1:
            return x, state
        window = torch.cat([state, x.transpose(1, 2)], dim=2)                # [B, C, k-1+T]
        y = F.conv1d(window, self.conv.weight, self.conv.bias, groups=self.channels)
        return y.transpose(1, 2), window[:, :, window.shape[2] - (self.kernel_size - 1):]

    def step(self, x_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_t ``[B, C]``, state ``[B, C, k-1]`` -> (``[B, C]``, new state)."""
        if self.kernel_size <= 1:
            return x_t, state
        window = torch.cat([state, x_t[:, :, None]], dim=2)                    # [B, C, k]
        y = (window * self.conv.weight[:, 0, :]).sum(-1) + self.conv.bias
        return y, window[:, :, 1:]

