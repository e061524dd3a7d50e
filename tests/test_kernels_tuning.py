"""The host-side integer helpers of ``ssmcraft.ops.common.tuning``: they stand in for
``triton.cdiv`` / ``triton.next_power_of_2`` (constexpr functions whose host call costs about
2 us) in every wrapper, so they must agree with them wherever the wrappers call them."""
from __future__ import annotations

import triton

from ssmcraft.ops.common.tuning import cdiv, next_pow2, pow2


def test_next_pow2_agrees_with_triton():
    for n in [*range(1, 2100), 4095, 4096, 4097, 1 << 20, (1 << 20) + 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert next_pow2(0) == 1


def test_cdiv_agrees_with_triton():
    for a in [*range(0, 300), 2047, 2048, 2049, 1 << 20]:
        for b in (1, 3, 16, 64, 100):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_pow2_keeps_its_floor():
    assert pow2(1) == 16 and pow2(17) == 32 and pow2(64) == 64 and pow2(65, lo=64) == 128
    assert pow2(3, lo=64) == 64
