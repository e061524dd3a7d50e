"""Ranking and reports, computed from the study alone (so ``ssmcraft leaderboard DIR``
works on a finished, running or killed search).

Ranking: complete trials by Pareto front (non-dominated sorting over the ranking
metrics), then by the first metric; pruned and failed trials follow, unranked. With one
metric this is simply sorting by it. ``DIR/leaderboard.csv`` holds one row per finished
trial with a fixed column order (``columns``): the same spec gives the same columns
whichever executor ran it.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from ssmcraft.fileio import write_text
from ssmcraft.search.pareto import directions_of, pareto_fronts

LEADERBOARD = "leaderboard.csv"
# metrics the trial returns that are not measurements
META_KEYS = {"status", "reason", "kernel_hash", "backend", "device", "state_bytes"}
STATUS = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}


def ranked(study: optuna.Study) -> list[tuple[FrozenTrial, int | None, int | None]]:
    """(trial, rank, front) for every finished trial, best first; rank and front are
    None for trials that did not complete."""
    finished = [t for t in study.get_trials(deepcopy=False) if t.state in STATUS]
    complete = [t for t in finished if t.state == TrialState.COMPLETE]
    directions = directions_of(study)
    fronts = pareto_fronts([t.values for t in complete], directions)
    sign = 1.0 if directions[0] == "minimize" else -1.0
    order = sorted(range(len(complete)), key=lambda i: (fronts[i], sign * complete[i].values[0], complete[i].number))
    rows = [(complete[i], r + 1, fronts[i]) for r, i in enumerate(order)]
    rest = sorted((t for t in finished if t.state != TrialState.COMPLETE),
                  key=lambda t: (t.state != TrialState.PRUNED, t.number))
    return rows + [(t, None, None) for t in rest]


def extra_metrics(study: optuna.Study) -> list[str]:
    """Scalar metrics trials returned beyond the ranking ones, sorted."""
    ranking = set(study.user_attrs.get("metrics", []))
    keys = set()
    for t in study.get_trials(deepcopy=False):
        for k, v in (t.user_attrs.get("metrics") or {}).items():
            if k not in META_KEYS and k not in ranking and (v is None or isinstance(v, (int, float, str, bool))):
                keys.add(k)
    return sorted(keys)


def columns(study: optuna.Study) -> list[str]:
    metrics = study.user_attrs.get("metrics", [])
    params = study.user_attrs.get("param_names", [])
    return (["rank", "trial", "status", "objective", "pareto"] + [f"metric.{m}" for m in metrics]
            + ["state_bytes", "wall_s"] + [f"param.{p}" for p in params]
            + [f"metric.{m}" for m in extra_metrics(study)]
            + ["attempts", "seed", "reason", "trial_dir", "objective_spec"])


def rows(study: optuna.Study) -> list[dict[str, Any]]:
    out = []
    for t, rank, front in ranked(study):
        a = t.user_attrs
        metrics = a.get("metrics") or {}
        row = {"rank": rank, "trial": t.number, "status": STATUS[t.state], "objective": a.get("objective"),
               "pareto": None if front is None else front == 0, "state_bytes": a.get("state_bytes"),
               "wall_s": a.get("wall_s"), "attempts": a.get("attempts"), "seed": a.get("seed"),
               "reason": a.get("reason"), "trial_dir": a.get("trial_dir"),
               "objective_spec": json.dumps(a["objective_spec"], sort_keys=True) if "objective_spec" in a else None}
        row.update({f"param.{k}": v for k, v in t.params.items()})
        row.update({f"metric.{k}": v for k, v in metrics.items() if not isinstance(v, (list, dict))})
        out.append(row)
    return out


def write_leaderboard(study: optuna.Study, out_dir: Path) -> tuple[Path, int]:
    """(Re)write ``DIR/leaderboard.csv`` atomically; returns its path and row count."""
    path = Path(out_dir) / LEADERBOARD
    table = rows(study)
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=columns(study), extrasaction="ignore")
    w.writeheader()
    for row in table:
        w.writerow({k: "" if v is None else v for k, v in row.items()})
    write_text(path, text.getvalue())
    return path, len(table)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "*" if v else ""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def _bytes(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024


def _seconds(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else ""


def format_table(study: optuna.Study, top: int | None = None, width: int = 48) -> str:
    """The leaderboard as a terminal table (``*`` marks the Pareto front)."""
    metrics = study.user_attrs.get("metrics", [])
    # the ``objective`` param (the option's label) is shown by the objective's name
    params = [p for p in study.user_attrs.get("param_names", []) if p != "objective"]
    header = ["rank", "trial", "status", "objective", "pareto", *metrics, "state", "wall_s", *params, "reason"]
    body = []
    for row in rows(study)[:top]:
        body.append([_cell(row["rank"]), _cell(row["trial"]), row["status"], _cell(row["objective"]),
                     _cell(row["pareto"]), *(_cell(row.get(f"metric.{m}")) for m in metrics),
                     _bytes(row["state_bytes"]), _seconds(row["wall_s"]),
                     *(_cell(row.get(f"param.{p}")) for p in params), _cell(row["reason"])[:width]])
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *body]]
    return "\n".join(lines)


def write_reports(study: optuna.Study, out_dir: Path, plots: bool = True) -> list[str]:
    """Leaderboard CSV and, with ``plots``, the PNGs; returns what was written or
    skipped (and why), one line each."""
    path, n = write_leaderboard(study, out_dir)
    done = [f"{path} ({n} trials)"]
    if plots:
        from ssmcraft.search import plots as plotting  # matplotlib: only when plotting

        done += plotting.write_plots(study, Path(out_dir))
    return done
