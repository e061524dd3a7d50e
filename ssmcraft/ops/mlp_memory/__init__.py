"""Family ``mlp_memory``: a memory that is a two-layer MLP (two weight states of different shapes over a
hidden width) stepped by the gradient of a regression loss, TTT-MLP / Titans style: one fused
sequential kernel per direction (``recurrent.py``)."""
from ssmcraft.ops.family import KernelFamily, recorded_match
from ssmcraft.ops.mlp_memory import recurrent

# exported with the roles ``recurrent.match`` reads off the IR (its declarations and a probe of its
# generated reference module) recorded as data
FAMILY = KernelFamily(name="mlp_memory", backend=recurrent.BACKEND_NAME, module=recurrent,
                      supports=recurrent.supports, prepare=recurrent.prepare, forward=recurrent.forward,
                      export_exclude=frozenset({"prepare", "supports", "match", "_structure", "_probe"}),
                      export_tail=recorded_match(recurrent.match, "the MLP memory kernels"), varlen=None)
