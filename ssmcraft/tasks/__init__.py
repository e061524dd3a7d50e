"""Tasks behind one interface (``Task``; docs/tasks.md), found through a registry.

Built in: MQAR, passkey retrieval and byte-level text LM; Zoology's MQAR variants
(``mqar_extrapolate``, ``mqar_forgetting``, ``mqar_compositional``, ``mqar_stacked``); MAD's six
synthetic tasks (``in_context_recall``, ``fuzzy_recall``, ``noisy_recall``, ``selective_copying``,
``compression``, ``memorization``). A user's task: ``task: {name: package.module:Class, ...}``.

``build_task({"name": "mqar", ...})`` builds one from an experiment's ``task:`` mapping.
"""
from __future__ import annotations

from typing import Any, Mapping

from ssmcraft.errors import SpecError
from ssmcraft.tasks.base import IGNORE, Options, Task
from ssmcraft.tasks.mad import TASK_CLASSES as MAD_TASK_CLASSES
from ssmcraft.tasks.mqar import MQARTask
from ssmcraft.tasks.mqar_variants import VARIANTS as MQAR_VARIANTS
from ssmcraft.tasks.passkey import PasskeyTask
from ssmcraft.tasks.registry import TASKS, register_task, task_class
from ssmcraft.tasks.text import TextTask

for _cls in (MQARTask, PasskeyTask, TextTask, *MQAR_VARIANTS, *MAD_TASK_CLASSES):
    register_task(_cls)


def build_task(cfg: Mapping[str, Any], source: str = "<experiment>") -> Task:
    """A task from its config mapping; ``cfg["name"]`` picks the class, unknown keys are errors."""
    check_task(cfg, source)
    return task_class(cfg["name"], source).from_config(cfg, source)


def check_task(cfg: Mapping[str, Any], source: str = "<experiment>") -> None:
    """What ``build_task`` refuses first, without building the task (a text corpus is not read):
    the mapping, its ``name`` and its keys (each task class's ``options``). Values are checked
    when the task is built."""
    if not isinstance(cfg, Mapping):
        raise SpecError(source, "task", f"expected a mapping with a 'name', got {cfg!r}")
    Options(cfg, task_class(cfg.get("name"), source).options, source)


__all__ = ["IGNORE", "Task", "MQARTask", "PasskeyTask", "TextTask", "TASKS", "build_task", "check_task",
           "register_task", "task_class"]
