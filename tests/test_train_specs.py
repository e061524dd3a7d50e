"""The shipped experiment specs are valid, and train_quick runs end to end (a few steps)."""
from pathlib import Path

import pytest

from ssmcraft.train import train_run
from ssmcraft.train.config import apply_overrides, load_experiment, resolve

SPECS = Path(__file__).resolve().parents[1] / "specs"


@pytest.mark.parametrize("name", ["train_quick.yaml", "longhorn_20m_bytes.yaml"])
def test_spec_resolves(name):
    cfg = resolve(load_experiment(SPECS / name), name)
    assert cfg["model"]["mixer"]["objective"] == "longhorn"


def test_train_quick_runs(tmp_path):
    cfg = apply_overrides(load_experiment(SPECS / "train_quick.yaml"),
                          ["train.tokens=10240", "train.eval_batches=1", "train.device=cpu"])
    m = train_run(cfg, tmp_path)
    assert m["status"] == "ok" and m["steps"] == 5 and m["objective"] == "longhorn"
    assert m["chance_accuracy"] == 0.25 and 0.0 <= m["accuracy"] <= 1.0
