"""``trainer.nproc=K``: run one training job as K processes through torchrun.

The Hydra job that receives ``trainer.nproc > 1`` outside torchrun owns the run directory
(it holds the directory's lock and has written its config there); it starts
``python -m torch.distributed.run --standalone --nproc_per_node=K -m bnexp train ...`` with
the same overrides and that directory, and waits. Inside torchrun, every rank composes
the same config under the launcher's lock; ranks other than 0 write nothing (see
:func:`rank_overrides`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from bnexp.errors import ConfigError
from bnexp.preemption import PreemptionGuard
from bnexp.runlock import HELD_ENV, LOCK_NAME


def rank_overrides() -> list[str]:
    """Extra Hydra overrides for a process started by torchrun: ranks above 0 log nothing
    (and, like every rank but 0, write nothing), so the run directory has one writer."""
    if int(os.environ.get("RANK", "0")) == 0:
        return []
    return ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def torchrun_command(nproc: int, overrides: list[str], run_dir: Path) -> list[str]:
    """The torchrun command line that runs this job on ``nproc`` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "bnexp", "train", *overrides, f"hydra.run.dir={run_dir}",
    ]


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
    env = {**os.environ, HELD_ENV: str((run_dir / LOCK_NAME).resolve())}  # the ranks run under this process's lock
    child = subprocess.Popen(torchrun_command(nproc, overrides, run_dir), env=env)
    with PreemptionGuard(on_signal=lambda _: child.send_signal(signal.SIGTERM)) as guard:
        code = child.wait()
        guard.forward()
    return code
