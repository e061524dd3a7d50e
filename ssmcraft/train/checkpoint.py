"""A run directory's files, and rebuilding a trained model from one.

``DIR/config.json``     the resolved experiment; ``model.mixer.objective`` holds the
                        objective's spec mapping, so the run loads without the library file
``DIR/metrics.json``    the run's figures (see ``ssmcraft.train.loop``) and, under ``artefacts``,
                        the hashes ``load_run`` checks config.json and the weights against
                        (``ssmcraft.train.record``)
``DIR/history.json``    the training and validation curves
``DIR/model.safetensors`` the weights (never pickle)
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from ssmcraft import fileio
from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers import LM, LMConfig
from ssmcraft.layers.config import ObjectiveMixerConfig, mixer_config
from ssmcraft.layers.objectives import spec_mapping
from ssmcraft.runtime.lookup import compile_objective
from ssmcraft.train import record

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
    fileio.write_json(path, _finite(data), allow_nan=False)


def read_json(path: str | Path) -> Any:
    """A JSON file's value; a file that cannot be read or parsed is one ``SsmcraftError`` line
    naming it (corrupt, truncated, not UTF-8, nested too deep)."""
    try:
        return json.loads(Path(path).read_bytes())
    except OSError as e:
        raise SsmcraftError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    except ValueError as e:            # JSONDecodeError, UnicodeDecodeError, too many digits
        raise SsmcraftError(f"{path}: not valid JSON ({' '.join(str(e).split())[:200]})") from None
    except RecursionError:
        raise SsmcraftError(f"{path}: not valid JSON (nested too deep)") from None


def read_mapping(path: str | Path) -> dict[str, Any]:
    """``read_json`` of a file that must hold a JSON object."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise SsmcraftError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def save_weights(model: torch.nn.Module, out_dir: str | Path) -> Path:
    path = Path(out_dir) / WEIGHTS
    save_model(model, str(path))
    return path


def model_config(config: dict[str, Any], source: str = "<config>") -> LMConfig:
    """The ``LMConfig`` of a resolved experiment whose ``model.vocab_size`` is filled in (errors
    name ``source``)."""
    return LMConfig.from_dict(config["model"], source)


def build_lm(config: dict[str, Any], source: str = "<experiment>") -> LM:
    """The LM of a resolved config whose ``model.vocab_size`` is set.

    Mutates ``config["model"]["mixer"]``: ``objective`` (a name or path) is replaced by the
    compiled spec's mapping, so the recorded config rebuilds the same model anywhere. An
    objective that does not compile, or a mixer setting its objective or sizes refuse, is a
    ``SpecError`` naming ``source`` and the mixer's key (``model.mixer.heads``,
    ``model.layers[1].mixer.heads``).
    """
    mixer = config["model"]["mixer"]
    objective = None
    if isinstance(mixer_config(mixer), ObjectiveMixerConfig):
        ref = mixer.get("objective", "longhorn")
        try:
            objective = compile_objective(ref)
        except SpecError as e:
            if e.source != "<dict>" or not isinstance(ref, Mapping):
                raise                      # names its own file already
            raise SpecError(source, f"model.mixer.objective.{e.key}" if e.key else "model.mixer.objective", e.problem) from None
        except SsmcraftError as e:
            raise SpecError(source, "model.mixer.objective", str(e)) from None
        mixer["objective"] = spec_mapping(objective)
    try:
        return LM(model_config(config, source), objective)
    except SpecError as e:
        if e.source != "<mixer>":
            raise
        raise SpecError(source, f"model.{e.key}", e.problem) from None


def load_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved experiment of a run directory, checked against what the run recorded
    (``record.check_config``) and validated as ``ssmcraft train`` validates an experiment."""
    from ssmcraft.train.config import resolve

    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise SsmcraftError(f"{run_dir}: not a run directory (no {CONFIG})")
    config = read_mapping(path)
    record.check_config(Path(run_dir), config, recorded(run_dir), CONFIG)
    return resolve(config, str(path))


def load_metrics(run_dir: str | Path) -> dict[str, Any] | None:
    """A run directory's ``metrics.json`` (None when it has none)."""
    path = Path(run_dir) / METRICS
    return read_mapping(path) if path.exists() else None


def recorded(run_dir: str | Path) -> dict[str, Any] | None:
    """The artefact hashes a run directory's metrics.json recorded (None: none recorded)."""
    return record.recorded_of(load_metrics(run_dir), Path(run_dir) / METRICS)


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> LM:
    """The trained ``LM`` of a run directory, in eval mode on ``device``: config.json and the
    weights are checked against the hashes the run recorded before either is used; a run that
    recorded none loads with a warning (``ssmcraft.train.record``)."""
    run_dir = Path(run_dir)
    config = load_config(run_dir)
    weights = run_dir / WEIGHTS
    if not weights.is_file():
        raise SsmcraftError(f"{run_dir}: no {WEIGHTS} (the run saved no weights)")
    if not (run_dir / METRICS).exists():
        raise SsmcraftError(f"{run_dir}: no {METRICS} beside {WEIGHTS} (the run was stopped before it finished "
                            f"writing, or the file was removed): the weights cannot be checked")
    hashes = recorded(run_dir)
    if hashes is None:
        record.warn_unrecorded(run_dir)
    record.check_weights(run_dir, weights, hashes)
    model = build_lm(config, str(run_dir / CONFIG))
    try:
        load_model(model, str(weights), device=str(device))
    except RuntimeError as e:      # safetensors: missing / unexpected keys, or a size mismatch
        raise SsmcraftError(f"{run_dir}: {WEIGHTS} does not fit {CONFIG} ({' '.join(str(e).split())[:300]})") from None
    except (SafetensorError, OSError) as e:
        raise SsmcraftError(f"{weights}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None
    record.check_kernel(run_dir, model, hashes)
    return model.to(device).eval()
