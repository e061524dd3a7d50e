"""Training and evaluation of one model: ``train_run(config, out_dir)`` and ``load_run(dir)``."""
from __future__ import annotations

from ssmcraft.train.checkpoint import load_config, load_run
from ssmcraft.train.loop import train_run

__all__ = ["train_run", "load_run", "load_config"]
