"""One writer per run directory: ``<run>/.lock``, holding the owner's PID and host.

The lock is created with ``O_CREAT | O_EXCL`` (atomic on local and NFSv3+ file systems)
before anything is written to the directory, and removed when the run ends however it
ends. A lock left by a process that no longer exists on this host (SIGKILL, a crash) is
stale: it is taken over with a warning. A lock held from another host cannot be checked
from here; the error says which host and how to clear it.

Every process of a run also holds a shared ``flock`` on the lock file while it lives: the
owner, the processes it forks (DataLoader workers) and, for ``trainer.nproc>1``, torchrun's
agent and every rank (:func:`join_held_lock`). The kernel drops a process's hold when it
exits, however it exits, so a lock whose owner is gone is only stale once no process holds
it: a re-run waits up to :data:`STALE_WAIT` seconds for them, then stops with exit 4.

The lock file is opened read-write wherever it is flocked: Linux's NFS client emulates
``flock`` with byte-range locks, and those need a descriptor open for reading (shared) or
writing (exclusive). Byte-range locks are not inherited across ``fork``, so on NFS the
processes a run forks (DataLoader workers) do not hold it; the ones that join it
explicitly (torchrun's agent, the ranks) do.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

from bnexp.support.errors import EXIT_LOCKED, BnexpError
from bnexp.support.untrusted import SMALL_FILE, read_regular_text

log = logging.getLogger("bnexp.lock")

LOCK_NAME = ".lock"
HELD_ENV = "BNEXP_HELD_LOCK"  # set for the torchrun ranks of a run whose lock their launcher holds
STALE_WAIT = 30.0  # seconds to wait for the processes of a dead owner's run to exit
_joined: list[int] = []  # the descriptor a process joining its launcher's lock keeps open until it exits


class RunLocked(BnexpError):
    """Another process is writing to this run directory."""

    exit_code = EXIT_LOCKED
    in_run_log = False


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: exists and, where /proc says, is not a zombie (a killed
    process its parent has not reaped yet: a launcher's worker, say, which writes nothing more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _share(fd: int) -> None:
    """A shared flock on ``fd``, held until it is closed (nothing where the file system has no
    locks: the PID check then stands alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as err:
        log.debug("no flock on the run lock (%s): only its owner's PID is checked", err)


def _open_for_flock(path: Path) -> int:
    """``path`` open read-write, as an exclusive flock on NFS needs it (read-only where this
    user may not write it: a lock of another user's run, which is then checked locally only)."""
    try:
        return os.open(path, os.O_RDWR)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def _unheld(path: Path, wait: float) -> bool:
    """Whether no process holds ``path``'s flock, waiting up to ``wait`` seconds for them to go."""
    try:
        fd = _open_for_flock(path)
    except FileNotFoundError:
        return True  # cleared by another process meanwhile: the caller's rename finds out
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
            except OSError:  # no locks on this file system
                return True
    finally:
        os.close(fd)


def join_held_lock() -> None:
    """In a process of a run whose launcher holds the lock (:data:`HELD_ENV`): hold the lock's
    flock too, until this process exits, so that the lock stays taken while it lives. Raise
    :class:`RunLocked` when the file is no longer the launcher's (the launcher ended and
    another run took the directory over)."""
    held = os.environ.get(HELD_ENV)
    if held is None or _joined:
        return
    try:
        fd = os.open(held, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there opens at once (samestat refuses it)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:
        _share(fd)
        if os.path.exists(held) and os.path.samestat(os.fstat(fd), os.stat(held)):
            _joined.append(fd)
            return
        os.close(fd)
    raise RunLocked(f"{held}: the lock of the run this process belongs to is gone (its launcher ended)")


MAX_PID = 2**31 - 1  # pid_t's range: a larger number names no process (os.kill would overflow)


def read_owner(path: Path) -> dict[str, Any]:
    """The owner a lock file names; empty when unreadable (half-written by a crashed writer,
    not a regular file) or when its ``pid`` is no process ID."""
    try:
        owner = json.loads(read_regular_text(path, SMALL_FILE))
    except (OSError, ValueError, RecursionError):
        return {}
    pid = owner.get("pid") if isinstance(owner, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= MAX_PID:
        return {}
    return owner


class RunLock:
    """Context manager holding ``<run_dir>/.lock`` (a no-op when this process's launcher holds it)."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = run_dir / LOCK_NAME
        self.enabled = enabled  # False for torchrun ranks above 0: rank 0 holds the run's lock
        self.held = False
        self.fd = -1  # the lock file, open while held (its shared flock: see the module's doc)

    def inherited(self) -> bool:
        """Whether the process that started this one (bnexp's torchrun launcher) holds the lock."""
        return os.environ.get(HELD_ENV) == str(self.path.resolve())

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunLocked` naming its live owner."""
        if not self.enabled or self.inherited():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):  # a second try after clearing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)  # read: its flock on NFS
            except FileExistsError:
                self._clear_stale(me["host"])
                continue
            os.write(fd, json.dumps(me).encode())
            _share(fd)
            self.fd, self.held = fd, True
            return
        raise RunLocked(f"{self.path.parent} is locked by a process that started while this one cleared a stale lock")

    def _clear_stale(self, host: str) -> None:
        """Remove a lock whose owner is gone; raise :class:`RunLocked` when it is alive or unknown."""
        owner = read_owner(self.path)
        pid, their_host = owner.get("pid"), owner.get("host")
        gone = their_host == host and isinstance(pid, int) and not _alive(pid)
        if gone and not _unheld(self.path, STALE_WAIT):
            raise RunLocked(f"{self.path.parent} is still being written by processes of the run of process {pid}, "
                            f"which ended: they hold {self.path} after {STALE_WAIT:.0f} s; run again once they "
                            "have exited")
        if gone:
            # Renamed, not deleted: of several processes clearing it at once, one renames it,
            # and none can delete the fresh lock another has just taken in its place.
            moved = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
            try:
                os.rename(self.path, moved)
            except FileNotFoundError:  # another process cleared it first
                return
            if read_owner(moved) == owner:
                log.warning("removing the stale lock %s of process %d, which no longer runs", self.path, pid)
                moved.unlink()
                return
            os.rename(moved, self.path)  # a fresh lock: put it back
            owner = read_owner(self.path)
            pid, their_host = owner.get("pid"), owner.get("host")
        who = f"process {pid} on {their_host}" if pid else "a process that left an unreadable lock file"
        raise RunLocked(f"{self.path.parent} is being written by {who} ({self.path}); wait for it to finish, "
                        f"or, if that process is gone, delete {self.path} and run again")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd, self.held = -1, False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, kind: Optional[type[BaseException]], err: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.release()
