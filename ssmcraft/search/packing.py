"""Automatic packing of trials onto GPUs: ``resources.gpus_per_trial: auto``.

Small trials leave a GPU mostly idle with one trial per GPU (BENCHMARKS.md), so ``auto`` runs
several per GPU, as many as fit in its memory:

1. *Probe*: before the first trial, the Ray executor runs the first trial's config for
   ``PROBE_STEPS`` training steps and one validation batch on one whole GPU
   (``probe_memory``; ``train.compile`` off, whose memory is at least that of the compiled
   model) and reads the peak of PyTorch's allocator (``max_memory_reserved``).
2. *Plan* (``plan``, a pure function): one trial needs ``peak * SAFETY + CONTEXT_BYTES``
   (the CUDA context, cuBLAS and Triton workspaces of its own process are outside the
   allocator's count); ``k = floor(usable / need)`` trials share a GPU, ``usable`` the
   GPU's memory less ``RESERVE_FRACTION``; ``k`` is capped by
   ``resources.max_trials_per_gpu`` and by the CPUs (``cpus_per_trial`` each), and is
   at least 1. Ray is asked for ``num_gpus = 1/k`` per trial (rounded down to Ray's
   precision, so k of them fit).
3. *Adapt*: every finished trial reports its own peak GPU memory; when one needed more
   than its share, the plan is made again from the largest peak seen (k only goes down),
   for the trials submitted after that. Trials of the space differ (state size, objective
   structure): the probe measures the first, the rest correct it.

On a cluster every GPU is assumed to be like the probed one (the same k on each).
Trials sharing a GPU are time-sliced by the driver (no MPS): the packing fills the idle
gaps of each trial (Python, data, host work) with the others' kernels.

Every decision (probe result, plan, its reason, each update) is logged and written to
``packing.json`` in the run folder. A probe that fails packs nothing: one trial per GPU,
with the reason in the log and the file. On a machine without GPUs ``auto`` means CPU
trials, and the in-process executor never packs (one trial at a time).
"""
from __future__ import annotations

import copy
import math
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ssmcraft.errors import one_line
from ssmcraft.search.fidelity import tokens_per_step

CONTEXT_BYTES = 768 * 2**20      # per trial process: CUDA context + library workspaces (outside the allocator)
SAFETY = 1.25                    # on the measured peak: fragmentation, and other trials of the space
RESERVE_FRACTION = 0.05          # of the GPU's memory, never planned for
PROBE_STEPS = 3
RAY_PRECISION = 1e-4             # Ray rounds fractional resources to 4 decimals
PACKING_FILE = "packing.json"


@dataclass(frozen=True)
class Packing:
    """How trials share a GPU, and why."""
    trials_per_gpu: int
    gpu_fraction: float              # Ray num_gpus of one trial
    peak_bytes: int | None           # per-trial peak the plan is made from (None: not measured)
    gpu_bytes: int | None            # memory of one GPU
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_fraction(k: int) -> float:
    """Ray ``num_gpus`` for ``k`` trials per GPU: 1/k rounded down to Ray's precision."""
    steps = round(1 / RAY_PRECISION)
    return 1.0 if k <= 1 else math.floor(steps / k) / steps


