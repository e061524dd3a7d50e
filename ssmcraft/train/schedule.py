"""Learning-rate schedule: linear warmup then cosine decay to ``min_lr_ratio * lr``."""
from __future__ import annotations

import math


def warmup_steps(warmup: float, total_steps: int) -> int:
    """``warmup`` < 1 is a fraction of ``total_steps``; >= 1 a number of steps."""
    n = int(round(warmup * total_steps)) if warmup < 1 else int(warmup)
    return min(max(n, 0), max(total_steps - 1, 0))


def lr_at(step: int, total_steps: int, lr: float, warmup: int, min_lr_ratio: float) -> float:
    """The learning rate of (0-based) ``step``."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
