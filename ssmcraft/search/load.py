"""Getting a trained trial back out of a search folder."""
from __future__ import annotations

from pathlib import Path

from ssmcraft.errors import SsmcraftError
from ssmcraft.search.reports import ranked
from ssmcraft.search.rundir import open_study


def find_trial(out_dir: str | Path, which: str | int = "best", storage: str | None = None) -> Path:
    """Folder of trial ``which`` of the search in ``out_dir``: ``"best"`` (rank 1 of the
    leaderboard) or a trial number. Only complete trials have a model to load."""
    out_dir = Path(out_dir)
    table = ranked(open_study(out_dir, storage))
    if which == "best":
        complete = [t for t, rank, _ in table if rank is not None]
        if not complete:
            raise SsmcraftError(f"{out_dir}: no complete trial yet")
        trial = complete[0]
    else:
        try:
            number = int(which)
        except ValueError:
            raise SsmcraftError(f"trial must be 'best' or a trial number, got {which!r}") from None
        by_number = {t.number: (t, rank) for t, rank, _ in table}
        if number not in by_number:
            raise SsmcraftError(f"{out_dir}: no finished trial {number}; finished: "
                                f"{', '.join(str(n) for n in sorted(by_number)) or 'none'}")
        trial, rank = by_number[number]
        if rank is None:
            raise SsmcraftError(f"{out_dir}: trial {number} did not complete "
                                f"({trial.user_attrs.get('reason', 'no reason recorded')}): no model to load")
    return out_dir / trial.user_attrs["trial_dir"]


def load_trial(out_dir: str | Path, which: str | int = "best", storage: str | None = None):
    """The trained model of a trial (``ssmcraft.train.load_run`` on its folder)."""
    from ssmcraft.train import load_run

    return load_run(find_trial(out_dir, which, storage))
