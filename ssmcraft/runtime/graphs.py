"""CUDA graphs of a compiled objective's call: the call's host work once, then one replay.

Every kernel launch costs host time, and a forward+backward of ``obj()`` (Python, Triton's
launcher, the autograd engine) can take longer on the host than its kernels take on the GPU at
training shapes (BENCHMARKS.md, "Host floor"). ``obj.graphed(...)`` captures the call's forward and
backward into two CUDA graphs with ``torch.cuda.make_graphed_callables``; a later call copies its
tensors into the graph's static inputs and replays (one host call per graph). Our Triton kernels and autograd Functions are captured as they are.

``GraphedCall(obj, inputs, params, initial_state, output_final_state)`` is fixed to one *call
signature* (``call_signature``): every tensor's place (``inputs['x']``, ``params['A']``,
``initial_state``), shape, dtype, device and ``requires_grad``, and ``output_final_state``. A call
with another signature raises ``SsmcraftError`` naming what differs (``signature_difference``):
it is never captured again silently, and nothing falls back to the eager path.

Capture safety (``docs/cuda_graphs.md``): everything that happens once
per signature (path choice and validation in ``dispatch``, generating and loading kernel modules,
Triton compilation, the autotuners' timing runs: ``tuning.tune``'s ``triton.autotune`` and
``diagonal._pick``'s ``do_bench``, the first launch of each ``launch.launch`` key) happens in the
warm-up iterations ``make_graphed_callables`` runs before capturing (on a side stream, outside
the capture). What is captured reads no tensor on the host and copies nothing from host memory.
Direct launches (``launch.launch``) take ``driver.active.get_current_stream``, torch's current
stream, which is the capture stream inside ``torch.cuda.graph`` (the autograd engine runs the
backward nodes on the stream their forward ran on: the capture stream again).
"""
from __future__ import annotations

from typing import Mapping

import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common.reference import like, states

NEED_CUDA = "CUDA graphs need a CUDA device"


def _entries(inputs, params, initial_state) -> list[tuple[str, object]]:
    """[(place, value)] in a fixed order: inputs, params, the initial state(s)."""
    if not isinstance(inputs, Mapping):
        raise SsmcraftError(f"graphed: inputs must be a mapping of name -> tensor, got {type(inputs).__name__}")
    out = [(f"inputs[{n!r}]", t) for n, t in inputs.items()]
    out += [(f"params[{n!r}]", t) for n, t in (params or {}).items()]
    if isinstance(initial_state, (tuple, list)):
        out += [(f"initial_state[{i}]", t) for i, t in enumerate(initial_state)]
    elif initial_state is not None:
        out.append(("initial_state", initial_state))
    return out


def require_cuda(entries, what: str = "graphed") -> None:
    """Every value a CUDA tensor, and CUDA available; else a ``SsmcraftError`` saying which is not."""
    if not torch.cuda.is_available():
        raise SsmcraftError(f"{what}: {NEED_CUDA}; torch.cuda.is_available() is false on this machine")
    for place, t in entries:
        if not isinstance(t, torch.Tensor):
            raise SsmcraftError(f"{what}: {place} is a {type(t).__name__}; {NEED_CUDA} and tensors "
                                f"(numbers would be copied from the host inside the graph)")
        if t.device.type != "cuda":
            raise SsmcraftError(f"{what}: {place} is on {t.device}; {NEED_CUDA}")


