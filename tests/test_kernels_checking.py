"""``ssmcraft.runtime.checking``, the comparison with the float64 reference that the kernel tests
and the GPU checks share: it names every output and gradient, finds a wrong output, a wrong
gradient and an unwritten (NaN) one, and handles several states and no initial state."""
import torch

import ssmcraft
from helpers import kernel_inputs
from ssmcraft.runtime.checking import compare, reference


def _case(name, seed=0):
    obj = ssmcraft.compile(name)
    obj.prefer = "torch"
    ins, params, S0, g = kernel_inputs(obj, 1, 5, 2, 6, 4, seed=seed)
    return obj, ins, params, S0, g


def test_names_and_a_correct_path_passes():
    obj, ins, params, S0, g = _case("mamba")
    ref = reference(obj, ins, params, S0, g)
    cmp = compare(ref, lambda i, p, s: obj(i, p, s, True))
    assert list(cmp.errors) == ["y", "S_T", "dx", "dk", "dq", "ddelta", "dA", "dS0"]
    assert cmp.within({"y": 1e-5, "grad": 1e-5}) and cmp.written and cmp.worst[1] < 1e-5


def test_wrong_output_gradient_and_nan_are_found():
    obj, ins, params, S0, g = _case("longhorn_diag", seed=1)
    ref = reference(obj, ins, params, S0, g)

    def off(i, p, s):
        y, S = obj({**i, "q": i["q"] * 1.01}, p, s, True)      # y and dq off by ~1%
        return y, S
    cmp = compare(ref, off)
    assert 1e-3 < cmp.errors["y"] < 1e-1 and cmp.errors["S_T"] < 1e-5 and not cmp.within(1e-4)

    def unwritten(i, p, s):
        y, S = obj(i, p, s, True)
        return y + torch.where(torch.arange(y.shape[1]) == 2, float("nan"), 0.0)[None, :, None, None], S
    cmp = compare(ref, unwritten)
    assert not cmp.written and cmp.worst[0] == "y" and not cmp.within(1.0)


def test_a_wrong_gradient_with_a_right_output_is_found():
    # the forward is exact; only the backward is scaled by 1.01 (so only the gradients are off)
    obj, ins, params, S0, g = _case("longhorn_diag", seed=3)
    ref = reference(obj, ins, params, S0, g)

    def wrong_backward(i, p, s):
        y, S = obj(i, p, s, True)
        return y + 0.01 * (y - y.detach()), S
    cmp = compare(ref, wrong_backward)
    assert cmp.errors["y"] < 1e-6 and cmp.errors["S_T"] < 1e-6
    grads = {k: v for k, v in cmp.errors.items() if k.startswith("d")}
    assert grads and all(5e-3 < e < 5e-2 for e in grads.values()), grads
    assert cmp.written and not cmp.within({"y": 1e-4, "grad": 1e-4})


def test_several_states_and_no_initial_state():
    obj = ssmcraft.compile("momentum_longhorn")
    obj.prefer = "torch"
    ins, _, _, g = kernel_inputs(obj, 1, 4, 1, 6, 4, seed=2)
    S0 = tuple(0.5 * torch.randn(1, 1, 6, 4, generator=g, dtype=torch.float64) for _ in obj.spec.states)
    cmp = compare(reference(obj, ins, None, S0, g), lambda i, p, s: obj(i, p, s, True))
    assert [k for k in cmp.errors if k.endswith("_T") or k.endswith("0")] == ["D_T", "S_T", "dD0", "dS0"]
    assert cmp.within(1e-5)
    cmp = compare(reference(obj, ins, None, None, g), lambda i, p, s: obj(i, p, s, True))
    assert "dD0" not in cmp.errors and cmp.within(1e-5)


def test_a_covariance_states_initial_gradient_is_compared_by_its_symmetric_part():
    """rls's R is symmetric: reading R0 as R0^T is the same layer (the antisymmetric part of dR0
    flips, which is not compared); scaling R0's entries by 1.001 is not."""
    obj, ins, params, _, g = _case("rls", seed=2)
    A = torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64)
    R0 = torch.eye(4, dtype=torch.float64) + 0.3 * A @ A.transpose(-1, -2)
    S0 = (R0, torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64))
    ref = reference(obj, ins, params, S0, g)
    as_f64 = lambda i: {k: v.double() for k, v in i.items()}    # noqa: E731
    transposed = compare(ref, lambda i, p, s: obj.reference(as_f64(i), p, (s[0].transpose(-1, -2).double(), s[1].double()),
                                                            True), torch.float64)
    assert transposed.errors["dR0"] < 1e-6        # the initial states reach the call in float32
    scaled = compare(ref, lambda i, p, s: obj.reference(as_f64(i), p, (1.001 * s[0].double(), s[1].double()), True),
                     torch.float64)
    assert scaled.errors["dR0"] > 1e-4
