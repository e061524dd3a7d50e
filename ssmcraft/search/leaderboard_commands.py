"""``ssmcraft leaderboard DIR``: the ranked trials of a search, read from its storage
(works while the search runs, or after it was killed). Read-only unless ``--write``."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="search run folder (ssmcraft search --out)")
    p.add_argument("--storage", default=None, metavar="URL", help="RDB URL, when the study is not in DIR")
    p.add_argument("--top", type=int, default=None, help="show only the best N trials")
    p.add_argument("--write", action="store_true",
                   help="also rewrite DIR/leaderboard.csv and the PNG plots from the storage")


def run(args: argparse.Namespace) -> int:
    from ssmcraft.search import reports
    from ssmcraft.search.rundir import open_study

    study = open_study(args.dir, args.storage)
    print(reports.format_table(study, top=args.top))
    if args.write:
        for line in reports.write_reports(study, args.dir):
            print(f"report: {line}")
    return 0
