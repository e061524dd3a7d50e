"""Family ``block_rank1_row``: two states updated by one rank-1 step of an extrapolated state
(``ssmcraft.compiler.blockrank1``: Longhorn with momentum), one program per block of state rows
carrying both states (``recurrent.py``, kernels in ``kernels.py``)."""
from ssmcraft.ops.block_rank1_row import recurrent
from ssmcraft.ops.family import KernelFamily

FAMILY = KernelFamily(name="block_rank1_row", backend="block-rank1-row", module=recurrent,
                      supports=recurrent.supports, prepare=recurrent.prepare)
