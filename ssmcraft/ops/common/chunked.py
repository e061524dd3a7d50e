"""Host-side helpers of the chunked tensor-core families (``rank1_chunk``, ``rank1_keydecay_chunk``,
``keydecay_chunk``): the padded key block of their 16-bit products, per-head slots as their kernels
take them, the structure checks the chunked rank-1 families share, and the refusal of a key dimension
too large for their register tiles.
A module of its own so that an exported bundle, which pastes a family's modules into one
namespace, imports these once (under the names the families call them by: a renamed import
cannot be bundled)."""
from __future__ import annotations

import torch

from ssmcraft.ops.common.tuning import INTERPRET, pow2


def _block_floor(dtype) -> int:
    """The least key or value block of a 16-bit tensor-core product. bf16 products with a block below
    64 fail on Hopper (sm_90) with Triton 3.6, while fp32 (tf32x3) is right at every size
    (``benchmarks/diag_rank1_smallk.py``, which runs both): a key block of 32 gave an illegal memory
    access in rank1_chunk's backward and 16 NaN outputs; a value block of 32 (V = 32) gave wrong
    outputs in the forward (relative error ~1 for Gated DeltaNet) and the same illegal access in the
    backward. There the block is padded to 64: the loads are masked, so the extra columns are zeros.
    fp16 is padded too, by analogy with bf16 (the same 16-bit dot path; not measured)."""
    return 16 if dtype == torch.float32 else 64


def _key_block(K: int, dtype) -> int:
    """The padded key block (``_block_floor``). The rule is the same under the interpreter, so the
    CPU tests run the padded kernels."""
    return pow2(K, lo=_block_floor(dtype))


# bytes of the largest [key block, value block] tile the chunked kernels take: bf16's [128, 64], with
# which every kernel of rank1_chunk and rankr_chunk fits sm_90's 227 KB of shared memory per block
# (``benchmarks/compile_sm90.py``). fp32 tiles of the same shape take twice the bytes: at K = 128 with
# a value block of 64, rank1_chunk's gradient kernel needs 320 KB, the decay gradient's 352 KB.
TILE_BYTES = 128 * 64 * 2


def _value_block(V: int, dtype, interpret_bv: int | None = None, K: int | None = None) -> int:
    """The value block of the parallel kernels, at most 64 and padded as ``_block_floor`` says; with
    the key dimension ``K``, also at most what keeps a ``[_key_block, value block]`` tile of ``dtype``
    within ``TILE_BYTES`` (fp32 at K = 128 gets 32; bf16, whose floor is 64, keeps 64 at any K);
    under the interpreter ``interpret_bv`` where given (the tests' way to run several value tiles)."""
    if INTERPRET and interpret_bv:
        return interpret_bv
    bv = pow2(V, lo=_block_floor(dtype))
    if INTERPRET:
        return bv
    fit = 64 if K is None else TILE_BYTES // (_key_block(K, dtype) * dtype.itemsize)
    return min(bv, max(_block_floor(dtype), min(fit, 64)))


def state_stage_rule(configs, nargs=None, **kw):
    """``early_config_prune`` of the state kernels (a ``[BK, BV]`` state carried over chunks, the
    next chunk's loads double-buffered in ``num_stages=2`` configs): the single-stage configs where a
    key column of the io dtype (the ``W`` buffer's) is longer than bf16's at K = 128, 256 bytes, else
    the others. fp32 at K = 128 double-buffered needs 232 KB at a value block of 32 with a decay, past
    sm_90's 227 KB (``benchmarks/compile_sm90.py``)."""
    single = kw["BK"] * {**(nargs or {}), **kw}["W"].element_size() > 256
    return [c for c in configs if (c.num_stages == 1) == single] or list(configs[:1])


def _split_p(ir):
    """(s, x) when p's expression is s * x with s a per-head input/param and x a (d,) one."""
    co = ir.coefficient("p")
    if co is None or co.dims != ("d",):
        return None
    dims = {**ir.inputs, **ir.params}
    # the expression is sympy here and its printed text in an exported module: read the text
    names = str(co.expr).replace(" ", "").split("*")
    if len(names) != 2 or not all(n in dims for n in names):
        return None
    s = [n for n in names if tuple(dims[n]) == ()]
    x = [n for n in names if tuple(dims[n]) == ("d",)]
    return (s[0], x[0]) if len(s) == 1 and len(x) == 1 else None


