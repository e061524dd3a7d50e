"""What runs a compiled objective: ``CompiledObjective`` and ``ssmcraft.compile`` (``objective``),
the path per call signature (``dispatch``), the kernel family that runs it (``select``, over
``ssmcraft.ops.registry``), CUDA graphs (``graphs``), timing and the checking helpers the tests and
benchmarks share."""
