"""Shared test setup.

Compiler fixtures: an isolated cache directory for generated code, a memoised
``compile`` of library objectives, and a generator of random inputs that respect each
input's declared constraints (positive / bounded / normalize) and each param's sign.

The suite runs in parallel (pytest-xdist, ``-n auto --dist loadgroup``): each worker is its own
process with its own cache folder (``compiler_cache_dir``), temporary folders and environment. What
is shared by the machine is kept apart: every test that starts Ray is in ``xdist_group("ray")``, so
one worker runs them one after another; and each worker gets its share of the cores for torch's
threads (``pytest_configure``), since two workers each using every core slow each other down.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

# Every kernel test runs Triton's interpreter (CPU). Set before anything imports triton or
# ssmcraft.ops: both read it once, at import (tuning.INTERPRET). test_sass_count compiles the GPU
# form in a subprocess without it; test_export_bundle's subprocess keeps it.
os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # `pytest` without `pip install -e .` still imports ssmcraft
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    """Under xdist, torch's intra-op threads (and those of the subprocesses a test starts, through
    ``OMP_NUM_THREADS``) are the worker's share of the cores the process may use."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def compiler_cache_dir(tmp_path_factory):
    """Generated reference modules go to a per-session folder, never the user's ~/.cache."""
    old = os.environ.get("SSMCRAFT_CACHE")
    path = tmp_path_factory.mktemp("ssmcraft_cache")
    os.environ["SSMCRAFT_CACHE"] = str(path)
    yield path / "generated"
    if old is None:
        os.environ.pop("SSMCRAFT_CACHE", None)
    else:
        os.environ["SSMCRAFT_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def trusted_example_modules():
    """The example mixers and tasks the tests name by module path are allowed, as a user allows
    their own packages (``ssmcraft.modpath``); nothing else is."""
    old = os.environ.get("SSMCRAFT_TRUST_MODULES")
    os.environ["SSMCRAFT_TRUST_MODULES"] = "examples,example_task,example_mixer"
    yield
    if old is None:
        os.environ.pop("SSMCRAFT_TRUST_MODULES", None)
    else:
        os.environ["SSMCRAFT_TRUST_MODULES"] = old


@functools.lru_cache(maxsize=None)
def _compile_cached(name: str):
    import ssmcraft
    return ssmcraft.compile(name)


@pytest.fixture(scope="session")
def compiled(compiler_cache_dir):
    """``compiled(name)``: the library objective ``name``, compiled once per session."""
    return _compile_cached


@pytest.fixture(scope="session")
def random_inputs():
    """``random_inputs(spec, B=, T=, H=, sizes=, dtype=, seed=)`` -> (inputs, params)."""
    from helpers import random_inputs as draw
    return draw
