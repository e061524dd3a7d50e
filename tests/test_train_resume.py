"""Resumable training: a run stopped (or SIGKILLed) after a checkpoint and started again with the same
command reaches the uninterrupted run's weights bit for bit on CPU; a changed config is refused in one
line and changes nothing; ``--fresh`` starts over; settings that do not change the math may differ."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ssmcraft.cli import main
from ssmcraft.errors import SpecError
from ssmcraft.train import resume, train_run
from helpers import code_corpus, stop_after, subprocess_env, tiny_text_experiment

ENV = subprocess_env()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return code_corpus(tmp_path_factory.mktemp("corpus"))


def config(corpus, steps=12, **train):
    return tiny_text_experiment(corpus, batch_size=4, steps=steps, seed=3, **{"warmup": 3, "checkpoint_every": 4,
                                                                               **train})


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"parameters differ: {differ}"


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return out, train_run(config(corpus), out)


def stopped_run(corpus, folder, monkeypatch, step=8, **train):
    with monkeypatch.context() as m:
        stop_after(m, step)
        with pytest.raises(KeyboardInterrupt):
            train_run(config(corpus, **train), folder)
    assert (folder / resume.FILE).is_file() and not (folder / "model.safetensors").exists()


def test_a_stopped_run_resumes_to_the_uninterrupted_weights_bitwise(corpus, whole, tmp_path, monkeypatch):
    stopped_run(corpus, tmp_path, monkeypatch)
    m = train_run(config(corpus), tmp_path)
    assert m["status"] == "ok" and m["resumed_from_step"] == 8 and whole[1]["resumed_from_step"] is None
    assert_bitwise(weights(whole[0]), weights(tmp_path))
    again, before = (json.loads((folder / "history.json").read_text()) for folder in (tmp_path, whole[0]))
    assert again == before                                   # every step's loss, lr, grad norm and both validations
    assert m["steps"] == 12 and m["tokens"] == whole[1]["tokens"] and m["val_loss"] == whole[1]["val_loss"]
    assert not (tmp_path / resume.FILE).exists()             # a finished run leaves no checkpoint
    log = (tmp_path / "train.log").read_text()
    assert "checkpoint after step 4" in log and "resumed after step 8 of 12" in log   # the killed run's lines kept


def test_resume_puts_back_the_data_position_and_the_optimizer(corpus, whole, tmp_path, monkeypatch):
    """With the data generator at its start, or AdamW's moments zeroed, the resumed run ends elsewhere:
    the checkpoint's states are what make it bitwise."""
    def data_at_start(tensors):
        tensors["rng.data"] = torch.Generator().manual_seed(3 + 1).get_state()

    def moments_zeroed(tensors):
        for k in tensors:
            if k.startswith("opt.") and "exp_avg" in k:
                tensors[k] = torch.zeros_like(tensors[k])

    for name, mangle in (("data", data_at_start), ("opt", moments_zeroed)):
        folder = tmp_path / name
        stopped_run(corpus, folder, monkeypatch)
        real = resume.read_state

        def mangled(out, mangle=mangle):
            meta, tensors = real(out)
            mangle(tensors)
            return meta, tensors
        with monkeypatch.context() as m:
            m.setattr(resume, "read_state", mangled)
            assert train_run(config(corpus), folder)["resumed_from_step"] == 8
        a, b = weights(whole[0]), weights(folder)
        assert any(not torch.equal(a[k], b[k]) for k in a), name


def test_a_changed_config_is_refused_in_one_line_and_changes_nothing(corpus, tmp_path, monkeypatch, capsys):
    stopped_run(corpus, tmp_path, monkeypatch)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SpecError) as e:
        train_run(config(corpus, lr=2e-2), tmp_path, source="x.yaml")
    assert e.value.key == "train.lr"
    assert str(e.value) == (f"x.yaml: train.lr: 0.01 in {tmp_path / resume.FILE} (after step 8), 0.02 now: resume "
                            "with the run's settings, or start it again with --fresh")
    spec = tmp_path.parent / "exp.yaml"
    spec.write_text(json.dumps(config(corpus)))
    capsys.readouterr()             # what the runs above logged (a handler an earlier CLI test installed)
    assert main(["train", str(spec), "--out", str(tmp_path), "--quiet", "--set", "model.d_model=24"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ssmcraft train: error: {spec}: model.d_model: 16 in ") and len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # a setting that changes how steps run, not what they compute, may differ
    m = train_run(config(corpus, log_every=3, checkpoint_every=5), tmp_path)
    assert m["status"] == "ok" and m["resumed_from_step"] == 8


def test_fresh_starts_over(corpus, whole, tmp_path, monkeypatch, capsys):
    stopped_run(corpus, tmp_path, monkeypatch)
    spec = tmp_path.parent / "fresh.yaml"
    spec.write_text(json.dumps(config(corpus, lr=2e-2)))
    assert main(["train", str(spec), "--out", str(tmp_path), "--quiet", "--fresh"]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["resumed_from_step"] is None and metrics["steps"] == 12
    assert json.loads((tmp_path / "config.json").read_text())["train"]["lr"] == 0.02
    assert not (tmp_path / resume.FILE).exists()


def test_an_unreadable_checkpoint_is_one_line(corpus, tmp_path):
    (tmp_path / resume.FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(Exception) as e:
        train_run(config(corpus), tmp_path)
    assert str(e.value).startswith(f"{tmp_path / resume.FILE}: not a readable resume checkpoint (")
    assert "--fresh" in str(e.value) and "\n" not in str(e.value)


def test_a_sigkilled_cli_run_resumes_with_the_same_command(corpus, whole, tmp_path, capsys):
    """A real ``kill -9`` of ``python -m ssmcraft train`` once a checkpoint is on disk; the same command
    again finishes the run with the uninterrupted run's weights."""
    steps = 40            # the checkpoint of step 2 stays on disk until the run ends: the poll below sees it
    spec = tmp_path / "exp.yaml"
    spec.write_text(json.dumps(config(corpus, steps=steps, eval_every=0, checkpoint_every=2)))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "ssmcraft", "train", str(spec), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (out / resume.FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    meta, _ = resume.read_state(out)
    assert 0 < meta["step"] < steps and not (out / "metrics.json").exists()
    assert main(["train", str(spec), "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "metrics.json").read_text())["resumed_from_step"] == meta["step"] > 0
    assert f"processes=1 resumed_from_step={meta['step']}" in capsys.readouterr().out     # the summary says so
    reference = tmp_path / "whole"
    train_run(config(corpus, steps=steps, eval_every=0, checkpoint_every=2), reference)
    assert_bitwise(weights(reference), weights(out))
