"""Where a study lives: a journal file in the run folder by default, an RDB URL when
asked; and the run folder's own lock.

The journal (``DIR/journal.log``) is Optuna's ``JournalStorage(JournalFileBackend)``:
append-only JSON lines, readable by ``optuna-dashboard DIR/journal.log`` while the search
runs. A coordinator killed mid-write can leave a torn last line (no newline); Optuna's
reader skips it, but the next append would glue a new record onto it and corrupt the
file, so ``repair_journal`` cuts it off before the coordinator writes again. Optuna's
own lock file (``journal.log.lock``) outlives a killed writer too; the coordinator holds
``DIR/coordinator.lock`` (an ``flock``, released by the kernel when its process dies),
so any journal lock it finds on start is stale and is removed.
"""
from __future__ import annotations

import fcntl
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


def repair_journal(path: Path) -> int:
    """Cut a torn last line off the journal; returns the number of bytes removed."""
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # scan back to the last newline (records are small: a few KiB)
        pos, block = size, 1 << 16
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        else:
            keep = 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


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
    first; readers (leaderboard, load_trial) never modify anything."""
    if url is not None:
        return _rdb(url), f"RDB {mask_url(url)}"
    path = journal_path(out_dir)
    if writer:
        dropped = repair_journal(path)
        if dropped:
            log(f"storage: cut a torn last line ({dropped} bytes) off {path}, left by an interrupted write")
        lock = Path(f"{path}.lock")
        if lock.is_symlink() or lock.exists():
            lock.unlink()
            log(f"storage: removed the stale journal lock {lock}")
    elif not path.exists():
        raise SsmcraftError(f"{out_dir}: no {JOURNAL} here; is it a search folder? (or pass --storage URL)")
    return JournalStorage(JournalFileBackend(str(path))), f"journal file {path}"


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
