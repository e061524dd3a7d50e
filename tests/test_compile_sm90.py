"""``benchmarks/compile_sm90.py``: the kernels an objective's fwd+bwd launches, compiled for sm_90 on
a CPU-only machine with the arguments the host code passes in its CUDA mode. It covers the GPU form
the interpreter never compiles (typed integers and pointers, constexpr-only branches, the first
autotune config): the packed-sequence kernels and the chunked families, whose GPU runs are few."""
import os
import subprocess
import sys

SM90_SHARED_LIMIT = 232448      # compile_sm90.SM90_SHARED_LIMIT, bytes per block
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_sm90.py"), *args],
                         capture_output=True, text=True, env=env, timeout=900)
    return out.returncode, out.stdout, out.stderr


def _kernels(stdout: str) -> dict[tuple[str, str], str]:
    rows = {}
    for line in stdout.splitlines():
        label, backend, kernel, verdict = line.split(None, 3)
        rows[(label, kernel)] = verdict
    return rows


def test_packed_kernels_compile_for_sm90():
    rc, out, err = _run("gla", "mamba", "--packed", "0,17,5,33")
    assert rc == 0, out + err[-2000:]
    rows = _kernels(out)
    assert "+packed" in out
    assert {k for (label, k) in rows if label == "gla"} >= {"keydecay_chunk_fwd_state_kernel", "keydecay_chunk_bwd_intra_kernel"}
    # packed, the scan splits into time groups as padded (summaries, propagation), from a device chunk table
    assert {k for (label, k) in rows if label == "mamba"} == {
        "diagonal_fwd_main_kernel", "diagonal_bwd_main_kernel", "diagonal_fwd_summary_kernel", "diagonal_bwd_summary_kernel",
        "diagonal_fwd_propagate_kernel", "diagonal_bwd_propagate_kernel", "chunk_tables_kernel"}
    assert set(rows.values()) == {"ok"}


def test_packed_chunked_families_compile_for_sm90():
    """The packed form (VARLEN, cu/ci/co int32 pointers) of the composed classes' chunked families and
    of the precision family's float64 kernels (RLS)."""
    rc, out, err = _run("kda_like", "minibatch_delta", "rls", "--packed", "0,17,5,33")
    assert rc == 0, out + err[-2000:]
    backends = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert backends == {"kda_like": "triton:rank1-keydecay-chunk+packed", "minibatch_delta": "triton:minibatch-chunk+packed",
                        "rls": "triton:precision-fp64+rank1-chunk+packed"}
    assert {k for (label, k) in _kernels(out) if label == "rls"} >= {"precision_fwd_kernel", "precision_bwd_kernel"}
    assert {k for (label, k) in _kernels(out) if label == "kda_like"} >= {      # with the decay's exact gradient
        "rank1_keydecay_chunk_bwd_wy_kernel", "rank1_keydecay_chunk_bwd_out_kernel", "rank1_keydecay_chunk_bwd_da_kernel"}
    assert set(_kernels(out).values()) == {"ok"}


def test_packed_chunked_delta_kernels_compile_for_sm90():
    """The WY kernels' packed form (VARLEN: chunk indices, one sequence per sequential program) for
    rank1_chunk (DeltaNet, Gated DeltaNet) and rankr_chunk's two terms per token; lengths with an
    empty sequence and one that is exactly a chunk."""
    rc, out, err = _run("deltanet", "gated_deltanet", "rank2_head_gated", "--packed", "0,17,5,64,33")
    assert rc == 0, out + err[-2000:]
    backends = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert backends == {"deltanet": "triton:rank1-chunk+packed", "gated_deltanet": "triton:rank1-chunk+packed",
                        "rank2_head_gated": "triton:rankr-chunk+packed"}
    kernels = {"rank1_chunk_prep_kernel", "rank1_chunk_fwd_state_kernel", "rank1_chunk_bwd_state_kernel",
               "rank1_chunk_bwd_grad_kernel", "chunk_tables_kernel"}     # the packed chunk table, built on the device
    rows = _kernels(out)
    for label in backends:      # with a decay, its exact gradient's kernel too
        assert {k for (lab, k) in rows if lab == label} == kernels | ({"rank1_chunk_bwd_da_kernel"} if label != "deltanet"
                                                                       else set())
    assert set(rows.values()) == {"ok"}


