"""Device and precision choice for a run (which one ran is recorded in its metrics)."""
from __future__ import annotations

import contextlib
import logging

import torch

from ssmcraft.errors import SsmcraftError

log = logging.getLogger(__name__)


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU; an explicit CUDA device must exist."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise SsmcraftError(f"device {name!r}: {' '.join(str(e).split())[:200]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SsmcraftError(f"device {name!r} asked for, but CUDA is not available on this machine")
    return device


def pick_precision(precision: str, device: torch.device) -> str:
    """``auto``: bf16 autocast on CUDA, fp32 elsewhere; bf16 is refused off CUDA."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16" and device.type != "cuda":
        raise SsmcraftError("precision bf16 (autocast) is only supported on CUDA here; use fp32 on CPU")
    return precision


def autocast(device: torch.device, precision: str, cache_enabled: bool = True):
    """The autocast context of ``precision`` (a no-op for fp32). ``cache_enabled=False`` for a region
    captured in a CUDA graph (autocast's weight-cast cache must not outlive the capture)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
    return contextlib.nullcontext()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_reserved(device: torch.device) -> int | None:
    """Peak bytes PyTorch's CUDA allocator held (allocated plus cached); None off CUDA."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): CUDA's max allocated on GPU; the process's peak RSS on CPU (whole process)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_max_rss"
