"""The Mamba/Longhorn block around any compiled objective.

Data flow for hidden states ``h [B, T, d_model]`` (``D = expand * d_model = H * d``):

    x, z   = in_proj(h)                        x, z: [B, T, D]   (z only with gate)
    u      = silu(causal_depthwise_conv(x))    [B, T, D]
    inputs = one tensor per spec input, from u (shapes the compiled-objective API takes):
               the value input (Mamba's x):     u viewed [B, T, H, d]
               other [d] inputs, constrained:    low-rank  D -> r -> H*d  (Mamba's dt_proj)
               other [d] inputs, plain:          linear    D -> H*d
               [m] inputs (keys, queries, ...):  linear    D -> H*m       -> [B, T, H, m]
               scalar inputs (per head):         linear    D -> H         -> [B, T, H]
             each followed by its activation (``activations.implied_activation``) and, if
             declared, L2 normalisation over its vector
    params = the spec's learned params, per head [H, *shape] (``params.py``)
    y      = objective(inputs, params)         [B, T, H, d]  -> [B, T, D]
    y      = (y + skip * u) * silu(z)
    out    = out_proj(y)                       [B, T, d_model]

The state is ``[B, H, d, m]`` (a tuple of them for an objective with several states). ``step`` runs one token with a carried conv window and
recurrent state and gives the same outputs as ``forward``; ``prefill`` runs a prompt in parallel
and returns that cache after its last token.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.ops.common.reference import initial_states
from ssmcraft.layers.activations import (apply_activation, implied_activation, inverse_softplus,
                                         l2_normalize, log_uniform)
from ssmcraft.layers.config import ObjectiveMixerConfig
from ssmcraft.layers.conv import CausalConv1d
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.runtime.lookup import compile_objective
from ssmcraft.layers.params import from_raw, initial_value, to_raw

log = logging.getLogger(__name__)


@dataclass
class RecurrentCache:
    """One mixer's carried state in recurrent mode: conv window ``[B, D, k-1]``, state ``[B, H, d, m]``
    (an objective with several states: a tuple of them, in the spec's declaration order)."""

    conv: torch.Tensor
    state: torch.Tensor | tuple


@dataclass
class ChunkCache:
    """A mini-batch objective's recurrent state (``approximation: {minibatch: C}``): the state before
    the current chunk and the projected inputs of the chunk's tokens so far (``[B, n, H, ...]``, n < C),
    from which each step recomputes the chunk, so that steps equal parallel mode (its chunks start at
    the sequence's first token)."""

    start: torch.Tensor | tuple
    inputs: dict


def is_constrained(decl) -> bool:
    return bool(decl.positive or decl.bounded or decl.normalize or decl.activation)


def choose_value_input(spec, setting: str) -> str | None:
    """The input fed the conv output directly (see ``ObjectiveMixerConfig.value_input``)."""
    row = spec.dims[0]
    if setting == "none":
        return None
    if setting != "auto":
        decl = spec.inputs.get(setting)
        if decl is None or tuple(decl.shape) != (row,):
            vectors = [n for n, d in spec.inputs.items() if tuple(d.shape) == (row,)]
            raise SpecError("<mixer>", "value_input", f"{setting!r} is not a [{row}] input of objective "
                            f"{spec.name}; its [{row}] inputs: {', '.join(vectors) or 'none'}")
        return setting
    plain = [n for n, d in spec.inputs.items() if tuple(d.shape) == (row,) and not is_constrained(d)]
    return plain[0] if len(plain) == 1 else None


class ObjectiveMixer(nn.Module):
    """Sequence mixer from a compiled objective; see the module docstring.

    ``objective``: an already compiled objective (else ``cfg.objective`` is compiled).
    """

    def __init__(self, cfg: ObjectiveMixerConfig, d_model: int, objective: Any = None):
        super().__init__()
        self.cfg, self.d_model = cfg, d_model
        self.obj = objective if objective is not None else compile_objective(cfg.objective)
        spec = self.obj.spec
        H, D = cfg.heads, cfg.expand * d_model
        if H < 1 or D % H:
            raise SpecError("<mixer>", "heads", f"expand * d_model = {D} is not divisible by heads = {H}")
        self.H, self.D, self.d, self.m = H, D, D // H, cfg.state_size
        row, col = spec.dims
        self.sizes = {row: self.d, col: self.m}
        self.in_proj = nn.Linear(d_model, 2 * D if cfg.gate else D, bias=False)
        self.conv = CausalConv1d(D, cfg.conv_kernel)
        self.value_name = choose_value_input(spec, cfg.value_input)
        self.rank = math.ceil(d_model / 16) if cfg.low_rank == "auto" else int(cfg.low_rank)
        self.activation = {n: implied_activation(decl, cfg.plain_activation) for n, decl in spec.inputs.items()}
        unknown_bias = set(cfg.input_bias) - set(spec.inputs)
        if unknown_bias:
            raise SpecError("<mixer>", "input_bias", f"unknown input(s) {sorted(unknown_bias)}; "
                            f"objective {spec.name} has {', '.join(spec.inputs)}")
        self.proj = nn.ModuleDict()
        self.route: dict[str, str] = {}
        for name, decl in spec.inputs.items():
            if name != self.value_name:
                self.proj[name] = self._projection(name, decl)
            else:
                self.route[name] = "conv output"
        self.param_decls = dict(spec.params)
        self.raw_params = nn.ParameterDict()
        for name, decl in self.param_decls.items():
            raw = to_raw(decl, initial_value(decl, self.sizes, H))
            self.raw_params[name] = nn.Parameter(raw, requires_grad=bool(decl.trainable))
        self.skip = nn.Parameter(torch.ones(D)) if cfg.skip else None
        self.out_proj = nn.Linear(D, d_model, bias=False)
        self.mitigation = Mitigation()
        self._scaled_obj = None
        self.last_backend: str | None = None

    # --- construction helpers -------------------------------------------------------------
    def _projection(self, name: str, decl) -> nn.Module:
        n_out = self.H * (self.sizes[decl.shape[0]] if decl.shape else 1)
        act = self.activation[name]
        has_bias = act != "identity"
        if tuple(decl.shape) == (self.obj.spec.dims[0],) and is_constrained(decl):
            last = nn.Linear(self.rank, n_out, bias=True)
            module: nn.Module = nn.Sequential(nn.Linear(self.D, self.rank, bias=False), last)
            self.route[name] = f"low-rank {self.D}->{self.rank}->{n_out}"
            has_bias = True
        else:
            last = module = nn.Linear(self.D, n_out, bias=has_bias)
            self.route[name] = f"linear {self.D}->{n_out}"
        if has_bias:
            with torch.no_grad():
                last.bias.copy_(self._bias_init(name, n_out))
        return module

    def _bias_init(self, name: str, n: int) -> torch.Tensor:
        if name in self.cfg.input_bias:
            return torch.full((n,), float(self.cfg.input_bias[name]))
        if self.activation[name] == "softplus":
            return inverse_softplus(log_uniform(n, self.cfg.dt_min, self.cfg.dt_max))
        return torch.zeros(n)

    # --- the pieces of forward ------------------------------------------------------------
    def param_values(self) -> dict[str, torch.Tensor]:
        """name -> ``[H, *shape]`` with the sign constraints applied."""
        return {n: from_raw(self.param_decls[n], p) for n, p in self.raw_params.items()}

    def _split_in(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        xz = self.in_proj(h)
        if self.cfg.gate:
            x, z = xz.chunk(2, dim=-1)
            return x, z
        return xz, None

    def project(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        """u ``[B, T, D]`` -> spec input name -> ``[B, T, H, n]`` (``[B, T, H]`` for scalars)."""
        B, T, _ = u.shape
        out = {}
        for name, decl in self.obj.spec.inputs.items():
            v = u if name == self.value_name else self.proj[name](u)
            v = apply_activation(self.activation[name], v)
            v = v.view(B, T, self.H, -1) if decl.shape else v.view(B, T, self.H)
            out[name] = l2_normalize(v) if decl.normalize else v
        return out

    def _finish(self, y: torch.Tensor, u: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """y ``[B, T, H, d]``, u and z ``[B, T, D]`` -> ``[B, T, d_model]``."""
        y = y.reshape(*u.shape)
        if self.skip is not None:
            y = y + self.skip * u
        if z is not None:
            y = y * F.silu(z)
        return self.out_proj(y)

    def _active_objective(self):
        return self._scaled_obj if self.mitigation.scales else self.obj

    def _recur(self, inputs, params, state=None):
        """The recurrence from ``state`` and its final state (parallel forward: from zero, no final state)."""
        obj = self._active_objective()
        if self.mitigation.window is not None:
            if state is not None:
                raise SsmcraftError("the sliding-window mitigation has no recurrent mode (no step, no prefill)")
            y = obj.sliding_window(inputs, params, self.mitigation.window)
            S = None
        else:
            y, S = obj(inputs, params, initial_state=state, output_final_state=state is not None)
        self.last_backend = getattr(obj, "backend", None)
        return y, S

    # --- public API -----------------------------------------------------------------------
    def forward(self, h: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """h ``[B, T, d_model]`` -> ``[B, T, d_model]`` (parallel mode). ``cu_seqlens``: offsets of the
        sequences packed in the B rows laid end to end (``[N + 1]``, from 0 to ``B * T``; every row
        starts one): the conv window and the recurrent state restart at each (``ssmcraft.ops.common.varlen``)."""
        if cu_seqlens is not None:
            B, T, D = h.shape
            return self._packed(h.reshape(1, B * T, D), cu_seqlens).reshape(B, T, -1)
        x, z = self._split_in(h)
        u = F.silu(self.conv(x))
        y, _ = self._recur(self.project(u), self.param_values())
        return self._finish(y, u, z)

    def _packed(self, h: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.mitigation.window is not None:
            raise SsmcraftError("the sliding-window mitigation does not run packed sequences (cu_seqlens)")
        x, z = self._split_in(h)
        u = F.silu(self.conv(x, cu_seqlens))
        obj = self._active_objective()
        y, _ = obj(self.project(u), self.param_values(), output_final_state=False, cu_seqlens=cu_seqlens)
        self.last_backend = getattr(obj, "backend", None)
        return self._finish(y, u, z)

    def init_cache(self, batch_size: int) -> RecurrentCache:
        """Zero conv window and the objective's initial state (zero, or c I for a square state declared
        ``init: {identity: c}``), on the module's device and in its dtype."""
        w = self.in_proj.weight
        state = initial_states(self.obj.ir, batch_size, self.H, self.d, self.m, w.device, w.dtype)
        if getattr(self.obj.ir, "minibatch", 0):     # (an export's IR view has it only when set)
            state = ChunkCache(state, {})
        return RecurrentCache(self.conv.init_state(batch_size, w.device, w.dtype), state)

    def prefill(self, h: torch.Tensor, cache: RecurrentCache | None = None) -> tuple[torch.Tensor, RecurrentCache]:
        """A prompt h ``[B, T, d_model]`` through the parallel (chunked) path, continuing ``cache``
        (a fresh one when None) -> (``[B, T, d_model]``, the cache after its last token): the same
        as ``step`` over every token, for one parallel pass."""
        if cache is None:       # init_cache's dtypes (the weights'), as step keeps them under autocast
            cache = self.init_cache(h.shape[0])
        x, z = self._split_in(h)
        x, conv_state = self.conv.prefill(x, cache.conv)
        u = F.silu(x)
        if isinstance(cache.state, ChunkCache):
            y, S = self._chunk_prefill(self.project(u), cache.state)
        else:
            y, S = self._recur(self.project(u), self.param_values(), cache.state)
        return self._finish(y, u, z), RecurrentCache(conv_state, S)

    def step(self, h_t: torch.Tensor, cache: RecurrentCache) -> tuple[torch.Tensor, RecurrentCache]:
        """One token: h_t ``[B, d_model]`` -> (``[B, d_model]``, the next cache)."""
        x, z = self._split_in(h_t[:, None])
        u_t, conv_state = self.conv.step(x[:, 0], cache.conv)
        u = F.silu(u_t)[:, None]
        if isinstance(cache.state, ChunkCache):
            y, S = self._chunk_step(self.project(u), cache.state)
        else:
            y, S = self._recur(self.project(u), self.param_values(), state=cache.state)
        return self._finish(y, u, z)[:, 0], RecurrentCache(conv_state, S)

    def state_elements(self) -> int:
        """Numbers of recurrent state one sequence carries, every declared state counted (``[H, d, m]``
        each, ``[H, m, m]`` for a square one; the iso-state measure; the conv window's ``D * (k - 1)`` is
        not counted)."""
        return self.obj.state_elements(self.H, self.d, self.m)

    def _chunk_prefill(self, inputs: dict, chunk: ChunkCache):
        """A prompt through a mini-batch objective, continuing ``chunk``: the chunk's pending tokens and
        the prompt from the chunk's start, in two parallel calls (the whole chunks, then the last partial
        one from the state they end in), so the chunks stay aligned as in ``step``."""
        pending = next(iter(chunk.inputs.values())).shape[1] if chunk.inputs else 0
        if pending:
            inputs = {k: torch.cat([chunk.inputs[k], v], dim=1) for k, v in inputs.items()}
        T, C = next(iter(inputs.values())).shape[1], self.obj.ir.minibatch
        whole = T - T % C
        y, S = self._recur({k: v[:, :whole] for k, v in inputs.items()}, self.param_values(), chunk.start) \
            if whole else (None, chunk.start)
        rest = {k: v[:, whole:] for k, v in inputs.items()}
        if T > whole:
            y_rest, _ = self._recur(rest, self.param_values(), S)
            y = y_rest if y is None else torch.cat([y, y_rest], dim=1)
        return y[:, pending:], ChunkCache(S, rest if T > whole else {})

    def _chunk_step(self, inputs: dict, chunk: ChunkCache):
        """One token of a mini-batch objective: the chunk so far and this token from the chunk's
        starting state; the chunk's final state starts the next one once it holds C tokens."""
        if chunk.inputs:
            inputs = {k: torch.cat([chunk.inputs[k], v], dim=1) for k, v in inputs.items()}
        y, S = self._recur(inputs, self.param_values(), state=chunk.start)
        full = next(iter(inputs.values())).shape[1] == self.obj.ir.minibatch
        return y[:, -1:], ChunkCache(S, {}) if full else ChunkCache(chunk.start, inputs)

    def trace_states(self, h: torch.Tensor, every: int = 1) -> torch.Tensor:
        """States over time for inputs h ``[B, T, d_model]``: ``[B, T // every, H, d, m]``.

        With several states, the state the output reads (``CompiledObjective.traced_state``: the
        last declared state the output reads), so that state statistics describe the memory read.
        With a retention/insertion mitigation the mitigated recurrence is traced; the
        sliding window has no single state, so its trace is the unmitigated one.
        """
        x, _ = self._split_in(h)
        u = F.silu(self.conv(x))
        return self._active_objective().trace(self.project(u), self.param_values(), every=every)

    def set_mitigation(self, mitigation: Mitigation | None) -> None:
        """Apply a training-free mitigation (``None``: none); refusals raise ``SsmcraftError``."""
        mitigation = mitigation or Mitigation()
        self._scaled_obj = (self.obj.mitigated(retention=mitigation.retention, insertion=mitigation.insertion)
                            if mitigation.scales else None)
        self.mitigation = mitigation

    def describe(self) -> dict[str, Any]:
        spec = self.obj.spec
        return {"kind": "objective", "objective": spec.name,
                "structure": getattr(self.obj, "structure_kind", None), "heads": self.H,
                "d": self.d, "m": self.m, "value_input": self.value_name,
                "state_elements": self.state_elements(),
                "inputs": {n: {"route": self.route[n], "activation": self.activation[n],
                               "normalize": bool(spec.inputs[n].normalize)} for n in spec.inputs},
                "params": {n: {"shape": [self.H, *(self.sizes[s] for s in d.shape)],
                               "constraint": "negative" if d.negative else "positive" if d.positive else None,
                               "trainable": bool(d.trainable)} for n, d in self.param_decls.items()}}