def test_packed_sequential_kernels_compile_for_sm90():
    """The sequential families' packed form (VARLEN: each program row's offsets, lengths and first
    checkpoint loaded from cu_seqlens): rank1_row_chunk (Longhorn, Gated Longhorn, and wd_longhorn's per-row
    decay: ``rowdecay.py``), rankr_row's own kernels, the generated general ones (one state row-tiled, the rows
    summed in the step, two states)."""
    rc, out, err = _run("longhorn", "gated_longhorn", "wd_longhorn", "longhorn_2key", "huber_longhorn", "cauchy_delta",
                        "momentum_longhorn", "--packed", "0,17,5,33")
    assert rc == 0, out + err[-2000:]
    backends = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert backends == {"longhorn": "triton:rank1-row-chunk+prologue+packed",
                        "gated_longhorn": "triton:rank1-row-chunk+prologue+packed",
                        "wd_longhorn": "triton:rank1-row-chunk+prologue+packed",
                        "longhorn_2key": "triton:rankr-row+prologue+packed",
                        "huber_longhorn": "triton:general+packed", "cauchy_delta": "triton:general+packed",
                        "momentum_longhorn": "triton:general+packed"}
    rows = _kernels(out)
    assert {k for (label, k) in rows} >= {"rank1_row_chunk_rowdecay_fwd_kernel", "rank1_row_chunk_rowdecay_bwd_kernel",
                                          "rank1_row_chunk_fwd_kernel",
                                          "rank1_row_chunk_bwd_kernel", "rankr_row_fwd_kernel",
                                          "rankr_row_bwd_kernel", "general_fwd_kernel", "general_bwd_kernel"}
    assert {k for (label, k) in rows if label == "momentum_longhorn"} == {"general_fwd_kernel", "general_bwd_kernel"}
    assert set(rows.values()) == {"ok"}


def test_minibatch_general_kernels_compile_for_sm90():
    """The generated kernels of a mini-batch update (anchors carried, checkpointed and their adjoint
    gathered: the ``MB`` constexpr paths), packed (mini-batches counted from each sequence's start).
    With ``--regs``, each kernel's ptxas register and spill figures."""
    import re
    rc, out, err = _run("minibatch_huber", "--packed", "0,17,5,33", "--regs")
    assert rc == 0, out + err[-2000:]
    assert {line.split()[1] for line in out.splitlines()} == {"triton:general+packed"}
    rows = _kernels(out)
    assert set(rows) == {("minibatch_huber", "general_fwd_kernel"), ("minibatch_huber", "general_bwd_kernel")}
    for verdict in rows.values():
        assert re.fullmatch(r"ok \(smem \d+, regs \d+, spills \d+/\d+ bytes\)", verdict), verdict


def test_mlp_memory_compiles_for_sm90():
    """The MLP memory's two kernels (``mlp_memory``, ttt_mlp), unpacked and packed (one program per
    sequence and head, its chunk end states counted from the sequence's first token)."""
    for packed in ((), ("--packed", "0,17,5,33")):
        rc, out, err = _run("ttt_mlp", *packed)
        assert rc == 0, out + err[-2000:]
        assert {line.split()[1] for line in out.splitlines()} == {"triton:mlp-memory" + ("+packed" if packed else "")}
        assert _kernels(out) == {("ttt_mlp", "mlp_memory_fwd_kernel"): "ok", ("ttt_mlp", "mlp_memory_bwd_kernel"): "ok"}


def test_mlp_minibatch_chunk_compiles_for_sm90():
    """The MLP memory's chunk-parallel mini-batch kernels (``mlp_minibatch_chunk``: a pseudo-Huber memory
    with a decay and a per-channel step in mini-batches of 16), unpacked and packed, with their registers."""
    import re
    for packed in ((), ("--packed", "0,17,5,33")):
        rc, out, err = _run("mlp_huber_minibatch", *packed, "--regs")
        assert rc == 0, out + err[-2000:]
        assert {line.split()[1] for line in out.splitlines()} == \
            {"triton:mlp-minibatch-chunk" + ("+packed" if packed else "")}
        rows = _kernels(out)
        assert set(rows) == {("mlp_huber_minibatch", "mlp_chunk_fwd_kernel"),
                             ("mlp_huber_minibatch", "mlp_chunk_bwd_kernel"),
                             ("mlp_huber_minibatch", "mlp_chunk_exact_dc_kernel")}   # the decay's exact gradient
        for verdict in rows.values():
            assert re.fullmatch(r"ok \(smem \d+, regs \d+, spills \d+/\d+ bytes\)", verdict), verdict


def test_chunked_families_compile_for_sm90():
    rc, out, err = _run("kda_like", "rank2_head_gated", "minibatch_delta", "rls")
    assert rc == 0, out + err[-2000:]
    backends = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert backends == {"kda_like": "triton:rank1-keydecay-chunk", "rank2_head_gated": "triton:rankr-chunk",
                        "minibatch_delta": "triton:minibatch-chunk", "rls": "triton:precision-fp64+rank1-chunk"}
    rows = _kernels(out)
    assert ("kda_like", "rank1_keydecay_chunk_bwd_da_kernel") in rows and ("rank2_head_gated", "rank1_chunk_bwd_da_kernel") in rows
    assert set(rows.values()) == {"ok"}


