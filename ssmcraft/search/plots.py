"""PNG plots of a search (matplotlib's object API: no pyplot, no global backend).

- ``pareto.png`` (several metrics): each metric against the first, the front marked;
  ``history.png`` (one metric): the metric per trial with the best so far;
- ``state_size.png``: each ranking metric against the recurrent state size;
- ``importances.png``: parameter importances per metric (Optuna's PED-ANOVA).

A plot that cannot be drawn is skipped with the reason, in the returned lines.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import optuna
from matplotlib.figure import Figure
from optuna.trial import TrialState

from ssmcraft.search.pareto import directions_of, pareto_fronts


def _save(fig: Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def _complete(study: optuna.Study):
    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]


def plot_front(study: optuna.Study, out_dir: Path) -> str:
    metrics, directions = study.user_attrs.get("metrics", []), directions_of(study)
    trials = _complete(study)
    if not trials:
        return "pareto/history plot skipped: no complete trial"
    if len(metrics) == 1:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        xs = [t.number for t in trials]
        ys = [t.values[0] for t in trials]
        best = min if directions[0] == "minimize" else max
        ax.plot(xs, ys, "o", label=metrics[0])
        ax.step(xs, [best(ys[: i + 1]) for i in range(len(ys))], where="post", label="best so far")
        ax.set(xlabel="trial", ylabel=metrics[0], title=f"{study.study_name}: {metrics[0]} ({directions[0]})")
        ax.legend()
        return _save(fig, out_dir / "history.png")
    fronts = pareto_fronts([t.values for t in trials], directions)
    fig = Figure(figsize=(5 * (len(metrics) - 1), 4))
    for k in range(1, len(metrics)):
        ax = fig.add_subplot(1, len(metrics) - 1, k)
        for on_front, style, label in ((False, "o", "dominated"), (True, "*", "Pareto front")):
            pts = [t.values for t, f in zip(trials, fronts) if (f == 0) == on_front]
            ax.plot([p[0] for p in pts], [p[k] for p in pts], style, label=label, markersize=9 if on_front else 5)
        for t in trials:  # which trial and objective each point is
            ax.annotate(f"{t.number} {t.user_attrs.get('objective', '')}", (t.values[0], t.values[k]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel=f"{metrics[0]} ({directions[0]})", ylabel=f"{metrics[k]} ({directions[k]})")
        ax.legend()
    fig.suptitle(f"{study.study_name}: Pareto front")
    return _save(fig, out_dir / "pareto.png")


def plot_state_size(study: optuna.Study, out_dir: Path) -> str:
    metrics = study.user_attrs.get("metrics", [])
    trials = [t for t in _complete(study) if isinstance(t.user_attrs.get("state_bytes"), (int, float))]
    if not trials:
        return "state_size.png skipped: no complete trial reported state_bytes"
    fig = Figure(figsize=(5 * len(metrics), 4))
    names = sorted({str(t.user_attrs.get("objective")) for t in trials})
    for k, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), k + 1)
        for name in names:
            pts = [(t.user_attrs["state_bytes"], t.values[k]) for t in trials if str(t.user_attrs.get("objective")) == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=name)
        ax.set(xscale="log", xlabel="recurrent state (bytes per sequence)", ylabel=metric)
        ax.legend(fontsize="small")
    return _save(fig, out_dir / "state_size.png")


def plot_importances(study: optuna.Study, out_dir: Path) -> str:
    """PED-ANOVA importances (Optuna's; numpy only): how much each param decides whether a
    trial lands in the top ``q`` of a metric, with ``q`` wide enough to hold 2 trials."""
    metrics, directions = study.user_attrs.get("metrics", []), directions_of(study)
    n = len(_complete(study))
    if n < 3:
        return "importances.png skipped: fewer than 3 complete trials"
    q = min(0.5, max(0.1, 2 / n))
    results = []
    for k, metric in enumerate(metrics):
        sign = 1.0 if directions[k] == "minimize" else -1.0
        with warnings.catch_warnings():  # "lower target is better": the sign sees to that
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(target_quantile=q),
                target=lambda t, k=k, sign=sign: sign * t.values[k])
        results.append((metric, imp))
    if not any(imp for _, imp in results):
        return "importances.png skipped: no parameter varies across the complete trials"
    fig = Figure(figsize=(5 * len(metrics), 1.5 + 0.4 * max(len(i) for _, i in results)))
    for k, (metric, imp) in enumerate(results):
        ax = fig.add_subplot(1, len(metrics), k + 1)
        names = list(imp)[::-1]
        ax.barh(names, [imp[name] for name in names])
        ax.set(xlabel=f"importance (PED-ANOVA, top {q:.0%})", title=metric)
    return _save(fig, out_dir / "importances.png")


def write_plots(study: optuna.Study, out_dir: Path) -> list[str]:
    return [plot_front(study, out_dir), plot_state_size(study, out_dir), plot_importances(study, out_dir)]
