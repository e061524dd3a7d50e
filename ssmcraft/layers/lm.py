"""The small LM: embedding, N x (RMSNorm, mixer, RMSNorm, gated MLP), final RMSNorm, tied head.

tokens ``[B, T]`` int64 -> logits ``[B, T, V]``. ``step`` runs one token with per-layer
caches (constant size for objective mixers and sliding-window attention, growing for full
attention) and matches ``forward``; ``prefill`` runs a prompt in parallel and returns those
caches. A hybrid stack places a mixer per layer
(``LMConfig.layers``, ``config.layer_mixers``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmcraft.layers.attention import AttentionMixer
from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers.config import AttentionConfig, LMConfig, ModuleMixerConfig, ObjectiveMixerConfig, layer_mixers, \
    mixer_config
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.layers.mixer import ObjectiveMixer
from ssmcraft.layers.module_mixer import ModuleMixer
from ssmcraft.runtime.lookup import compile_objective


DOC_START = 1 << 30     # an input id plus DOC_START: that token begins a document (packed text, task.pack)


def document_offsets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents: tokens ``[B, T]`` whose ids carry ``DOC_START`` where a document begins ->
    (the plain ids, int32 offsets ``[N + 1]`` of the documents in the rows laid end to end, each row
    starting one). Reads the flags to the host once (the kernels' chunk indices need the offsets)."""
    B, T = tokens.shape
    flagged = tokens >= DOC_START
    starts = flagged.clone()
    starts[:, 0] = True
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.full((1,), B * T, dtype=first.dtype, device=first.device)
    return torch.where(flagged, tokens - DOC_START, tokens), torch.cat([first, end]).to(torch.int32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., dim]``, normalised in float32 and cast back."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, hidden size ``round(ratio * d_model)``."""

    def __init__(self, d_model: int, ratio: float):
        super().__init__()
        hidden = max(1, int(round(ratio * d_model)))
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


def build_mixer(mixer: dict, d_model: int, objective: Any = None) -> nn.Module:
    """A mixer module from its config mapping (``kind`` objective, attention or module)."""
    cfg = mixer_config(mixer)
    if isinstance(cfg, AttentionConfig):
        return AttentionMixer(cfg, d_model)
    if isinstance(cfg, ModuleMixerConfig):
        return ModuleMixer(cfg, d_model)
    return ObjectiveMixer(cfg, d_model, objective)


