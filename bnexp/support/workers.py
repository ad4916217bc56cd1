"""Worker processes that end with the command that started them.

A parallel command (a sweep with ``hydra/launcher=joblib``, ``bnexp claims``, ``bnexp bench
run jobs=K``) trains in worker processes that joblib's loky backend starts. A worker only
notices that its command is gone when it next reads its queue, so a command ended by a
signal (SIGTERM, SIGINT, or SIGKILL, which it cannot handle) used to leave its workers
training. A job run through :func:`ends_with_parent` watches the worker's parent: once it is
gone, the worker sends itself SIGTERM (a run then writes a checkpoint and stops as
``preempted``, so the same command resumes it; an idle worker ends), exits as soon as the
job is over (nobody is left to take its result), and is sent SIGKILL if it is still there
:data:`GRACE_SECONDS` later.

A thread polls the parent's pid rather than asking the kernel for a signal at the parent's
death (``PR_SET_PDEATHSIG``, which the ranks of ``trainer.nproc`` use): that signal follows
the *thread* that started the process, and loky may start a worker from a thread of its own
that ends before the command does.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from typing import Callable, Optional, ParamSpec, TypeVar

POLL_SECONDS = 0.5  # how often a worker looks at its parent
GRACE_SECONDS = 60.0  # after its SIGTERM, how long a worker has to checkpoint before SIGKILL
_watched: set[int] = set()  # the processes (pids) in which a thread watches the parent
P = ParamSpec("P")
R = TypeVar("R")


def ends_with_parent(job: Callable[P, R]) -> Callable[P, R]:
    """``job``, which in a worker process stops when the process that started the worker
    ends (:func:`end_with_parent`), and after which such an orphaned worker exits."""
    @functools.wraps(job)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        parent = end_with_parent()
        try:
            return job(*args, **kwargs)
        finally:
            if parent is not None and os.getppid() != parent:
                os._exit(1)

    return run


def end_with_parent() -> Optional[int]:
    """In a process that multiprocessing or joblib started: send it SIGTERM when its parent
    process ends, and SIGKILL :data:`GRACE_SECONDS` later (a thread watches it, started once
    per process). Returns the parent's pid; None in any other process.

    The parent is the process that forked this one: the one that asked for it, or a
    forkserver that forked it on that one's behalf (and ends with it). When this one has
    another parent already and the one that asked for it is gone, it ended before this call."""
    asked = multiprocessing.parent_process()
    if asked is None or asked.pid is None:
        return None
    parent = os.getppid()
    if os.getpid() not in _watched:
        _watched.add(os.getpid())
        gone = parent != asked.pid and not _exists(asked.pid)
        threading.Thread(target=_watch, args=(parent, gone), name="bnexp-end-with-parent", daemon=True).start()
    return parent


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int, gone: bool) -> None:
    """Wait for ``parent`` to end (this process then has another parent), then stop this one."""
    while not gone and os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
