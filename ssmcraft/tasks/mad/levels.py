"""MAD's difficulty levels and its score.

Each task has a baseline setting and changes; a level is the baseline, or the baseline with one
setting changed to one of its harder values (MAD's ``configs/tasks/*.yml``; ``vocab_size`` is
``vocab`` here). MAD's score of an architecture is its accuracy on each level's test set,
averaged over the levels of a task (``task_score``) and over the six tasks (``mad_score``), the
architectures compared at the same state size.

Compression levels are translated to this package's causal form: MAD's length ``L`` is
``seq_len = 2 (L - 1)`` (``copying.py``).
"""
from __future__ import annotations

from typing import Any, Mapping

BASELINES: dict[str, tuple[dict[str, Any], dict[str, list]]] = {
    "in_context_recall": ({"vocab": 16, "seq_len": 128, "num_train_examples": 12_800},
                          {"vocab": [32, 64, 128], "seq_len": [256, 512, 1024],
                           "num_train_examples": [6_400, 3_200, 1_600, 800]}),
    "fuzzy_recall": ({"vocab": 16, "seq_len": 128, "num_train_examples": 12_800, "k_motif_size": 3, "v_motif_size": 3},
                     {"vocab": [32, 64, 128], "seq_len": [256, 512, 1024],
                      "num_train_examples": [6_400, 3_200, 1_600, 800]}),
    "noisy_recall": ({"vocab": 32, "noise_vocab_size": 16, "seq_len": 128, "num_train_examples": 12_800,
                      "frac_noise": 0.2},
                     {"vocab": [48, 80, 144], "seq_len": [256, 512, 1024],
                      "num_train_examples": [6_400, 3_200, 1_600, 800], "frac_noise": [0.4, 0.6, 0.8]}),
    "selective_copying": ({"vocab": 16, "seq_len": 256, "num_tokens_to_copy": 16, "num_train_examples": 12_800},
                          {"vocab": [32, 64, 128], "seq_len": [512, 1024],
                           "num_train_examples": [6_400, 3_200, 1_600, 800], "num_tokens_to_copy": [32, 64, 96]}),
    "compression": ({"vocab": 16, "seq_len": 32, "num_train_examples": 12_800},
                    {"vocab": [32, 64, 128], "seq_len": [64, 128, 256],
                     "num_train_examples": [6_400, 3_200, 1_600, 800]}),
    "memorization": ({"vocab": 256, "seq_len": 32, "num_train_examples": 256},
                     {"vocab": [512, 1024, 2048, 4096, 8192]}),
}
MAD_TASKS = tuple(BASELINES)


def levels(task: str) -> list[tuple[str, dict[str, Any]]]:
    """``(label, task config)`` of every MAD level of ``task``: ``baseline`` first, then
    ``<setting>=<value>`` for each change, in MAD's order."""
    if task not in BASELINES:
        raise ValueError(f"unknown MAD task {task!r}; MAD's: {', '.join(MAD_TASKS)}")
    base, changes = BASELINES[task]
    out = [("baseline", {"name": task, **base})]
    for key, values in changes.items():
        for v in values:
            out.append((f"{key}={v}", {"name": task, **base, key: v}))
    if task == "compression":       # MAD's length L -> this package's causal layout
        out = [(label, {**cfg, "seq_len": 2 * (cfg["seq_len"] - 1)}) for label, cfg in out]
    return out


def task_score(accuracies: Mapping[str, float], task: str, labels: list[str] | None = None) -> float:
    """MAD's score of one task: the mean accuracy over its levels (every level must be there;
    ``labels``: over these levels only, e.g. ``["baseline"]`` for a quick study)."""
    want = labels if labels is not None else [label for label, _ in levels(task)]
    missing = [label for label in want if label not in accuracies]
    if missing:
        raise ValueError(f"{task}: no accuracy for level(s) {', '.join(missing)}")
    return sum(float(accuracies[label]) for label in want) / len(want)


def mad_score(accuracies: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Per-task scores and ``mad_score``, their mean over the six tasks, from
    ``accuracies[task][level label]``."""
    scores = {task: task_score(accuracies.get(task, {}), task) for task in MAD_TASKS}
    return {**scores, "mad_score": sum(scores.values()) / len(scores)}
