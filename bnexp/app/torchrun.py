"""``trainer.nproc=K``: run one training job as K processes through torchrun.

The Hydra job that receives ``trainer.nproc > 1`` outside torchrun owns the run directory
(it holds the directory's lock and has written its config there); it starts torchrun's
agent (``python -m bnexp.app.torchrun --standalone --nproc_per_node=K -m bnexp train ...``: torchrun's
own entry point behind :func:`agent_main`) with the same overrides and that directory, and
waits. Inside torchrun, every rank composes the same config under the launcher's lock;
ranks other than 0 write nothing (see :func:`rank_overrides`).

No process of the run outlives the launcher: the agent and every rank ask the kernel to
SIGKILL them when their parent ends (``prctl(PR_SET_PDEATHSIG)``, :func:`die_with_parent`),
so killing the launcher (even with SIGKILL, which it cannot handle) kills the agent, and
the agent's death kills the ranks. The kernel delivers that signal itself, whatever the
dying process was doing, so it needs no watcher thread, no polling and no PID that could
be reused; a process group would not do, since torchrun starts each rank in a session of
its own. SIGKILL rather than SIGTERM: SIGTERM would make the ranks write a checkpoint
after their launcher, the holder of the run's lock, is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from bnexp.support.errors import ConfigError
from bnexp.support.runlock import HELD_ENV, LOCK_NAME, join_held_lock

RUN_DIR_ENV = "BNEXP_RUN_DIR"  # the run directory, handed to the ranks outside Hydra's override grammar
PARENT_ENV = "BNEXP_PARENT_PID"  # the process a rank (or torchrun's agent) must not outlive
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def rank_overrides() -> list[str]:
    """Extra Hydra overrides for a process started by torchrun: ranks above 0 log nothing
    (and, like every rank but 0, write nothing), so the run directory has one writer."""
    if int(os.environ.get("RANK", "0")) == 0:
        return []
    return ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def torchrun_command(nproc: int, overrides: list[str]) -> list[str]:
    """The torchrun command line that runs this job on ``nproc`` local processes.

    The run directory goes to the ranks through :data:`RUN_DIR_ENV`, read by OmegaConf's
    ``oc.env`` resolver: a directory name holds ``=`` and ``,`` (and may hold quotes,
    spaces or brackets), which Hydra's override grammar would parse.
    """
    return [
        sys.executable, "-m", "bnexp.app.torchrun", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "bnexp", "train", *overrides, f"hydra.run.dir=${{oc.env:{RUN_DIR_ENV}}}",
    ]


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (process ``parent``) ends; exit
    at once if it has ended already (this process then has another parent). Linux only:
    elsewhere nothing is set up."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(1)


def follow_launcher() -> None:
    """In a process started by bnexp's launcher (through torchrun): end with its parent, and
    share the run's lock (:func:`bnexp.support.runlock.join_held_lock`) until it ends. Nothing
    elsewhere."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        return
    die_with_parent(int(parent))
    join_held_lock()


def agent_main() -> None:
    """torchrun's agent, started by :func:`run_under_torchrun`: it dies with the launcher and
    tells the ranks it starts to die with it. A failed rank ends it with that rank's exit
    code (128 + N for signal N), without the traceback of torchrun's ChildFailedError: its
    log has named the rank already, and the launcher sums up in one line. The SIGTERM the
    launcher passes on (a preemption) ends it with 128 + the signal, without the traceback of
    torchrun's SignalException: it has passed the signal on to the ranks, which checkpoint."""
    follow_launcher()
    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks' parent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(sys.argv[1:])
    except ChildFailedError as err:
        code = err.get_first_failure()[1].exitcode
        sys.exit(code if code > 0 else 128 - code)
    except SignalException as err:
        sys.exit(128 + int(err.sigval))


def check_gpus(nproc: int, device: str) -> None:
    """``trainer.nproc`` processes started here on CUDA need a visible GPU each."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    if nproc > visible:
        raise ConfigError(f"trainer.nproc={nproc} processes need a GPU each and this machine shows {visible}: use "
                          f"trainer.nproc<={visible}, or trainer.device=cpu")


def run_under_torchrun(nproc: int, overrides: list[str], run_dir: Path) -> int:
    """Start the processes, wait for them, and return torchrun's exit code.

    A preemption signal reaching this process goes on to torchrun as SIGTERM, which torchrun
    hands to every rank: they checkpoint at the same step and stop. The handler installed
    before bnexp's (submitit's requeue) then runs here, once the checkpoint is on disk.
    """
    env = {**os.environ, RUN_DIR_ENV: str(run_dir), PARENT_ENV: str(os.getpid()),
           HELD_ENV: str((run_dir / LOCK_NAME).resolve())}  # the ranks run under this process's lock
    child = subprocess.Popen(torchrun_command(nproc, overrides), env=env)
    from bnexp.engine.preemption import PreemptionGuard  # here: it imports torch, which rank_overrides does not need

    with PreemptionGuard(on_signal=lambda _: child.send_signal(signal.SIGTERM)) as guard:
        code = child.wait()
        guard.forward()
    return code


if __name__ == "__main__":
    agent_main()
