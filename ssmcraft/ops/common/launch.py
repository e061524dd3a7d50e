"""Direct launches of compiled Triton kernels: a kernel call's host side in a few microseconds.

``kernel[grid](*args, **kw)`` spends tens of microseconds of Python per launch (binding the
arguments, computing the specialisation key, looking the kernel up; the autotuner's bookkeeping
on top), and a forward+backward of the chunked families launches 6-12 kernels: host time that
can exceed the GPU time of the kernels at training shapes (BENCHMARKS.md, "Public path").

``launch(kernel, grid, *args, **kw)`` does the first launch of each *launch key* through Triton
(compiling, autotuning, caching as usual) and keeps the compiled kernel that ran; a later call
with the same key calls that compiled kernel's launcher directly. The key holds everything a
compiled Triton kernel is specialised on, conservatively:

- a tensor: its dtype and whether its data pointer is 16-byte aligned (Triton's pointer
  specialisation); ``None``: itself;
- a number or any other value: the value itself (ints are specialised on ``== 1``, divisibility
  by 16 and their width; constexprs on their value; a float is not specialised, but floats here
  are per-objective constants, so keying on them costs nothing);
- the current CUDA device.

The keys live on the kernel object (``kernel.__dict__["_ssmcraft_launches"]``), so a generated
kernel module's cache goes away with the module. Under ``TRITON_INTERPRET=1``, with ``SSMCRAFT_DIRECT_LAUNCH=0``
(benchmarks time both ways with it; both variables are read when this module is imported), or while a Triton launch hook is installed (a profiler such
as proton), every launch goes through Triton.
``stats(kernel)`` counts both kinds, for the tests and ``ssmcraft bench --explain``.
"""
from __future__ import annotations

import inspect
import os

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

_ATTR = "_ssmcraft_launches"
_Tensor = torch.Tensor


def _through_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("SSMCRAFT_DIRECT_LAUNCH") == "0"


_THROUGH_TRITON = _through_triton()     # read once at import: no environment lookup on the launch path


def _hooked() -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 keeps them in ``HookChain`` objects,
    empty by default; older versions use ``None``)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _jit(kernel):
    """The ``JITFunction`` under autotuner / heuristics wrappers."""
    k = kernel
    while not isinstance(k, JITFunction):
        k = k.fn
    return k


def _tuple_entry(t: tuple) -> tuple:
    """A tuple argument's key entry (Triton specialises each element): ``tuple`` then each element's
    entry, never the tensors themselves (a key that held them would keep every call's buffers alive
    in the cache and never match the next call's)."""
    return (tuple, *[(x.dtype, x.data_ptr() % 16 == 0) if isinstance(x, _Tensor)
                     else _tuple_entry(x) if type(x) is tuple else (type(x), x) for x in t])


def launch_key(device, args: tuple, kw: dict) -> tuple:
    """The launch key of one call (the module docstring): the device, then per positional argument
    ``(dtype, 16-byte aligned)`` for a tensor, ``_tuple_entry`` for a tuple and ``(type, value)`` for
    anything else, then per keyword argument the same with its name first. Built in one pass without
    a call per argument (but per tuple): this is on every launch's path."""
    return (device,
            *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, _Tensor)
              else _tuple_entry(a) if type(a) is tuple else (type(a), a) for a in args],
            *[(n, v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, _Tensor)
              else (n, *_tuple_entry(v)) if type(v) is tuple else (n, type(v), v) for n, v in kw.items()])


def plan(kernel, n_args: int, kw_names) -> tuple:
    """How to rebuild the kernel's full argument list (every parameter in order, constexprs
    included, as Triton's launcher takes it) from a call's ``args`` and ``kw``: per parameter
    ``("a", i)`` (positional), ``("k", name)`` (keyword) or ``("c", value)`` (an autotuned
    config's value or the signature default)."""
    jit = _jit(kernel)
    config = getattr(kernel, "best_config", None)
    fixed = dict(config.kwargs) if config is not None else {}
    defaults = {n: p.default for n, p in inspect.signature(jit.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    out = []
    for i, name in enumerate(jit.arg_names):
        if i < n_args:
            out.append(("a", i))
        elif name in kw_names:
            out.append(("k", name))
        elif name in fixed:
            out.append(("c", fixed[name]))
        elif name in defaults:
            out.append(("c", defaults[name]))
        else:
            raise TypeError(f"{jit.fn.__name__}: no value for parameter {name!r}")
    return tuple(out)


def values(order: tuple, args: tuple, kw: dict) -> list:
    """The full argument list of ``plan``'s ``order`` for one call."""
    return [args[s] if t == "a" else kw[s] if t == "k" else s for t, s in order]


def stats(kernel) -> dict:
    """``{"triton": launches through Triton, "direct": direct launches}`` of one kernel."""
    return dict(kernel.__dict__.get(_ATTR, {}).get("stats", {"triton": 0, "direct": 0}))


def launch(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)``, direct after the first launch of each key (module docstring).

    ``grid``: a tuple of 1-3 ints, or a callable of the launch's ``{parameter: value}`` (evaluated
    on every launch, as Triton does: a grid may depend on sizes that are not in the key)."""
    if _THROUGH_TRITON or _hooked():
        return kernel[grid](*args, **kw)
    state = kernel.__dict__.get(_ATTR)
    if state is None:
        state = kernel.__dict__[_ATTR] = {"keys": {}, "stats": {"triton": 0, "direct": 0}}
    device = torch.cuda.current_device()
    key = launch_key(device, args, kw)
    hit = state["keys"].get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kw)
        state["stats"]["triton"] += 1
        config = getattr(kernel, "best_config", None)
        if compiled is None or hasattr(compiled, "result") or getattr(config, "pre_hook", None) is not None:
            return compiled          # an async compile, or a config hook that must run: not kept
        if len(state["keys"]) >= 256:                          # shapes churn: start over
            state["keys"].clear()
        state["keys"][key] = (compiled, plan(kernel, len(args), kw.keys()), _jit(kernel).arg_names)
        return compiled
    compiled, order, names = hit
    vals = values(order, args, kw)
    run_compiled(compiled, _grid3(grid, names, vals), device, vals)
    state["stats"]["direct"] += 1
    return compiled


def _grid3(grid, names, vals) -> tuple:
    """The launch grid as 3 ints (``grid``: a tuple, or a callable of ``{parameter: value}``)."""
    return (*(grid(dict(zip(names, vals))) if callable(grid) else grid), 1, 1)


def run_compiled(compiled, g: tuple, device, vals: list) -> None:
    """The compiled kernel's own launcher (Triton 3.6's ``CompiledKernel.run`` signature) on the
    full argument list ``vals`` over grid ``g``, on the device's current stream."""
    compiled.run(g[0], g[1], g[2], driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *vals)


def direct_parts(kernel, grid, *args, **kw) -> tuple[dict, int]:
    """The parts of a direct launch of a key launched before, each a call of its own, for timing
    (``benchmarks/host_floor.py``): ``({"launch key": fn, "arguments + grid": fn, "compiled launcher":
    fn}, number of arguments)``, built from the pieces ``launch`` runs."""
    device = torch.cuda.current_device()
    compiled, order, names = kernel.__dict__[_ATTR]["keys"][launch_key(device, args, kw)]
    vals = values(order, args, kw)
    g = _grid3(grid, names, vals)
    return ({"launch key": lambda: launch_key(device, args, kw),
             "arguments + grid": lambda: _grid3(grid, names, values(order, args, kw)),
             "compiled launcher": lambda: run_compiled(compiled, g, device, vals)}, len(vals))
