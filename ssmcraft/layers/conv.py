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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, C]`` -> ``[B, T, C]``."""
        if self.kernel_size <= 1:
            return x
        T = x.shape[1]
        return self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)

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

