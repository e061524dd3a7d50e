"""The default trial: compile the objective, train, evaluate, return the metrics.

It is a plain function of its arguments (see ``ssmcraft.search.outcome`` for the trial
function contract), so any executor can ship it to a worker. Training code is imported
here, on the worker, not when the search starts.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

from ssmcraft.runtime.lookup import compile_objective
from ssmcraft.search.space import objective_of


def train_trial(config: dict, out_dir: Path, report: Callable[[int, dict], bool]) -> dict:
    """Compile the trial's objective (a ``SpecError`` here fails the trial with the
    compiler's message), then ``ssmcraft.train.train_run(config, out_dir)``, passing
    ``report`` when ``train_run`` takes it (``can_report``).

    Adds ``kernel_hash`` (content hash of the derived update's IR, from which the
    generated code is printed) and, when training does not report it, ``state_bytes``
    (fp32 recurrent state per sequence, all layers).
    """
    compiled = compile_objective(objective_of(config))
    from ssmcraft.train import train_run

    kwargs = {"report": report} if can_report() else {}
    metrics = dict(train_run(config, out_dir, progress=False, **kwargs))
    metrics["kernel_hash"] = compiled.ir.content_hash()
    if "state_bytes" not in metrics:
        metrics["state_bytes"] = state_bytes(out_dir)
    return metrics


def can_report() -> bool:
    """Whether ``train_run`` takes ``report=`` (intermediate values, pruning)."""
    from ssmcraft.train import train_run

    return "report" in inspect.signature(train_run).parameters


def state_bytes(run_dir: Path) -> int | None:
    """Bytes of state one sequence carries through the run's model, fp32 (``LM.state_elements``:
    every objective state (``[H, d, m]`` each, ``[H, m, m]`` for a square one), a sliding window's keys and values, a module mixer's own
    count); None when a layer's state grows with the context (full attention) or is unknown.
    Built from the run's config; no weights needed."""
    from ssmcraft.layers import LM
    from ssmcraft.train.checkpoint import load_config, model_config

    n = LM(model_config(load_config(run_dir))).state_elements()
    return None if n is None else 4 * n


train_trial.can_report = can_report
