"""Data-parallel training of one model over processes, and gradient accumulation.

``torchrun --nproc_per_node N -m ssmcraft train SPEC`` starts N processes; each trains a replica of
the model on its rows of every batch and the gradients are summed over processes before the
optimizer step, so every replica takes the same step:

- The process group comes from torchrun's environment (``WORLD_SIZE`` > 1; ``start``), or is one a
  caller initialised already. NCCL for CUDA (each process takes ``cuda:LOCAL_RANK``), gloo on CPU.
- The global batch is the spec's ``train.batch_size``: every process draws the whole batch from
  the run's data generator (the same seed everywhere: drawing is index arithmetic, cheap beside the
  step) and keeps its own ``batch_size / N`` rows, a disjoint part. So the data stream, and the
  optimisation, are those of one process with the same spec, up to float rounding.
- ``train.grad_accum`` = A splits a process's rows into A micro-batches, one forward and backward
  each. Each micro-batch's mean loss is weighted by its share of the global batch's scored tokens,
  so the sum over micro-batches and processes is the global batch's mean loss (and gradient).
- The sum (``Reducer``): after the last micro-batch every gradient and the step's loss are added
  into one flat buffer and all-reduced in one collective. Not ``DistributedDataParallel``: its
  bucketed all-reduce runs from autograd hooks during the backward, which the CUDA-graph training
  step (``train.cuda_graphs``) would have to capture; here the captured step stays the one-GPU
  step and the all-reduce follows its replay, for the eager, graphed and compiled step alike.
  Its cost is one unoverlapped all-reduce of the gradients per step (20M fp32 parameters: 80 MB).
- One writer: rank 0 writes the run folder; every rank runs the same steps and the same
  validation (identical weights), and decisions that depend on a clock or a callback (the time
  limit, the search's pruning) are rank 0's or agreed (``any``, ``writers``), so no process
  waits for a collective another has left.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ssmcraft.errors import SpecError
from ssmcraft.tasks.base import IGNORE
from ssmcraft.train.device import pick_device


@dataclass
class Processes:
    """This process's place in the run: ``rank`` of ``world``; ``owned``: ``start`` created the group."""
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))   # where collectives' tensors live
    owned: bool = False

    @property
    def writer(self) -> bool:
        """Whether this process writes the run folder (rank 0 only)."""
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any (one collective)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def writers(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every process."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def same_start(self, module: torch.nn.Module) -> None:
        """Every process starts from rank 0's parameters and buffers (the seeds make them equal already;
        this makes it so whatever an initialiser did)."""
        if self.world > 1:
            for t in module.state_dict().values():
                dist.broadcast(t, 0)

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()


def start(setting: str, source: str = "<experiment>") -> Processes:
    """The run's processes and device for ``train.device`` = ``setting``: one process unless torchrun's
    environment says ``WORLD_SIZE`` > 1 (then the process group is initialised here) or a group exists."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(setting)
    if world <= 1:
        return Processes(device=device)
    if device.type == "cuda":
        if setting.startswith("cuda:"):
            raise SpecError(source, "train.device", f"{setting} names one GPU, but this run has {world} processes, "
                            "each on cuda:LOCAL_RANK (use auto or cuda)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise SpecError(source, "train.device", f"{device.type} does not train over several processes "
                        "(use cuda, or cpu with gloo)")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Processes(rank=dist.get_rank(), world=dist.get_world_size(), device=device, owned=owned)


def check_split(batch_size: int, world: int, accum: int, source: str) -> None:
    """The global batch must split evenly over processes and micro-batches (``SpecError`` naming the key)."""
    if batch_size % (world * accum):
        raise SpecError(source, "train.batch_size", f"{batch_size} does not split into {world} process(es) x "
                        f"{accum} micro-batch(es) (train.grad_accum) of equal size")


class Reducer:
    """Splits each global batch into this process's micro-batches and sums their gradients and weighted
    losses over micro-batches and processes (module docstring). Used when there is more than one
    process or micro-batch; one process with one micro-batch takes the plain step."""

    def __init__(self, params: list[torch.nn.Parameter], procs: Processes, accum: int, device: torch.device):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"the parameters have several dtypes {sorted(map(str, dtypes))}; one flat buffer "
                             "needs one")
        self.params, self.procs, self.accum, self.device = params, procs, accum, device
        sizes = [p.numel() for p in params]
        self.flat = torch.zeros(sum(sizes) + 1, dtype=dtypes.pop(), device=device)   # the last: the step's loss
        self.views = [v.view_as(p) for v, p in zip(self.flat[:-1].split(sizes), params)]
        self.used = [False] * len(params)
        self.weights: list[torch.Tensor] = []

    def split(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, targets) ``[B, T]`` of the global batch -> this process's micro-batches
        ``[B / (world * accum), T]`` on the device; their loss weights go to ``self.weights``."""
        rows = inputs.shape[0] // self.procs.world
        mine = slice(self.procs.rank * rows, (self.procs.rank + 1) * rows)
        xs = [x.to(self.device, non_blocking=True) for x in inputs[mine].chunk(self.accum)]
        ys = [y.to(self.device, non_blocking=True) for y in targets[mine].chunk(self.accum)]
        total = (targets != IGNORE).sum().to(self.device)
        self.weights = [(y != IGNORE).sum() / total for y in ys]
        return xs, ys

    def add(self, index: int, loss: torch.Tensor) -> None:
        """Take micro-batch ``index``'s gradients (then cleared) and weighted loss (0-dim, detached)."""
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        views, grads = [self.views[i] for i in have], [self.params[i].grad for i in have]
        if index == 0:
            self.flat.zero_()
        if grads:
            torch._foreach_add_(views, grads)
        self.flat[-1:].add_(loss.reshape(1).to(self.flat.dtype))
        for i in have:
            self.used[i] = True
            self.params[i].grad = None

    def finish(self) -> torch.Tensor:
        """Sum over processes (one all-reduce); each parameter's ``.grad`` becomes its slice of the sum
        (None for one no micro-batch reached); returns the global batch's loss (0-dim)."""
        if self.procs.world > 1:
            dist.all_reduce(self.flat)
        for p, v, used in zip(self.params, self.views, self.used):
            p.grad = v if used else None
        return self.flat[-1].clone()
