"""Mixer factories that tests load by module path: an FLA-style layer and broken ones."""
from __future__ import annotations

import torch
import torch.nn as nn


def fla_like(hidden_size: int, expand: int = 1):
    """An FLA-style layer: takes ``hidden_size``, returns ``(o, attentions, past_key_values)``."""
    return _TupleLayer(hidden_size, expand)


class _TupleLayer(nn.Module):
    def __init__(self, hidden_size, expand):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size * expand, bias=False)
        self.back = nn.Linear(hidden_size * expand, hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.back(torch.cumsum(self.proj(hidden_states), dim=1)), None, None


def wrong_shape(d_model: int):
    return nn.Linear(d_model, d_model + 1)


NOT_CALLABLE = 3
