"""The Triton source generators: sympy expressions to Triton (``triton_printer``), the diagonal
family's chunked kernels (``diagonal``) and the fused prologue of computed slots (``prologue``).
The general family's generator lives with its kernels (``ssmcraft.ops.general.recurrent``)."""
