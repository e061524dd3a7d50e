"""``train.cuda_graphs``: the training step's model forward, loss and backward replayed from CUDA graphs.

Why: every kernel launch costs host time, and one training step of the byte LM launches hundreds
of kernels; the GPU waits on the host (BENCHMARKS.md, "Training throughput"). Our
recurrences are graph breaks for ``torch.compile`` (``train.compile``), so its
``reduce-overhead`` mode cannot capture them; ``torch.cuda.make_graphed_callables`` captures the
Triton kernels and autograd Functions as they are.

What is captured (``GraphedLoss``): ``batch_loss(model(inputs), targets)`` under the run's
autocast (with the autocast cache off, as graphs require) and its backward, for the run's one
(micro-)batch shape ``[batch_size / (processes * grad_accum), seq_len]``, in static buffers (each
step copies its batch in). What
stays eager: the optimizer (fused AdamW with the divergence flag as ``found_inf``), gradient
clipping, the loss read-back, evaluation (the eager ``model``, which shares the parameters), and
any batch of another shape (counted as ``eager_steps``). The warm-up iterations before capture
(kernel choice, compilation, autotuning) compute gradients with ``torch.autograd.grad`` and touch
neither ``.grad`` nor the weights. A step's gradients are the graph's static buffers: AdamW and the
clipping consume them before the next replay; with ``train.grad_accum`` or several processes
``parallel.Reducer`` adds each replay's gradients into its own buffer before the next one.

Settings (``graphs_decision``; the decision and its reason go to the run's ``metrics.json`` under
``cuda_graphs`` and to the log, like ``train.compile``'s):
  ``auto``  (the default) on for CUDA unless ``train.compile`` is true (the two do not combine: the
            compiled LM is not captured; ``train.compile: auto`` resolves off when this is not
            false) or ``train.activation_checkpointing`` is true; off on CPU (recorded as not
            applicable). Several processes (``ssmcraft.train.parallel``) keep it: the gradients are
            all-reduced after the replay;
  ``true``  on; refused on CPU, with ``train.compile: true`` and with
            ``train.activation_checkpointing: true`` (``SpecError``; the config check
            ``config._check_train`` refuses those pairs before anything is built);
  ``false`` off.
A capture that fails raises under ``true``; under ``auto`` it is logged as a warning, recorded
(``fallback``) and the run goes on eager.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ssmcraft.errors import SpecError, SsmcraftError, one_line
from ssmcraft.runtime.graphs import require_cuda, require_warmup
from ssmcraft.train.compiled import record_fallback
from ssmcraft.train.config import GRAPHS_WITH_COMPILE, GRAPHS_WITH_RECOMPUTE
from ssmcraft.train.device import autocast
from ssmcraft.train.validate import step_loss

log = logging.getLogger(__name__)


def graphs_decision(setting: Any, device: torch.device, compile_enabled: bool,
                    source: str = "<experiment>", recompute: bool = False, documents: bool = False) -> tuple[bool, str]:
    """(capture the step?, why) for ``train.cuda_graphs`` = ``setting`` on ``device``, with
    ``train.compile`` resolved to ``compile_enabled`` and ``train.activation_checkpointing`` =
    ``recompute`` (``ssmcraft.train.recompute``); ``documents``: batches of packed documents, whose
    boundaries change every batch (a graph replays fixed ones). Refusals raise ``SpecError``."""
    if setting is False:
        return False, "train.cuda_graphs is false"
    if documents:
        if setting is True:
            raise SpecError(source, "train.cuda_graphs", "true cannot capture packed documents (task.pack: their "
                            "boundaries change every batch); set task.pack: false or train.cuda_graphs: auto")
        return False, "train.cuda_graphs auto: off for packed documents (task.pack: boundaries change every batch)"
    if recompute:
        if setting is True:
            raise SpecError(source, "train.cuda_graphs", GRAPHS_WITH_RECOMPUTE)   # config refuses it first
        return False, "train.cuda_graphs auto: off while train.activation_checkpointing is true"
    if device.type != "cuda":
        if setting is True:
            raise SpecError(source, "train.cuda_graphs", f"true needs a CUDA device; this run is on {device.type} "
                            "(use auto or false)")
        return False, f"train.cuda_graphs auto: not applicable on {device.type} (CUDA graphs need a CUDA device)"
    if compile_enabled:
        if setting is True:
            raise SpecError(source, "train.cuda_graphs", GRAPHS_WITH_COMPILE)   # config refuses it first
        return False, "train.cuda_graphs auto: off while train.compile is on (set train.compile: false to capture)"
    if setting is True:
        return True, "train.cuda_graphs is true"
    return True, "train.cuda_graphs auto: on for CUDA"


class _LossModule(torch.nn.Module):
    """``batch_loss(model(inputs), targets)`` under autocast without its cache (the captured function)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str):
        super().__init__()
        self.model = model
        self._device, self.precision = device, precision

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return step_loss(self.model, inputs, targets,
                         lambda: autocast(self._device, self.precision, cache_enabled=False))


class GraphedLoss:
    """``loss_fn(inputs [B, T], targets [B, T]) -> loss`` (0-dim fp32, differentiable in the model's
    parameters) replayed from CUDA graphs for one batch shape; ``fits`` says whether a batch has it.
    The loss is a static buffer: clone it to keep it past the next call."""

    def __init__(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 device: torch.device, precision: str, warmup: int = 3):
        require_warmup(warmup, "train.cuda_graphs")
        require_cuda([("the model", next(model.parameters())), ("the batch", inputs)], "train.cuda_graphs")
        self.shapes = (tuple(inputs.shape), tuple(targets.shape))
        sample = (inputs.detach().clone(), targets.detach().clone())
        self._fn = torch.cuda.make_graphed_callables(_LossModule(model, device, precision), sample,
                                                     num_warmup_iters=warmup, allow_unused_input=True)

    def fits(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        return (tuple(inputs.shape), tuple(targets.shape)) == self.shapes

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._fn(inputs, targets)


def capture_loss(model, inputs, targets, device, precision, info: dict) -> GraphedLoss | None:
    """The graphed loss for the run's batch shape, or None when the capture failed under ``auto``
    (recorded in ``info`` and logged); under ``true`` a failure raises ``SsmcraftError``."""
    try:
        graphed = GraphedLoss(model, inputs, targets, device, precision)
    except Exception as e:  # noqa: BLE001: only the capture runs here; recorded, or raised under true
        if info["setting"] is True:
            raise SsmcraftError(f"train.cuda_graphs: capturing the training step failed: "
                                f"{one_line(e)}") from e
        record_fallback(info, "capture failed", "CUDA graph capture of the training step failed", e)
        return None
    log.info("CUDA graphs: training step captured for batches %s", list(graphed.shapes[0]))
    return graphed
