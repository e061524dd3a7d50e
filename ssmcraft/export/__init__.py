"""Export a trained trial as a standalone PyTorch module: ``ssmcraft export`` (see
``ssmcraft.export.exporter``). ``export(run_dir, out, trial="best")`` is the Python entry.
``ssmcraft export --format hf`` puts that module in a folder ``transformers`` loads
(``ssmcraft.export.hf``: ``export_run``; needs the ``hf`` extra)."""
from __future__ import annotations


def export(*args, **kwargs):
    """``ssmcraft.export.exporter.export`` (imported on first use)."""
    from ssmcraft.export.exporter import export as _export

    return _export(*args, **kwargs)


__all__ = ["export"]
