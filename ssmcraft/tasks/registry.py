"""The task registry: how a ``task: {name: ...}`` mapping finds its class.

Built-in tasks are registered under their ``name``; a name of the form ``package.module:Class``
is a user's task class, imported from that module (``importlib.import_module``; nothing from
the spec is evaluated). Importing a module runs its code: a module path in a spec is code the
spec's author chose to run, exactly as if it were passed to ``python -c "import ..."``.

A task class follows ``ssmcraft.tasks.base.Task`` (docs/tasks.md): ``name``, ``options`` (its
config keys and their defaults), ``from_config(cfg, source)``, ``vocab_size``, ``seq_len``,
``eval_seq_len``, ``sample(split, batch_size, seq_len, generator)``, ``describe()``.
"""
from __future__ import annotations

from typing import Mapping

from ssmcraft.errors import SpecError
from ssmcraft.modpath import load_object
from ssmcraft.tasks.base import Task

TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Register a built-in task class under its ``name`` (usable as a class decorator)."""
    if cls.name in TASKS and TASKS[cls.name] is not cls:
        raise ValueError(f"task name {cls.name!r} is registered twice ({TASKS[cls.name].__module__}, {cls.__module__})")
    TASKS[cls.name] = cls
    return cls


def task_class(name, source: str = "<experiment>", key: str = "task.name") -> type[Task]:
    """The class a task name names: a registered name, or ``package.module:Class``."""
    if isinstance(name, str) and name in TASKS:
        return TASKS[name]
    if not isinstance(name, str) or ":" not in name:
        raise SpecError(source, key, f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}, "
                        "or a class as package.module:Class")
    cls = load_object(name, source, key)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise SpecError(source, key, f"{name} is not a subclass of ssmcraft.tasks.Task (docs/tasks.md)")
    if not isinstance(getattr(cls, "options", None), Mapping):
        raise SpecError(source, key, f"{name} has no 'options' mapping (its config keys and their defaults)")
    return cls
