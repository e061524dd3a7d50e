"""Packed sequences in FLA's convention: N sequences laid end to end in one row.

A packed call passes inputs ``[1, total_T, H, n]`` (``[1, total_T, H]`` for a per-head scalar) and
``cu_seqlens``, an int32 or int64 tensor ``[N + 1]`` of offsets: sequence ``i`` is time steps
``cu_seqlens[i] .. cu_seqlens[i + 1] - 1``, the offsets start at 0, never decrease and end at
``total_T``. A zero-length sequence is allowed (as in FLA, whose chunk indices give it no chunk): its
final state is its initial state. ``initial_state`` and the final state are ``[N, H, d, m]`` (a tuple
of them with several states): every sequence starts from its own state and none sees another's
tokens. The result equals N separate calls, one per sequence, concatenated along time.

How much of a call is checked, and when: ``layout`` checks what needs no offset value (a tensor of
int32 or int64 offsets, ``[N + 1]``, B = 1, N rows in every initial state) on every call. The values
(start at 0, never decrease, end at ``total_T``) are checked on the host (``read_offsets``) where reading
them costs no wait for the accelerator, or where the caller asks (``CHECK``, from the environment
variable ``SSMCRAFT_CHECK_OFFSETS``): ``auto`` (the default) checks offsets that live on the CPU and
leaves offsets on a GPU unread, so that a packed call of the families that build their tables on the
device (``diagonal``, ``keydecay_chunk``, ``rank1_chunk``, ``rankr_chunk``, ``rank1_keydecay_chunk``)
queues its kernels without waiting for the GPU (and a CUDA graph can capture it; the other families
read the offsets: ``offsets``); ``always`` checks them wherever they
are (one read per call); ``never`` checks none. Offsets on a GPU that break the layout give wrong
results, never an access out of bounds: ``rows.device_chunks`` clamps them into ``[0, total_T]`` and makes
them non-decreasing before building the tables.

``offsets`` checks a call and reads the offsets to the host, for the families whose host code needs
them there (one read per call); ``rows.device_chunks`` builds the chunk tables of those kernels on the
device in one launch, sized from what is known without reading the offsets; ``per_sequence`` runs any unpacked path
once per sequence, which is how the reference loop (and every family without packed kernels) runs a
packed call.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common.reference import like, states

OFFSET_DTYPES = (torch.int32, torch.int64)


CHECK_MODES = ("auto", "always", "never")
CHECK = os.environ.get("SSMCRAFT_CHECK_OFFSETS", "auto")     # read once, at import


def _fail(name: str, problem: str):
    raise SsmcraftError(f"{name}: cu_seqlens: {problem}")


def layout(name: str, cu_seqlens, inputs: dict, initial_state) -> tuple[int, int]:
    """(N, total_T) of a packed call, after the checks that read no offset: a tensor of int32 or int64
    offsets ``[N + 1]``, inputs with B = 1, ``initial_state`` with N rows. ``SsmcraftError`` names the
    problem."""
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(name, f"must be a tensor of offsets (int32 or int64), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in OFFSET_DTYPES:
        _fail(name, f"must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail(name, f"must be 1-D with N + 1 >= 2 offsets, got shape {list(cu_seqlens.shape)}")
    tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)] if isinstance(inputs, dict) else []
    if not tensors or tensors[0].dim() < 3:
        _fail(name, "a packed call needs input tensors [1, total_T, H, ...]")
    B, T = tensors[0].shape[:2]
    if B != 1:
        _fail(name, f"packed inputs must have B = 1 (sequences laid end to end), got B = {B}")
    N = cu_seqlens.numel() - 1
    for i, S0 in enumerate(states(initial_state)):
        if isinstance(S0, torch.Tensor) and S0.dim() >= 1 and S0.shape[0] != N:
            what = "initial_state" if not isinstance(initial_state, (tuple, list)) else f"initial_state[{i}]"
            _fail(name, f"{what} has {S0.shape[0]} rows, but cu_seqlens holds N = {N} sequences "
                  f"(a packed call's states are [N, H, ...])")
    return N, T


def read_offsets(name: str, cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """The offsets as Python ints (one read), checked: from 0, never decreasing, to ``T``."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0:
        _fail(name, f"must start at 0, got {cu[0]}")
    if cu[-1] != T:
        _fail(name, f"must end at total_T = {T} (the inputs' length), got {cu[-1]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            _fail(name, f"must not decrease, got {cu[i - 1]} then {cu[i]} at index {i}")
    return cu


def offsets(name: str, cu_seqlens, inputs: dict, initial_state) -> list[int]:
    """The offsets ``[N + 1]`` of a packed call as Python ints, after checking them against the
    inputs (B = 1, total_T) and ``initial_state`` (N rows). ``SsmcraftError`` names the problem."""
    _, T = layout(name, cu_seqlens, inputs, initial_state)
    return read_offsets(name, cu_seqlens, T)


def check(name: str, cu_seqlens, inputs: dict, initial_state) -> int:
    """N, after ``layout``'s checks and, as ``CHECK`` says (the module docstring), ``read_offsets``'."""
    N, T = layout(name, cu_seqlens, inputs, initial_state)
    if CHECK not in CHECK_MODES:
        raise SsmcraftError(f"{name}: SSMCRAFT_CHECK_OFFSETS must be one of {', '.join(CHECK_MODES)}, got {CHECK!r}")
    if CHECK == "always" or (CHECK == "auto" and cu_seqlens.device.type == "cpu"):
        read_offsets(name, cu_seqlens, T)
    return N


def first_rows(initial_state):
    """The initial state(s) of the first sequence (``[1, H, ...]``), to validate a packed call's
    layout as one unpacked sequence; None stays None."""
    return like(initial_state, tuple(S[:1] for S in states(initial_state)))


def sequence(inputs: dict, initial_state, cu: list[int], i: int):
    """Sequence ``i`` of a packed call as an unpacked one: (inputs ``[1, T_i, H, ...]``, its initial
    state(s) ``[1, H, ...]`` or None)."""
    s, e = cu[i], cu[i + 1]
    ins = {n: t[:, s:e] for n, t in inputs.items()}
    return ins, like(initial_state, tuple(S[i:i + 1] for S in states(initial_state)))


def per_sequence(run, inputs: dict, params, initial_state, output_final_state: bool, cu: list[int]):
    """A packed call as N unpacked ones: ``run(inputs, params, initial_state, output_final_state) ->
    (y [1, T_i, H, d], S_T)`` per sequence, outputs concatenated along time and final states along
    the batch. Returns (y [1, total_T, H, d], S_T [N, H, d, m] (a tuple with several) or None)."""
    ys, finals, S = [], [], None
    for i in range(len(cu) - 1):
        ins, S0 = sequence(inputs, initial_state, cu, i)
        y, S = run(ins, params, S0, output_final_state)
        ys.append(y)
        finals.append(states(S))
    longest = max(range(len(ys)), key=lambda i: ys[i].shape[1])     # its dtypes win (an empty one's may differ)
    y = torch.cat([t.to(ys[longest].dtype) for t in ys], dim=1)
    if not output_final_state:
        return y, None
    return y, like(S, tuple(torch.cat([t.to(parts[longest].dtype) for t in parts], dim=0) for parts in zip(*finals)))


@dataclass
class Chunks:
    """A packed row cut into chunks of ``BT`` tokens that never straddle two sequences, for the
    chunked kernels (device tensors, int32): ``cu`` the offsets ``[N + 1]``; ``ci [NT, 2]`` each chunk's
    (sequence, index within the sequence), sequence by sequence; ``co [N]`` each sequence's first
    chunk in that list. A zero-length sequence has no chunk. ``NT`` is the chunk count (``chunks``) or
    a bound on it (``rows.device_chunks``, whose entries past the last chunk are ``(0, -1)``); the
    per-chunk buffers have ``NT`` slots either way."""
    cu: torch.Tensor
    ci: torch.Tensor
    co: torch.Tensor
    N: int
    NT: int


def chunks(cu: list[int], cu_seqlens: torch.Tensor, BT: int) -> Chunks:
    """``Chunks`` at chunk size ``BT`` of the offsets ``cu`` (``offsets``' list, checked) whose device
    tensor is ``cu_seqlens``."""
    counts = [-(-(e - s) // BT) for s, e in zip(cu[:-1], cu[1:])]
    pairs = [(n, j) for n, c in enumerate(counts) for j in range(c)]
    first = [0, *itertools.accumulate(counts)][:-1]
    dev = cu_seqlens.device
    ci = torch.tensor(pairs, dtype=torch.int32, device=dev).reshape(-1, 2)
    return Chunks(cu_seqlens.to(torch.int32), ci, torch.tensor(first, dtype=torch.int32, device=dev),
                  len(counts), len(pairs))
