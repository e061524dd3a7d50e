"""The PyTorch chunked parallel scan (the decay classes' torch path on a GPU) against the
reference loop, run here on CPU tensors: states at every step, outputs and gradients.

Tolerance: float64 throughout; the scan reassociates products, so 1e-10 relative.
"""
import pytest
import torch

import ssmcraft
from ssmcraft.ops.common import reference as R
from helpers import random_inputs

DECAYS = ["linear_attention", "retnet", "gla", "mamba", "hgrn", "longhorn_diag"]


@pytest.mark.parametrize("T", [1, 7, R.SCAN_CHUNK + 5])
@pytest.mark.parametrize("name", DECAYS)
def test_scan_matches_reference_loop(name, T):
    g = torch.Generator().manual_seed(T)
    obj = ssmcraft.compile(name)
    B, H, d, m = 2, 2, 3, 4
    inputs, params = random_inputs(obj.spec, B=B, T=T, H=H, sizes=dict(zip(obj.spec.dims, (d, m))), seed=T)
    inputs = {k: v.requires_grad_() for k, v in inputs.items()}
    S0 = torch.randn(B, H, d, m, generator=g, dtype=torch.float64, requires_grad=True)
    lay = R.layout(obj.ir, obj.spec, inputs, params, S0)
    co = obj.module.coefficients(lay.env, d, m)
    states = R.diagonal_states(obj.module, lay, co)
    y_scan = obj.module.readout(states, lay.env, co, d, m)[..., 0].expand(B, T, H, d)
    ref = obj.trace(inputs, params, S0, every=1)
    y_ref, S_ref = obj.reference(inputs, params, S0)
    torch.testing.assert_close(states, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y_scan, y_ref, rtol=1e-10, atol=1e-10)
    leaves = [*inputs.values(), S0]
    g1 = torch.autograd.grad((y_scan * y_ref.detach()).sum() + states[:, -1].sum(), leaves)
    g2 = torch.autograd.grad((y_ref * y_ref.detach()).sum() + S_ref.sum(), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