def test_metric_compositions_compile_for_sm90():
    """The metric compositions ``precision_rank1`` does not run (``precision_general``): the precision's
    float64 kernels, then the step on rank1_chunk / rankr_chunk (one / two keys, a per-head step, linear
    in S) or on the general family's kernels generated for it (a per-row step; Huber), unpacked and
    packed."""
    for packed in ((), ("--packed", "0,17,5,33")):
        rc, out, err = _run("metric_rank2", "metric_huber", "metric_implicit", "metric_implicit_channel", *packed)
        assert rc == 0, out + err[-2000:]
        tail = "+packed" if packed else ""
        backends = {line.split()[0]: line.split()[1] for line in out.splitlines()}
        assert backends == {"metric_rank2": "triton:precision-fp64+rankr-chunk" + tail,
                            "metric_huber": "triton:precision-fp64+general" + tail,
                            "metric_implicit": "triton:precision-fp64+rank1-chunk" + tail,
                            "metric_implicit_channel": "triton:precision-fp64+general" + tail}
        rows = _kernels(out)
        assert {k for (label, k) in rows if label == "metric_implicit"} >= {
            "precision_fwd_kernel", "precision_bwd_kernel", "rank1_chunk_fwd_state_kernel", "rank1_chunk_bwd_grad_kernel"}
        assert {k for (label, k) in rows if label == "metric_huber"} == {
            "precision_fwd_kernel", "precision_bwd_kernel", "general_fwd_kernel", "general_bwd_kernel"}
        assert set(rows.values()) == {"ok"}


FAILING = """
import torch, triton, triton.language as tl
import compile_sm90

@triton.jit
def typed_int_kernel(x, n, L):
    m = tl.cdiv(tl.load(x) + n, L)      # a float: tl.cdiv of a float does not compile for the GPU
    tl.store(x, m)

seen = {}
compile_sm90.compile_call(typed_int_kernel, (torch.zeros(1), 3, 4), {}, seen)
((name, err, _),) = seen.values()
print(name, "FAIL" if err else "ok")
"""


