"""Family ``precision_rank1``: recursive least squares and the preconditioned delta rule, split into
their precision (a chunked float64 Triton recurrence that never reads the memory) and a rank-1 memory
update run by ``rank1_chunk``'s chunked function (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.precision_rank1 import chunk

FAMILY = KernelFamily(name="precision_rank1", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, supports_inputs=chunk.supports_inputs,
                      supports_sizes=chunk.supports_sizes, varlen=None)
# not exported (no ``forward``): ``supports`` probes the objective's generated reference module
