"""The training step as device work only, and its capture as one CUDA graph (``trainer.cuda_graph``).

:class:`TrainStep` is what the trainer's loop calls once per step (as detectron2's
``AMPTrainer.run_step``): the learning rate of every parameter group, the step's position in
its epoch, the pack's frozen-run mask and the training sums live on the device at fixed
addresses and are updated there, so the step's work reads no device value on the host and
bakes in no value that changes between steps. Its parts, in order: each group's lr (each
run's, in a pack whose runs differ in it) read from a table of the epoch's rates (filled at
the epoch's start from a copy of the run's schedule, or of each run's, :class:`LrAhead`), the
batch (gathered on the device from the epoch's draws under
``data.loader=device``, :class:`bnexp.data.device.PackedEpochs`), the methods' in-step hooks
(AMAT's eta from that lr, BNP's gradient rewrite, the frozen runs' gradients), forward, loss,
backward, the optimizer's update (:class:`bnexp.engine.optim.DeviceLrSGD`), the training sums
and the position. It computes what :func:`bnexp.engine.trainer.train_step` and the schedule
computed before it, bit for bit (tests/test_step.py).

Modules that replace a buffer in their forward instead of writing it in place (AMAT's
averages, batch renormalization's and BN with 4 things' statistics: the backward may still
need the old values) get their buffer back after the backward, holding the new values
(:meth:`TrainStep.restore_buffers`): every tensor the step touches keeps its address, which a
CUDA graph needs.

With ``trainer.cuda_graph`` on a CUDA device the step runs plainly for :data:`WARMUP` steps
(real training steps: the optimizer's state then exists and cuDNN has chosen its kernels),
is then captured once (capturing runs nothing, so no statistic is updated twice) and replayed
for every later step; it is captured again whenever what it was captured with changes (the
batch's shape, a run frozen, a hook gone). Where the step cannot be captured the run says so
in one line and takes the plain step (:func:`graph_obstacles`): the numbers are the same.
:class:`HostUse` checks a step for host work: reads of device values, tensors made from host
data, host values that change between steps, and, on a GPU, CPU tensors.
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._python_dispatch import TorchDispatchMode

from bnexp.data.device import PackedEpochs
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.optim import DeviceLrSGD
from bnexp.models.packing import per_run
from bnexp.support.distributed import sum_over_ranks

log = logging.getLogger("bnexp.train")

WARMUP = 3  # plain steps before a capture (and again before each new capture)
Batch = tuple[Tensor, Tensor]


class _GroupsOnly:
    """What an lr schedule reads and writes of its optimizer: a copy of the groups' settings
    without their parameters. A rate held as a 0-d tensor (``trainer.compile``'s optimizer
    step) is copied too: a schedule writes such a rate in place, and the copy that steps
    ahead must not write the optimizer's."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.param_groups = [{k: v.clone() if isinstance(v, Tensor) else v for k, v in group.items() if k != "params"}
                             for group in optimizer.param_groups]

    def step(self) -> None:
        """Never called: a schedule only looks that it exists."""


class LrAhead:
    """The learning rates of the coming steps, from a copy of the run's schedule that steps
    ahead of it over a copy of the optimizer's group settings: the same Python arithmetic on
    the same values, so the same floats the schedule gives the optimizer step by step."""

    def __init__(self, scheduler: LRScheduler, optimizer: Optimizer) -> None:
        groups = _GroupsOnly(optimizer)
        self.schedule = copy.deepcopy(scheduler, {id(optimizer): groups})
        self.groups = groups.param_groups

    def rates(self, steps: int) -> Tensor:
        """``(steps, groups)``, float64: the rates of the next ``steps`` steps, the first the current ones."""
        rows = []
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": this copy has no optimizer
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                rows.append([float(group["lr"]) for group in self.groups])
                self.schedule.step()
        return torch.tensor(rows, dtype=torch.float64)


def graph_obstacles(state: TrainState, net: AmpCompileWrapper, callbacks: Sequence[Callback]) -> list[str]:
    """Why this run's step cannot be captured as a CUDA graph (empty: it can)."""
    found = []
    if state.device.type != "cuda":
        found.append(f"it needs a CUDA device and this run is on {state.device.type}")
    if state.dist.enabled:
        found.append("under torchrun DDP all-reduces the gradients from autograd hooks that a graph does not capture")
    if not isinstance(state.optimizer, DeviceLrSGD):
        found.append(f"optim={state.cfg.optim.name} reads its step count on the host (only sgd is captured)")
    if net.scaler.is_enabled():
        found.append("trainer.amp=fp16 decides on the host whether to skip each step")
    for cb in callbacks:
        if not cb.capturable and type(cb).after_backward is not Callback.after_backward:
            found.append(f"{type(cb).__name__} works on the host between backward and update")
    return found


