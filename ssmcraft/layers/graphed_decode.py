"""One-token decoding with the whole ``LM.step`` in one CUDA graph (decode is host-bound).

Eager decoding launches about 20 small kernels per layer and token, each with its host-side
launch cost, so at batch 1 the GPU waits on the host (BENCHMARKS.md).
``GraphedDecoder(model, batch_size)`` keeps the token and every layer's cache (conv window
``[B, D, k-1]``, state ``[B, H, d, m]`` or a tuple of them; a sliding window's key and value
slots ``[B, H, w, d_head]`` and position) in static buffers, captures one
``model.step`` whose new caches are copied into those buffers inside the graph, and then runs a
token as: copy the token in, replay, read the static logits ``[B, V]``.

    dec = GraphedDecoder(model, batch_size=16, autocast_dtype=torch.bfloat16)
    dec.state.reset()                 # zero caches: a new sequence (dec.state.load(model.prefill(prompt)[1]): a prompt)
    for t in range(T):
        logits = dec.step(tokens[:, t])     # [B] int64 -> [B, V]; overwritten by the next step

``StaticDecodeState`` is the captured body (static token, static caches, ``advance()`` = one step
and the in-place cache update) without the graph: it runs on any device, which is how the tests
check the bookkeeping on CPU against eager ``LM.step``.

Objective mixers and sliding-window attention (a ring of ``window`` key/value slots and its
position, all tensors of fixed shape); full attention's key/value cache grows by one token per
step, which a graph with fixed buffers cannot hold (``SsmcraftError``).
"""
from __future__ import annotations

import contextlib

import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.runtime.graphs import require_cuda, require_warmup
from ssmcraft.layers.attention import KVCache
from ssmcraft.layers.mixer import RecurrentCache


def _tensors(cache) -> tuple[torch.Tensor, ...]:
    """A cache's tensors: a ``RecurrentCache``'s conv window, then the state(s); a sliding window's
    keys, values and position."""
    if isinstance(cache, KVCache):
        return (cache.k, cache.v, cache.pos)
    return (cache.conv, *(cache.state if isinstance(cache.state, tuple) else (cache.state,)))


def fixed_size(cache) -> bool:
    """Whether a layer's cache keeps its shapes from step to step (what a graph can hold)."""
    return isinstance(cache, RecurrentCache) or (isinstance(cache, KVCache) and isinstance(cache.pos, torch.Tensor))


class StaticDecodeState:
    """The static buffers of graphed decoding and the step that updates them in place.

    ``token`` ``[B]`` int64, ``caches`` (``model.init_cache(B)``).
    """

    def __init__(self, model, batch_size: int):
        caches = model.init_cache(batch_size)
        for i, c in enumerate(caches):
            if not fixed_size(c):
                raise SsmcraftError(f"graphed decoding: layer {i} has a {type(c).__name__} (its cache grows with "
                                    f"every token); only objective mixers and sliding-window attention, whose "
                                    f"caches have a constant size, can decode in a CUDA graph")
        self.model = model
        self.caches = caches
        self.token = torch.zeros(batch_size, dtype=torch.long, device=model.embed.weight.device)

    def advance(self) -> torch.Tensor:
        """One ``model.step`` on ``token``; the new caches are copied into the static ones."""
        logits, new = self.model.step(self.token, self.caches)
        self.load(new)
        return logits

    def reset(self) -> None:
        """Zero every cache in place (a new sequence)."""
        for c in self.caches:
            for t in _tensors(c):
                t.zero_()

    def load(self, caches) -> None:
        """Copy ``caches`` (e.g. ``model.prefill``'s after a prompt) into the static ones. They
        must fit exactly: one per layer, each tensor of the static one's shape (``copy_`` would
        broadcast a batch-1 cache into every row); else ``SsmcraftError`` naming the layer."""
        caches = list(caches)
        if len(caches) != len(self.caches):
            raise SsmcraftError(f"graphed decoding: {len(caches)} layer cache(s) given; this model has "
                                f"{len(self.caches)}")
        for i, (mine, theirs) in enumerate(zip(self.caches, caches)):
            dst, src = _tensors(mine), _tensors(theirs)
            shapes, got = [list(t.shape) for t in dst], [list(t.shape) for t in src]
            if shapes != got:
                raise SsmcraftError(f"graphed decoding: layer {i}'s cache (its tensors: _tensors) has shapes "
                                    f"{got}; the decoder holds {shapes} (batch {self.token.shape[0]})")
            for a, b in zip(dst, src):
                a.copy_(b)


class GraphedDecoder:
    """``model.step`` captured once for ``batch_size`` sequences (module docstring).

    ``autocast_dtype``: run the step under ``torch.autocast("cuda", dtype)`` (captured with the
    autocast cache off, as CUDA graphs need; the values are those of eager autocast). ``warmup``
    eager steps run first on a side stream (kernel choice, compilation), then the caches are zeroed.
    The logits returned by ``step`` are a static buffer, overwritten by the next step. ``state`` is
    the ``StaticDecodeState`` the graph reads and writes: ``state.reset()`` starts a new sequence,
    ``state.load(caches)`` continues a prefill (``model.prefill``'s caches), ``state.caches`` are the current caches.
    """

    def __init__(self, model, batch_size: int, autocast_dtype: torch.dtype | None = None, warmup: int = 3):
        require_warmup(warmup, "graphed decoding")
        require_cuda([("the model", model.embed.weight)], "graphed decoding")
        device = model.embed.weight.device
        self.state = StaticDecodeState(model, batch_size)
        amp = ((lambda: torch.autocast("cuda", dtype=autocast_dtype, cache_enabled=False))
               if autocast_dtype is not None else contextlib.nullcontext)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad(), amp():
            for _ in range(warmup):
                self.state.advance()
        torch.cuda.current_stream(device).wait_stream(side)
        self.state.reset()          # the warm-up advanced the caches (a capture runs nothing)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), amp(), torch.cuda.graph(self.graph):
            self.logits = self.state.advance()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token ``[B]`` (int64, on the model's device) -> logits ``[B, V]`` (static buffer)."""
        want = self.state.token
        if (token.shape, token.dtype, token.device) != (want.shape, want.dtype, want.device):
            raise SsmcraftError(f"graphed decoding: token is {list(token.shape)} {token.dtype} on {token.device}; "
                                f"this decoder was captured for {list(want.shape)} {want.dtype} on {want.device} "
                                "(a host token would be copied synchronously every step)")
        self.state.token.copy_(token)
        self.graph.replay()
        return self.logits
