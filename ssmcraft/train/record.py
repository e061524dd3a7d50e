"""What a run records of its artefacts when it is written, and the check of a run folder
against that record when it is loaded (eval, export, ``load_trial``).

``metrics.json`` holds, under ``artefacts``:

    objective_sha256  sha256 of ``config.json``'s ``model.mixer.objective`` (the objective's
                      spec mapping, canonical JSON); null for an attention model
    model_sha256      sha256 of ``config.json``'s whole ``model`` section (canonical JSON)
    update_hash       the derived update's IR hash without its provenance (``update_hash``);
                      null for an attention model
    weights_sha256    sha256 of ``model.safetensors``; null when the run saved no weights

On load, an edited objective or model section and replaced or corrupted weights are refused
with one line. The hashes guard against edits and corruption, not against someone who
rewrites ``metrics.json`` too: they are checksums, not signatures. Weights without a
``metrics.json`` beside them are refused (the run did not finish writing). A ``metrics.json``
with no ``artefacts`` (written by an ssmcraft that did not record them) loads with a warning
saying what went unchecked: such runs stay usable, and the warning says they are unverified.
The IR hash is compared only to warn: the same spec may derive a differently printed IR
under another compiler or sympy version, and the run stays what its spec says.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from ssmcraft.errors import SsmcraftError
from ssmcraft.fileio import file_sha256

log = logging.getLogger("ssmcraft.train")

KEY = "artefacts"


def value_sha256(value: Any) -> str:
    """sha256 of a JSON value's canonical text (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
                          .encode()).hexdigest()


def update_hash(objective) -> str:
    """The hash of a compiled objective's derived update: its IR as data without ``source`` (the
    spec's file or ``<dict>``), which ``UpdateIR.content_hash`` includes, so that a run trained
    from a library file and loaded from the spec mapping in its config.json hash the same."""
    ir = objective.ir.to_json()
    ir.pop("source", None)
    return value_sha256(ir)[:16]


def _objective_of(config: dict) -> Any:
    mixer = config.get("model", {}).get("mixer", {})
    return mixer.get("objective") if mixer.get("kind", "objective") == "objective" else None


def config_record(config: dict) -> dict[str, Any]:
    """The hashes of a run's ``config.json`` as written (``config`` read back from the file)."""
    objective = _objective_of(config)
    return {"objective_sha256": None if objective is None else value_sha256(objective),
            "model_sha256": value_sha256(config["model"])}


def artefacts_record(config: dict, model, weights: Path | None) -> dict[str, Any]:
    """The full ``artefacts`` record of a finished run: ``config_record`` of its config.json, the
    IR hash of ``model``'s objective and the sha256 of its weights file (``weights``, or None)."""
    objective = getattr(model, "objective", None)
    return {**config_record(config), "update_hash": None if objective is None else update_hash(objective),
            "weights_sha256": None if weights is None else file_sha256(weights)}


def check_config(run_dir: Path, config: dict, recorded: dict | None, config_name: str) -> None:
    """Refuse a ``config.json`` whose objective or model section is not the recorded one."""
    if recorded is None:
        return
    now = config_record(config)
    for key, where, what in (("objective_sha256", "model.mixer.objective", "the objective"),
                             ("model_sha256", "model", "the model section")):
        if recorded.get(key) != now[key]:
            raise SsmcraftError(
                f"{run_dir / config_name}: {where}: {what} is not the one this run trained (sha256 "
                f"{_short(now[key])}, recorded {_short(recorded.get(key))} in metrics.json); the file was edited: "
                f"restore it, or train a new run with the changed setting")


def check_weights(run_dir: Path, weights: Path, recorded: dict | None) -> None:
    """Refuse a weights file whose sha256 is not the recorded one."""
    if recorded is None:
        return
    want, now = recorded.get("weights_sha256"), file_sha256(weights)
    if want != now:
        raise SsmcraftError(f"{weights}: sha256 {_short(now)} is not the weights this run recorded "
                            f"({_short(want)} in metrics.json): the file was replaced or is corrupt")


def check_kernel(run_dir: Path, model, recorded: dict | None) -> None:
    """Warn when this ssmcraft derives another update IR from the recorded spec than the run did."""
    objective = getattr(model, "objective", None)
    if recorded is None or objective is None or recorded.get("update_hash") is None:
        return
    now = update_hash(objective)
    if now != recorded["update_hash"]:
        log.warning("%s: this ssmcraft derives update IR %s from the run's objective, the run trained with IR %s "
                    "(another compiler or sympy version): results may differ from training", run_dir, now,
                    recorded["update_hash"])


def warn_unrecorded(run_dir: Path) -> None:
    log.warning("%s: metrics.json records no artefact hashes (a run from an ssmcraft that did not record them): "
                "config.json and model.safetensors are loaded unchecked; train it again to have them checked",
                run_dir)


def recorded_of(metrics: dict | None, path: Path) -> dict | None:
    """The ``artefacts`` record of a parsed ``metrics.json`` (None: none recorded); refuses a
    malformed record."""
    if metrics is None or KEY not in metrics:
        return None
    rec = metrics[KEY]
    keys = ("objective_sha256", "model_sha256", "update_hash", "weights_sha256")
    if not isinstance(rec, dict) or any(not isinstance(rec.get(k), (str, type(None))) for k in keys) \
            or not isinstance(rec.get("model_sha256"), str):
        raise SsmcraftError(f"{path}: {KEY}: expected a mapping of sha256 strings ({', '.join(keys)}), "
                            f"got {_clip(rec)}")
    return rec


def _short(digest: Any) -> str:
    return digest[:12] if isinstance(digest, str) else repr(digest)


def _clip(value: Any, n: int = 80) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= n else text[:n] + "..."