def step_batches(loaders: Sequence[Any], host: Callable[[], Iterator[Batch]]) -> Iterator[Batch] | PackedEpochs:
    """What a step takes its batches from: every member's draws when its loaders are on the
    device (``data.loader=device``), else the batches ``host()`` yields (the DataLoader path)."""
    return PackedEpochs([loader.train for loader in loaders]) if loaders[0].kind == "device" else host()


def cuda_graph_wanted(state: TrainState, net: AmpCompileWrapper, callbacks: Sequence[Callback]) -> bool:
    """``trainer.cuda_graph``, where the step can be captured; where it cannot, one line says
    why and the run takes the plain step, which computes the same numbers."""
    if not state.cfg.trainer.get("cuda_graph", False):
        return False
    obstacles = graph_obstacles(state, net, callbacks)
    if obstacles:
        log.warning("trainer.cuda_graph=true: not used, %s; the run takes the plain step (the same numbers)",
                    "; ".join(obstacles))
    return not obstacles


class TrainMeter:
    """Sums loss, correct predictions and images on the device, in place (six small kernels a
    step, no sync); read (one sync) when reported. One row of sums per run of a packed model
    (``runs``)."""

    def __init__(self, device: torch.device, runs: int = 1) -> None:
        self.sums = torch.zeros(runs, 3, device=device, dtype=torch.float64)  # loss*n, correct, n

    def reset(self) -> None:
        self.sums.zero_()

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        """A step's mean loss (one per run), logits (``(N, runs * classes)``) and targets
        (``(N,)``, or ``(N, runs)`` for a pack)."""
        n, runs = len(y), len(self.sums)
        self.sums[:, 0].add_(loss.reshape(runs), alpha=n)  # in float64
        self.sums[:, 1].add_(per_run(logits, runs).argmax(dim=2).eq(y.view(n, runs)).sum(0))
        self.sums[:, 2].add_(n)

    def state(self) -> torch.Tensor:
        """``[loss * n, correct, n]`` per run summed since the last reset (for checkpoints and reads)."""
        return self.sums

    def load(self, sums: Sequence[torch.Tensor], rank: int = 0) -> None:
        """Each run's sums as its checkpoint holds them: one block per process
        (``(processes, 1, 3)``, :meth:`Trainer.payloads`) of which process ``rank`` takes its
        own; or, in checkpoints written before, one row (a pack's) or 3 values (a run's from
        before packing existed)."""
        self.sums.copy_(torch.cat([s[rank] if s.dim() == 3 else s.view(1, 3) for s in sums]))

    def read_runs(self) -> list[tuple[float, float]]:
        """(mean loss, accuracy in percent) per run over all processes since the last reset;
        NaN if non-finite."""
        sums = sum_over_ranks(self.state().clone()).tolist()
        return [(loss_sum / n, 100 * correct / n) if n else (float("nan"), float("nan")) for loss_sum, correct, n in sums]