def require_warmup(warmup, what: str) -> None:
    """Refuse a ``warmup`` (eager iterations before the capture) that is not a positive int with an
    ``SsmcraftError``: the warm-up is where kernels are chosen, compiled and autotuned, which must
    not happen in the capture."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise SsmcraftError(f"{what}: warmup must be an integer >= 1 (eager iterations before the capture, "
                            f"where kernels are compiled and tuned), got {warmup!r}")


def call_signature(entries, output_final_state: bool) -> tuple:
    """What a graphed call is fixed to: ``((place, shape, dtype, device, requires_grad), ...,
    ("output_final_state", bool))``, from the call's ``_entries`` and ``output_final_state``.
    Cheap: reads no tensor data."""
    rows = [(place, *_row(t)) for place, t in entries]
    return (*rows, ("output_final_state", bool(output_final_state)))


def _row(t) -> tuple:
    """One value's part of a call signature: ``(shape, dtype, device, requires_grad)``; a non-tensor's
    ``(type name, None, None, False)``."""
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype, t.device, bool(t.requires_grad)
    return type(t).__name__, None, None, False


def signature_difference(expected: tuple, got: tuple) -> str | None:
    """A sentence on how ``got`` differs from ``expected`` (``call_signature`` values), or None."""
    if expected == got:
        return None
    places = [r[0] for r in expected]
    got_places = [r[0] for r in got]
    if places != got_places:
        missing = [p for p in places if p not in got_places]
        extra = [p for p in got_places if p not in places]
        if missing or extra:
            return (f"the tensors differ: captured with {', '.join(places[:-1])}"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; not captured {', '.join(extra)}" if extra else ""))
        return (f"the tensors come in another order: captured {', '.join(places[:-1])}, "
                f"called with {', '.join(got_places[:-1])}")
    parts = []
    for e, g in zip(expected, got):
        if e[0] == "output_final_state":
            if e[1] != g[1]:
                parts.append(f"output_final_state is {g[1]} (captured {e[1]})")
            continue
        for i, what in ((1, "shape"), (2, "dtype"), (3, "device"), (4, "requires_grad")):
            if e[i] != g[i]:
                parts.append(f"{e[0]}: {what} {_show(g[i])} (captured {_show(e[i])})")
    return "; ".join(parts)


def _show(v) -> str:
    return f"[{', '.join(str(x) for x in v)}]" if isinstance(v, tuple) else str(v)


class GraphedCall:
    """``obj(inputs, params, initial_state, output_final_state)`` replayed from CUDA graphs, for one
    call signature (see the module docstring). Made by ``CompiledObjective.graphed``.

    Shapes as ``obj()``: inputs ``[B, T, H, n]`` (``[B, T, H]`` for a scalar input), params of their
    declared shape or ``[H, *shape]``, ``initial_state`` ``[B, H, d, m]`` (a tuple of them with several
    states). Returns ``(y [B, T, H, d], S_T [B, H, d, m] or None)``, differentiable as ``obj()``'s in
    every tensor that requires grad (the backward replays the second graph).

    The returned tensors (and the gradients the backward hands to autograd) live in the graphs'
    static buffers: the next call overwrites them. Clone what you keep across calls.

    Each call copies its tensors into the graph's static inputs (one copy kernel per tensor);
    ``static_inputs()`` gives those buffers, and a call with them copies nothing: write a new
    call's values into them in place (under ``torch.no_grad()``) and call ``g(*g.static_inputs())``.
    """

    def __init__(self, obj, inputs, params=None, initial_state=None, output_final_state: bool = False,
                 warmup: int = 3):
        require_warmup(warmup, f"{obj.name}: graphed")
        entries = _entries(inputs, params, initial_state)
        require_cuda(entries, f"{obj.name}: graphed")
        self.obj = obj
        self.signature = call_signature(entries, output_final_state)
        self._rows = [r[1:] for r in self.signature[:-1]]   # what a call is compared with (no place names)
        self.output_final_state = bool(output_final_state)
        self._input_names = list(inputs)
        self._param_names = list(params or {})
        self._tuple_state = isinstance(initial_state, (tuple, list))
        self.several_states = bool(obj.ir.states)
        # static inputs: copies, so that a later call's copy-in never writes the caller's tensors
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for _, t in entries)
        self._static = sample
        self._graphed = torch.cuda.make_graphed_callables(self._run, sample, num_warmup_iters=warmup,
                                                          allow_unused_input=True)

    def _unflatten(self, flat):
        ni, np_ = len(self._input_names), len(self._param_names)
        inputs = dict(zip(self._input_names, flat[:ni]))
        params = dict(zip(self._param_names, flat[ni:ni + np_])) or None
        return inputs, params, like(() if self._tuple_state else None, flat[ni + np_:])

    def static_inputs(self) -> tuple:
        """``(inputs, params, initial_state)`` made of the graph's static input buffers (same names and
        shapes as the captured call; ``params`` None when the call had none)."""
        return self._unflatten(self._static)

    def _run(self, *flat):
        """The captured function: flat tensors -> flat outputs ``(y, *S_T)``."""
        y, S = self.obj(*self._unflatten(flat), self.output_final_state)
        return (y, *states(S))

    def _flat_if_captured(self, inputs, params, initial_state, ofs) -> tuple | None:
        """The call's values in the captured order when its signature is the captured one, else None.
        The per-call check of the replay path: names and rows compared, no place names built."""
        tuple_state = isinstance(initial_state, (tuple, list))
        if (not isinstance(inputs, Mapping) or bool(ofs) != self.output_final_state
                or tuple_state != self._tuple_state or list(inputs) != self._input_names
                or list(params or {}) != self._param_names):
            return None
        flat = (*inputs.values(), *(params or {}).values(), *states(initial_state))
        return flat if [_row(t) for t in flat] == self._rows else None

    def _checked_flat(self, inputs, params, initial_state, ofs) -> tuple:
        """The full check (``call_signature``) where the quick one failed: the call's values when the
        signature is the captured one after all (an empty state tuple for None, say), else
        ``SsmcraftError`` naming how it differs."""
        entries = _entries(inputs, params, initial_state)
        got = call_signature(entries, ofs)
        if got == self.signature:
            return tuple(t for _, t in entries)
        # a number or a host tensor where a CUDA tensor was captured: require_cuda's message by place
        expected = set(self.signature)
        require_cuda([e for e, row in zip(entries, got) if row not in expected], f"{self.obj.name}: graphed")
        raise SsmcraftError(f"{self.obj.name}: graphed call with another signature than the one captured "
                            f"({signature_difference(self.signature, got)}); make another with "
                            f"obj.graphed(...) for these tensors")

    def __call__(self, inputs, params=None, initial_state=None, output_final_state: bool | None = None):
        ofs = self.output_final_state if output_final_state is None else output_final_state
        flat = self._flat_if_captured(inputs, params, initial_state, ofs)
        if flat is None:
            flat = self._checked_flat(inputs, params, initial_state, ofs)
        out = self._graphed(*flat)
        y, finals = out[0], tuple(out[1:])
        if not self.output_final_state:
            return y, None
        return y, (finals if self.several_states else finals[0])
