# family: mlp_memory (ssmcraft/ops/mlp_memory/)
# hand-written kernels specialised by constexpr modes: no per-objective source
