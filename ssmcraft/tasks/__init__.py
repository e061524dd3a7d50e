"""Tasks: MQAR, passkey retrieval and byte-level text LM, behind one interface (``Task``).

``build_task({"name": "mqar", ...})`` builds one from an experiment's ``task:`` mapping.
"""
from __future__ import annotations

from typing import Any, Mapping

from ssmcraft.errors import SpecError
from ssmcraft.tasks.base import IGNORE, Options, Task
from ssmcraft.tasks.mqar import MQARTask
from ssmcraft.tasks.passkey import PasskeyTask
from ssmcraft.tasks.text import TextTask

TASKS: dict[str, type[Task]] = {"mqar": MQARTask, "passkey": PasskeyTask, "text": TextTask}


def build_task(cfg: Mapping[str, Any], source: str = "<experiment>") -> Task:
    """A task from its config mapping; ``cfg["name"]`` picks the class, unknown keys are errors."""
    check_task(cfg, source)
    return TASKS[cfg["name"]].from_config(cfg, source)


def check_task(cfg: Mapping[str, Any], source: str = "<experiment>") -> None:
    """What ``build_task`` refuses first, without building the task (a text corpus is not read):
    the mapping, its ``name`` and its keys (each task class's ``options``). Values are checked
    when the task is built."""
    if not isinstance(cfg, Mapping):
        raise SpecError(source, "task", f"expected a mapping with a 'name', got {cfg!r}")
    name = cfg.get("name")
    if not isinstance(name, str) or name not in TASKS:
        raise SpecError(source, "task.name", f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    Options(cfg, TASKS[name].options, source)


__all__ = ["IGNORE", "Task", "MQARTask", "PasskeyTask", "TextTask", "TASKS", "build_task", "check_task"]
