"""``ssmcraft bench SPEC``: time what users call, ``obj(inputs)`` (fwd, fwd+bwd, achieved
bandwidth, HBM floor), or with ``--layer`` the mixer built on the objective (fwd+bwd).

The HBM floor is the bytes that must move (every input read once, the output written once;
for the backward also ``dy`` read and one gradient per input written) divided by the copy
bandwidth measured in the same process. Times are ``triton.testing.do_bench`` medians. The
headline is always the public path (``obj(...)``, whose ``backend`` is reported); for the
diagonal family the kernel-level entry (``diagonal.diagonal_scan``) is printed beside it as a
diagnostic: the gap between the two is host overhead.

fwd+bwd is timed twice: as PyTorch runs it by default (the autograd engine hands a CUDA backward
to its device thread) and with the engine on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``; ``timing.obj_calls``' ``onethread``), which
on hosts where that handoff is slow keeps the GPU busy (BENCHMARKS.md, "Host floor").

``--graphed`` adds ``obj.graphed(...)`` (CUDA graphs, ``ssmcraft.runtime.graphs``) beside the eager
figures, in the same table and JSON: each timed call is captured once on exactly the eager call's
tensors and ``output_final_state`` and replayed, once with the tensors copied in (``graphed_*``)
and once on the graph's own input buffers (``static_*``, ``static_inputs()``); every call gets its
GPU-busy fraction (profiler GPU time / wall time) and host time (``timing.time_calls``). The
graphed call is then checked against eager with an initial state and the final state (output,
final state, every gradient including the initial state's; ``check_*``); a failed check exits 1.
Without CUDA ``--graphed`` is an error (never an eager run in its place); ``--layer --graphed``
is refused: the mixer has no graphed form of its own (the training step has, ``train.cuda_graphs``).
"""
from __future__ import annotations

import math


def random_inputs(obj, B, T, H, d, m, dtype, device, seed: int = 0, requires_grad: bool = False,
                  unit_keys: bool = False):
    """Inputs and params for ``obj`` with values in the ranges its spec declares
    (positive -> softplus, bounded -> sigmoid, normalize -> unit L2 norm as the layer feeds it,
    which keeps the delta-rule family's steps stable; negative params -> -U(0.5, 1.5), S4D-real init
    for A). ``unit_keys``: a key input ``k`` of unit norm even where the spec does not declare it
    (exact Longhorn's step is only stable then). Returns (inputs, params) in the API layout
    ([B, T, H, n] / [B, T, H]; params [*shape])."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    ir, spec = obj.ir, obj.spec
    size = {ir.dims[0]: d, ir.dims[1]: m}
    inputs = {}
    for n, dims in ir.inputs.items():
        shape = [B, T, H] + [size[x] for x in dims]
        t = torch.randn(shape, generator=g)
        decl = spec.inputs.get(n) if hasattr(spec, "inputs") else None
        positive = getattr(decl, "positive", False)
        bounded = getattr(decl, "bounded", False)
        if bounded:
            t = torch.sigmoid(t + 2.0) if not positive else torch.sigmoid(t)
        elif positive:
            t = torch.nn.functional.softplus(t) * 0.5
        elif getattr(decl, "normalize", False) or (unit_keys and n == "k"):
            t = torch.nn.functional.normalize(t, dim=-1)
        elif n == "k":
            t = t / math.sqrt(max(1, m))
        inputs[n] = t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
    params = {}
    for n, dims in ir.params.items():
        shape = [size[x] for x in dims]
        decl = spec.params.get(n)
        init = getattr(decl, "init", None)
        if init == "s4d_real" and len(shape) == 2:
            t = -torch.arange(1, shape[1] + 1, dtype=torch.float32).repeat(shape[0], 1)
        elif getattr(decl, "negative", False):
            t = -(torch.rand(shape, generator=g) + 0.5)
        else:
            t = torch.rand(shape, generator=g) * 0.5 + 0.5
        params[n] = t.to(device=device).requires_grad_(requires_grad)
    return inputs, params


def floor_bytes(inputs: dict, params: dict, out_numel: int, out_elt: int, backward: bool) -> int:
    """Bytes that must move: inputs read + output written (+ dy read and one gradient per input written)."""
    ins = sum(t.numel() * t.element_size() for t in inputs.values())
    ins += sum(t.numel() * t.element_size() for t in params.values())
    out = out_numel * out_elt
    return ins + out + ((out + ins) if backward else 0)


LAYER_NOT_GRAPHED = ("--layer --graphed: the mixer has no graphed form of its own (CUDA graphs capture obj() as "
                     "obj.graphed, the whole training step as train.cuda_graphs and decoding as GraphedDecoder); "
                     "time the mixer's objective with --graphed, or the graphed training step with "
                     "benchmarks/bench_graphs.py --only train")
NEED_GPU = "ssmcraft bench needs a CUDA device (timings under the interpreter mean nothing)"


def _require_gpu(graphed: bool) -> None:
    """CUDA or ``SsmcraftError``; with ``graphed`` the message is the graphs' (never an eager run instead)."""
    import torch

    from ssmcraft.errors import SsmcraftError
    from ssmcraft.runtime.graphs import require_cuda

    if graphed:
        require_cuda([], "--graphed")
    if not torch.cuda.is_available():
        raise SsmcraftError(NEED_GPU)


