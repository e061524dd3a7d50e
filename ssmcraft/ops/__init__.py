"""The Triton kernels, one folder per kernel family (``ssmcraft/ops/<family>/``, declared by a
``KernelFamily`` in its ``__init__.py`` and listed in ``ssmcraft.ops.registry``), with what the
families share in ``common/`` and the source generators in ``codegen/``."""
