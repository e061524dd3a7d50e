"""Helpers shared by the test modules (imported as ``helpers``; pytest puts tests/ on sys.path).

``random_inputs`` draws inputs and params that respect each declaration; ``rel_rms`` and
``assert_within`` are the error metric and check every kernel test uses.
"""
from __future__ import annotations


def random_inputs(spec, *, B=2, T=3, H=2, sizes=None, dtype=None, seed=0, per_head_params=True):
    """Random ``inputs, params`` for ``spec`` in the API layout ([B, T, H, n], params [H, *shape]).

    positive -> softplus(N) + 0.1; bounded -> in (0.2, 0.8); normalize -> unit L2 norm;
    positive params -> in (0.2, 0.8) (decays stay stable over long T);
    negative params -> -(softplus(N) + 0.1). float64 unless ``dtype`` is given.
    """
    import torch
    dtype = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or {spec.dims[0]: 3, spec.dims[1]: 4}

    def draw(shape, *, positive=False, bounded=False, negative=False, normalize=False):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if bounded:
            t = 0.2 + 0.6 * torch.sigmoid(t)
        elif positive:
            t = torch.nn.functional.softplus(t) + 0.1
        elif negative:
            t = -(torch.nn.functional.softplus(t) + 0.1)
        if normalize:
            t = t / t.norm(dim=-1, keepdim=True)
        return t.to(dtype)

    inputs = {}
    for name, decl in spec.inputs.items():
        shape = [B, T, H, *[sizes[s] for s in decl.shape]]
        inputs[name] = draw(shape, positive=decl.positive, bounded=decl.bounded, normalize=decl.normalize)
    params = {}
    for name, decl in spec.params.items():
        shape = ([H] if per_head_params else []) + [sizes[s] for s in decl.shape]
        params[name] = draw(shape, bounded=decl.positive, negative=decl.negative)
    return inputs, params


def rel_rms(got, ref) -> float:
    """Relative RMS error ||got - ref|| / ||ref|| in float64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_within(errs: dict, tol: dict) -> None:
    """Every error in ``errs`` is within ``tol[name]`` (``tol["grad"]`` for gradients); NaN fails."""
    bad = {k: v for k, v in errs.items() if not v <= tol.get(k, tol["grad"])}
    assert not bad, f"errors over tolerance: {bad} (all: {errs})"
