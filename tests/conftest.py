"""Shared test setup.

Compiler fixtures (issue 2): an isolated cache directory for generated code, a memoised
``compile`` of library objectives, and a generator of random inputs that respect each
input's declared constraints (positive / bounded / normalize) and each param's sign.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # `pytest` without `pip install -e .` still imports ssmcraft
    sys.path.insert(0, str(ROOT))


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


@functools.lru_cache(maxsize=None)
def _compile_cached(name: str):
    import ssmcraft
    return ssmcraft.compile(name)


@pytest.fixture(scope="session")
def compiled(compiler_cache_dir):
    """``compiled(name)``: the library objective ``name``, compiled once per session."""
    return _compile_cached


def _random_inputs(spec, *, B=2, T=3, H=2, sizes=None, dtype=None, seed=0, per_head_params=True):
    """Random ``inputs, params`` for ``spec`` in the API layout ([B, T, H, n], params [H, *shape]).

    positive -> softplus(N) + 0.1; bounded -> in (0.2, 0.8); normalize -> unit L2 norm;
    positive params -> in (0.2, 0.8) (decays stay stable over long T);
    negative params -> -(softplus(N) + 0.1). float64 unless ``dtype`` is given.
    """
    import torch
    dtype = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or {spec.dims[0]: 3, spec.dims[1]: 4}

    def draw(shape, *, positive=False, bounded=False, negative=False, normalize=False):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if bounded:
            t = 0.2 + 0.6 * torch.sigmoid(t)
        elif positive:
            t = torch.nn.functional.softplus(t) + 0.1
        elif negative:
            t = -(torch.nn.functional.softplus(t) + 0.1)
        if normalize:
            t = t / t.norm(dim=-1, keepdim=True)
        return t.to(dtype)

    inputs = {}
    for name, decl in spec.inputs.items():
        shape = [B, T, H, *[sizes[s] for s in decl.shape]]
        inputs[name] = draw(shape, positive=decl.positive, bounded=decl.bounded, normalize=decl.normalize)
    params = {}
    for name, decl in spec.params.items():
        shape = ([H] if per_head_params else []) + [sizes[s] for s in decl.shape]
        params[name] = draw(shape, bounded=decl.positive, negative=decl.negative)
    return inputs, params


@pytest.fixture(scope="session")
def random_inputs():
    """``random_inputs(spec, B=, T=, H=, sizes=, dtype=, seed=)`` -> (inputs, params)."""
    return _random_inputs