def test_a_kernel_that_does_not_compile_is_reported_by_name(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks"), env.get("PYTHONPATH", "")])
    script = tmp_path / "failing.py"       # Triton reads a kernel's source from its file
    script.write_text(FAILING)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split() == ["typed_int_kernel", "FAIL"], out.stdout + out.stderr[-2000:]


def _spill_bytes(verdict: str) -> int:
    """The stored spill bytes of a ``--regs`` verdict ``ok (smem N, regs R, spills S/L bytes)``."""
    return int(verdict.split("spills ")[1].split("/")[0])


def test_chunked_per_row_kernels_spill_little():
    """rank1_row_chunk (Longhorn's one-key path) at its default tiles (16 tokens x 32 rows, 4 warps) in
    bf16 (``--regs``): the forward spills nothing; the backward spilled 208 bytes when its tiles were
    chosen (the fastest measured, ``chunk.py``), and a blow-up fails."""
    rc, out, err = _run("longhorn", "--regs")
    assert rc == 0, out + err[-2000:]
    rows = {k: v for (label, k), v in _kernels(out).items() if k.startswith("rank1_row_chunk")}
    assert set(rows) == {"rank1_row_chunk_fwd_kernel", "rank1_row_chunk_bwd_kernel"}, out
    assert _spill_bytes(rows["rank1_row_chunk_fwd_kernel"]) == 0, rows
    assert _spill_bytes(rows["rank1_row_chunk_bwd_kernel"]) <= 256, rows


def test_decayed_per_row_chunk_kernels_compile_for_sm90():
    """rank1_row_chunk's decayed forms, unpacked and packed, bf16 at its default tiles (``--regs``): Gated
    Longhorn's per-head decay (the forward spills nothing; the backward spilled 452 bytes, 255 registers,
    when written) and wd_longhorn's per-row one (the forward spills nothing; the backward, its mild chunks'
    products and the walks in one kernel, spilled 704 bytes stored and 832 loaded when measured at 4.06 ms
    fwd+bwd, the walks alone 156 bytes at 7.63 ms: ``chunk.ROW_DECAY_AHEAD``). Split (``chunk.ROW_DECAY_SPLIT``,
    ``--show PATH``), its products-only specialisation spilled 140 bytes and its mixed one 704 (700 packed)
    when written; one kernel (``--no-row-split``) as above. A blow-up fails."""
    kernels = {"gated_longhorn": "rank1_row_chunk", "wd_longhorn": "rank1_row_chunk_rowdecay"}
    bwd = {"gated_longhorn": {"rank1_row_chunk_bwd_kernel": 512},
           "wd_longhorn": {"rank1_row_chunk_rowdecay_bwd_kernel[PATH=1]": 192,
                           "rank1_row_chunk_rowdecay_bwd_kernel[PATH=2]": 768}}
    for extra in ((), ("--packed", "0,17,5,33")):
        rc, out, err = _run(*kernels, "--regs", "--decay-ahead", "--show", "PATH", *extra)
        assert rc == 0, out + err[-2000:]
        assert {line.split()[1] for line in out.splitlines()} == {
            "triton:rank1-row-chunk+prologue" + ("+packed" if extra else "")}, out
        for label, prefix in kernels.items():
            rows = {k: v for (lab, k), v in _kernels(out).items() if lab == label and k.startswith("rank1_row_chunk")}
            assert set(rows) == {f"{prefix}_fwd_kernel", *bwd[label]}, out
            assert _spill_bytes(rows[f"{prefix}_fwd_kernel"]) == 0, rows
            for name, bound in bwd[label].items():
                assert _spill_bytes(rows[name]) <= bound, rows
    rc, out, err = _run("wd_longhorn", "--regs", "--decay-ahead", "--show", "PATH", "--no-row-split")
    assert rc == 0, out + err[-2000:]
    rows = {k: v for (lab, k), v in _kernels(out).items() if k.startswith("rank1_row_chunk")}
    assert set(rows) == {"rank1_row_chunk_rowdecay_fwd_kernel", "rank1_row_chunk_rowdecay_bwd_kernel[PATH=0]"}, out
    assert _spill_bytes(rows["rank1_row_chunk_rowdecay_bwd_kernel[PATH=0]"]) <= 768, rows


def _shared_bytes(verdict: str) -> int:
    """The shared bytes of a ``--regs`` verdict ``ok (smem N, regs R, ...)``."""
    return int(verdict.split("smem ")[1].split(",")[0])


def test_chunked_delta_kernels_fit_sm90_shared_memory_in_fp32_at_128():
    """DeltaNet, Gated DeltaNet (rank1_chunk) and rank2_head_gated (rankr_chunk) at d = m = 128 in fp32:
    every kernel within sm_90's shared memory per block. With fp32 tiles as large as bf16's in count
    (value blocks of 64, the state kernels double-buffered), the gradient kernel needed 327680 bytes,
    the decay gradient's 360448 and Gated DeltaNet's reverse state scan 237828 in its smallest config."""
    rc, out, err = _run("deltanet", "gated_deltanet", "rank2_head_gated", "--dtype", "fp32", "--shape", "2,67,2,128,128",
                        "--regs")
    assert rc == 0, out + err[-2000:]
    rows = _kernels(out)
    assert {k for (label, k) in rows if label == "gated_deltanet"} == {
        "rank1_chunk_prep_kernel", "rank1_chunk_fwd_state_kernel", "rank1_chunk_bwd_state_kernel",
        "rank1_chunk_bwd_grad_kernel", "rank1_chunk_bwd_da_kernel"}
    assert {label for (label, k) in rows} == {"deltanet", "gated_deltanet", "rank2_head_gated"}
    for (label, kernel), verdict in rows.items():
        assert verdict.startswith("ok ") and _shared_bytes(verdict) <= SM90_SHARED_LIMIT, (label, kernel, verdict)


def test_value_block_and_state_stages_by_tile_bytes(monkeypatch):
    """The GPU's tile rule (``chunked._value_block``, ``chunked.state_stage_rule``): bf16 keeps value
    blocks of 64 and double-buffered state kernels up to K = 128; fp32 tiles stay within bf16's
    [128, 64] bytes (value block 32 at K = 128, 16 at K = 256) and its state kernels run single-stage
    from K = 128."""
    import torch
    import triton
    from ssmcraft.ops.common import chunked
    monkeypatch.setattr(chunked, "INTERPRET", False)
    bv = lambda K, dt, V=128: chunked._value_block(V, dt, None, K)  # noqa: E731
    assert [bv(K, torch.bfloat16) for K in (16, 64, 128, 256)] == [64, 64, 64, 64]
    assert [bv(K, torch.float32) for K in (16, 64, 128, 256)] == [64, 64, 32, 16]
    assert bv(128, torch.float32, V=20) == 32 and bv(64, torch.float32, V=20) == 32 and bv(16, torch.bfloat16, V=20) == 64
    configs = [triton.Config({"BV": b}, num_warps=4, num_stages=s) for b, s in ((32, 2), (64, 2), (32, 1))]
    stages = lambda BK, dt: [(c.kwargs["BV"], c.num_stages) for c in chunked.state_stage_rule(  # noqa: E731
        configs, {}, BK=BK, K=BK, V=128, W=torch.empty(0, dtype=dt))]
    assert stages(128, torch.bfloat16) == stages(64, torch.float32) == [(32, 2), (64, 2)]
    assert stages(128, torch.float32) == stages(256, torch.bfloat16) == [(32, 1)]
