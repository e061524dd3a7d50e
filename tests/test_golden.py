"""Golden files: for every library objective, its IR, its generated reference module and the kernel
source generated for it, compared with ``tests/golden/<objective>/`` so that a change to the
compiler or a generator shows up as a reviewed diff.

    SSMCRAFT_UPDATE_GOLDEN=1 python3 -m pytest tests/test_golden.py     # rewrite them

What is compared is what the compiler makes of the spec: the objective is compiled from its
repository-relative path (``objectives/<name>.yaml``), so no absolute path reaches the text; the
IR hash in the headers is a hash of the IR itself, not of ssmcraft's source.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest

import ssmcraft
from ssmcraft.errors import SsmcraftError
from ssmcraft.compiler.library import library_names
from ssmcraft.ops import registry
from ssmcraft.runtime.select import kernel_source

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("SSMCRAFT_UPDATE_GOLDEN") == "1"
NAMES = library_names()
FILES = ("ir.json", "reference.py", "kernels.py")


def kernels_text(obj) -> str:
    """The family that runs ``obj`` on CUDA tensors and the source generated for it
    (``ssmcraft.runtime.select.kernel_source``)."""
    try:
        fam, parts = kernel_source(obj)
    except SsmcraftError as e:        # no family runs it yet: the golden file records every family's reason
        return f"# no Triton kernel family: {e}\n"
    out = [f"# family: {fam} ({registry.family(fam).path})"]
    if not parts:
        out.append("# hand-written kernels specialised by constexpr modes: no per-objective source")
    for what, text in parts:
        out.append(f"# {text}" if what == "note" else f"# -- {what} --\n{text.rstrip()}")
    return "\n".join(out) + "\n"


def texts(name: str) -> dict[str, str]:
    obj = ssmcraft.compile(f"objectives/{name}.yaml")
    return {"ir.json": json.dumps(obj.ir.to_json(), indent=1, sort_keys=True) + "\n",
            "reference.py": obj.source,
            "kernels.py": kernels_text(obj)}


@pytest.mark.parametrize("name", NAMES)
def test_generated_text_matches_the_golden_files(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    folder = GOLDEN / name
    differ = []
    for file, text in texts(name).items():
        path = folder / file
        if UPDATE:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        assert path.is_file(), f"{path} is missing: SSMCRAFT_UPDATE_GOLDEN=1 python3 -m pytest tests/test_golden.py"
        want = path.read_text()
        if text != want:
            diff = difflib.unified_diff(want.splitlines(), text.splitlines(), f"golden/{name}/{file}", "generated",
                                        lineterm="", n=1)
            differ.append("\n".join(list(diff)[:40]))
    assert not differ, ("generated text differs from the golden files (review, then rewrite them with "
                        "SSMCRAFT_UPDATE_GOLDEN=1 python3 -m pytest tests/test_golden.py):\n" + "\n".join(differ))


def test_every_golden_folder_is_a_library_objective_and_complete():
    folders = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir())
    assert folders == NAMES
    for name in folders:
        assert sorted(p.name for p in (GOLDEN / name).iterdir()) == sorted(FILES)


def test_no_absolute_path_in_golden_text():
    for path in GOLDEN.rglob("*"):
        if path.is_file():
            assert str(ROOT) not in path.read_text(), path
