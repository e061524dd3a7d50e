"""Family ``rank1_row_chunk``: identity-minus-rank-1 recurrences with a per-row step and no decay
(Longhorn exact), a per-head one (Gated Longhorn) or a per-row one (wd_longhorn; ``rowdecay.py``),
chunked: per chunk of tokens one shared-matrix triangular system per state row, its products on tensor
cores (``chunk.py``). Its float64 reference is ``rank1_row``'s ``naive.py``. On CUDA it goes ahead of
``rank1_row`` (with a per-head decay where ``chunk.DECAY_AHEAD``, a per-row one where
``chunk.ROW_DECAY_AHEAD``) for keys of ``chunk.MIN_KEYS`` or more, where it was measured faster."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.rank1_row_chunk import chunk

FAMILY = KernelFamily(name="rank1_row_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, varlen=None,
                      supports_inputs=chunk.supports_inputs, supports_sizes=chunk.supports_sizes,
                      ahead_on_gpu=("rank1_row", chunk.per_row_step),
                      # the dispatch's checks (rank1_row's supports among them) stay in ssmcraft: an exported
                      # module runs the family it was exported with
                      export_exclude=frozenset({"prepare", "supports", "supports_inputs", "supports_sizes",
                                                 "_one_key_reason", "per_row_step", "_decay"}))
