"""Loss and task metrics of a model on fixed batches."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmcraft.tasks.base import IGNORE, Task


def batch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (float32) over scored positions; logits ``[B, T, V]``, targets ``[B, T]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy ``[B, T]`` (0 where the target is IGNORE)."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


@torch.no_grad()
def evaluate(model, task: Task, batches, device: torch.device, autocast) -> dict[str, float]:
    """``loss`` (mean over every scored token of ``batches``) and the task's metrics.

    ``batches``: ``[(inputs [B, T], targets [B, T]), ...]``; ``autocast``: a callable giving
    the precision context.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    sums: dict[str, list[float]] = {}
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast():
            logits = model(inputs)
        losses = token_losses(logits, targets)
        total += float(losses.sum())
        count += int((targets != IGNORE).sum())
        for name, (num, den) in task.score(logits, targets).items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += num
            acc[1] += den
    model.train(was_training)
    out = {"loss": total / max(count, 1)}
    out.update({name: num / max(den, 1) for name, (num, den) in sums.items()})
    out.update(task.constant_metrics())
    return out
