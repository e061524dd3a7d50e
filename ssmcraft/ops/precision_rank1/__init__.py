"""Family ``precision_rank1``: recursive least squares and the preconditioned delta rule, split into
their precision (a chunked float64 Triton recurrence that never reads the memory) and a rank-1 memory
update run by ``rank1_chunk``'s chunked function (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily, recorded_match
from ssmcraft.ops.precision_rank1 import chunk

# exported with the roles ``chunk.match`` reads off the IR (its structure and a probe of its generated
# reference module) recorded as data
FAMILY = KernelFamily(name="precision_rank1", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, supports_inputs=chunk.supports_inputs,
                      supports_sizes=chunk.supports_sizes, varlen=None,
                      export_exclude=frozenset({"prepare", "supports", "supports_inputs", "supports_sizes", "match",
                                                "_leaf", "_structure", "_probe", "covariance_and_memory"}),
                      export_tail=recorded_match(chunk.match, "the precision kernels"))
