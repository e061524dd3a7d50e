"""The exported language model: ``from_pretrained``, recurrent ``step`` and ``generate``.

Part of ssmcraft and copied into exported modules (not into ``--layer-only`` ones); the
same rules as ``ssmcraft.export.runtime`` apply.
"""
from __future__ import annotations

import math
import numbers
import os

import torch
import torch.nn.functional as F

from ssmcraft.errors import SsmcraftError
from ssmcraft.export.runtime import (CONFIG_FILE, MODEL_CONFIG, OBJECTIVE, WEIGHTS_FILE, _shape, check_cache,
                                     check_count, check_tokens, default_dir, load_safetensors, load_weights,
                                     read_config)
from ssmcraft.layers.config import LMConfig
from ssmcraft.layers.attention import AttentionMixer, KVCache
from ssmcraft.layers.lm import LM
from ssmcraft.layers.mixer import ObjectiveMixer


def check_kv_cache(mixer: AttentionMixer, cache, batch_size: int, where: str) -> None:
    """An attention layer's cache (``init_cache``/``prefill``'s): keys and values ``[B, H, t, d_head]``,
    ``t`` the window's slots with a window, any length without."""
    want = (batch_size, mixer.H, mixer.window or None, mixer.hd)

    def fits(t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 4 and all(w in (None, g) for w, g in zip(want, t.shape))

    if not (isinstance(cache, KVCache) and fits(cache.k) and fits(cache.v)):
        got = (f"keys {_shape(cache.k)}, values {_shape(cache.v)}" if isinstance(cache, KVCache)
               else type(cache).__name__)
        raise SsmcraftError(f"{where}: expected an attention cache from init_state({batch_size}) (keys and values "
                            f"[{batch_size}, {mixer.H}, {mixer.window or 't'}, {mixer.hd}]), got {got}")


class Model(LM):
    """The exported LM: ``tokens [B, T]`` int64 -> ``logits [B, T, V]`` (parallel form).

    Recurrent form, with a state whose size does not grow with the sequence::

        state = model.init_state(batch_size)          # per layer: conv window + [B, H, d, m]
        logits_t, state = model.step(token_t, state)  # token_t [B] -> logits_t [B, V]

    ``logits, state = model.prefill(tokens)`` runs a prompt ``[B, T]`` in one parallel pass and
    returns the state ``step`` continues from. ``generate(ids, max_new_tokens)`` prefills the
    prompt and runs the new tokens through ``step``.
    ``model.backend`` says which recurrence path ran last (``triton`` or
    ``torch-vectorised``; see ``Objective``).
    """

    def __init__(self, config: dict | None = None, source: str = "config.json"):
        config = dict(config if config is not None else MODEL_CONFIG)
        super().__init__(LMConfig.from_dict(config, source, "model"), OBJECTIVE)

    @classmethod
    def from_pretrained(cls, path: str | None = None, device="cpu", dtype: torch.dtype | None = None) -> "Model":
        """The trained model in ``path`` (default: the folder of this module), in eval mode."""
        path = path or default_dir()
        config = read_config(path)
        model = cls(config["model"], os.path.join(path, CONFIG_FILE))
        weights = os.path.join(path, WEIGHTS_FILE)
        if not os.path.isfile(weights):
            raise SsmcraftError(f"{path}: no {WEIGHTS_FILE}")
        load_weights(model, load_safetensors(weights), path)
        model = model.to(device)
        if dtype is not None:
            model = model.to(dtype)
        return model.eval()

    @property
    def backend(self) -> str | None:
        """The recurrence path the mixers ran last (None before the first call)."""
        names = [m.last_backend for m in self.mixers if m.last_backend is not None]
        return ",".join(sorted(set(names))) if names else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` int64 -> logits ``[B, T, V]``."""
        check_tokens(tokens, self.cfg.vocab_size, self.embed.weight.device, "Model: tokens")
        return super().forward(tokens)

    def init_state(self, batch_size: int = 1) -> list:
        """The recurrent state for ``batch_size`` sequences: one cache per layer."""
        return self.init_cache(check_count(batch_size, "init_state: batch_size"))

    def step(self, token_t: torch.Tensor, state: list) -> tuple[torch.Tensor, list]:
        """token_t ``[B]`` -> (logits ``[B, V]``, the next state); ``state`` from ``init_state(B)``
        or the previous ``step``."""
        check_tokens(token_t, self.cfg.vocab_size, self.embed.weight.device, "step: token_t", "[B]")
        if not isinstance(state, (list, tuple)) or len(state) != len(self.blocks):
            got = f"{len(state)} entries" if isinstance(state, (list, tuple)) else type(state).__name__
            raise SsmcraftError(f"step: state must hold one cache per layer ({len(self.blocks)}; from "
                                f"init_state), got {got}")
        for i, (block, cache) in enumerate(zip(self.blocks, state)):
            check = check_cache if isinstance(block.mixer, ObjectiveMixer) else check_kv_cache
            check(block.mixer, cache, token_t.shape[0], f"step: state[{i}]")
        return super().step(token_t, list(state))

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list]:
        """tokens ``[B, T]`` -> (logits ``[B, T, V]``, the state after the last token), in one
        parallel pass; the same as ``step`` over every token from ``init_state(B)``."""
        check_tokens(tokens, self.cfg.vocab_size, self.embed.weight.device, "prefill: tokens")
        return super().prefill(tokens)

    @staticmethod
    def state_size(state: list) -> int:
        """Number of elements of a recurrent state: every tensor of every layer's cache, each state of
        an objective with several (the same after any number of steps, except a mini-batch objective's,
        which also holds its chunk's inputs so far)."""
        def numel(x) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel()
            if isinstance(x, (tuple, list)):
                return sum(numel(v) for v in x)
            if isinstance(x, dict):
                return sum(numel(v) for v in x.values())
            return sum(numel(v) for v in vars(x).values()) if hasattr(x, "__dict__") else 0
        return sum(numel(cache) for cache in state)

    @torch.no_grad()
    def generate(self, ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``ids`` (``[T]`` or ``[B, T]``, ints) by ``max_new_tokens`` tokens.

        Greedy when ``temperature == 0``, else sampled from ``softmax(logits / temperature)``
        (restricted to the ``top_k`` most likely when given). Returns ``[B, T + max_new_tokens]``
        (``[T + max_new_tokens]`` for a 1-D prompt). The prompt runs in one parallel pass
        (``prefill``), the new tokens recurrently: memory does not grow with their number.
        """
        device = self.embed.weight.device
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids, device=device)
            except (TypeError, ValueError, RuntimeError) as e:
                why = " ".join(str(e).split())[:120]
                raise SsmcraftError(f"generate: ids must be token ids [T] or [B, T] ({why})") from None
        squeeze = ids.dim() == 1
        check_tokens(ids, self.cfg.vocab_size, device, "generate: ids", "[T]" if squeeze else "[B, T]")
        if squeeze:
            ids = ids[None]
        max_new_tokens = check_count(max_new_tokens, "generate: max_new_tokens", low=0)
        finite = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and math.isfinite(temperature)
        if not finite or temperature < 0:
            raise SsmcraftError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if top_k is not None:
            check_count(top_k, "generate: top_k")
        ids = ids.long()
        logits, state = self.prefill(ids)
        logits = logits[:, -1]
        out = [ids]
        for _ in range(max_new_tokens):
            nxt = self._pick(logits, temperature, top_k, generator)
            out.append(nxt[:, None])
            logits, state = self.step(nxt, state)
        result = torch.cat(out, dim=1)
        return result[0] if squeeze else result

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


def from_pretrained(path: str | None = None, device="cpu", dtype: torch.dtype | None = None) -> Model:
    """``Model.from_pretrained``: the trained model of an export folder (default: this module's)."""
    return Model.from_pretrained(path, device, dtype)
