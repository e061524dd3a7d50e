"""The structure-class table (``ssmcraft bench --classes``, ``ssmcraft.bench.classes_commands``) as a script,
for a device machine where the package is on ``PYTHONPATH`` but not installed:

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_classes.py [--shape 8,2048,16,64,64] [--dtype bf16]
        [--only longhorn,kda_like,my_layer.yaml] [--no-composed] [--profile] [--out OUT.json]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ssmcraft.bench import commands  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands.add_arguments(ap)
    args = ap.parse_args(["--classes", *(sys.argv[1:] if argv is None else argv)])
    return commands.run(args)


if __name__ == "__main__":
    sys.exit(main())
