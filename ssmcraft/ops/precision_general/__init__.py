"""Family ``precision_general``: the metric (second-order) compositions that ``precision_rank1`` does
not run (two keys, linear, Huber or Cauchy data terms, implicit updates, per-channel steps): the
precision's gains by its float64 kernels, the memory's step over those gains on ``rank1_chunk`` /
``rankr_chunk`` (a per-head step linear in S) or on the ``general`` family's kernel generated for it
(``step.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.precision_general import step

FAMILY = KernelFamily(name="precision_general", backend=step.BACKEND_NAME, module=step, supports=step.supports,
                      prepare=step.prepare, supports_inputs=step.supports_inputs, forward=None,
                      varlen=None)
