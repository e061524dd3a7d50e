"""Long-context measurements of a trained LM: loss by position, states over time, passkey grid."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ssmcraft.tasks.base import IGNORE, Task
from ssmcraft.tasks.passkey import passkey_batch, retrieved
from ssmcraft.train.state_stats import STATS, state_statistics
from ssmcraft.train.validate import token_losses


@torch.no_grad()
def loss_by_position(model, batches, device, amp: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss ``[T]``, scored-token count ``[T]``) over ``batches`` of ``[B, T]`` pairs."""
    total = count = None
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with amp():
            losses = token_losses(model(inputs), targets).double().cpu()
        scored = (targets != IGNORE).double().cpu()
        total = losses.sum(0) if total is None else total + losses.sum(0)
        count = scored.sum(0) if count is None else count + scored.sum(0)
    return total, count


def _mean(total: torch.Tensor, count: torch.Tensor) -> float | None:
    n = float(count.sum())
    return float(total.sum()) / n if n > 0 else None


def summarise_positions(total: torch.Tensor, count: torch.Tensor, train_len: int, n_buckets: int = 64) -> dict:
    """Bucketed curve and per-multiple-of-training-length means of a loss-by-position result.

    ``segments["kx"]`` is the mean loss over positions ``((k-1) L, k L]`` (1-based positions);
    ``extrapolation_loss`` the last segment's.
    """
    T = total.numel()
    edges = torch.linspace(0, T, min(n_buckets, T) + 1).round().long().tolist()
    centres, losses = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        centres.append((a + b) / 2)
        losses.append(_mean(total[a:b], count[a:b]))
    segments = {}
    for k in range(1, math.ceil(T / train_len) + 1):
        segments[f"{k}x"] = _mean(total[(k - 1) * train_len: k * train_len], count[(k - 1) * train_len: k * train_len])
    last = list(segments.values())[-1]
    return {"positions": centres, "loss": losses, "segments": segments, "extrapolation_loss": last,
            "loss_within_train_len": segments["1x"], "mean_loss": _mean(total, count),
            "scored_tokens": int(count.sum())}


@torch.no_grad()
def state_traces(model, inputs: torch.Tensor, every: int, device, amp: Callable) -> list[torch.Tensor]:
    """Per recurrent layer (``model.recurrent_layers``, in order), the states over time
    ``[B, T // every, H, d, m]``; attention layers have none and are not traced.

    The mixers' inputs are captured by forward pre-hooks during one forward pass; each is then
    traced through its mixer's recurrence.
    """
    captured: dict[int, torch.Tensor] = {}
    layers = model.recurrent_layers
    hooks = [model.mixers[i].register_forward_pre_hook(lambda mod, args, i=i: captured.__setitem__(i, args[0]))
             for i in layers]
    try:
        with amp():
            model(inputs.to(device))
    finally:
        for h in hooks:
            h.remove()
    return [model.mixers[i].trace_states(captured[i].float(), every=every) for i in layers]


def state_series(traces: list[torch.Tensor]) -> dict[str, list[list[list[float]]]]:
    """``stats[name][layer][head]`` lists over time from per-layer traces ``[B, T', H, d, m]``."""
    out: dict[str, list] = {name: [] for name in STATS}
    for trace in traces:
        stats = state_statistics(trace)
        for name in STATS:
            out[name].append(stats[name].transpose(0, 1).tolist())                  # [H][T']
    return out


@torch.no_grad()
def passkey_grid(model, lengths: list[int], depths: list[float], trials: int, device, amp: Callable,
                 seed: int = 0, digits: int = 5) -> dict[str, Any]:
    """Retrieval accuracy ``[len(lengths)][len(depths)]`` over ``trials`` random keys per cell."""
    g = torch.Generator().manual_seed(seed)
    acc, digit_acc = [], []
    for T in lengths:
        row, drow = [], []
        for depth in depths:
            inputs, targets, _ = passkey_batch(trials, T, depth, digits, g)
            inputs, targets = inputs.to(device), targets.to(device)
            with amp():
                logits = model(inputs)
            row.append(float(retrieved(logits, targets).float().mean()))
            mask = targets != IGNORE
            drow.append(float(((logits.argmax(-1) == targets) & mask).sum() / mask.sum()))
        acc.append(row)
        digit_acc.append(drow)
    return {"lengths": lengths, "depths": depths, "trials": trials, "accuracy": acc, "digit_accuracy": digit_acc,
            "mean_accuracy": sum(map(sum, acc)) / (len(lengths) * len(depths))}


def length_ladder(train_len: int, factor: int) -> list[int]:
    """``L, 2L, 4L, ...`` up to ``factor * L`` (which is always included)."""
    out, k = [], 1
    while k < factor:
        out.append(k * train_len)
        k *= 2
    return out + [factor * train_len]


def task_metrics_by_length(task: Task, evaluate_fn: Callable, lengths: list[int], n_batches: int,
                           batch_size: int, seed: int) -> dict[str, dict]:
    """The task's validation metrics on fixed batches of each length."""
    return {str(T): evaluate_fn(task.fixed_batches("val", n_batches, batch_size, T, seed)) for T in lengths}