def random_state(obj, B, H, d, m, device, seed: int = 1, requires_grad: bool = False):
    """A random fp32 initial state ``[B, H, d, m]`` (a tuple of them for several states)."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    states = tuple(torch.randn(B, H, d, m, generator=g).to(device).requires_grad_(requires_grad)
                   for _ in obj.ir.state_names)
    return states if obj.ir.states else states[0]


def _capturing(what: str, fn):
    """``fn()``; a failure (a capture that is not safe, say) as a one-line ``SsmcraftError`` naming
    what was being done (``what``; the cause chained)."""
    from ssmcraft.errors import SsmcraftError, one_line
    try:
        return fn()
    except SsmcraftError:
        raise
    except Exception as e:  # noqa: BLE001: re-raised with what failed
        raise SsmcraftError(f"--graphed: {what} failed: {one_line(e)}") from e


def _device_name(dev) -> str:
    import torch
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)


def run_bench(spec_arg, shape, dtype_name: str = "bf16", backward: bool = True, graphed: bool = False,
              device: str = "cuda", prefer: str = "triton") -> dict:
    """Time one objective's ``obj()``; returns a dict of figures (see module docstring).

    ``graphed``: also ``obj.graphed(...)`` captured on the same tensors and ``output_final_state`` as
    the eager calls (``timing.obj_calls``: ``graphed_*`` copies the tensors in, ``static_*`` calls
    the graph on its own buffers), every call's GPU-busy fraction and host time (``*_busy_*``,
    ``*_host_us_*``), and the graphed call checked against eager with an initial state and the final
    state (``check_*``: ``checking.graphed_against_eager``). ``device`` and ``prefer`` are for tests
    (the command always times CUDA and the Triton path)."""
    import torch

    import ssmcraft
    from ssmcraft.ops import registry
    from ssmcraft.ops.diagonal import chunk as diagonal
    from ssmcraft.runtime import timing
    from ssmcraft.runtime.checking import graphed_against_eager

    _require_gpu(graphed)
    B, T, H, d, m = shape
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    dev = torch.device(device)
    obj = ssmcraft.compile(spec_arg)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, dev, requires_grad=backward)
    obj.prefer = prefer
    y = obj(inputs, params, None, False)[0]          # the first call of this signature: path choice, compilation
    backend = obj.backend
    use_diag = backend.startswith(f"triton:{registry.family('diagonal').backend}")   # the family obj() ran (GLA: key-decay)
    dy = torch.randn_like(y) if backward else None
    calls = _capturing("capturing obj() (fwd, fwd+bwd)", lambda: timing.obj_calls(obj, inputs, params, None, False, dy,
                                                                        graphed=graphed))
    times = timing.time_calls(calls, with_busy=graphed)
    res = {"spec": obj.name, "kind": obj.ir.kind, "backend": backend, "shape": {"B": B, "T": T, "H": H, "d": d, "m": m},
           "dtype": dtype_name, "device": _device_name(dev), "fwd_ms": times["eager_fwd_ms"]}
    bw = timing.copy_bandwidth(dev)
    res["copy_bandwidth_GBps"] = bw / 1e9
    fb = floor_bytes(inputs, params, y.numel(), y.element_size(), False)
    res["fwd_floor_ms"] = fb / bw * 1e3
    res["fwd_GBps"] = fb / (res["fwd_ms"] * 1e-3) / 1e9
    res["fwd_x_floor"] = res["fwd_ms"] / res["fwd_floor_ms"]
    if backward:
        t_fb = times["eager_fwd_bwd_ms"]
        fbb = floor_bytes(inputs, params, y.numel(), y.element_size(), True)
        res.update({"fwd_bwd_ms": t_fb, "fwd_bwd_floor_ms": fbb / bw * 1e3, "fwd_bwd_GBps": fbb / (t_fb * 1e-3) / 1e9,
                    "fwd_bwd_x_floor": t_fb / (fbb / bw * 1e3), "onethread_fwd_bwd_ms": times["onethread_fwd_bwd_ms"]})
    if graphed:
        res["graphed"] = True
        res.update(times)
        S0 = random_state(obj, B, H, d, m, dev, requires_grad=backward)
        res.update(_capturing("the graphed-vs-eager check (capture, replay and eager, with an initial and a final state)",
                              lambda: graphed_against_eager(obj, inputs, params, S0)))
    if use_diag:
        with torch.no_grad():
            res["kernel_entry_fwd_ms"] = timing.bench_ms(
                lambda: diagonal.diagonal_scan(obj, {**inputs, **params}, None, False)[0])
        res["configs"] = {str(k[0]): repr(v) for k, v in diagonal.tuned_configs().items()}
    return res


def run_layer_bench(spec_arg, shape) -> dict:
    """Time the mixer on an objective, fwd and fwd+bwd, bf16 autocast: h [B, T, H*d] -> [B, T, H*d]."""
    import torch

    from ssmcraft.runtime.timing import bench_ms
    from ssmcraft.layers.config import mixer_config
    from ssmcraft.layers.mixer import ObjectiveMixer

    _require_gpu(False)
    B, T, H, d, m = shape
    cfg = mixer_config({"kind": "objective", "objective": spec_arg, "heads": H, "state_size": m, "expand": 1})
    mixer = ObjectiveMixer(cfg, H * d).cuda()
    h = torch.randn(B, T, H * d, device="cuda", requires_grad=True)

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return mixer(h)
    y = fwd()
    dy = torch.randn_like(y)
    with torch.no_grad():
        t_fwd = bench_ms(fwd)
    t_fb = bench_ms(lambda: torch.autograd.grad(fwd(), [h, *mixer.parameters()], dy, allow_unused=True))
    return {"spec": mixer.obj.name, "kind": mixer.obj.ir.kind, "backend": mixer.last_backend, "layer": True,
            "shape": {"B": B, "T": T, "H": H, "d": d, "m": m}, "dtype": "bf16 autocast",
            "device": torch.cuda.get_device_name(), "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb,
            "tokens_per_s_fwd_bwd": B * T / (t_fb * 1e-3)}
