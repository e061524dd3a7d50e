"""Family ``decode``: one-token calls of every structure, in one fused Triton kernel (``step.py``)."""
from ssmcraft.ops.decode import step
from ssmcraft.ops.family import KernelFamily

FAMILY = KernelFamily(name="decode", backend=step.BACKEND_NAME, module=step, supports=step.supports,
                      prepare=step.prepare, supports_inputs=step.supports_inputs, one_token=True)
