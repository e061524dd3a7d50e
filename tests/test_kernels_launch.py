"""The direct-launch cache (``ssmcraft.ops.common.launch``): what a launch key holds, and how a
call's arguments are rebuilt into the full parameter list Triton's launcher takes.

The direct launch itself needs a GPU (compiled kernels): it runs in every GPU benchmark, whose
correctness checks compare repeated ``obj(...)`` calls (the second and later ones are direct)
against the anchors and the reference loop. Here, on CPU, the pure parts, the direct route on
stand-ins for a compiled kernel and the driver, and the interpreter route (every launch through
Triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ssmcraft.ops.common import launch as L


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


def _entry(a):
    """The launch key's entry of one positional argument."""
    return L.launch_key(None, (a,), {})[1]


def test_the_key_holds_what_a_compiled_kernel_is_specialised_on():
    base = torch.zeros(64)
    assert _entry(base) == (torch.float32, True)
    assert _entry(base[1:]) == (torch.float32, False)        # 4-byte offset: not 16-byte aligned
    assert _entry(base[4:]) == (torch.float32, True)
    assert _entry(base.to(torch.bfloat16)) != _entry(base)
    assert _entry(1) != _entry(True)                       # an int 1 and a bool are different keys
    assert _entry(1) != _entry(16) and _entry(None) == (type(None), None)
    # keyword arguments: the same entries, named; the positional and keyword forms stay apart
    key = L.launch_key(0, (base,), {"n": 1, "out": base[1:]})
    assert key == (0, (torch.float32, True), ("n", int, 1), ("out", torch.float32, False))
    assert key != L.launch_key(0, (base,), {"n": True, "out": base[1:]})
    assert key != L.launch_key(0, (base,), {"m": 1, "out": base[1:]})
    assert key != L.launch_key(1, (base,), {"n": 1, "out": base[1:]})
    assert L.launch_key(0, (base, 1), {}) != L.launch_key(0, (base,), {"n": 1})


def test_a_tuple_argument_is_keyed_by_its_elements_and_not_kept():
    """Tuples of tensors (``rankr_row``'s key vectors and factors): keyed per element as Triton
    specialises them, so the next call's new tensors of the same kind find the key, and the key keeps
    none of them alive (it did: every call's buffers stayed in the cache)."""
    import gc
    import weakref
    base = torch.zeros(64)
    a, b = torch.zeros(64), torch.ones(64)
    assert _entry((a, None, 2.0)) == (tuple, (torch.float32, True), (type(None), None), (float, 2.0))
    assert _entry((a, b)) == _entry((torch.ones(64), torch.zeros(64)))
    assert _entry((a, b)) != _entry((a, base[1:])) and _entry((a, b)) != _entry((a, b.to(torch.bfloat16)))
    assert _entry((a, b)) != _entry((a, None)) and _entry((a,)) != _entry(a) and _entry((a, (b,))) != _entry((a, b))
    kw_key = L.launch_key(0, (), {"vecs": (a, b)})
    assert kw_key == (0, ("vecs", tuple, (torch.float32, True), (torch.float32, True)))
    ref = weakref.ref(b)
    key = L.launch_key(0, ((a, b),), {"vecs": (a, b)})
    del b
    gc.collect()
    assert ref() is None and key == L.launch_key(0, ((a, torch.ones(64)),), {"vecs": (a, torch.ones(64))})


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


class _Compiled:
    """Stands in for a compiled Triton kernel: records what its launcher is called with."""
    function, packed_metadata = "fn-handle", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Launchable(_Tuned):
    """An autotuned kernel whose ``kernel[grid](...)`` (the route through Triton) is recorded."""
    def __init__(self, config):
        super().__init__(KERN, config)
        self.compiled, self.through = _Compiled(), []

    def __getitem__(self, grid):
        return lambda *a, **k: self.through.append((grid, a, k)) or self.compiled


def _direct_route(monkeypatch):
    """Launches take the GPU route (direct after the first of a key) on CPU stand-ins."""
    class _Driver:
        class active:
            @staticmethod
            def get_current_stream(device):
                return f"stream{device}"
    monkeypatch.setattr(L, "_THROUGH_TRITON", False)
    monkeypatch.setattr(L, "driver", _Driver)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_after_the_first_launch_of_a_key_the_compiled_launcher_is_called_directly(monkeypatch):
    """The GPU route on CPU stand-ins: the first launch of a key goes through Triton and is kept;
    the next calls the kept launcher with the grid (a callable grid evaluated on the call's
    parameters), the current stream and every parameter in order, config values included; a new
    key (another int) goes through Triton again."""
    _direct_route(monkeypatch)
    k = _Launchable({"BLOCK": 64})
    x, y = torch.zeros(8), torch.ones(8)
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]), 2)      # noqa: E731
    assert L.launch(k, grid, x, y, 130, 0.5) is k.compiled
    assert len(k.through) == 1 and k.compiled.runs == [] and L.stats(k) == {"triton": 1, "direct": 0}
    L.launch(k, grid, x, y, 130, 0.5)
    assert len(k.through) == 1 and L.stats(k) == {"triton": 1, "direct": 1}
    (run,) = k.compiled.runs
    assert run[:9] == (3, 2, 1, "stream0", "fn-handle", "metadata", None, None, None)
    assert run[9] is x and run[10] is y and run[11:] == (130, 0.5, 64, False)
    L.launch(k, grid, x, y, 16, 0.5)                                    # n = 16: another key
    assert len(k.through) == 2 and L.stats(k) == {"triton": 2, "direct": 1}


def test_a_call_with_new_tensors_in_a_tuple_launches_directly(monkeypatch):
    """A tuple of tensors (``rankr_row``'s arguments): the next call with other tensors of the same
    kinds is the same key, so it launches directly with its own tuple, and the cache keeps none of
    the first call's tensors alive."""
    import gc
    import weakref
    _direct_route(monkeypatch)
    k = _Launchable({"BLOCK": 64})
    a, b = torch.zeros(8), torch.ones(8)
    ref = weakref.ref(a)
    L.launch(k, (1,), (a, b), b, 130, 0.5)
    k.through.clear()                   # the stand-in's record of the call through Triton
    del a
    gc.collect()
    assert ref() is None
    c, d = torch.zeros(8), torch.ones(8)
    L.launch(k, (1,), (c, d), d, 130, 0.5)
    assert L.stats(k) == {"triton": 1, "direct": 1}
    (run,) = k.compiled.runs
    assert run[9] == (c, d) and run[9][0] is c and run[10] is d
    L.launch(k, (1,), (c, d.to(torch.bfloat16)), d, 130, 0.5)           # another dtype in the tuple: a new key
    assert L.stats(k) == {"triton": 2, "direct": 1}
