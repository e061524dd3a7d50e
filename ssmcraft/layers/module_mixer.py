"""Any ``nn.Module`` as a mixer: a factory named by a module path in the model config.

``{kind: module, module: "package.module:factory", options: {...}}`` builds
``factory(**{d_model_arg: d_model}, **options)`` (FLA's layers take the width as
``hidden_size``: ``d_model_arg: hidden_size``). The module maps hidden states ``[B, T, d_model]``
to ``[B, T, d_model]``; a tuple output (FLA's ``(o, attentions, past_key_values)``) gives its
first item.

Optional hooks on the built module, used when present:
- ``state_elements() -> int | None``: numbers of state one sequence carries (iso-state
  accounting; the config's ``state_elements`` overrides it);
- ``init_cache(batch_size)`` and ``step(h_t [B, d_model], cache) -> (y_t [B, d_model], cache)``:
  recurrent decoding (``LM.step``); without them the LM decodes only by its parallel forward;
- ``prefill(h [B, T, d_model]) -> (y [B, T, d_model], cache)``: a prompt in parallel, giving the
  cache ``step`` continues from (``LM.prefill``).

Importing the factory's module runs its code: a module path in a spec is code its author chose to
run. Nothing from the spec is evaluated (``ssmcraft.modpath``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ssmcraft.errors import SpecError, SsmcraftError
from ssmcraft.layers.config import ModuleMixerConfig
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.modpath import load_object


class ModuleMixer(nn.Module):
    """The wrapper around a user's mixer module (module docstring); ``inner`` is that module."""

    def __init__(self, cfg: ModuleMixerConfig, d_model: int):
        super().__init__()
        factory = load_object(cfg.module, "<mixer>", "module")
        if not callable(factory):
            raise SpecError("<mixer>", "module", f"{cfg.module} is not callable (a class or a function)")
        try:
            inner = factory(**{cfg.d_model_arg: d_model}, **dict(cfg.options))
        except TypeError as e:
            raise SpecError("<mixer>", "options", f"{cfg.module}({cfg.d_model_arg}={d_model}, "
                            f"{', '.join(f'{k}=...' for k in cfg.options)}) failed: {e}") from None
        if not isinstance(inner, nn.Module):
            raise SpecError("<mixer>", "module", f"{cfg.module} returned a {type(inner).__name__}, not an nn.Module")
        fixed = cfg.state_elements
        if fixed is not None and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 0):
            raise SpecError("<mixer>", "state_elements", f"expected a non-negative integer or null, got {fixed!r}")
        self.cfg, self.d_model, self.inner = cfg, d_model, inner
        self.last_backend = "module"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h ``[B, T, d_model]`` -> ``[B, T, d_model]``."""
        y = self.inner(h)
        if isinstance(y, tuple):
            y = y[0]
        if not isinstance(y, torch.Tensor) or y.shape != h.shape:
            got = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise SsmcraftError(f"mixer {self.cfg.module}: returned {got} for input {list(h.shape)}; a mixer maps "
                                "[B, T, d_model] to the same shape")
        return y

    def _hook(self, name: str, needs: str = "recurrent decoding needs init_cache(batch) and step(h_t, cache)"):
        hook = getattr(self.inner, name, None)
        if hook is None:
            raise SsmcraftError(f"mixer {self.cfg.module} has no {name}(); {needs}")
        return hook

    def init_cache(self, batch_size: int):
        return self._hook("init_cache")(batch_size)

    def prefill(self, h: torch.Tensor, cache=None) -> tuple[torch.Tensor, Any]:
        """A prompt h ``[B, T, d_model]`` -> (``[B, T, d_model]``, its cache), by the module's ``prefill``."""
        if cache is not None:
            raise SsmcraftError(f"mixer {self.cfg.module}: prefill starts from an empty cache (cache=None)")
        return self._hook("prefill", "parallel prefill needs prefill(h) -> (y, cache)")(h)

    def step(self, h_t: torch.Tensor, cache) -> tuple[torch.Tensor, Any]:
        """One token: h_t ``[B, d_model]`` -> (``[B, d_model]``, the next cache), by the module's ``step``."""
        return self._hook("step")(h_t, cache)

    def state_elements(self) -> int | None:
        """The config's ``state_elements``, else the module's ``state_elements()``, else None (unknown)."""
        if self.cfg.state_elements is not None:
            return int(self.cfg.state_elements)
        hook = getattr(self.inner, "state_elements", None)
        return None if hook is None else hook()

    def trace_states(self, h: torch.Tensor, every: int = 1) -> torch.Tensor:
        raise SsmcraftError(f"mixer {self.cfg.module}: a module mixer's state is not traced")

    def set_mitigation(self, mitigation: Mitigation | None) -> None:
        if mitigation is not None and not mitigation.is_identity:
            raise SsmcraftError(f"mitigation {mitigation.label()} does not apply to module mixer {self.cfg.module}")

    def describe(self) -> dict[str, Any]:
        return {"kind": "module", "module": self.cfg.module, "options": dict(self.cfg.options),
                "class": type(self.inner).__name__, "state_elements": self.state_elements(),
                "n_params": sum(p.numel() for p in self.inner.parameters())}
