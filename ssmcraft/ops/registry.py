"""Every kernel family, in the order the runtime tries them: the one list that dispatch
(``ssmcraft.runtime.select``), the exporter, ``ssmcraft bench`` and the tests read.

Order: ``decode`` (one-token calls only), ``keydecay_chunk`` (decays scalar or over the key
dimension, provably positive: GLA, RetNet, HGRN, linear attention; chunked, on tensor cores),
``diagonal`` (every scalar/elementwise decay, e.g. Mamba's over ``(d, m)``), ``rank1_row``,
``rankr_row`` (several keys), ``block_rank1_row`` (two states updated by one rank-1 step of an
extrapolated state: Longhorn with momentum), ``minibatch_chunk`` (mini-batch regression steps with a
scalar or weight decay, on tensor cores: ahead of ``general``, which runs every other mini-batch
update), ``general`` (anything else the generator prints), then ``rank1_chunk``, which declares itself
ahead of ``rank1_row`` on CUDA for a per-head step (``KernelFamily.ahead_on_gpu``), ``rank1_row_chunk``
(a per-row step with no decay, a per-head or a per-row one, chunked: ahead of ``rank1_row`` on CUDA
for keys of its ``MIN_KEYS`` or more, after ``rank1_chunk``, with a decay only where its ``DECAY_AHEAD``
or ``ROW_DECAY_AHEAD``), ``rankr_chunk``,
ahead of ``rankr_row`` likewise, ``precision_rank1`` (recursive least squares, the preconditioned
delta rule), ``precision_general`` (the other metric compositions: the precision's gains, then the
memory's step on a chunked or the general family's kernels), ``rank1_keydecay_chunk`` (rank-1 with a
per-key decay and a per-head step: a KDA-like layer; chunked, on tensor cores), ``mlp_minibatch_chunk``
(the MLP memory with mini-batches of 16 to 64 tokens, chunk-parallel on tensor cores) and ``mlp_memory``
(a two-layer MLP memory: two weight states of different shapes, sequential), which no other family runs,
and ``block_rank1_row_chunk`` (the block form with per-head state weights, chunked: ahead of
``block_rank1_row`` on CUDA only where its ``AHEAD``). A family that does not support an IR says why
(``KernelFamily.reason``); nothing falls back silently.
"""
from __future__ import annotations

from ssmcraft.ops.block_rank1_row import FAMILY as BLOCK_RANK1_ROW
from ssmcraft.ops.block_rank1_row_chunk import FAMILY as BLOCK_RANK1_ROW_CHUNK
from ssmcraft.ops.decode import FAMILY as DECODE
from ssmcraft.ops.diagonal import FAMILY as DIAGONAL
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.general import FAMILY as GENERAL
from ssmcraft.ops.keydecay_chunk import FAMILY as KEYDECAY_CHUNK
from ssmcraft.ops.minibatch_chunk import FAMILY as MINIBATCH_CHUNK
from ssmcraft.ops.mlp_memory import FAMILY as MLP_MEMORY
from ssmcraft.ops.mlp_minibatch_chunk import FAMILY as MLP_MINIBATCH_CHUNK
from ssmcraft.ops.precision_general import FAMILY as PRECISION_GENERAL
from ssmcraft.ops.precision_rank1 import FAMILY as PRECISION_RANK1
from ssmcraft.ops.rank1_chunk import FAMILY as RANK1_CHUNK
from ssmcraft.ops.rank1_keydecay_chunk import FAMILY as RANK1_KEYDECAY_CHUNK
from ssmcraft.ops.rank1_row import FAMILY as RANK1_ROW
from ssmcraft.ops.rank1_row_chunk import FAMILY as RANK1_ROW_CHUNK
from ssmcraft.ops.rankr_chunk import FAMILY as RANKR_CHUNK
from ssmcraft.ops.rankr_row import FAMILY as RANKR_ROW

FAMILIES: tuple[KernelFamily, ...] = (DECODE, KEYDECAY_CHUNK, DIAGONAL, RANK1_ROW, RANKR_ROW, BLOCK_RANK1_ROW,
                                      MINIBATCH_CHUNK, GENERAL, RANK1_CHUNK, RANK1_ROW_CHUNK, RANKR_CHUNK, PRECISION_RANK1,
                                      PRECISION_GENERAL, RANK1_KEYDECAY_CHUNK, MLP_MINIBATCH_CHUNK, MLP_MEMORY,
                                      BLOCK_RANK1_ROW_CHUNK)
BY_NAME: dict[str, KernelFamily] = {f.name: f for f in FAMILIES}


def order(ir, mode: str) -> list[KernelFamily]:
    """The families in the order they are tried for ``ir`` in ``mode`` ("triton" on CUDA, or
    "interpret"): ``FAMILIES``, with each family that declares ``ahead_on_gpu`` moved before the
    family it names, on CUDA, where its condition holds."""
    out = list(FAMILIES)
    if mode != "triton":
        return out
    for fam in FAMILIES:
        if fam.ahead_on_gpu is not None and fam.ahead_on_gpu[1](ir):
            out.remove(fam)
            out.insert(out.index(BY_NAME[fam.ahead_on_gpu[0]]), fam)
    return out


def family(name: str) -> KernelFamily:
    """The family called ``name`` (KeyError names the known ones)."""
    if name not in BY_NAME:
        raise KeyError(f"no kernel family {name!r}; families: {', '.join(BY_NAME)}")
    return BY_NAME[name]
