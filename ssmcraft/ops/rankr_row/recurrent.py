"""Diagonal-plus-rank-r recurrences with per-row (or per-head) factors: the ``rankr`` IR kind.

Several keys or regression terms (``objectives/longhorn_2key.yaml``, Woodbury updates, explicit
steps on several keys). Row ``i`` of the state ``S [V, K]`` (math layout ``[d, m]``; the
public state is FLA's ``[B, H, K, V]``)::

    z_l,i = s_{t-1,i} . u_l                               (L <= 4 scalars per row)
    s_t,i = a_i s_{t-1,i} - sum_{r,l} c_rl,i z_l,i v_r + B_i
    y_t,i = oc_i (s_t,i . oq) + oh_i

Rows are independent, so the kernel is ``ssmcraft.ops.general.recurrent``'s fused sequential
generator run row-tiled: one program per (batch*head, block of ``BV`` rows), the state tile
``[BK, BV]`` in registers, a loop over time; the update is printed from the IR's slots in
element form (``ssmcraft.compiler.structure.element_form``) with every coefficient (the
Woodbury ``c_rl``, e.g.) inlined by the Triton printer, and the backward is the symbolically derived adjoint of that step
(checkpoints every ``general.CHUNK`` steps, recomputed into scratch). Gradients of leaves
shared by the rows (keys, per-head values) are written per row block and summed on the host.

Why per-row and not chunked: as for ``rank1_row`` (see its docstring and BENCHMARKS.md), a
chunked form multiplies the per-row work by K (a K x K transition product per row and
segment instead of L K-vector dot products), and Longhorn-style shapes (V = 1536, K = 16)
already give hundreds of programs; the per-row step costs O(L K) per row, L + R dot
products, the same order as the rank-1 kernel.
"""
from __future__ import annotations

from ssmcraft.ops.general import recurrent as general
from ssmcraft.ops.common.tuning import INTERPRET, next_pow2

BACKEND_NAME = "rankr-row"
ROW_BLOCK: int | None = None      # rows per program; None: by rule (tests set it to tile rows)
generated_source = general.generated_source   # the kernels it runs (``ssmcraft derive SPEC --kernel``)


def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernel, else the reason."""
    if ir.kind != "rankr":
        return f"not a rank-r update ({ir.kind})"
    try:
        step, _, _ = general._module(ir)
    except NotImplementedError as e:
        return f"cannot print the update for Triton: {e}"
    over_rows = general.row_sums(step)
    if over_rows:
        return f"the step sums over the rows ({', '.join(over_rows)}), so rows cannot be tiled"
    return None


def row_block(V: int, K: int) -> int:
    """Rows per program: all rows under the interpreter (fewest programs), else a tile of
    about 1024 fp32 state values per program (H200, ``longhorn_2key`` at K=16, bf16: fwd+bwd
    36 ms with 64 rows, 52 ms with 128, 39-40 ms with 16-32; the forward is 4.6-5.3 ms at any
    block; BENCHMARKS.md, "Several states and rank-r")."""
    full = next_pow2(V)
    if ROW_BLOCK is not None:
        return min(ROW_BLOCK, full)
    if INTERPRET:
        return full
    return min(full, max(16, 1024 // next_pow2(K)))


def forward(obj, lay, co, output_final_state):
    """Family contract: (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None)."""
    return general.forward(obj, lay, co, output_final_state, row_block=row_block(lay.d, lay.m))


def prepare(obj, lay):
    """The family's runner for one call signature: ``general.runner`` row-tiled (``row_block``)."""
    return general.runner(obj, obj.ir, lay, row_block=row_block(lay.d, lay.m))
