"""The direct-launch cache (``ssmcraft.kernels.launch``): what a launch key holds, and how a
call's arguments are rebuilt into the full parameter list Triton's launcher takes.

The direct launch itself needs a GPU (compiled kernels): it runs in every GPU benchmark, whose
correctness checks compare repeated ``obj(...)`` calls (the second and later ones are direct)
against the anchors and the reference loop. Here, on CPU, the pure parts, and the interpreter
route (every launch through Triton)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: like every kernel test module

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from ssmcraft.kernels import launch as L  # noqa: E402


def _kern(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


KERN = JITFunction(_kern)


class _Config:
    def __init__(self, kwargs):
        self.kwargs, self.pre_hook = kwargs, None


class _Tuned:
    """Stands in for triton's Autotuner: ``fn`` and the config of the last launch."""
    def __init__(self, fn, config):
        self.fn, self.best_config = fn, _Config(config)


def test_plan_rebuilds_every_parameter_in_order():
    x, y = torch.zeros(4), torch.ones(4)
    order = L.plan(KERN, 2, {"n", "scale", "BLOCK"})
    assert order == (("a", 0), ("a", 1), ("k", "n"), ("k", "scale"), ("k", "BLOCK"), ("c", False))
    vals = L.values(order, (x, y), {"n": 4, "scale": 0.5, "BLOCK": 16})
    assert vals[0] is x and vals[1] is y and vals[2:] == [4, 0.5, 16, False]


def test_plan_takes_an_autotuned_config_and_refuses_a_missing_parameter():
    tuned = _Tuned(KERN, {"BLOCK": 64})
    order = L.plan(tuned, 4, set())
    assert order[4] == ("c", 64) and order[5] == ("c", False)
    try:
        L.plan(KERN, 4, set())
    except TypeError as e:
        assert "BLOCK" in str(e)
    else:
        raise AssertionError("a parameter without a value must be refused")


def test_the_key_holds_what_a_compiled_kernel_is_specialised_on():
    base = torch.zeros(64)
    assert L.arg_key(base) == (torch.float32, True)
    assert L.arg_key(base[1:]) == (torch.float32, False)        # 4-byte offset: not 16-byte aligned
    assert L.arg_key(base[4:]) == (torch.float32, True)
    assert L.arg_key(base.to(torch.bfloat16)) != L.arg_key(base)
    assert L.arg_key(1) != L.arg_key(True)                       # an int 1 and a bool are different keys
    assert L.arg_key(1) != L.arg_key(16) and L.arg_key(None) == (type(None), None)


def test_under_the_interpreter_every_launch_goes_through_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(L, "_THROUGH_TRITON", L._through_triton())     # as an import under the interpreter reads it
    assert L._THROUGH_TRITON
    calls = []

    class _Fake:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k)) or "ran"
    f = _Fake()
    assert L.launch(f, (3,), 1, B=2) == "ran" and L.launch(f, (3,), 1, B=2) == "ran"
    assert len(calls) == 2 and L.stats(f) == {"triton": 0, "direct": 0}


def test_an_installed_launch_hook_is_seen_and_the_empty_default_is_not():
    from triton import knobs
    assert not L._hooked()                      # Triton 3.6's default: empty hook chains
    hook = (lambda *a, **k: None)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert L._hooked()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not L._hooked()
