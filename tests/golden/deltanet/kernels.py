# family: rank1_chunk (ssmcraft/ops/rank1_chunk/)
# hand-written kernels specialised by constexpr modes: no per-objective source
