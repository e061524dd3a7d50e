"""The small LM: embedding, N x (RMSNorm, mixer, RMSNorm, gated MLP), final RMSNorm, tied head.

tokens ``[B, T]`` int64 -> logits ``[B, T, V]``. ``step`` runs one token with per-layer
caches (constant size for objective mixers) and matches ``forward``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmcraft.layers.attention import AttentionMixer
from ssmcraft.layers.config import AttentionConfig, LMConfig, mixer_config
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.layers.mixer import ObjectiveMixer
from ssmcraft.layers.objectives import compile_objective


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
    """A mixer module from its config mapping (``kind`` objective or attention)."""
    cfg = mixer_config(mixer)
    if isinstance(cfg, AttentionConfig):
        return AttentionMixer(cfg, d_model)
    return ObjectiveMixer(cfg, d_model, objective)


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, objective: Any = None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(cfg.mixer, cfg.d_model, objective)
        self.mlp = GatedMLP(cfg.d_model, cfg.mlp_ratio) if cfg.mlp_ratio > 0 else None
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps) if self.mlp is not None else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(self.norm1(h))
        return h + self.mlp(self.norm2(h)) if self.mlp is not None else h

    def step(self, h_t: torch.Tensor, cache):
        y, cache = self.mixer.step(self.norm1(h_t), cache)
        h_t = h_t + y
        if self.mlp is not None:
            h_t = h_t + self.mlp(self.norm2(h_t))
        return h_t, cache


class LM(nn.Module):
    """A language model over ``cfg.vocab_size`` tokens.

    ``objective``: a compiled objective shared by every layer (else the mixer config's
    ``objective`` is compiled once here). Attention mixers ignore it.
    """

    def __init__(self, cfg: LMConfig, objective: Any = None):
        super().__init__()
        self.cfg = cfg
        mcfg = mixer_config(cfg.mixer)
        if objective is None and not isinstance(mcfg, AttentionConfig):
            objective = compile_objective(mcfg.objective)
        self.objective = objective
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, objective) for _ in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` -> final normalised hidden states ``[B, T, d_model]``."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.norm_f(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` int64 -> logits ``[B, T, V]`` (head tied to the embedding)."""
        return F.linear(self.hidden(tokens), self.embed.weight)

    def init_cache(self, batch_size: int) -> list:
        return [b.mixer.init_cache(batch_size) for b in self.blocks]

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

    def set_mitigation(self, mitigation: Mitigation | None) -> None:
        for mixer in self.mixers:
            mixer.set_mitigation(mitigation)

    def backends(self) -> list[str]:
        """The recurrence path each mixer last ran (``None`` before the first forward)."""
        return sorted({str(m.last_backend) for m in self.mixers})

    def describe(self) -> dict[str, Any]:
        return {"n_params": sum(p.numel() for p in self.parameters()), "config": self.cfg.to_dict(),
                "mixer": self.mixers[0].describe() if self.mixers else None}
