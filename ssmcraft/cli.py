"""The ``ssmcraft`` command.

Each subcommand lives in the module of the pipeline stage it belongs to and exposes
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches, importing
a stage's module only when its subcommand runs (``ssmcraft derive`` never imports torch
training code, Optuna or Ray).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ssmcraft.errors import SsmcraftError

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "derive": ("ssmcraft.compiler.commands", "derive the update of an objective spec and print every stage"),
    "bench": ("ssmcraft.bench.commands", "time an objective's kernel (fwd, fwd+bwd, bandwidth)"),
    "tasks": ("ssmcraft.tasks.commands", "list the tasks (built in and MAD's, Zoology's) and their options"),
    "train": ("ssmcraft.train.commands", "train one model described by an experiment spec"),
    "eval": ("ssmcraft.train.eval_commands", "long-context evaluation of a trained run"),
    "search": ("ssmcraft.search.commands", "search over objectives and hyperparameters"),
    "leaderboard": ("ssmcraft.search.leaderboard_commands", "print a search's leaderboard"),
    "export": ("ssmcraft.export.commands", "export a trial as a standalone PyTorch module"),
    "study": ("ssmcraft.study.commands", "run a study spec and write its report"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssmcraft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except SsmcraftError as e:
        print(f"ssmcraft {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ssmcraft {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
