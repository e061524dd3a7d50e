"""Loss and task metrics of a model on fixed batches."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmcraft.tasks.base import IGNORE, Task


def batch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (float32) over scored positions; logits ``[B, T, V]``, targets ``[B, T]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def step_loss(model, inputs: torch.Tensor, targets: torch.Tensor, autocast) -> torch.Tensor:
    """A training step's loss: the model under ``autocast()`` (a callable giving the precision
    context, as ``evaluate``'s), the loss outside it (``batch_loss``, fp32). The eager step, the
    captured one (``train.graphed``) and the benchmarks'."""
    with autocast():
        logits = model(inputs)
    return batch_loss(logits, targets)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy ``[B, T]`` (0 where the target is IGNORE)."""
    return F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


@torch.no_grad()
def evaluate(model, task: Task, batches, device: torch.device, autocast) -> dict[str, float]:
    """``loss`` (mean over every scored token of ``batches``) and the task's metrics.

    ``batches``: ``[(inputs [B, T], targets [B, T]), ...]``; ``autocast``: a callable giving
    the precision context. Sums stay on the device; the one host sync is the read-back at
    the end (the GPU runs every batch back to back).
    """
    was_training = model.training
    model.eval()
    total = count = 0
    sums: dict[str, list] = {}
    for inputs, targets in batches:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast():
            logits = model(inputs)
        losses = token_losses(logits, targets)
        total = total + losses.sum()
        count = count + (targets != IGNORE).sum()
        for name, (num, den) in task.score(logits, targets).items():
            acc = sums.setdefault(name, [0, 0])
            acc[0] = acc[0] + num
            acc[1] = acc[1] + den
    model.train(was_training)
    # one read-back for every sum (each float() of a device tensor would be its own sync)
    parts = [total, count, *(x for pair in sums.values() for x in pair)]
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in parts]).tolist()
    out = {"loss": values[0] / max(values[1], 1.0)}
    out.update({name: values[2 + 2 * i] / max(values[3 + 2 * i], 1.0) for i, name in enumerate(sums)})
    out.update(task.constant_metrics())
    return out
