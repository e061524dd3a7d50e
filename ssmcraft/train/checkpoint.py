"""A run directory's files, and rebuilding a trained model from one.

``DIR/config.json``     the resolved experiment; ``model.mixer.objective`` holds the
                        objective's spec mapping, so the run loads without the library file
``DIR/metrics.json``    the run's figures (see ``ssmcraft.train.loop``)
``DIR/history.json``    the training and validation curves
``DIR/model.safetensors`` the weights (never pickle)
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from ssmcraft.errors import SsmcraftError
from ssmcraft.layers import LM, LMConfig

CONFIG, METRICS, HISTORY, WEIGHTS = "config.json", "metrics.json", "history.json", "model.safetensors"


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: those become null (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as strict JSON, atomically (a reader never sees half a file)."""
    write_bytes(path, (json.dumps(_finite(data), indent=2, sort_keys=False, allow_nan=False) + "\n").encode())


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` atomically: a temporary file beside ``path``, then a rename, so a reader (or a
    run resumed after a kill) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def save_weights(model: torch.nn.Module, out_dir: str | Path) -> Path:
    path = Path(out_dir) / WEIGHTS
    save_model(model, str(path))
    return path


def model_config(config: dict[str, Any]) -> LMConfig:
    """The ``LMConfig`` of a resolved experiment whose ``model.vocab_size`` is filled in."""
    return LMConfig.from_dict(config["model"])


def load_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved experiment of a run directory."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise SsmcraftError(f"{run_dir}: not a run directory (no {CONFIG})")
    return read_json(path)


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> LM:
    """The trained ``LM`` of a run directory, in eval mode on ``device``."""
    config = load_config(run_dir)
    weights = Path(run_dir) / WEIGHTS
    if not weights.is_file():
        raise SsmcraftError(f"{run_dir}: no {WEIGHTS} (the run saved no weights)")
    model = LM(model_config(config))
    try:
        load_model(model, str(weights), device=str(device))
    except RuntimeError as e:      # safetensors: missing / unexpected keys, or a size mismatch
        raise SsmcraftError(f"{run_dir}: {WEIGHTS} does not fit {CONFIG} ({' '.join(str(e).split())[:300]})") from None
    return model.to(device).eval()
