"""A mixer of your own, for ``model.mixer: {module: examples.mixers:EMAMixer, options: {...}}``
(docs/mixers.md). Run from the repository root with ``PYTHONPATH=.``::

    PYTHONPATH=. ssmcraft train specs/train_quick.yaml --out runs/ema \
        --set 'model.mixer={module: examples.mixers:EMAMixer, options: {decay: 0.9}}'
"""
from __future__ import annotations

import torch
import torch.nn as nn


class EMAMixer(nn.Module):
    """``s_t = decay * s_{t-1} + (1 - decay) * W_in h_t``, ``y_t = W_out s_t``: a recurrent mixer
    with the optional hooks (``init_cache``, ``step``, ``prefill``, ``state_elements``)."""

    def __init__(self, d_model: int, decay: float = 0.9, width: int = 8):
        super().__init__()
        self.decay, self.width = decay, width
        self.w_in = nn.Linear(d_model, width, bias=False)
        self.w_out = nn.Linear(width, d_model, bias=False)

    def _states(self, h):
        """``s_t`` for every position of h ``[B, T, d_model]``: ``[B, T, width]``."""
        u, s, out = (1 - self.decay) * self.w_in(h), torch.zeros_like(h[:, 0, :self.width]), []
        for t in range(h.shape[1]):
            s = self.decay * s + u[:, t]
            out.append(s)
        return torch.stack(out, 1)

    def forward(self, h):
        return self.w_out(self._states(h))

    def prefill(self, h):
        states = self._states(h)
        return self.w_out(states), states[:, -1]

    def init_cache(self, batch_size):
        return torch.zeros(batch_size, self.width, dtype=self.w_in.weight.dtype, device=self.w_in.weight.device)

    def step(self, h_t, s):
        s = self.decay * s + (1 - self.decay) * self.w_in(h_t)
        return self.w_out(s), s

    def state_elements(self):
        return self.width
