# family: precision_rank1 (ssmcraft/ops/precision_rank1/)
# hand-written kernels specialised by constexpr modes: no per-objective source
