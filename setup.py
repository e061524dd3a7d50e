"""Build hook: ship the top-level objectives/ and specs/ folders as package data.

Users read and copy those folders in a checkout (DESIGN.md, "Layout"); an installed
ssmcraft finds the same files under ``ssmcraft/data/`` (see ssmcraft/compiler/library.py).
Everything else is configured in pyproject.toml.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        root = Path(__file__).resolve().parent
        for kind in ("objectives", "specs"):
            if (root / kind).is_dir():
                shutil.copytree(root / kind, Path(self.build_lib) / "ssmcraft" / "data" / kind, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
