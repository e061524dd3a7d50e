"""Helpers shared by the test modules (imported as ``helpers``; pytest puts tests/ on sys.path).

``random_inputs`` draws inputs and params that respect each declaration; ``rel_rms`` and
``assert_within`` are the error metric and check every kernel test uses; ``poison_step`` makes
a training run diverge at a chosen step; ``tiny_search`` runs a small in-process search;
``time_limit`` turns a hang into a failure.
"""
from __future__ import annotations

import contextlib
import itertools
import signal

from ssmcraft.runtime.checking import over, rel_rms  # noqa: F401 - rel_rms: the error metric every kernel test uses


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


def assert_within(errs: dict, tol: dict) -> None:
    """Every error in ``errs`` is within ``tol[name]`` (``tol["grad"]`` for gradients); NaN fails."""
    bad = over(errs, tol)
    assert not bad, f"errors over tolerance: {bad} (all: {errs})"


def kernel_errors(obj, run, ins, params, S0, g) -> dict:
    """Relative RMS errors of a kernel against ``obj.reference`` (float64): the output, the final
    state and every gradient (inputs, params, initial state) under random cotangents ``dy, dS``
    drawn from ``g`` (``ssmcraft.runtime.checking``, which the GPU checks use too).
    ``run(obj, layout) -> (y, S_T)`` gets the fp32 layout of the same values; ``S_T`` must be fp32."""
    import torch

    from ssmcraft.runtime.checking import reference_errors
    from ssmcraft.ops.common.reference import layout

    def call(i, p, s):
        y, S = run(obj, layout(obj.ir, obj.spec, i, p, s))
        assert all(x.dtype == torch.float32 for x in (S if isinstance(S, tuple) else (S,))), "the state is not fp32"
        return y, S
    return reference_errors(obj, call, ins, params, S0, g).errors


def kernel_inputs(obj, B, T, H, d, m, seed, unit_keys=False):
    """Float64 inputs, per-head params (in (0.2, 0.8)) and an initial state for kernel tests, in the
    ranges the spec declares: bounded -> (0.2, 0.8), positive -> (0.5, 1.5), ``normalize`` (or, with
    ``unit_keys``, every vector over the key dimension) -> unit norm. Returns (ins, params, S0, g)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    size = lambda dims: [d if x == obj.ir.dims[0] else m for x in dims]     # noqa: E731
    ins = {}
    for n, dims in obj.ir.inputs.items():
        decl = obj.spec.inputs[n]
        x = torch.randn(B, T, H, *size(dims), generator=g, dtype=torch.float64)
        if decl.bounded:
            x = 0.2 + 0.6 * torch.sigmoid(x)
        elif decl.positive:
            x = 0.5 + torch.rand(x.shape, generator=g, dtype=torch.float64)
        if decl.normalize or (unit_keys and tuple(dims) == (obj.ir.dims[1],)):
            x = x / x.norm(dim=-1, keepdim=True)
        ins[n] = x
    params = {n: 0.2 + 0.6 * torch.rand(H, *size(dims), generator=g, dtype=torch.float64)
              for n, dims in obj.ir.params.items()}
    return ins, params, torch.randn(B, H, d, m, generator=g, dtype=torch.float64) * 0.5, g


def poison_step(monkeypatch, at_call: int) -> None:
    """The training loop's ``at_call``-th step loss (``loop.step_loss``, counted from 1) made NaN."""
    from ssmcraft.train import loop
    real = loop.step_loss
    calls = {"n": 0}

    def poisoned(*args):
        calls["n"] += 1
        loss = real(*args)
        return loss * float("nan") if calls["n"] == at_call else loss

    monkeypatch.setattr(loop, "step_loss", poisoned)


