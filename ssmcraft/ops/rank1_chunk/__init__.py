"""Family ``rank1_chunk``: chunked identity-minus-rank-1 recurrences with a per-head step (DeltaNet,
Gated DeltaNet), on tensor cores (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.rank1_chunk import chunk


def per_head_step(ir) -> bool:
    """A rank-1 update whose step ``c`` is one number per head: on CUDA the chunked kernel is the
    fast one, so it is tried before ``rank1_row``."""
    return ir.kind == "rank1" and ir.is_per_head_step()


FAMILY = KernelFamily(name="rank1_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, supports_inputs=chunk.supports_inputs,
                      supports_sizes=chunk.supports_sizes, ahead_on_gpu=("rank1_row", per_head_step), varlen=None)
