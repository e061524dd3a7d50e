"""Family ``general``: general and nonlinear updates, a fused sequential kernel generated per
objective with a symbolically derived backward (``recurrent.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.general import recurrent

FAMILY = KernelFamily(name="general", backend="general", module=recurrent, supports=recurrent.supports,
                      prepare=recurrent.prepare, forward=recurrent.forward,
                      generated_source=recurrent.generated_source, varlen=None)