def tiny_search(out, trial_fn, trials: int):
    """``run_search`` of ``ssmcraft.search.testing.tiny_spec`` with ``trials`` trials, each run by
    ``trial_fn(config, out_dir, report)`` in this process, into ``out``; the ``SearchResult``."""
    from ssmcraft.search import InlineExecutor, load_search_spec, run_search
    from ssmcraft.search.testing import tiny_spec

    spec = load_search_spec(tiny_spec(budget={"trials": trials, "tokens_per_trial": 1000, "seconds_per_trial": 120}))
    return run_search(spec, out, executor=InlineExecutor(), trial_fn=trial_fn, compile_fn=None, plots=False,
                      log=lambda _msg: None)


def code_corpus(folder) -> str:
    """A small Python-like text corpus written into ``folder`` (its path, for a text task)."""
    from pathlib import Path
    (Path(folder) / "code.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    return str(folder)


def tiny_text_experiment(corpus: str, *, batch_size: int, steps: int, seed: int = 0, **train) -> dict:
    """A 2-layer byte LM on ``corpus`` for ``steps`` steps of ``batch_size`` x 16 bytes, on one CPU thread
    (a shared machine thrashes with more), validating every 5 steps."""
    return {"name": "tiny", "seed": seed,
            "task": {"name": "text", "corpus": corpus, "seq_len": 16, "val_fraction": 0.1, "block_size": 512},
            "model": {"d_model": 16, "n_layers": 2, "mlp_ratio": 2,
                      "mixer": {"kind": "objective", "objective": "longhorn", "state_size": 4}},
            "train": {"batch_size": batch_size, "tokens": batch_size * 16 * steps, "lr": 1e-2, "warmup": 2,
                      "eval_every": 5, "eval_batches": 1, "eval_batch_size": 4, "device": "cpu", "threads": 1,
                      **train}}


def subprocess_env() -> dict:
    """The environment for a subprocess that must import this checkout's ssmcraft."""
    import os
    from pathlib import Path
    repo = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}


def stop_after(monkeypatch, step: int) -> None:
    """A training run is killed (``KeyboardInterrupt``) right after writing its resume checkpoint of ``step``."""
    from ssmcraft.train import resume
    real = resume.save_state

    def save_then_stop(out, **kw):
        path = real(out, **kw)
        if kw["step"] == step:
            raise KeyboardInterrupt
        return path
    monkeypatch.setattr(resume, "save_state", save_then_stop)


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``TimeoutError`` in the block after ``seconds`` (SIGALRM: main thread only)."""
    def handler(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s (a hang)")
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except TimeoutError:
        import sympy                       # an interrupted sympy may leave half-computed
        sympy.core.cache.clear_cache()     # assumptions in its caches: drop them
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def decode_all(lm, tokens):
    """``lm.step`` over every position of tokens ``[B, T]`` from fresh caches: logits ``[B, T, V]``
    (the caches at the end as well)."""
    import torch

    caches, outs = lm.init_cache(tokens.shape[0]), []
    for t in range(tokens.shape[1]):
        logits, caches = lm.step(tokens[:, t], caches)
        outs.append(logits)
    return torch.stack(outs, 1), caches


def packed_naive(naive, ins: dict, lens: list[int]):
    """A kernel family's plain-loop twin run on each sequence of a packed row from its own initial
    state: ``naive(**ins)`` with token tensors ``[1, total_T, ...]`` cut along time and ``h0`` ``[N, ...]``
    along the batch (None stays None); an empty sequence gives no output and keeps its initial
    state. Returns (o ``[1, total_T, ...]``, final states ``[N, ...]``) and the int32 offsets."""
    import torch
    cu = [0, *itertools.accumulate(lens)]
    outs, finals = [], []
    for n in range(len(lens)):
        s, e = cu[n], cu[n + 1]
        seq = {k: (None if t is None else t[n:n + 1] if k == "h0" else t[:, s:e]) for k, t in ins.items()}
        p = seq["p"]                                      # [1, T_n, H, (R,) V]
        o, h = naive(**seq) if e > s else (p.reshape(1, 0, p.shape[2], p.shape[-1]), seq["h0"])
        outs.append(o)
        finals.append(h)
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0), torch.tensor(cu, dtype=torch.int32)