class TrainStep:
    """One training step of ``state``'s model (see the module's docstring), called by the
    trainer's loop; ``graph`` captures it as a CUDA graph (:func:`graph_obstacles` must be
    empty). ``callbacks`` is the trainer's live list of hooks (a member's leave it as it ends);
    ``batches`` the batches on the device from the current step on, or the draws they are
    gathered from (:func:`step_batches`)."""

    def __init__(self, state: TrainState, net: AmpCompileWrapper, meter: TrainMeter, callbacks: list[Callback],
                 criterion: Callable[[Tensor, Tensor], Tensor], batches: Iterator[Batch] | PackedEpochs,
                 graph: bool = False) -> None:
        self.state, self.net, self.meter, self.callbacks, self.criterion = state, net, meter, callbacks, criterion
        device = state.device
        self.plan = batches if isinstance(batches, PackedEpochs) else None
        self.host = None if self.plan is not None else batches
        runs = state.run_rates  # a pack whose runs differ in their lr: (groups, runs) rates
        shape = (len(state.optimizer.param_groups), *([] if runs is None else [len(runs.index)]))
        self.lr = torch.zeros(shape, dtype=torch.float64, device=device)
        self.table = torch.zeros(state.steps_per_epoch, *shape, dtype=torch.float64, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)  # the step's batch in its epoch
        state.device_lr = self.lr
        self.device_update = isinstance(state.optimizer, DeviceLrSGD) and not net.scaler.is_enabled()
        if self.device_update:
            state.optimizer.prepare_device_step()
        self.compiled_update: Optional[Callable[[], Any]] = None
        self.ahead = [LrAhead(*pair) for pair in ([(state.scheduler, state.optimizer)] if runs is None else runs.pairs())]
        self.pick = None if runs is None else torch.tensor(runs.index)  # each run's schedule
        self.epoch_end = state.step  # the step at which the next epoch's rates and draws are due
        self.buffers = [(m, name) for m in state.model.modules() for name in m._buffers]
        self.params = [p for group in state.optimizer.param_groups for p in group["params"]]
        self.graphs = StepGraphs(self.body) if graph else None

    def run(self) -> None:
        """Train one step (hooks' ``after_step``, the schedule and the step count are the loop's)."""
        state = self.state
        if state.step == self.epoch_end:
            self.start_epoch()
        for cb in self.callbacks:
            if not cb.capturable:  # host work: just before the step's device work
                cb.before_step(state)
        if self.plan is None:
            x, y = next(self.host)
            size, shape = None, (tuple(x.shape), tuple(y.shape))
        else:
            x = y = None
            size = shape = self.plan.batch_size_at(state.step % state.steps_per_epoch)
        if self.graphs is None:
            self.body(x, y, size)
        else:
            key = (shape, tuple((id(cb), cb.captured_with()) for cb in self.callbacks if cb.capturable))
            self.graphs.step(key, x, y, size)

    def start_epoch(self) -> None:
        """Between steps, at an epoch's start (or the step a run resumes at): its learning rates
        into the table, its position, and under the device loader its draws."""
        state = self.state
        epoch, first = divmod(state.step, state.steps_per_epoch)
        rates = [ahead.rates(state.steps_per_epoch - first) for ahead in self.ahead]
        self.table[first:].copy_(rates[0] if self.pick is None else torch.stack(rates, -1)[..., self.pick])
        self.position.fill_(first)
        if self.plan is not None:
            self.plan.start_epoch(epoch)
        self.epoch_end = (epoch + 1) * state.steps_per_epoch

    def body(self, x: Optional[Tensor], y: Optional[Tensor], size: Optional[int]) -> None:
        """The step's device work (what a graph captures): ``(x, y)`` the host's batch, or
        ``size`` images of every run gathered from the epoch's draws."""
        state = self.state
        self.lr.copy_(self.table.index_select(0, self.position.view(1)).view(self.lr.shape))
        if x is None:
            x, y = self.plan.batch(self.position, size)
        for cb in self.callbacks:
            if cb.capturable:
                cb.before_step(state)
        before = [m._buffers[name] for m, name in self.buffers]
        logits = self.net(x)
        loss = self.criterion(logits, y)
        for p in self.params:  # optimizer.zero_grad(set_to_none=True), which torch.compile does not trace
            p.grad = None
        total = loss.sum() if loss.dim() else loss
        if self.device_update:  # no loss scale (trainer.amp is not fp16): the wrapper's backward is this
            total.backward()
        else:
            self.net.backward(total, state.optimizer)
        self.restore_buffers(before)
        for cb in self.callbacks:
            cb.after_backward(state)
        self.update()
        self.meter.add(loss.detach(), logits.detach(), y)
        self.position.add_(1)

    @torch.no_grad()
    def restore_buffers(self, before: list[Optional[Tensor]]) -> None:
        """Each buffer a module replaced during the step (``before``: the ones it started with)
        back in place, holding the new values."""
        moved = [(m, name, old) for (m, name), old in zip(self.buffers, before) if m._buffers[name] is not old]
        if moved:
            torch._foreach_copy_([old for _, _, old in moved], [m._buffers[name] for m, name, _ in moved])
            for m, name, old in moved:
                m._buffers[name] = old

    def update(self) -> None:
        """The optimizer's step: SGD at the device's rates (compiled under ``trainer.compile``
        once its state exists, as :meth:`AmpCompileWrapper.step` does), else the wrapper's own."""
        optimizer = self.state.optimizer
        if not self.device_update:
            self.net.step(optimizer)
        elif self.compiled_update is not None:
            self.compiled_update(self.lr)
        else:
            if self.net.compiled and not AmpCompileWrapper._creates_state(optimizer):
                self.compiled_update = torch.compile(optimizer.device_step)
            optimizer.device_step(self.lr)


