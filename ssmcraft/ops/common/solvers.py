"""Triton solvers shared by the chunked kernels: the inverse of a unit lower-triangular chunk
matrix by block forward substitution written as tensor-core products (the WY / UT transform of the
chunked delta rule, ``ssmcraft.ops.rank1_chunk``)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def neumann4(Mi, Ao, PREC: tl.constexpr):
    """(D + Ao)^{-1} from Mi = D^{-1} when N = Mi Ao is nilpotent of order 4 (at most four
    diagonal blocks of D per block of the next level): (I - N)(I + N^2) D^{-1}. This is block
    forward substitution, written as tensor-core products."""
    N = tl.dot(Mi, Ao, input_precision=PREC)
    X = Mi + tl.dot(tl.dot(N, N, input_precision=PREC), Mi, input_precision=PREC)
    return X - tl.dot(N, X, input_precision=PREC)


@triton.jit
def solve_unit_lower(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^{-1} for A [BT, BT] strictly lower triangular (fp32), BT in {16, 32, 64}.

    Three levels of block forward substitution, each exact because a block holds at most four
    blocks of the level below: 4 x 4 diagonal blocks as (I - A4)(I + A4^2) (A4^4 = 0), then
    16 x 16, then 64 x 64 blocks by :func:`neumann4`. Only matrix products: no serial
    row-by-row loop (which costs a cross-warp reduction per row).
    """
    o = tl.arange(0, BT)
    r = o[:, None] // 4
    cc = o[None, :] // 4
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    A4 = tl.where(r == cc, A, 0.)
    X = eye + tl.dot(A4, A4, input_precision=PREC)
    Mi = X - tl.dot(A4, X, input_precision=PREC)                     # 4 x 4 blocks
    Mi = neumann4(Mi, tl.where(((r // 4) == (cc // 4)) & (r != cc), A, 0.), PREC)   # 16 x 16
    if BT > 16:
        Mi = neumann4(Mi, tl.where((r // 4) != (cc // 4), A, 0.), PREC)           # 64 x 64
    return Mi
