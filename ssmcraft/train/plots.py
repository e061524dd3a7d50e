"""PNG figures of runs and evaluations (matplotlib's object API: no global pyplot state).

matplotlib is imported when a figure is drawn, not when this module is (it costs ~0.8 s).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def _figure(figsize):
    """A matplotlib ``Figure`` (imported on first use)."""
    from matplotlib.figure import Figure as _Figure

    return _Figure(figsize=figsize)


def _save(fig, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    return Path(path)


def _ema(values: Sequence[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def loss_curve(history: dict, path: str | Path, title: str = "") -> Path:
    """Training loss (raw and smoothed) and validation loss against tokens seen."""
    fig = _figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    train = history.get("train", [])
    if train:
        x = [r["tokens"] for r in train]
        y = [r["loss"] for r in train]
        ax.plot(x, y, color="tab:blue", alpha=0.25, lw=0.8, label="train")
        ax.plot(x, _ema(y), color="tab:blue", lw=1.5, label="train (EMA)")
    val = history.get("val", [])
    if val:
        ax.plot([r["tokens"] for r in val], [r["loss"] for r in val], "o-", color="tab:orange", label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def loss_by_position(curves: dict[str, tuple[list[float], list[float | None]]], train_len: int,
                     path: str | Path, title: str = "") -> Path:
    """Loss per position bucket (one line per curve: label -> (bucket centres, losses))."""
    fig = _figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    for label, (x, y) in curves.items():
        ax.plot(x, [float("nan") if v is None else v for v in y], "-", lw=1.3, label=label)
    ax.axvline(train_len, color="k", ls="--", lw=0.8, label="training length")
    ax.set_xlabel("position")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def state_stats(times: list[int], stats: dict[str, list[list[list[float]]]], train_len: int,
                path: str | Path, title: str = "", layers: list[int] | None = None) -> Path:
    """One panel per statistic: a line per (layer, head) over time; ``stats[name][i][head]``,
    ``layers[i]`` the model's layer of series ``i`` (default ``i``)."""
    names = list(stats)
    fig = _figure(figsize=(6.4, 2.6 * len(names)))
    for i, name in enumerate(names):
        ax = fig.add_subplot(len(names), 1, i + 1)
        for j, heads in enumerate(stats[name]):
            layer = layers[j] if layers is not None else j
            for head, series in enumerate(heads):
                ax.plot(times, series, lw=1.0, label=f"L{layer}H{head}")
        ax.axvline(train_len, color="k", ls="--", lw=0.8)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        values = [v for heads in stats[name] for series in heads for v in series]
        if name in ("norm", "var") and values and min(values) > 0:
            ax.set_yscale("log")
    ax.set_xlabel("position")
    fig.axes[0].set_title(title)
    if sum(len(h) for h in stats[names[0]]) <= 12:
        fig.axes[0].legend(fontsize=7, ncol=4)
    return _save(fig, path)


def heatmap(values: list[list[float]], rows: list, cols: list, path: str | Path, title: str = "",
            xlabel: str = "", ylabel: str = "") -> Path:
    """A [rows x cols] grid in [0, 1] with each cell's value written in it."""
    fig = _figure(figsize=(1.0 + 0.9 * len(cols), 1.0 + 0.6 * len(rows)))
    ax = fig.add_subplot()
    im = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    return _save(fig, path)
