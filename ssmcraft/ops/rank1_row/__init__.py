"""Family ``rank1_row``: identity-minus-rank-1 recurrences with a per-row or per-head step (Longhorn,
DeltaNet on CPU), one program per block of state rows (``recurrent.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.rank1_row import recurrent

FAMILY = KernelFamily(name="rank1_row", backend="rank1-row", module=recurrent, supports=recurrent.supports,
                      prepare=recurrent.prepare, forward=recurrent.forward, varlen=None,
                      export_exclude=frozenset({"prepare", "packing"}))
