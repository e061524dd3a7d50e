"""Family ``block_rank1_row_chunk``: two states updated by one rank-1 step of an extrapolated state
(``ssmcraft.compiler.blockrank1``: Longhorn with momentum) with the state weights per head, chunked: per
chunk of tokens one shared-matrix triangular system per state row, its per-head weights (the chunk's
products of transitions) from small kernels of their own (``weights.py``), its products on tensor cores
(``chunk.py``, kernels in ``kernels.py``). Its float64 reference is ``block_rank1_row``'s ``naive.py``.
On CUDA it goes ahead of ``block_rank1_row`` where ``chunk.AHEAD`` (measured faster), for keys of
``chunk.MIN_KEYS`` or more."""
from ssmcraft.ops.block_rank1_row_chunk import chunk
from ssmcraft.ops.family import KernelFamily

FAMILY = KernelFamily(name="block_rank1_row_chunk", backend=chunk.BACKEND_NAME, module=chunk,
                      supports=chunk.supports, prepare=chunk.prepare,
                      supports_inputs=chunk.supports_inputs, supports_sizes=chunk.supports_sizes,
                      ahead_on_gpu=("block_rank1_row", chunk.ahead))