class Block(nn.Module):
    """One layer; ``mixer`` its mixer's config mapping (``cfg.mixer`` when not given)."""

    def __init__(self, cfg: LMConfig, objective: Any = None, mixer: dict | None = None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(cfg.mixer if mixer is None else mixer, cfg.d_model, objective)
        self.mlp = GatedMLP(cfg.d_model, cfg.mlp_ratio) if cfg.mlp_ratio > 0 else None
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps) if self.mlp is not None else None

    def forward(self, h: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``cu_seqlens``: packed documents (``LM.hidden``), which objective and attention mixers run."""
        if cu_seqlens is None:
            return self._residual(h, self.mixer(self.norm1(h)))
        if not isinstance(self.mixer, (ObjectiveMixer, AttentionMixer)):
            raise SsmcraftError(f"packed documents (task.pack) need objective or attention mixers; a "
                                f"{type(self.mixer).__name__} layer cannot be told the document boundaries "
                                "(set task.pack: false)")
        return self._residual(h, self.mixer(self.norm1(h), cu_seqlens))

    def _residual(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = h + y
        return h + self.mlp(self.norm2(h)) if self.mlp is not None else h

    def prefill(self, h: torch.Tensor):
        y, cache = self.mixer.prefill(self.norm1(h))
        return self._residual(h, y), cache

    def step(self, h_t: torch.Tensor, cache):
        y, cache = self.mixer.step(self.norm1(h_t), cache)
        return self._residual(h_t, y), cache


class LM(nn.Module):
    """A language model over ``cfg.vocab_size`` tokens.

    ``objective``: a compiled objective shared by every objective layer (else the mixer
    config's ``objective`` is compiled once here). Attention mixers ignore it.
    A mixer setting a layer refuses (e.g. heads that do not divide d_model) is a ``SpecError``
    from source ``<mixer>`` keyed from the model section (``mixer.heads``, ``layers[1].mixer.heads``).
    """

    def __init__(self, cfg: LMConfig, objective: Any = None):
        super().__init__()
        self.cfg = cfg
        self.layout = layer_mixers(cfg)
        if objective is None and isinstance(mixer_config(cfg.mixer), ObjectiveMixerConfig):
            objective = compile_objective(mixer_config(cfg.mixer).objective)
        self.objective = objective
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.blocks = nn.ModuleList(self._block(where, mixer) for where, mixer in self.layout)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.documents = False          # inputs carry document starts (a packing task sets it: train.loop)

    def _block(self, where: str, mixer: dict) -> Block:
        try:
            return Block(self.cfg, self.objective, mixer)
        except SpecError as e:
            if e.source != "<mixer>":
                raise
            raise SpecError("<mixer>", f"{where}.{e.key}", e.problem) from None

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` -> final normalised hidden states ``[B, T, d_model]``. With ``documents``
        set, tokens flagged ``DOC_START`` begin a document (``ssmcraft.tasks.base``): every layer
        restarts its state there, and at each row's start."""
        cu_seqlens = None
        if self.documents:
            tokens, cu_seqlens = document_offsets(tokens)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h) if cu_seqlens is None else block(h, cu_seqlens)
        return self.norm_f(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` int64 -> logits ``[B, T, V]`` (head tied to the embedding)."""
        return F.linear(self.hidden(tokens), self.embed.weight)

    def init_cache(self, batch_size: int) -> list:
        return [b.mixer.init_cache(batch_size) for b in self.blocks]

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list]:
        """A prompt ``[B, T]`` in one parallel pass (each mixer's parallel path: the objective's
        chunked or row kernel, attention's SDPA) -> (logits
        ``[B, T, V]``, the caches after its last token, as ``init_cache`` + ``step`` over every
        token would leave them); decode on with ``step``."""
        h = self.embed(tokens)
        caches = []
        for block in self.blocks:
            h, cache = block.prefill(h)
            caches.append(cache)
        return F.linear(self.norm_f(h), self.embed.weight), caches

    def step(self, token_t: torch.Tensor, caches: list) -> tuple[torch.Tensor, list]:
        """token_t ``[B]`` -> (logits ``[B, V]``, the next caches)."""
        h = self.embed(token_t)
        new = []
        for block, cache in zip(self.blocks, caches):
            h, cache = block.step(h, cache)
            new.append(cache)
        return F.linear(self.norm_f(h), self.embed.weight), new

    @property
    def mixers(self) -> list[nn.Module]:
        return [b.mixer for b in self.blocks]

    @property
    def recurrent_layers(self) -> list[int]:
        """Indices of the layers whose mixer has a recurrent state to trace (objective mixers)."""
        return [i for i, m in enumerate(self.mixers) if isinstance(m, ObjectiveMixer)]

    def set_mitigation(self, mitigation: Mitigation | None) -> None:
        """Apply a training-free mitigation to every recurrent layer. In a hybrid the attention
        layers keep their plain form (they have no state to scale); a model with no recurrent
        layer refuses a mitigation (``SsmcraftError`` from its mixers)."""
        recurrent = self.recurrent_layers
        for i, mixer in enumerate(self.mixers):
            if i in recurrent or not recurrent:
                mixer.set_mitigation(mitigation)

    def state_elements(self) -> int | None:
        """Numbers of state one sequence carries through every layer (``state_elements`` of each
        mixer: objective states, sliding-window caches); None when a layer's cache grows with the
        context (full attention)."""
        sizes = [m.state_elements() for m in self.mixers]
        return None if any(s is None for s in sizes) else sum(sizes)

    def layout_labels(self) -> list[str]:
        """One word per layer: ``objective``, ``attention``, ``swa<window>`` or ``module``."""
        return [mixer_label(m.describe()) for m in self.mixers]

    def backends(self) -> list[str]:
        """The recurrence path each mixer last ran (``None`` before the first forward)."""
        return sorted({str(m.last_backend) for m in self.mixers})

    def describe(self) -> dict[str, Any]:
        """Sizes, config, layout, and ``mixer``: the first objective layer's description (the
        first layer's when none is recurrent)."""
        first = self.recurrent_layers[:1] or [0]
        return {"n_params": sum(p.numel() for p in self.parameters()), "config": self.cfg.to_dict(),
                "layout": self.layout_labels(),
                "mixer": self.mixers[first[0]].describe() if self.mixers else None}


def mixer_label(described: dict) -> str:
    """A layer's short label from its mixer's ``describe()``."""
    if described.get("kind") == "attention" and described.get("window"):
        return f"swa{described['window']}"
    return str(described.get("kind"))
