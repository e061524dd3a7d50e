"""The task registry: built-in tasks are found through it, and a user's task class through a
module path in the spec (imported, never evaluated)."""
from __future__ import annotations

import math

import pytest
import torch

from ssmcraft.errors import SpecError
from ssmcraft.tasks import TASKS, build_task, task_class
from ssmcraft.tasks.mqar import MQARTask

BUILT_IN = {"mqar", "passkey", "text", "mqar_forgetting", "mqar_compositional", "mqar_stacked", "mqar_extrapolate"}


def test_built_in_tasks_are_found_through_the_registry():
    assert BUILT_IN <= set(TASKS)
    assert task_class("mqar") is MQARTask


def test_a_user_task_from_a_module_path_builds_and_trains(tmp_path):
    from ssmcraft.train import train_run

    task = build_task({"name": "examples.tasks:PreviousTokenTask", "vocab": 12, "lag": 2})
    x, y = task.sample("train", 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(y[:, 2:], x[:, :-2]) and task.describe()["lag"] == 2
    metrics = train_run({"name": "user-task", "task": {"name": "examples.tasks:PreviousTokenTask", "vocab": 12, "seq_len": 16},
                         "model": {"d_model": 16, "n_layers": 1, "mixer": {"kind": "attention", "heads": 2}},
                         "train": {"batch_size": 8, "tokens": 8 * 16 * 3, "eval_every": 0, "eval_batches": 1,
                                   "eval_batch_size": 4}}, tmp_path / "run")
    assert metrics["status"] == "ok" and math.isfinite(metrics["val_loss"]) and "accuracy" in metrics
    assert metrics["task"]["name"] == "previous_token"


@pytest.mark.parametrize("cfg, key, problem", [
    ({"name": "no_such_task"}, "task.name", "unknown task 'no_such_task'"),
    ({"name": "examples.no_such_module_xyz:Task"}, "task.name", "cannot import module 'examples.no_such_module_xyz'"),
    ({"name": "example_task:Missing"}, "task.name", "has no 'Missing'"),
    ({"name": "example_task:NotATask"}, "task.name", "not a subclass of ssmcraft.tasks.Task"),
    ({"name": "__import__('os'):x"}, "task.name", "not a module path"),
    ({"name": "examples.tasks:PreviousTokenTask", "lagg": 1}, "task.lagg", "unknown key"),
    ({"name": "examples.tasks:PreviousTokenTask", "lag": 0}, "task", "lag must be a positive integer"),
])
def test_bad_task_names_and_keys_are_one_error(cfg, key, problem):
    with pytest.raises(SpecError) as e:
        build_task(cfg)
    assert e.value.key == key and problem in e.value.problem


def test_tasks_command_lists_the_registry_and_a_tasks_levels(capsys):
    from ssmcraft.cli import main

    assert main(["tasks"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[:len(TASKS)]}
    assert listed == set(TASKS)
    assert main(["tasks", "memorization"]) == 0
    out = capsys.readouterr().out
    assert '"map_seed": 12345' in out and "vocab=8192" in out
    assert main(["tasks", "no_such_task"]) == 2
    assert "unknown task 'no_such_task'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["example_task:PreviousTokenTask", "antigravity:x", "os.path:join"])
def test_a_module_path_outside_the_trusted_packages_is_refused_before_import(monkeypatch, name):
    """A spec alone cannot run code: a module path is imported only from a package the person
    running the command allowed (SSMCRAFT_TRUST_MODULES)."""
    import sys

    monkeypatch.setenv("SSMCRAFT_TRUST_MODULES", "examples")
    module = name.partition(":")[0]
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(SpecError) as e:
        build_task({"name": name, "vocab": 12})
    assert e.value.key == "task.name" and "SSMCRAFT_TRUST_MODULES=" in e.value.problem
    assert module not in sys.modules
