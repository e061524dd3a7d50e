"""Pareto fronts of a multi-objective study (the ranking ``reports`` and ``plots`` share)."""
from __future__ import annotations

from typing import Sequence

import optuna


def pareto_fronts(values: Sequence[Sequence[float]], directions: Sequence[str]) -> list[int]:
    """Front index of each point (0 = non-dominated), for minimize/maximize directions."""
    signs = [1.0 if d == "minimize" else -1.0 for d in directions]
    pts = [[s * v for s, v in zip(signs, p)] for p in values]

    def dominates(a, b):
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    front = [-1] * len(pts)
    left, k = set(range(len(pts))), 0
    while left:
        layer = {i for i in left if not any(dominates(pts[j], pts[i]) for j in left if j != i)}
        for i in layer:
            front[i] = k
        left -= layer
        k += 1
    return front


def directions_of(study: optuna.Study) -> list[str]:
    return ["minimize" if d == optuna.study.StudyDirection.MINIMIZE else "maximize" for d in study.directions]
