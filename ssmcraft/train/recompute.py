"""``train.activation_checkpointing``: each block's activations recomputed in the backward.

Every block of the LM (``model.blocks``) keeps only its input during the forward and runs its
forward again in the backward (``torch.utils.checkpoint``, non-reentrant), trading one more forward
for the activation memory of the whole stack; the gradients are those of the plain step. The block
instances are wrapped in place, so the parameter names (the weights file, a resume checkpoint)
are unchanged. No block draws random numbers, so the RNG state is not stashed for the replay.

The CUDA-graph step does not combine with it (``graphed.graphs_decision``: ``auto`` turns the
graphs off, ``true`` is refused): the recomputation inside a captured backward is not a path this
project has tested.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def recompute_blocks(model: torch.nn.Module) -> int:
    """Wrap each block's forward of ``model`` in activation checkpointing; returns how many."""
    blocks = list(getattr(model, "blocks", ()))
    for block in blocks:
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False,
                                          preserve_rng_state=False)
    return len(blocks)
