"""``train.compile``: torch.compile of the LM's non-recurrent work, the recurrence left opaque.

What is compiled: the whole LM forward (embedding, norms, projections, short conv, gates,
MLPs, the head; the backward through AOT autograd), with each objective mixer's
recurrence call (``ObjectiveMixer._recur``: the Triton kernels' autograd Functions, or the
PyTorch scan on CPU) wrapped in ``torch.compiler.disable``, so Dynamo breaks the graph
there and the kernels run exactly as they do eagerly. Compiling Triton autograd Functions
inside a Dynamo graph is what this avoids: it is fragile across torch versions.

Settings: ``auto`` compiles on CUDA only with ``train.cuda_graphs: false`` (the captured step is
the CUDA default, ``ssmcraft.train.graphed``) and not on CPU
(where the recurrence dominates and the C++ compile costs more than it saves in a short
trial); ``true`` compiles on any device; ``false`` never. A compile failure is never
silent: the run logs a warning, goes on eager, and records the reason under ``compile`` in
its metrics (``run_compiled_step``). Only errors of
torch.compile's machinery count as compile failures (``is_compile_error``: an exception type of
Dynamo, AOT autograd or Inductor, or one in its cause chain); any other error at the first
step (the model's own, ours, out of memory) is raised as it is.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ssmcraft.errors import one_line

log = logging.getLogger(__name__)


def compile_decision(setting: Any, device: torch.device, cuda_graphs: Any) -> tuple[bool, str]:
    """(compile?, why) for ``train.compile`` = ``setting`` on ``device``. ``auto`` is on only for CUDA
    with ``train.cuda_graphs`` (``cuda_graphs``) false: the recurrences are graph breaks for
    torch.compile, which is slower than the step captured in CUDA graphs (``ssmcraft.train.graphed``;
    BENCHMARKS.md, "Training throughput")."""
    if setting is False:
        return False, "train.compile is false"
    if setting is True:
        return True, "train.compile is true"
    if device.type != "cuda":
        return False, f"train.compile auto: off on {device.type}"
    if cuda_graphs is not False:
        return False, (f"train.compile auto: off because train.cuda_graphs is {cuda_graphs} on CUDA (the captured "
                       "step is faster: BENCHMARKS.md, \"CUDA graphs\")")
    return True, "train.compile auto: on for CUDA with train.cuda_graphs false"


def compile_model(model: torch.nn.Module, setting: Any, device: torch.device,
                  cuda_graphs: Any) -> tuple[torch.nn.Module, dict]:
    """(the module to train with, the compile record ``{setting, enabled, reason}``).

    The returned module shares ``model``'s parameters. Evaluation keeps using ``model``
    (eager: its batch and length differ, which would recompile).
    """
    enabled, reason = compile_decision(setting, device, cuda_graphs)
    info = {"setting": setting, "enabled": enabled, "reason": reason}
    if not enabled:
        return model, info
    # per instance, only when compiling: a torch.compiler.disable on the class method would import
    # torch._dynamo (and sympy) with the mixer everywhere, the exported standalone module included
    # (it must import with torch alone: tests/test_export_bundle.py's interpreter case fails then)
    opaque = 0
    for module in model.modules():
        recur = getattr(module, "_recur", None)
        if recur is not None:
            module._recur = torch.compiler.disable(recur)
            opaque += 1
    info["opaque_recurrences"] = opaque
    log.info("torch.compile: %s; %d recurrence call(s) left to the kernels (graph breaks)", reason, opaque)
    return torch.compile(model), info


_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch")


def is_compile_error(e: BaseException) -> bool:
    """Whether ``e`` (or an exception in its ``__cause__`` / ``__context__`` chain) is an error type of
    torch.compile's machinery: Dynamo (``BackendCompilerFailed``, ``Unsupported``, ...), AOT autograd
    or Inductor (``InductorError``, ``InvalidCxxCompiler``, ...)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.startswith(_COMPILER_MODULES):
            return True
        e = e.__cause__ or e.__context__
    return False


def run_compiled_step(step: Callable[[torch.nn.Module], Any], compiled: torch.nn.Module,
                      eager: torch.nn.Module, info: dict) -> tuple[Any, torch.nn.Module]:
    """Run ``step(module)`` with the compiled module; if compiling fails, say so loudly,
    record it in ``info`` (``enabled`` false, ``fallback``), and run it eager instead.
    Returns (the step's result, the module to use from now on). Call it for the first
    step only (that is when Dynamo and Inductor compile); later errors are real errors, and so
    are errors at the first step that do not come from the compiler (``is_compile_error``)."""
    try:
        return step(compiled), compiled
    except Exception as e:  # noqa: BLE001: a compile error is recorded and logged, not hidden; others raise
        if not is_compile_error(e):
            raise
        record_fallback(info, "torch.compile failed", "torch.compile failed at the first step", e)
        return step(eager), eager


def record_fallback(info: dict, what: str, logged: str, e: BaseException) -> None:
    """A path that failed and fell back to eager training: ``info`` (a run record's ``compile`` or
    ``cuda_graphs``) gets ``enabled: false`` and ``fallback``, and the log a warning."""
    reason = one_line(e)
    info.update(enabled=False, fallback=f"{what}: {reason}; ran eager")
    log.warning("%s (%s): training eager instead", logged, reason)
