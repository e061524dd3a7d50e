"""The run folder of a search, and opening its study for reading.

::

    DIR/
      coordinator.lock   held by the running coordinator (flock)
      journal.log        the Optuna study (unless --storage URL)
      run.json           study name and storage (password masked)
      search.yaml        the spec the study was created from
      leaderboard.csv, pareto.png | history.png, state_size.png, importances.png
      trials/0007/       one folder per trial: trial.json (config, seed, params,
                         provenance, outcome), attempts.log, error.txt, and whatever
                         the trial writes (checkpoint, metrics.json, curves)
"""
from __future__ import annotations

import json
from pathlib import Path

import optuna

from ssmcraft import fileio
from ssmcraft.errors import SsmcraftError, one_line
from ssmcraft.search.storage import open_storage

RUN_INFO = "run.json"
SPEC_COPY = "search.yaml"
TRIALS = "trials"
TRIAL_INFO = "trial.json"


def trial_dir(out_dir: Path, number: int) -> Path:
    return Path(out_dir) / TRIALS / f"{number:04d}"


def check_trial_folders(out_dir: Path, numbers: set[int]) -> None:
    """Refuse a run folder whose ``trials/`` holds a folder for a trial number the study does
    not have (``numbers``): the study's storage lost trials (a journal truncated, deleted
    or replaced), and the next trials would take those numbers and write over the folders."""
    folder = Path(out_dir) / TRIALS
    if not folder.is_dir():
        return
    orphans = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and int(p.name) not in numbers)
    if orphans:
        held = f"trials {min(numbers)}-{max(numbers)}" if numbers else "no trial"
        raise SsmcraftError(
            f"{out_dir}: {TRIALS}/{orphans[0]:04d} ({len(orphans)} folder(s) in all) belongs to no trial of the "
            f"study, which holds {held}: its storage lost trials (a journal truncated, deleted or replaced), "
            f"and a search here would reuse their numbers and folders. Restore the journal from a copy, or "
            f"start the search again with another --out (the trial folders are left as they are)")


def journal_trial_numbers(out_dir: Path, study_name: str) -> set[int]:
    """The trial numbers the folder's journal holds for ``study_name``, read without changing
    anything (none when there is no journal or no such study)."""
    from ssmcraft.search.storage import journal_path

    if not journal_path(out_dir).exists():
        return set()
    backend, _ = open_storage(Path(out_dir), None, writer=False)
    try:
        study = optuna.load_study(study_name=study_name, storage=backend, sampler=optuna.samplers.RandomSampler())
    except KeyError:
        return set()
    return {t.number for t in study.get_trials(deepcopy=False)}


def run_dir_of(trial_folder: Path) -> Path:
    """The run folder a trial folder (``trial_dir``) lies in."""
    return Path(trial_folder).parent.parent


def write_json(path: Path, data: dict) -> None:
    """Write a run folder's JSON record atomically (``fileio.write_json``): keys sorted, values
    JSON cannot hold written as their ``str``."""
    fileio.write_json(path, data, sort_keys=True, default=str)


def read_run_info(out_dir: Path) -> dict:
    """``run.json``: the study's name and storage; one ``SsmcraftError`` line when it is
    missing or is not such a record."""
    path = Path(out_dir) / RUN_INFO
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SsmcraftError(f"{out_dir}: not a search folder (no {RUN_INFO})") from None
    except (OSError, ValueError) as e:
        problem = f"unreadable ({one_line(e)})"
    else:
        info = info if isinstance(info, dict) else {}
        storage = info.get("storage")
        problem = None if (isinstance(info.get("study"), str) and isinstance(storage, dict)
                           and (storage.get("kind") == "journal" or (
                               storage.get("kind") == "rdb" and isinstance(storage.get("url"), str)))) \
            else "not a run record (study name and storage)"
    if problem is not None:
        raise SsmcraftError(f"{path}: {problem}; restore it from a copy, or, for a search kept in this folder's "
                            f'journal, write {{"study": "NAME", "storage": {{"kind": "journal"}}}} with the name of '
                            f"the study in {SPEC_COPY}")
    return info


def open_study(out_dir: Path, storage_url: str | None = None) -> optuna.Study:
    """The folder's study, for reading (leaderboard, load_trial); writes nothing."""
    info = read_run_info(out_dir)
    storage = info["storage"]
    if storage_url is None and storage["kind"] == "rdb":
        if storage["password_hidden"]:
            raise SsmcraftError(f"{out_dir}: the study is in {storage['url']}; pass its URL with "
                                f"the password (--storage), which run.json does not keep")
        storage_url = storage["url"]
    backend, _ = open_storage(Path(out_dir), storage_url, writer=False)
    try:
        return optuna.load_study(study_name=info["study"], storage=backend,
                                 sampler=optuna.samplers.RandomSampler())
    except KeyError:
        raise SsmcraftError(f"{out_dir}: study {info['study']!r} not found in its storage") from None
