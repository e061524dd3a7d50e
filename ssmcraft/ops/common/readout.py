"""The readout's scale and offset on a family's kernel output, for the families' ``forward`` (the
exported path): a module of its own, light enough for an exported bundle to import."""
from __future__ import annotations

import torch


def finish_laid_out(y: torch.Tensor, co: dict, B: int, T: int, H: int) -> torch.Tensor:
    """``slots.CallSlots.finish`` on laid-out coefficients (``reference.layout``: slot -> tensor
    ``[B|1, T|1, H|1, r, c]`` or number), the families' ``forward`` path: ``oc * y + oh`` on
    ``y [B, T, H, d]``."""
    oc = co.get("oc", 1)
    if isinstance(oc, torch.Tensor):
        y = y * oc.expand(B, T, H, oc.shape[-2], 1).reshape(B, T, H, oc.shape[-2])
    elif float(oc) != 1.0:
        y = y * float(oc)
    oh = co.get("oh")
    if oh is not None:
        y = y + (oh.reshape(*oh.shape[:3], -1) if isinstance(oh, torch.Tensor) else float(oh))
    return y
