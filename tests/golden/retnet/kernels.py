# family: keydecay_chunk (ssmcraft/ops/keydecay_chunk/)
# hand-written kernels specialised by constexpr modes: no per-objective source
