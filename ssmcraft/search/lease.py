"""Which coordinator owns a running trial, and whether that coordinator is still alive.

A trial belongs to the study, not to a machine or a folder: each coordinator that starts
takes a fresh *driver id* and marks the trials it asks for with it (``owner``). When a
coordinator starts, the trials left RUNNING by a coordinator that is gone are re-queued
(``coordinator.recover_stale``). Who is gone depends on the storage:

- the run folder's journal has one writer, the coordinator holding the folder's lock
  (``storage.RunLock``): whoever holds it owns every RUNNING trial, whatever host, path or
  container wrote it;
- an RDB may be shared by several coordinators at once: each records a *lease* in the
  study (user attr ``driver:<id>``: host, pid, run folder, ``heartbeat`` time), renewed
  every ``BEAT_S`` seconds by a thread while it runs and marked ``closed`` when it stops.
  A trial whose owner's lease is closed, missing or older than ``LEASE_S`` is stale; one
  whose owner still beats is left to it. Hosts' clocks must agree to well within
  ``LEASE_S``.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import optuna

from ssmcraft.errors import one_line

LEASE_S = 60.0      # a coordinator whose heartbeat is older than this is gone
BEAT_S = 10.0       # how often a coordinator renews its lease
PREFIX = "driver:"


def new_driver_id() -> str:
    return uuid.uuid4().hex[:16]


class Lease:
    """This coordinator's lease in an RDB study: recorded on ``start``, renewed by a daemon
    thread, marked closed on ``close``. A renewal that fails (the database went away for a
    moment) is logged and retried at the next beat."""

    def __init__(self, storage: optuna.storages.BaseStorage, study_id: int, driver: str, out_dir: Path,
                 log: Callable[[str], None]) -> None:
        self.storage, self.study_id, self.driver, self.log = storage, study_id, driver, log
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "out_dir": str(Path(out_dir).resolve()),
                       "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, closed: bool = False) -> None:
        self.storage.set_study_user_attr(self.study_id, PREFIX + self.driver,
                                         {**self.record, "heartbeat": time.time(), "closed": closed})

    def start(self) -> "Lease":
        self._write()
        self._thread = threading.Thread(target=self._beat, name="ssmcraft-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._write()
            except Exception as e:  # noqa: BLE001 -- the next beat tries again; the lease lapses only after LEASE_S
                self.log(f"search: could not renew this coordinator's lease: {one_line(e)}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._write(closed=True)


def gone(study_attrs: dict, owner: str | None, now: float | None = None) -> bool:
    """Whether the coordinator ``owner`` (a driver id) holds no live lease in a study whose
    user attrs are ``study_attrs``: closed, never recorded (an owner written before leases
    existed, or none at all) or not renewed for ``LEASE_S`` seconds."""
    lease = study_attrs.get(PREFIX + owner) if isinstance(owner, str) else None
    if not isinstance(lease, dict) or lease.get("closed"):
        return True
    now = time.time() if now is None else now
    try:
        return now - float(lease.get("heartbeat", 0.0)) > LEASE_S
    except (TypeError, ValueError):     # a heartbeat that is not a time
        return True


def describe(study_attrs: dict, owner: str, now: float | None = None) -> str:
    """``owner``'s lease in words, for the log."""
    lease = study_attrs.get(PREFIX + owner, {})
    now = time.time() if now is None else now
    return (f"coordinator {owner} on {lease.get('host', '?')} (pid {lease.get('pid', '?')}, heartbeat "
            f"{now - float(lease.get('heartbeat', now)):.0f} s ago)")
