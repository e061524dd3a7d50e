"""Family ``rankr_chunk``: chunked identity-minus-rank-r recurrences with a per-head step (two-key
explicit, decay-explicit and Woodbury-implicit updates), on ``rank1_chunk``'s tensor-core kernels
with R terms per token (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.rankr_chunk import chunk

FAMILY = KernelFamily(name="rankr_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, supports_inputs=chunk.supports_inputs,
                      supports_sizes=chunk.supports_sizes, ahead_on_gpu=("rankr_row", chunk.per_head_step),
                      varlen=None)
