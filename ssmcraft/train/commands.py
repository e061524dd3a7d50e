"""``ssmcraft train EXPERIMENT.yaml --out DIR [--set key=value ...] [--fresh]``.

The same command resumes a killed run from ``DIR/resume.safetensors`` (``train.checkpoint_every``;
``ssmcraft.train.resume``); ``--fresh`` starts over. ``torchrun --nproc_per_node N -m ssmcraft train ...``
trains one model over N processes (``ssmcraft.train.parallel``): rank 0 logs, prints and writes DIR.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ssmcraft.train.config import apply_overrides, load_experiment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="experiment spec (YAML): task, model, train sections")
    parser.add_argument("--out", required=True, help="run directory to write (created if missing)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting, e.g. --set train.lr=1e-3 --set model.mixer.objective=mamba")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    parser.add_argument("--fresh", action="store_true",
                        help="start over even where DIR holds a resume checkpoint (without it, the run resumes "
                             "from the checkpoint, and a changed config is refused)")


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (tests and embedders swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(quiet: bool) -> None:
    """Show ssmcraft's INFO lines on stderr (WARNING and up with --quiet); idempotent."""
    logger = logging.getLogger("ssmcraft")
    handler = next((h for h in logger.handlers if getattr(h, "_ssmcraft_cli", False)), None)
    if handler is None:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._ssmcraft_cli = True
        logger.addHandler(handler)
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    from ssmcraft.train.loop import train_run

    rank = int(os.environ.get("RANK", "0"))      # torchrun's: rank 0 speaks for the run, the others are quiet
    setup_logging(args.quiet or rank > 0)
    config = apply_overrides(load_experiment(args.experiment), args.set)
    metrics = train_run(config, args.out, progress=not args.quiet and rank == 0, source=args.experiment,
                        fresh=args.fresh)
    if rank == 0:
        summary = {k: metrics.get(k) for k in ("status", "val_loss", "train_loss_first", "accuracy", "chance_accuracy",
                                              "tokens", "tokens_per_s", "wall_s", "processes", "resumed_from_step")
                   if metrics.get(k) is not None}
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
        if metrics["status"] != "ok":
            print(f"run {metrics['status']}: {metrics['reason']}", file=sys.stderr)
        print(f"wrote {args.out}")
    return 0 if metrics["status"] in ("ok", "timeout") else 1
