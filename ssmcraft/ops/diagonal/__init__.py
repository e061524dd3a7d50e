"""Family ``diagonal``: every scalar or elementwise decay (Mamba's over ``(d, m)``), chunked kernels
generated per objective (``chunk.py``; the generator is ``ssmcraft.ops.codegen.diagonal``)."""
from ssmcraft.ops.diagonal import chunk
from ssmcraft.ops.family import KernelFamily

FAMILY = KernelFamily(name="diagonal", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, generated_source=chunk.generated_source,
                      export_exclude=chunk.EXPORT_EXCLUDE, export_tail=chunk.export_tail,
                      varlen=None)
