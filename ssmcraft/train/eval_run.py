"""``eval_run``: the Stuffed Mamba evaluation of a trained run directory.

Writes under ``OUT`` (default ``RUN/eval``):

- ``loss_by_position.json`` / ``.png``: loss per position on validation sequences of
  ``extrapolate x`` the training length (bucketed curve, mean per multiple of the training
  length); with a mitigation, the mitigated curve beside the plain one;
- ``state_stats.json`` / ``.png``: per recurrent layer and head, the state's norm, mean and
  variance over time, and the explosion verdict (``state_stats.detect_explosion``); a hybrid's
  attention layers have no recurrent state: ``layers`` lists the layers traced and
  ``not_traced`` the others;
- ``passkey.json`` / ``.png`` (``passkey=True``): retrieval accuracy on a context length x
  depth grid; needs a byte-level model (vocabulary >= 256);
- ``eval.json``: a summary of all of the above (what ``eval_run`` returns), including
  ``extrapolation_loss_{N}x`` and the task's metrics at each length of ``L, 2L, 4L, .., NL``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.layers import Mitigation
from ssmcraft.tasks import TextTask, build_task
from ssmcraft.tasks.passkey import VOCAB as PASSKEY_VOCAB, min_length
from ssmcraft.train import checkpoint, long_context as lc, plots
from ssmcraft.train.device import autocast, pick_device, pick_precision
from ssmcraft.train.state_stats import detect_explosion
from ssmcraft.train.validate import evaluate

log = logging.getLogger("ssmcraft.eval")


@dataclass
class EvalOptions:
    """extrapolate: evaluate to this many times the training length. batches, batch_size:
    validation sequences for the loss curve (fixed by ``seed``). state_batch_size and
    state_points: sequences traced and at most this many time points per trace.
    explosion_factor: see ``state_stats``. passkey_*: the grid (lengths default to the
    ladder ``L .. N*L`` clipped to the prompt's minimum; depths 0..1)."""

    extrapolate: int = 4
    batches: int = 4
    batch_size: int = 8
    seed: int = 0
    state_batch_size: int = 4
    state_points: int = 256
    explosion_factor: float = 3.0
    passkey: bool = False
    passkey_lengths: list[int] | None = None
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_trials: int = 8
    mitigation: Mitigation | None = None
    device: str = "auto"


def _check_options(opt: EvalOptions) -> None:
    """Refuse options the evaluation cannot run, naming the command-line option."""
    for flag, value in (("--extrapolate", opt.extrapolate), ("--batches", opt.batches), ("--batch-size", opt.batch_size),
                        ("state_batch_size", opt.state_batch_size), ("--state-points", opt.state_points),
                        ("--passkey-trials", opt.passkey_trials)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SsmcraftError(f"{flag} must be an integer >= 1, got {value!r}")
    bad = [d for d in opt.passkey_depths if not 0.0 <= d <= 1.0]
    if bad:
        raise SsmcraftError(f"--passkey-depths must lie in [0, 1], got {bad[0]:g}")


def _check_corpus(run_dir, config: dict, task) -> None:
    """A text task is rebuilt from its config, where a corpus path may be relative or a file may have
    changed: refuse to evaluate another text than the run trained on (the sha256 its metrics.json recorded)."""
    metrics = checkpoint.load_metrics(run_dir)
    if not isinstance(task, TextTask) or metrics is None:
        return
    described = metrics.get("task")
    corpus = described.get("corpus") if isinstance(described, dict) else None
    trained = corpus.get("sha256") if isinstance(corpus, dict) else None
    now = task.corpus.sha256
    if trained and trained != now:
        raise SsmcraftError(f"{run_dir}: corpus {config['task'].get('corpus')!r} reads as sha256 {now[:12]} here, but the "
                            f"run trained on sha256 {trained[:12]} (a relative path read from another folder, or a "
                            f"changed file); evaluate from the folder the run was trained in")


def _unpacked(task_cfg: dict) -> dict:
    """A text task's config with ``pack: false``: the evaluation reads unbroken windows, since
    extrapolation and state statistics ask how the state carries over a long context (across
    documents), whatever boundaries training restarted at."""
    return {**task_cfg, "pack": False} if task_cfg.get("name") == TextTask.name else task_cfg


def eval_run(run_dir: str | Path, options: EvalOptions | None = None, out_dir: str | Path | None = None) -> dict:
    """Evaluate the run in ``run_dir``; returns the summary also written to ``eval.json``."""
    opt = options or EvalOptions()
    _check_options(opt)
    t0 = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "eval"
    config = checkpoint.load_config(run_dir)
    device = pick_device(opt.device)
    precision = pick_precision("auto", device)
    amp = lambda: autocast(device, precision)  # noqa: E731
    model = checkpoint.load_run(run_dir, device)
    task = build_task(_unpacked(config["task"]))
    _check_corpus(run_dir, config, task)
    L = task.seq_len
    if isinstance(task, TextTask) and task.val_data.numel() < opt.extrapolate * L + 1:
        raise SsmcraftError(f"--extrapolate {opt.extrapolate}: the text's validation split has {task.val_data.numel()} "
                            f"bytes, fewer than one window of {opt.extrapolate} x {L} + 1 (a larger corpus or val_fraction, "
                            f"or a smaller --extrapolate)")
    recurrent = bool(model.recurrent_layers)
    if opt.mitigation is not None:
        _check_mitigation(model, opt.mitigation, device)
    passkey_lengths = _passkey_lengths(model, task, opt) if opt.passkey else None
    try:                                        # only once everything it reads was checked
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SsmcraftError(f"{out}: cannot be created as the output folder "
                            f"({e.strerror or type(e).__name__})") from None
    summary: dict[str, Any] = {"run": str(run_dir), "train_len": L, "extrapolate": opt.extrapolate,
                               "task": task.describe(), "device": str(device), "precision": precision}

    summary["loss_by_position"] = _loss_curves(model, task, opt, device, amp, out, config["name"])
    final = summary["loss_by_position"]["curves"]["plain"]
    summary[f"extrapolation_loss_{opt.extrapolate}x"] = final["extrapolation_loss"]
    summary["loss_within_train_len"] = final["loss_within_train_len"]
    lengths = lc.length_ladder(task.seq_len, opt.extrapolate)
    summary["metrics_by_length"] = lc.task_metrics_by_length(
        task, lambda b: evaluate(model, task, b, device, amp), lengths, opt.batches, opt.batch_size, opt.seed)
    if recurrent:
        summary["state"] = _states(model, task, opt, device, amp, out, config["name"])
    else:
        summary["state"] = {"skipped": "no layer has a recurrent state (attention only)"}
        log.info("state statistics skipped: attention only")
    if opt.passkey:
        summary["passkey"] = _passkey(model, passkey_lengths, opt, device, amp, out, config["name"])
    summary["backend"] = model.backends()
    summary["wall_s"] = time.perf_counter() - t0
    checkpoint.write_json(out / "eval.json", summary)
    log.info("eval written to %s (%.1f s)", out, summary["wall_s"])
    return summary


def _check_mitigation(model, mitigation: Mitigation, device) -> None:
    """Apply once and run two tokens so a refusal surfaces before any long evaluation."""
    model.set_mitigation(mitigation)
    try:
        with torch.no_grad():
            model(torch.zeros(1, 2, dtype=torch.long, device=device))
    finally:
        model.set_mitigation(None)


def _settings(opt: EvalOptions, traceable_only: bool = False) -> dict[str, Mitigation | None]:
    """label -> mitigation to evaluate: always "plain"; the asked mitigation too (for state
    traces only a retention/insertion scaling: a sliding window has no single state)."""
    settings: dict[str, Mitigation | None] = {"plain": None}
    m = opt.mitigation
    if m is not None and (m.scales or not traceable_only):
        settings[m.label()] = m
    return settings


def _loss_curves(model, task, opt, device, amp, out: Path, name: str) -> dict:
    T = opt.extrapolate * task.seq_len
    batches = task.fixed_batches("val", opt.batches, opt.batch_size, T, opt.seed)
    settings = _settings(opt)
    curves = {}
    for label, mitigation in settings.items():
        model.set_mitigation(mitigation)
        total, count = lc.loss_by_position(model, batches, device, amp)
        curves[label] = lc.summarise_positions(total, count, task.seq_len)
        log.info("loss by position (%s): within 1x %.4f, at %dx %s", label, curves[label]["loss_within_train_len"]
                 or float("nan"), opt.extrapolate, curves[label]["extrapolation_loss"])
    model.set_mitigation(None)
    result = {"seq_len": T, "batches": opt.batches, "batch_size": opt.batch_size, "curves": curves}
    checkpoint.write_json(out / "loss_by_position.json", result)
    plots.loss_by_position({k: (v["positions"], v["loss"]) for k, v in curves.items()}, task.seq_len,
                           out / "loss_by_position.png", title=f"{name}: loss by position")
    return result


def _states(model, task, opt, device, amp, out: Path, name: str) -> dict:
    T = opt.extrapolate * task.seq_len
    every = max(1, T // opt.state_points)
    inputs, _ = task.fixed_batches("val", 1, opt.state_batch_size, T, opt.seed)[0]
    layers = model.recurrent_layers
    labels = model.layout_labels()
    not_traced = {str(i): f"{labels[i]}: no recurrent state" for i in range(len(labels)) if i not in layers}
    result: dict[str, Any] = {"seq_len": T, "every": every}
    settings = _settings(opt, traceable_only=True)
    for label, mitigation in settings.items():
        model.set_mitigation(mitigation)
        traces = lc.state_traces(model, inputs, every, device, amp)
        times = [every * (i + 1) for i in range(traces[0].shape[1])]
        series = lc.state_series(traces)
        verdict = detect_explosion(times, series, task.seq_len, opt.explosion_factor, layers)
        result[label] = {"times": times, "stats": series, "explosion": verdict, "layers": layers,
                         "not_traced": not_traced}
        log.info("state (%s): explosion %s (%d flags)", label, verdict["exploded"], len(verdict["flags"]))
        suffix = "" if label == "plain" else "_mitigated"
        plots.state_stats(times, series, task.seq_len, out / f"state_stats{suffix}.png",
                          title=f"{name}: state statistics ({label})", layers=layers)
    model.set_mitigation(None)
    checkpoint.write_json(out / "state_stats.json", result)
    return {label: {"exploded": result[label]["explosion"]["exploded"], "flags": result[label]["explosion"]["flags"],
                    **({"layers": layers, "not_traced": not_traced} if not_traced else {})}
            for label in settings}


def _passkey_lengths(model, task, opt: EvalOptions) -> list[int]:
    """The grid's context lengths; refuses models that are not byte-level and too-short lengths."""
    if model.cfg.vocab_size < PASSKEY_VOCAB:
        raise SsmcraftError(f"--passkey needs a byte-level model (vocabulary >= {PASSKEY_VOCAB}); this run's "
                            f"vocabulary is {model.cfg.vocab_size} (train on the text or passkey task)")
    shortest = min_length(5)
    if opt.passkey_lengths:
        too_short = [T for T in opt.passkey_lengths if T < shortest]
        if too_short:
            raise SsmcraftError(f"--passkey-lengths: {too_short} shorter than the passkey prompt ({shortest} bytes)")
        return list(opt.passkey_lengths)
    return sorted({max(T, shortest) for T in lc.length_ladder(task.seq_len, opt.extrapolate)})


def _passkey(model, lengths: list[int], opt, device, amp, out: Path, name: str) -> dict:
    settings = _settings(opt)
    grids = {}
    for label, mitigation in settings.items():
        model.set_mitigation(mitigation)
        grids[label] = grid = lc.passkey_grid(model, lengths, opt.passkey_depths, opt.passkey_trials, device, amp,
                                              opt.seed)
        suffix = "" if mitigation is None else "_mitigated"
        plots.heatmap(grid["accuracy"], lengths, opt.passkey_depths, out / f"passkey{suffix}.png",
                      title=f"{name}: passkey retrieval ({label})", xlabel="depth", ylabel="context length")
    model.set_mitigation(None)
    checkpoint.write_json(out / "passkey.json", grids)
    return {label: g["mean_accuracy"] for label, g in grids.items()}
