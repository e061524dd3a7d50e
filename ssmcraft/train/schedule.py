"""Learning-rate schedules: linear warmup, then cosine decay (``train.schedule: cosine``) or
warmup-stable-decay (``wsd``: the peak rate held, then a linear decay over the last
``train.decay`` of the steps), both to ``min_lr_ratio * lr``.

The rate is a pure function of the step, so a resumed run continues the same schedule."""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")


def _count(amount: float, total_steps: int) -> int:
    """``amount`` < 1 is a fraction of ``total_steps``; >= 1 a number of steps."""
    return max(int(round(amount * total_steps)) if amount < 1 else int(amount), 0)


def warmup_steps(warmup: float, total_steps: int) -> int:
    """``warmup`` < 1 is a fraction of ``total_steps``; >= 1 a number of steps (at most all but one)."""
    return min(_count(warmup, total_steps), max(total_steps - 1, 0))


def lr_at(step: int, total_steps: int, lr: float, warmup: int, min_lr_ratio: float,
          schedule: str = "cosine", decay: float = 0.2) -> float:
    """The learning rate of (0-based) ``step``. ``decay`` (wsd only): the fraction of ``total_steps``
    (< 1) or the number of steps (>= 1) of the final decay, which starts after the warmup at the latest."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if schedule == "wsd":
        span = min(_count(decay, total_steps), total_steps - warmup)
        start = total_steps - span
        if step < start:
            return lr
        return lr * (1 - (1 - min_lr_ratio) * (step - start + 1) / span)   # min_lr_ratio * lr at the last step
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