class StepGraphs:
    """A step's CUDA graphs, one per key (what the captured work depends on besides tensors):
    a key's first :data:`WARMUP` steps run plainly on a side stream, the next is captured (a
    capture executes nothing) and replayed, as is every later step with that key."""

    def __init__(self, body: Callable[[Optional[Tensor], Optional[Tensor], Optional[int]], None]) -> None:
        self.body = body
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Optional[Batch]]] = {}
        self.plain: dict[Hashable, int] = {}
        self.stream = torch.cuda.Stream()
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs never run at once

    def step(self, key: Hashable, x: Optional[Tensor], y: Optional[Tensor], size: Optional[int]) -> None:
        if key not in self.graphs:
            if self.plain.get(key, 0) < WARMUP:
                self.plain[key] = self.plain.get(key, 0) + 1
                self.on_side_stream(lambda: self.body(x, y, size))
                return
            self.graphs[key] = self.capture(x, y, size)
        graph, static = self.graphs[key]
        if static is not None:
            static[0].copy_(x)
            static[1].copy_(y)
        graph.replay()

    def on_side_stream(self, work: Callable[[], None]) -> None:
        """``work`` on the capture stream, ordered after and before the current stream's work
        (PyTorch's advice for the steps before a capture)."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            work()
        current.wait_stream(self.stream)

    def capture(self, x: Optional[Tensor], y: Optional[Tensor],
                size: Optional[int]) -> tuple[torch.cuda.CUDAGraph, Optional[Batch]]:
        """The step captured, reading a host batch from buffers of its own."""
        static = None if x is None else (torch.empty_like(x), torch.empty_like(y))
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a DataLoader's pin-memory thread) may go on meanwhile
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            self.body(*(static or (None, None)), size)
        return graph, static


HOST_READS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
              "unique_consecutive", "item")  # ops whose result (a value, or a size) the host must wait for
HOST_DATA = ("lift_fresh", "lift_fresh_copy")  # a tensor made from host data (torch.tensor(...))


class HostUse(TorchDispatchMode):
    """Records what the ops run inside it ask of the host: reads of device values, tensors
    made from host data, CPU tensors among the operands when ``device`` is not the CPU (but
    the scalars an op makes of a Python number, whose value is recorded), and each op's
    non-tensor arguments (:meth:`step` starts a new step's record), so that
    :meth:`problems` can also name a host value that differs between steps (a value a CUDA
    graph would have baked in), such as a learning rate passed as a Python float."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.found: list[str] = []
        self.steps: list[list[tuple[str, str]]] = []
        self.scalars: weakref.WeakSet[Tensor] = weakref.WeakSet()  # CPU scalars made here from recorded host values

    def step(self) -> None:
        self.steps.append([])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.found.append(f"{func}: the host waits for a device value")
        if name in HOST_DATA:
            self.found.append(f"{func}: a tensor made from host data")
        flat = [*args, *kwargs.values()]
        if self.device.type != "cpu" and any(isinstance(a, Tensor) and a.device.type == "cpu" and a not in self.scalars
                                             for a in flat):
            self.found.append(f"{func}: a CPU tensor among its operands")
        if self.steps:
            self.steps[-1].append((str(func), repr([_host_value(a) for a in flat])))
        out = func(*args, **kwargs)
        if name == "scalar_tensor":  # a Python number made a tensor by the op that reads it (torch.where(c, 0.0, x))
            self.scalars.add(out)
        return out

    def problems(self) -> list[str]:
        """Everything found, then the first op whose host values differ between two recorded steps."""
        found = list(dict.fromkeys(self.found))
        for step, (a, b) in enumerate(zip(self.steps, self.steps[1:]), start=1):
            if [op for op, _ in a] != [op for op, _ in b]:
                found.append(f"steps {step} and {step + 1} run other operations (a Python branch on something that changed)")
                break
            changed = next(((op, x, y) for (op, x), (_, y) in zip(a, b) if x != y), None)
            if changed:
                found.append(f"{changed[0]}: host values {changed[1]} in step {step}, {changed[2]} in step {step + 1}")
                break
        return found


def _host_value(arg: Any) -> Any:
    """An op argument as the host sees it: tensors by shape and device only (their values
    stay on the device), lists recursively, anything else as it is."""
    if isinstance(arg, Tensor):
        return ("tensor", tuple(arg.shape), arg.dtype, arg.device.type)
    if isinstance(arg, (list, tuple)):
        return [_host_value(a) for a in arg]
    return arg
