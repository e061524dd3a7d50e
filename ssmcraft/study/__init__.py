"""Studies: reproduce a seed paper's finding with one command (``ssmcraft study SPEC --out DIR``).

A study spec (``specs/studies/*.yaml``) names a ``kind`` (one of ``spec.KINDS``) and its
parameters at two scales (``smoke``: a CPU-minute; ``full``: the GPU size). The runner
(``runners``) trains and evaluates with ``ssmcraft.train`` / ``ssmcraft.search`` (it calls
them, it does not copy them), the verdicts (``verdict``) compare the numbers with the
paper's claim under stated thresholds, and ``report`` writes ``DIR/report.md`` (with PNG
plots beside it) and ``DIR/results.json``.
"""
from ssmcraft.study.spec import KINDS, StudySpec, load_study_spec

__all__ = ["KINDS", "StudySpec", "load_study_spec"]
