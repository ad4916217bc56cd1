"""Multi-process training with torch.distributed (one process per GPU, started by torchrun).

What plain DDP does not cover, bnexp does here:

- batch statistics of every BN-family layer are per-process by default; with
  ``norm.sync=true`` they are combined over all processes (SyncBN semantics, AMAT
  included) through an autograd-aware all-reduce;
- running and AMAT buffers are AVERAGED over the processes after every optimizer step,
  so they are identical on every rank at the end of each step (DDP's own buffer
  broadcast is switched off);
- BNP's input statistics are combined over the processes before its running update, and
  its gradient rewrite runs after DDP's gradient all-reduce (``after_backward``);
- metrics are summed over the processes before they are logged, and only rank 0 writes;
- a process that waits longer than ``trainer.dist_timeout`` seconds for the others in a
  collective (one of them stuck, stopped or dead) stops the run (:class:`PeersTimedOut`).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn

from bnexp.support.errors import BnexpError, ConfigError


@dataclass(frozen=True)
class Dist:
    """This process's place in the job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environment() -> Dist:
    """The rank, world size and local rank torchrun exported (a single process otherwise).

    A SLURM job started by Hydra's submitit launcher with several tasks (one per GPU) gets
    the same variables from submitit's own helper first.
    """
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and slurm_tasks > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    return Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))


_timeout = [timedelta(minutes=30)]  # this process's trainer.dist_timeout, once init_process_group has run


class PeersTimedOut(BnexpError):
    """A collective waited longer than ``trainer.dist_timeout`` for another process."""


def init_process_group(d: Dist, device: torch.device, timeout: float) -> None:
    """Join the job's process group: nccl on CUDA, gloo on CPU. A collective that waits more
    than ``timeout`` seconds for another process fails (under nccl, torch's watchdog then
    ends the process)."""
    if d.enabled and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _timeout[0] = timedelta(seconds=timeout)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=_timeout[0])


@contextmanager
def peers_timeout_named(timeout: float) -> Iterator[None]:
    """Turn a collective that timed out (torch raises a RuntimeError saying "timed out")
    into :class:`PeersTimedOut`: one line naming ``trainer.dist_timeout``."""
    try:
        yield
    except RuntimeError as err:
        if world_size() == 1 or "timed out" not in str(err).lower():
            raise
        raise PeersTimedOut(f"another process of this run did not answer for trainer.dist_timeout={timeout:g} s "
                            "(stuck, stopped or dead): stopping the run; re-run the same command to resume from "
                            "its last checkpoint, and raise trainer.dist_timeout if a process legitimately "
                            "works alone that long") from err


def split_batch(global_batch: int, d: Dist) -> int:
    """Per-process batch size: ``trainer.batch_size`` stays the global batch, as in the papers.

    Also checked by ``config.validate`` with ``trainer.nproc`` processes, before any launch.
    """
    if global_batch % d.world_size:
        raise ConfigError(
            f"trainer.batch_size={global_batch} is not divisible by the {d.world_size} processes; the global "
            "batch is split evenly, so choose a multiple of the number of processes "
            "(trainer.nproc, or torchrun's nnodes x nproc_per_node)"
        )
    return global_batch // d.world_size


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_over_ranks(t: Tensor) -> Tensor:
    """In-place sum over processes (a no-op in a single process)."""
    if world_size() > 1:
        dist.all_reduce(t)
    return t


@functools.cache
def _host_group() -> dist.ProcessGroup | None:
    """A gloo group over all processes when the default group is nccl (None: use the default).

    Collective: every rank must make the first call at the same point (the first step).
    """
    return dist.new_group(backend="gloo", timeout=_timeout[0]) if dist.get_backend() == "nccl" else None


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over the processes (``value`` itself in a single process).

    Called every training step (the preemption check), so under nccl it goes through a gloo
    group on a CPU tensor: an nccl all-reduce would need a CUDA tensor and ``.item()``, a
    host-device sync every step.
    """
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_host_group())
    return int(t.item())


def synced_var_mean(var: Tensor, mean: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Combine per-process biased variances and means over all processes, differentiably
    (unchanged in a single process).

    Sums of ``n*mean`` and ``n*(var + mean^2)`` are all-reduced in float64 (so the
    second-moment subtraction keeps its precision) with an autograd-aware all-reduce,
    whose backward sums the gradients of every process.
    """
    if world_size() == 1:
        return var, mean
    n = mean.new_full((1,), float(count))
    packed = torch.cat([mean * n, (var + mean.square()) * n, n]).double()
    total = dist_fn.all_reduce(packed)
    c = mean.numel()
    grand_mean = total[:c] / total[-1]
    grand_var = (total[c : 2 * c] / total[-1] - grand_mean.square()).clamp_min(0)
    return grand_var.to(var.dtype), grand_mean.to(mean.dtype)


def bnp_reducer(means: Sequence[Tensor], variances: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """BNP's batch statistics of every layer input, combined over processes (equal batch
    sizes) in one all-reduce of the means and second moments, in float64."""
    if world_size() == 1:
        return list(means), list(variances)
    flat = torch.cat([t.double().reshape(-1) for m, v in zip(means, variances) for t in (m, v + m.square())])
    dist.all_reduce(flat)
    flat /= world_size()
    out_means, out_variances, offset = [], [], 0
    for mean in means:
        c = mean.numel()
        grand_mean, second = flat[offset : offset + c], flat[offset + c : offset + 2 * c]
        out_means.append(grand_mean.to(mean.dtype).view_as(mean))
        out_variances.append((second - grand_mean.square()).clamp_min(0).to(mean.dtype).view_as(mean))
        offset += 2 * c
    return out_means, out_variances


def average_buffers(model: nn.Module) -> None:
    """Average every floating-point buffer that is state (running and AMAT statistics) over
    the processes; the buffers left out of the state_dict are settings every process holds
    alike (rho per channel, AMAT's eta of the step), which averaging could only round."""
    if world_size() == 1:
        return
    names = {name for name, _ in model.named_buffers()}
    buffers = [b for name, b in model.state_dict(keep_vars=True).items() if name in names and b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in buffers])
    dist.all_reduce(flat)
    flat /= world_size()
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` from every process, in rank order ([obj] in a single process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
