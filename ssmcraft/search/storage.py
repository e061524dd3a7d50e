"""Where a study lives: a journal file in the run folder by default, an RDB URL when
asked; and the run folder's own lock.

The journal (``DIR/journal.log``) is Optuna's ``JournalStorage(JournalFileBackend)``:
append-only JSON lines, readable by ``optuna-dashboard DIR/journal.log`` while the search
runs. It is checked whenever it is opened (``check_journal``):

- every line must be a journal record (a JSON object with an ``op_code``); a line that is
  not is refused with one line saying how to recover: Optuna cannot read past it, and
  ssmcraft does not guess what it held;
- a last record that only lacks its newline (a writer killed between the two) is complete:
  the coordinator adds the newline and keeps it;
- a torn last record (a writer killed mid-write) is moved aside by the coordinator to
  ``journal.log.torn-N`` (and the log says so) before it writes again: the next append
  would otherwise glue a record onto it.

Optuna's own lock file (``journal.log.lock``) outlives a killed writer too; the
coordinator holds ``DIR/coordinator.lock`` (an ``flock``, released by the kernel when its
process dies), so any journal lock it finds on start is stale and is removed.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Callable

import optuna
from optuna.storages.journal import JournalFileBackend, JournalStorage

from ssmcraft.errors import SsmcraftError, one_line

JOURNAL = "journal.log"
COORDINATOR_LOCK = "coordinator.lock"


def journal_path(out_dir: Path) -> Path:
    return Path(out_dir) / JOURNAL


def _is_record(line: bytes) -> str | None:
    """None when ``line`` is a journal record, else what it is instead."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return f"not JSON: {str(e)[:80]}"
    if not isinstance(record, dict) or "op_code" not in record:
        return "JSON, but not a record (no op_code)"
    return None


def check_journal(path: Path, *, repair: bool, log: Callable[[str], None] = print) -> None:
    """Check the journal at ``path`` (see the module doc); with ``repair`` (the coordinator,
    holding the folder's lock) mend its last record. A line that is not a record is an
    ``SsmcraftError`` and nothing is changed."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1              # the newline-terminated part; data[end:] is the tail
    start = 0
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        problem = _is_record(line)
        if problem is not None:
            raise SsmcraftError(
                f"{path}: line {number} (byte {start}) is not a journal record ({problem}); Optuna cannot read "
                f"the study past it. Restore {path.name} from a copy, or delete that line if you know it held "
                f"no record, or start the search again with another --out; nothing here was changed")
        start += len(line) + 1
    tail = data[end:]
    if not tail or not repair:
        return
    with open(path, "rb+") as f:
        if _is_record(tail) is None:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
            log(f"storage: the last record of {path} lacked its newline (a write interrupted at its end); "
                f"kept, newline added")
        else:
            aside = _free_name(path, "torn")
            aside.write_bytes(tail)
            _fsync(aside)
            f.truncate(end)
            log(f"storage: moved a torn last record ({len(tail)} bytes, a write interrupted midway) from "
                f"{path} to {aside}; the study holds every record before it")
        f.flush()
        os.fsync(f.fileno())


def _free_name(path: Path, what: str) -> Path:
    n = 1
    while (aside := path.with_name(f"{path.name}.{what}-{n}")).exists():
        n += 1
    return aside


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mask_url(url: str) -> str:
    """The storage URL with its password hidden, for logs and run.json."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: show only its scheme
        return url.split("://", 1)[0] + "://***" if "://" in url else "(not a URL)"


def _rdb(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url``; a URL that is not one, a database driver that is not
    installed or a database that cannot be opened is one ``SsmcraftError`` line (password hidden)."""
    import sqlalchemy.exc

    try:
        return optuna.storages.RDBStorage(url)
    except (ImportError, ValueError, sqlalchemy.exc.SQLAlchemyError) as e:
        raise SsmcraftError(f"--storage {mask_url(url)}: {one_line(e)}") from None


def open_storage(out_dir: Path, url: str | None, *, writer: bool,
                 log: Callable[[str], None] = print) -> tuple[optuna.storages.BaseStorage, str]:
    """(storage, description). ``writer``: the coordinator, which repairs the journal
    first; readers (leaderboard, load_trial) never modify anything. Either checks the
    journal first (``check_journal``)."""
    if url is not None:
        return _rdb(url), f"RDB {mask_url(url)}"
    path = journal_path(out_dir)
    if path.exists() or not writer:
        if not path.is_file():
            raise SsmcraftError(f"{out_dir}: no {JOURNAL} here; is it a search folder? (or pass --storage URL)")
        check_journal(path, repair=writer, log=log)
    if writer:
        lock = Path(f"{path}.lock")
        if lock.is_symlink() or lock.exists():
            lock.unlink()
            log(f"storage: removed the stale journal lock {lock}")
    try:
        storage = JournalStorage(JournalFileBackend(str(path)))     # replays every record
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise SsmcraftError(f"{path}: its records cannot be replayed ({one_line(e)}): a record was damaged or "
                            f"edited. Restore {path.name} from a copy, or start the search again with another "
                            f"--out; nothing here was changed") from None
    return storage, f"journal file {path}"


class RunLock:
    """Exclusive lock on a run folder: one coordinator per folder. Released when the
    process exits, however it exits."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / COORDINATOR_LOCK
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SsmcraftError(f"{self.path.parent}: another ssmcraft search is running here (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