def _per_head(x, B, T, H, device, one_is_none=False):
    """A per-head slot as [B, T, H]: a ``[B, T, H]`` tensor as it is, a laid-out one
    (``[B|1, T|1, H|1, 1, 1]``) broadcast, a number filled in (None for a decay of 1 when ``one_is_none``)."""
    if isinstance(x, torch.Tensor):
        return x if x.dim() == 3 else x.expand(B, T, H, 1, 1).reshape(B, T, H)
    return None if one_is_none and float(x) == 1.0 else torch.full((B, T, H), float(x), device=device)


def key_size_reason(ir, sizes: dict, max_k: int, why: str = "whole key rows are held in registers") -> str | None:
    """Why a key dimension (``ir.dims[1]`` in ``sizes``) is too large for kernels that hold whole
    key rows in registers (or ``why`` else), or None."""
    K = sizes.get(ir.dims[1])
    if K is not None and K > max_k:
        return f"K = {K} > {max_k} ({why})"
    return None


def few_keys_reason(ir, sizes: dict, mode: str, min_keys: int, instead: str) -> str | None:
    """On CUDA, why a chunked per-row family refuses keys fewer than ``min_keys``: the per-token family
    ``instead``, next in the order and measured faster there, runs them (its K-long chains are short and
    it makes one pass over the tokens); the interpreter takes any size."""
    K = sizes.get(ir.dims[1])
    if mode == "triton" and K is not None and K < min_keys:
        return f"K = {K} < MIN_KEYS = {min_keys} ({instead}'s per-token loop is faster with few keys)"
    return None


def key_sizes(ir, inputs) -> dict:
    """``{key dim: size}`` read off the inputs that vary over the key dimension."""
    m = ir.dims[1]
    return {m: inputs[n].shape[-1] for n, dims in ir.inputs.items() if tuple(dims) == (m,) and n in inputs}


def slot_dims(ir, slot: str) -> tuple | None:
    """The dimensions a slot's coefficient varies over (None: the slot is absent)."""
    co = ir.coefficient(slot)
    return None if co is None else tuple(co.dims)


def rank1_chunk_reason(ir, decays: tuple, decay_words: str) -> str | None:
    """Why a chunked rank-1 family does not run ``ir``, or None: a ``rank1`` IR with no
    element-wise readout, a per-head step ``c``, a decay ``a`` whose dims are one of ``decays``
    (``decay_words`` says which, for the message),
    the keys ``u, v, q, oq`` over the key dimension, an input term ``p q^T`` with ``p`` per head or
    per row, and a readout scale / offset per head or per row."""
    name, (d, m) = ir.spec_name, ir.dims
    if ir.kind != "rank1":
        return f"{name}: structure {ir.kind!r}, not rank1"
    if ir.readout is not None:
        return f"{name}: element-wise readout"
    if slot_dims(ir, "c") != ():
        return f"{name}: step c has dims {slot_dims(ir, 'c')}, not per head ()"
    if slot_dims(ir, "a") not in decays:
        return f"{name}: decay a has dims {slot_dims(ir, 'a')}, not {decay_words}"
    for s in ("u", "v", "q", "oq"):
        if slot_dims(ir, s) != (m,):
            return f"{name}: slot {s} has dims {slot_dims(ir, s)}, not ({m},)"
    if "p" not in ir.slots or slot_dims(ir, "p") not in ((), (d,)):
        return f"{name}: input term is not p q^T with p of dims ({d},)"
    if slot_dims(ir, "oc") not in (None, (), (d,)):
        return f"{name}: readout scale oc has dims {slot_dims(ir, 'oc')}"
    if "oh" in ir.slots and slot_dims(ir, "oh") not in ((), (d,)):
        return f"{name}: readout offset oh has dims {slot_dims(ir, 'oh')}"
    return None
