"""Autotuning shared by the chunked Triton families: interpreter-aware ``tune``, the config rule
``warp_rule``, the block-size helpers ``pow2`` / ``dot_precision`` and the kernels' I/O dtype rule ``io_dtype``,
and the host-side integer helpers ``cdiv`` / ``next_pow2``."""
from __future__ import annotations

import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def tune(configs, key, prune=None):
    """Autotune on a GPU; under the interpreter (multi-config autotune fails there) the launcher
    passes a config chosen by rule. ``prune(configs, nargs, **kwargs)`` drops configs by rule
    before any is compiled or timed: the autotuner runs every config it keeps, so a config that
    faults kills the process even when it would not have won. Kernels tuned here must not read
    what they write (the autotuner launches them many times on the same buffers)."""
    if INTERPRET:
        return lambda fn: fn
    return triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune} if prune else None)


def warp_rule(configs, nargs=None, **kw):
    """``early_config_prune``: the configs the autotuner may compile and time at these constexprs.

    With 8 warps (two warpgroups splitting the N dimension of each tensor-core product), Triton 3.6
    on Hopper (sm_90) miscompiles products whose N is a key block of 16 (compute-sanitizer: "Invalid
    __shared__ read of size 1024 bytes", then an illegal memory access; BENCHMARKS.md, "Key-decay
    chunked"), so 8 warps are kept only where the key block ``BK`` (a config's or the launch's) is
    >= 64. Key-block configs larger than the padded K repeat it and are dropped."""
    bk = kw.get("BK")
    kpad = pow2(kw["K"]) if "K" in kw else None
    out = []
    for c in configs:
        b = c.kwargs.get("BK", bk)
        if kpad is not None and "BK" in c.kwargs and b > kpad:
            continue
        if c.num_warps >= 8 and (b or 0) < 64:
            continue
        out.append(c)
    return out or list(configs[:1])


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host side. ``triton.cdiv`` and ``triton.next_power_of_2`` are
    ``constexpr_function`` objects in Triton 3.6 whose host call unwraps every argument, and the
    wrappers call them several times per kernel call."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): ``triton.next_power_of_2`` on the host, see ``cdiv``."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def pow2(n: int, lo: int = 16) -> int:
    """The power of two >= n, at least ``lo`` (tensor-core products need blocks of 16)."""
    return max(lo, next_pow2(n))


IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what the kernels read and write


def io_dtype(dtype) -> torch.dtype:
    """The dtype the kernels write an output of ``dtype`` in: itself when it is one of
    ``IO_DTYPES``, else fp32 (e.g. an fp64 call; the caller casts the result back)."""
    return dtype if dtype in IO_DTYPES else torch.float32


def dot_precision(dtype) -> str:
    """``input_precision`` of tl.dot: fp32 I/O takes three-pass tf32 (fp32-accurate); bf16/fp16
    I/O products are bf16/fp16 (an fp32 product there, e.g. a block inverse, takes one tf32 pass)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def buffer(shape, device, dtype, poison: bool) -> torch.Tensor:
    """A kernel output buffer: NaN-filled when ``poison`` (the tests' ``POISON`` of each family, so
    that an element a kernel leaves unwritten shows), else uninitialised."""
    if poison:
        return torch.full(tuple(shape), float("nan"), device=device, dtype=dtype)
    return torch.empty(tuple(shape), device=device, dtype=dtype)
