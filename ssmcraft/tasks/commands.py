"""``ssmcraft tasks [NAME]``: the registered tasks with their options, or one task's options and
(for MAD's tasks) its difficulty levels."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default=None,
                   help="one task (a registered name or package.module:Class): its options, description and levels")


def _summary(cls) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def run(args: argparse.Namespace) -> int:
    from ssmcraft.tasks import TASKS, task_class
    from ssmcraft.tasks.mad import MAD_TASKS, levels

    if args.name is None:
        width = max(map(len, TASKS))
        for name in sorted(TASKS):
            print(f"{name:{width}}  {_summary(TASKS[name])}")
        print("\nssmcraft tasks NAME: a task's options; docs/tasks.md: the interface of a task of your own")
        return 0
    cls = task_class(args.name, "<command line>", "NAME")
    print(f"{args.name}: {_summary(cls)} ({cls.__module__})")
    print("options (defaults): " + json.dumps(dict(cls.options)))
    if args.name in MAD_TASKS:
        print("MAD's levels:")
        for label, cfg in levels(args.name):
            print(f"  {label:28} {json.dumps({k: v for k, v in cfg.items() if k != 'name'})}")
    return 0