def plan(peak_bytes: int, gpu_bytes: int, *, max_per_gpu: int, cpu_slots_per_gpu: int) -> Packing:
    """The packing for trials of measured peak ``peak_bytes`` on GPUs of ``gpu_bytes``; see
    the module doc. ``cpu_slots_per_gpu``: trials the CPUs allow per GPU."""
    need = peak_bytes * SAFETY + CONTEXT_BYTES
    usable = gpu_bytes * (1.0 - RESERVE_FRACTION)
    by_memory = int(usable // need)
    caps = {"memory": by_memory, "resources.max_trials_per_gpu": max_per_gpu, "CPUs": cpu_slots_per_gpu}
    bound = min(caps, key=lambda name: caps[name])
    k = max(1, caps[bound])
    gib = 2.0 ** 30
    reason = (f"{k} trial(s) per GPU, bound by {bound}: a trial needs {need / gib:.2f} GiB (peak "
              f"{peak_bytes / gib:.2f} GiB x {SAFETY:g} + {CONTEXT_BYTES / gib:.2f} GiB context), "
              f"{usable / gib:.1f} GiB usable of {gpu_bytes / gib:.1f} GiB -> {by_memory} by memory; "
              f"max_trials_per_gpu {max_per_gpu}; {cpu_slots_per_gpu} by CPUs")
    if by_memory < 1:
        reason += "; one trial may not fit: it runs alone on its GPU"
    return Packing(k, gpu_fraction(k), int(peak_bytes), int(gpu_bytes), reason)


def unpacked(reason: str) -> Packing:
    """One trial per GPU (no measurement, or it failed)."""
    return Packing(1, 1.0, None, None, reason)


def adapt(current: Packing, peak_bytes: int, *, max_per_gpu: int, cpu_slots_per_gpu: int) -> Packing | None:
    """A new packing when a trial's measured ``peak_bytes`` exceeds what ``current``
    planned for; None when it fits (or nothing was measured to plan from)."""
    if current.gpu_bytes is None or current.peak_bytes is None or peak_bytes <= current.peak_bytes:
        return None
    new = plan(peak_bytes, current.gpu_bytes, max_per_gpu=max_per_gpu, cpu_slots_per_gpu=cpu_slots_per_gpu)
    if new.trials_per_gpu >= current.trials_per_gpu:   # fits in the current share: keep the plan
        return None
    return replace(new, reason=f"a trial peaked at {peak_bytes / 2**30:.2f} GiB: {new.reason}")


def trial_peak_bytes(metrics: dict | None) -> int | None:
    """The peak GPU memory a finished trial reports (None for CPU trials or none reported)."""
    if not metrics or metrics.get("peak_memory_kind") != "cuda_max_allocated":
        return None
    values = [metrics.get(k) for k in ("peak_memory_bytes", "peak_memory_reserved_bytes")]
    values = [int(v) for v in values if isinstance(v, (int, float))]
    return max(values) if values else None


def probe_config(config: dict) -> dict:
    """``config`` cut to a memory probe: ``PROBE_STEPS`` steps, one validation batch, no
    compile, no checkpoint, no time limit."""
    cfg = copy.deepcopy(config)
    train = cfg.setdefault("train", {})
    train.update(tokens=PROBE_STEPS * tokens_per_step(cfg), eval_every=0,
                 eval_batches=1, compile=False, save_model=False, max_seconds=None)
    return cfg


def probe_memory(config: dict) -> dict[str, Any]:
    """Run ``probe_config(config)`` on this process's GPU: ``{peak_bytes, gpu_bytes,
    device_name, status}`` (runs as a Ray task given one whole GPU)."""
    import torch

    from ssmcraft.train import train_run

    with tempfile.TemporaryDirectory(prefix="ssmcraft_probe_") as tmp:
        metrics = train_run(probe_config(config), Path(tmp))
    props = torch.cuda.get_device_properties(0)
    return {"peak_bytes": trial_peak_bytes(metrics), "gpu_bytes": int(props.total_memory),
            "device_name": props.name, "status": metrics.get("status")}


def trial_slots(cpus: float, cpus_per_trial: float, gpu_slots: int | None = None,
                max_concurrent: int | None = None) -> int:
    """Trials at once: as many as the CPUs hold (``cpus // cpus_per_trial``), at most
    ``gpu_slots`` (what the GPUs hold; None for CPU trials) and ``max_concurrent``. May be 0:
    the caller says what cannot hold one trial."""
    slots = math.floor(cpus / cpus_per_trial)
    if gpu_slots is not None:
        slots = min(slots, gpu_slots)
    if max_concurrent is not None:
        slots = min(slots, max_concurrent)
    return slots


class AutoPacker:
    """The state of ``gpus_per_trial: auto`` for one search on ``gpus`` GPUs and ``cpus``
    CPUs: probes at the first trial (``first``), adapts to finished trials (``observe``),
    says how many trials may run (``slots``) and records every decision in ``packing.json``
    of the run folder."""

    def __init__(self, resources, cpus: float, gpus: float, log=print) -> None:
        self.resources, self.cpus, self.gpus, self.log = resources, cpus, int(gpus), log
        self.cpu_slots = max(1, trial_slots(cpus, resources.cpus_per_trial))
        self.cpu_slots_per_gpu = max(1, self.cpu_slots // max(1, self.gpus))
        self.packing: Packing | None = None
        self.decisions: list[dict] = []
        self.run_dir: Path | None = None

    def slots(self) -> int:
        """Trials at once: ``trials_per_gpu`` on every GPU (1 before the probe), within the
        CPUs and ``max_concurrent``."""
        k = self.packing.trials_per_gpu if self.packing is not None else 1
        return max(1, trial_slots(self.cpus, self.resources.cpus_per_trial, max(1, self.gpus) * k,
                                  self.resources.max_concurrent))

    def first(self, config: dict, run_dir: Path, probe) -> Packing:
        """The packing, probing ``config`` with ``probe(config) -> probe_memory's dict`` the
        first time (a probe that raises or measures nothing gives one trial per GPU)."""
        if self.packing is not None:
            return self.packing
        self.run_dir = Path(run_dir)
        self.log(f"packing: gpus_per_trial auto: probing the first trial's GPU memory ({PROBE_STEPS} steps)")
        try:
            found = probe(config)
        except Exception as e:  # noqa: BLE001: the reason is logged and recorded; the search goes on unpacked
            packing, found = unpacked(f"memory probe failed ({one_line(e)}): one trial per GPU"), None
        else:
            if not found.get("peak_bytes") or not found.get("gpu_bytes"):
                packing = unpacked(f"memory probe measured nothing ({found}): one trial per GPU")
            else:
                packing = plan(found["peak_bytes"], found["gpu_bytes"], max_per_gpu=self.resources.max_trials_per_gpu,
                               cpu_slots_per_gpu=self.cpu_slots_per_gpu)
        self._decide("probe", packing, probe=found)
        return packing

    def observe(self, metrics: dict | None) -> bool:
        """Take a finished trial's peak memory into account; True when the packing changed."""
        peak = trial_peak_bytes(metrics)
        if self.packing is None or peak is None:
            return False
        new = adapt(self.packing, peak, max_per_gpu=self.resources.max_trials_per_gpu,
                    cpu_slots_per_gpu=self.cpu_slots_per_gpu)
        if new is None:
            return False
        self._decide("adapt", new)
        return True

    def _decide(self, kind: str, packing: Packing, **extra) -> None:
        from ssmcraft.search.rundir import write_json

        self.packing = packing
        self.decisions.append({"kind": kind, **packing.to_dict(), "slots": self.slots(), **extra})
        self.log(f"packing ({kind}): {packing.reason}; Ray num_gpus {packing.gpu_fraction:g} per trial, "
                 f"{self.slots()} trial(s) at a time")
        if self.run_dir is not None:
            write_json(self.run_dir / PACKING_FILE, {"gpus": self.gpus, "cpu_slots": self.cpu_slots,
                                                     "current": packing.to_dict(), "decisions": self.decisions})
