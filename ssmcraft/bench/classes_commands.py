"""``ssmcraft bench --classes``: the structure-class table. Every library objective and one
composed objective per class that no library objective covers (``COMPOSED``), through ``obj()``
at one shape, in one process: fwd and fwd+bwd ms and the ratio to DeltaNet's fwd+bwd measured in
the same run. A command-line module (the cli layer): it composes objectives, which the search
layer, above ``bench``, does.

Inputs are drawn as ``ssmcraft bench`` draws them (``random_inputs``) and timed as it times them
(``timing.obj_calls`` + ``timing.time_calls``: ``do_bench`` medians; fwd under ``no_grad``,
fwd+bwd ``autograd.grad`` of ``y`` with respect to every input). A row that fails is a row of
the table with its error, not the end of it. ``profile`` adds each objective's GPU kernels of one
fwd+bwd (torch profiler: name, calls, total us): where the time goes.
"""
from __future__ import annotations

from typing import Any, Mapping

REFERENCE = "deltanet"

# a class the library does not cover -> the composition (``ssmcraft.search.compose``) that stands for it
COMPOSED: dict[str, dict[str, Any]] = {
    "kda_like": {"proximity": "diagonal_decay", "data": "regression", "step": "scalar",
                 "update": "decay_explicit", "normalize": True},
    "rank2_head": {"proximity": "plain", "data": "regression", "keys": 2, "step": "scalar",
                   "update": "explicit", "normalize": True},
    "rank2_head_gated": {"proximity": "scalar_decay", "data": "regression", "keys": 2, "step": "scalar",
                         "update": "decay_explicit", "normalize": True},
    "minibatch_delta": {"proximity": "plain", "data": "regression", "step": "scalar", "update": "explicit",
                        "normalize": True, "minibatch": 16},
    "minibatch_huber": {"proximity": "scalar_decay", "data": "huber", "step": "per_channel", "update": "explicit",
                        "normalize": True, "minibatch": 16},
    "huber_channel_gated": {"proximity": "scalar_decay", "data": "huber", "step": "per_channel",
                            "update": "decay_explicit", "normalize": True},
    "cauchy_channel": {"proximity": "plain", "data": "cauchy", "step": "per_channel", "update": "explicit",
                       "normalize": True},
    "mlp_huber_minibatch": {"memory": "mlp", "proximity": "scalar_decay", "data": "huber", "step": "per_channel",
                            "update": "explicit", "normalize": True, "minibatch": 16},
    "mlp_cauchy_2key": {"memory": "mlp", "proximity": "scalar_decay", "data": "cauchy", "keys": 2, "step": "scalar",
                        "update": "explicit", "normalize": True},
    # second-order learners (the key covariance as the metric) beyond RLS and the preconditioned delta rule
    "metric_rank2": {"proximity": "metric", "data": "regression", "keys": 2, "step": "scalar",
                     "update": "decay_explicit", "normalize": True},
    "metric_huber": {"proximity": "metric", "data": "huber", "step": "scalar", "update": "decay_explicit",
                     "normalize": True},
    "metric_implicit": {"proximity": "metric", "data": "regression", "step": "scalar", "update": "implicit",
                        "normalize": True},
    "metric_implicit_channel": {"proximity": "metric", "data": "regression", "step": "per_channel",
                                "update": "implicit", "normalize": True},
}


def class_specs(only: tuple[str, ...] = (), composed: bool = True) -> list[tuple[str, Any]]:
    """``(label, spec)`` rows of the table: DeltaNet first (the ratio's reference), then the
    library's objectives (or ``only``: library names, ``COMPOSED`` labels or spec files), then the
    composed classes."""
    from ssmcraft.compiler.library import library_names
    from ssmcraft.search.compose import compose_objective
    names = list(only) or list(library_names()) + (list(COMPOSED) if composed else [])
    names = [REFERENCE] + [n for n in names if n != REFERENCE]
    return [(n, compose_objective(COMPOSED[n]) if n in COMPOSED else n) for n in names]


def measure(label: str, spec: Any, shape, dtype, profile: bool = False, redraw=None) -> dict:
    """One row: ``spec`` compiled and timed through ``obj()`` on CUDA. ``redraw(obj, inputs, params)``:
    the inputs and params to time instead of the drawn ones (leaves of the same dtypes)."""
    import torch

    import ssmcraft
    from ssmcraft.bench.run import random_inputs
    from ssmcraft.runtime import timing
    B, T, H, d, m = shape
    obj = ssmcraft.compile(spec)
    inputs, params = random_inputs(obj, B, T, H, d, m, dtype, torch.device("cuda"), requires_grad=True)
    if redraw is not None:
        inputs, params = redraw(obj, inputs, params)
    calls = timing.obj_calls(obj, inputs, params, None, False, torch.randn_like(obj(inputs, params)[0]))
    calls.pop("onethread", None)
    t = timing.time_calls(calls)
    row = {"spec": label, "kind": obj.ir.kind, "backend": obj.backend,
           "fwd_ms": t["eager_fwd_ms"], "fwd_bwd_ms": t["eager_fwd_bwd_ms"]}
    if profile:
        row["kernels"] = kernel_profile(calls["eager"]["fwd_bwd"])
    return row


def kernel_profile(fn, n: int = 3) -> list[tuple[str, int, float]]:
    """(kernel name, calls per fn(), GPU us per fn()) of ``n`` calls, largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count >= n:
            rows.append((e.key, e.count // n, us / n))
    return sorted(rows, key=lambda r: -r[2])


def table(rows: list[Mapping[str, Any]]) -> list[str]:
    """The markdown table of ``rows`` with the ratio column (to ``REFERENCE``'s fwd+bwd)."""
    ref = next((r["fwd_bwd_ms"] for r in rows if r["spec"] == REFERENCE and "fwd_bwd_ms" in r), None)
    lines = [f"| objective | kind | backend | fwd ms | fwd+bwd ms | x {REFERENCE} fwd+bwd |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['spec']} | - | {r['error'][:80]} | - | - | - |")
            continue
        ratio = f"{r['fwd_bwd_ms'] / ref:.2f}" if ref else "-"
        lines.append(f"| {r['spec']} | {r['kind']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {ratio} |")
    return lines


def run_classes(shape, dtype_name: str, only: tuple[str, ...] = (), composed: bool = True,
                profile: bool = False, echo=print) -> list[dict]:
    """Every row of the table, measured one after another in this process; ``echo`` prints each
    row (its table line, without the ratio) and its kernel profile as it comes, so that a run cut
    short keeps what it measured."""
    import torch
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    rows = []
    for label, spec in class_specs(only, composed):
        try:
            row = measure(label, spec, shape, dtype, profile)
        except Exception as e:  # noqa: BLE001: one objective's failure is a row of the table, not the end of it
            row = {"spec": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        rows.append(row)
        echo(f"measured {table([row])[-1]}", flush=True)
        for k, c, us in row.get("kernels", [])[:12]:
            echo(f"   {label}: {us:10.1f} us  x{c:<3d} {k[:110]}")
        torch.cuda.empty_cache()
    return rows
