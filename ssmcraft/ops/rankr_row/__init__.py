"""Family ``rankr_row``: diagonal-plus-rank-r recurrences (several keys, Woodbury updates), the
general generator run row-tiled (``recurrent.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.rankr_row import recurrent

FAMILY = KernelFamily(name="rankr_row", backend=recurrent.BACKEND_NAME, module=recurrent,
                      supports=recurrent.supports, prepare=recurrent.prepare, forward=recurrent.forward,
                      generated_source=recurrent.generated_source, varlen=None)
